"""Writes that a kill or a full disk cannot leave half done: every file or folder the harness replaces goes to a
temporary beside it, is flushed to disk and renamed into place (:func:`atomic_write`); a folder a user may keep files
of their own in (a report's) is written file by file into place, and only the harness's own files are replaced or
removed (:func:`write_into`). A full disk (ENOSPC, EDQUOT, or a library's own words for it) is one
:class:`DiskFullError` naming the file, the free space and how to resume. Standard library only: the analysis writes
its reports through it too. :func:`check_writable` refuses, before anything is written, a folder that cannot be made.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import shutil
import stat
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from harness.run.errors import ConfigError

TMP = ".tmp"  # suffix of what atomic_write / atomic_folder write before renaming it into place
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
FULL_BELOW = 1 << 20  # a write that fails with less free space than this (1 MiB) is taken for a full disk


class DiskFullError(OSError):
    """No space left (ENOSPC) or over quota (EDQUOT) while writing ``filename``; ``str()`` is the one line the CLI
    prints: what could not be written, the free space, and how to resume."""

    def __init__(self, path: Path | str, code: int = errno.ENOSPC):
        super().__init__(code, os.strerror(code), str(path))

    def __str__(self) -> str:
        return (f"{'disk full' if self.errno == errno.ENOSPC else 'disk quota exceeded'}: could not write "
                f"{self.filename} ({free_space(Path(self.filename))} free there); free some space, then run the same "
                "command again to resume (every step written before is kept)")


def _free_bytes(path: Path) -> int:
    """Free bytes of the file system holding ``path`` (or its nearest existing parent); a large number if unknown."""
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return 2**62


def free_space(path: Path) -> str:
    """The free space of the file system holding ``path``, e.g. ``'12.0 KiB'``."""
    free = _free_bytes(path)
    if free == 2**62:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.0f} B" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    return "unknown"


# how libraries report a write the disk refused in their own words: torch.save's zip writer, safetensors
SHORT_WRITE = ("unexpected pos", "file write failed", "IoError")


def disk_full_error(error: BaseException, path: Path | str | None = None, written: int = 0) -> DiskFullError | None:
    """``error`` as a DiskFullError when it (or an error it was raised from) is ENOSPC / EDQUOT, or when it is any
    other failure while writing ``path`` and that file system has less than :data:`FULL_BELOW` bytes free, or it is
    a library's failed write (:data:`SHORT_WRITE`) and less is free than the ``written`` bytes it had written so far
    (processes writing side by side: by the time of the check another one's failed part may have been removed);
    None otherwise."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, DiskFullError):
            return cause
        if isinstance(cause, OSError) and cause.errno in DISK_FULL:
            return DiskFullError(cause.filename or path or "?", cause.errno)
        cause = cause.__cause__ or cause.__context__
    if path is None or not isinstance(error, Exception) or isinstance(error, OSError) and error.errno is not None:
        return None  # an interruption, or an OS error of another kind (permissions, ...)
    free = _free_bytes(Path(path))
    short_write = any(words in str(error) for words in SHORT_WRITE)
    return DiskFullError(path) if free < FULL_BELOW or short_write and free < written else None


def failure_line(error: Exception, folder: Path) -> str:
    """A run's or a lab's own failure as the one line the command prints: the error, with its traceback written to
    ``folder/traceback.txt`` (made if need be) and named; no traceback file when the disk is full (the line says so)
    or it cannot be written (the line says why). Call it in the ``except`` block (the traceback is the current one)."""
    full = disk_full_error(error, folder)
    if full is not None:
        return str(full)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "traceback.txt", traceback.format_exc())
        where = f" (traceback in {folder / 'traceback.txt'})"
    except OSError as write_error:
        where = f" (no traceback file: {write_error.strerror or write_error})"
    return f"{type(error).__name__}: {error}{where}"


def _size(path: Path) -> int:
    """Bytes of a file, or of a folder's files; 0 when it is not there."""
    with contextlib.suppress(OSError):
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    return 0


def to_file(save: Callable[[BinaryIO], None]) -> Callable[[Path], None]:
    """A ``write`` for :func:`write_temporary` that hands ``save`` a Python file open on the temporary: a library
    writing through it (``torch.save(obj, f)``) lets the kernel's ENOSPC through as an OSError, where writing to a
    path of its own it reports "unexpected pos ..." with the error number lost."""
    def write(path: Path) -> None:
        with open(path, "wb") as f:
            save(f)

    return write


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # the mode open() gives a new file in this process (its umask, read at import)


def _readable_as_opened(path: Path) -> None:
    """Give the files a ``write`` made under ``path`` the mode a plain open() gives (FILE_MODE). A library that writes
    through a temporary file of its own (safetensors: mode 0600) would leave weights that no one else can read in a
    results folder or a cache shared with others, beside metrics and configs they can."""
    for item in [path] if not path.is_dir() else path.rglob("*"):
        if item.is_file() and not item.is_symlink() and item.stat().st_mode & 0o777 != FILE_MODE:
            with contextlib.suppress(OSError):  # a file system without modes (some network mounts) keeps its own
                os.chmod(item, FILE_MODE)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder: its files and itself) to disk."""
    items = [*sorted(path.rglob("*")), path] if path.is_dir() else [path]
    for item in items:
        flags = os.O_RDONLY | (os.O_DIRECTORY if item.is_dir() else 0)
        try:
            fd = os.open(item, flags)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno in DISK_FULL:
                raise
        finally:
            os.close(fd)


def write_temporary(path: Path, content: str | bytes | None = None, *,
                    write: Callable[[Path], None] | None = None, shared: bool = False) -> Path:
    """Write ``content`` (text or bytes), or what ``write(tmp)`` writes (a file or a folder), to ``<path>.tmp``,
    flushed to disk; returns that path, for the caller to rename into place. ``shared``: a folder other processes
    may write the same file into without a lock (a cache): a temporary of this process's own,
    ``.<name>.<pid>.tmp``. On any failure nothing is left behind (the temporary is removed) and a full disk
    (ENOSPC, EDQUOT) is raised as :class:`DiskFullError` naming ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP}" if shared else path.name + TMP)
    try:
        _remove(tmp)  # a stale one from a killed writer
        if write is None:
            data = content.encode() if isinstance(content, str) else content
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            write(tmp)
            _readable_as_opened(tmp)
            _fsync(tmp)
    except BaseException as e:
        interruption = _interruption(e)
        full = None if interruption is not None else disk_full_error(e, path, written=_size(tmp))
        with contextlib.suppress(OSError):
            _remove(tmp)
        if interruption is not None and interruption is not e:
            raise interruption from None
        if full is not None:
            raise full from None
        raise
    return tmp


def _interruption(error: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit (a signal's) that ``error`` is, or was raised while handling: a library
    whose clean-up fails once Ctrl-C has cut its write short (torch.save's zip writer then raises "unexpected pos
    ..."), so that the run stops as interrupted, not as failed."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt | SystemExit):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


def atomic_write(path: Path, content: str | bytes | None = None, *,
                 write: Callable[[Path], None] | None = None, shared: bool = False) -> None:
    """Replace ``path`` all at once: ``content`` (text or bytes), or what ``write(tmp)`` writes to the temporary
    path (a file, or a folder), goes to ``<path>.tmp`` beside it, is flushed to disk, then renamed over ``path``
    (a folder: :func:`_swap`). A reader, or a kill, sees the old ``path`` or the new one, never a part; a failure
    leaves no temporary behind and ``path`` as it was; a full disk is a :class:`DiskFullError`. ``shared``: see
    :func:`write_temporary`. The way the harness and the analysis write what they replace (summary, manifest,
    config, checkpoints, exports, caches, the embedded model, tables); report folders: :func:`write_into`."""
    path = Path(path)
    tmp = write_temporary(path, content, write=write, shared=shared)
    try:
        if tmp.is_dir() and path.exists():
            _swap(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            _remove(tmp)
        raise


def _swap(tmp: Path, path: Path) -> None:
    """Put the folder ``tmp`` in place of the folder ``path``: the old one renamed aside (a temporary, swept as the
    others if a kill comes first), the new one renamed in, the old one removed; the old one is put back if the new
    one cannot be."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.old{TMP}")
    _remove(aside)
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # another writer of a shared folder moved it meanwhile
        aside = None
    try:
        os.replace(tmp, path)
    except BaseException:
        if aside is not None:
            os.replace(aside, path)
        raise
    if aside is not None:
        _remove(aside)


WRITTEN = ".written"  # in a folder written by write_into: the files the last write put there, one a line


class ForeignFileError(FileExistsError):
    """:func:`write_into` would replace a file it did not write (named in the message)."""


def _begins(path: Path, heading: str) -> bool:
    """Whether ``path`` is a file (not a link) whose text begins with ``heading``."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.read(len(heading)) == heading
    except OSError:
        return False


def write_into(folder: Path, write: Callable[[Path], None], *, earlier: tuple[str, str],
               entries: tuple[str, ...] = ()) -> list[Path]:
    """Write the files ``write(tmp)`` makes in a temporary folder into ``folder`` one by one, each renamed into place
    (a reader sees each file old or new, never a part); the files of the previous write that this one no longer makes
    are removed; returns the files written. Any other file in ``folder`` (a draft beside a report) is never touched:
    the files of a write are listed in ``folder/.written``; a folder from before that list counts the files this
    write makes as its own when it holds ``earlier`` = (a file, the start of its first line), e.g. a report.md
    beginning "# Report: " (a folder of one's own holding a report.md of one's own is not a report folder). A file
    of the same name that the harness did
    not write is refused (:class:`ForeignFileError`, before anything in ``folder`` changes). The list is written
    first with the old and the new files, so a kill halfway leaves every file of the harness listed. The entry files
    (``entries``, the files a reader opens: report.html, and ``earlier[0]``, report.md, last) are removed first and
    renamed in last, after the old files this write no longer makes are gone: wherever a kill comes, an entry file in
    ``folder`` stands beside the files of its own write only (a killed write leaves report.md out: run it again)."""
    folder = Path(folder)
    if folder.is_symlink():  # a link put there (to a folder of one's own): never written through
        raise ForeignFileError(f"{folder} is a link (to {os.readlink(folder)}), which the harness did not make: it "
                               "does not write through links; remove the link, or choose another folder")
    tmp = write_temporary(folder, write=write, shared=True)
    try:
        made = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file() and not p.is_symlink())
        listed = folder / WRITTEN
        ours = _listed(listed) if listed.is_file() else set(made) if _begins(folder / earlier[0], earlier[1]) else set()
        foreign = [name for name in made if os.path.lexists(folder / name) and name not in ours
                   or _through_link(folder, name)]
        if foreign:
            raise ForeignFileError(f"{folder} holds {', '.join(map(str, foreign[:3]))}"
                                   f"{f' and {len(foreign) - 3} more' if len(foreign) > 3 else ''}, which the "
                                   "harness did not write: refusing to replace it; move it, or choose another folder")
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(listed, "".join(f"{name}\n" for name in sorted(ours | set(made))))
        opened = [Path(name) for name in (*entries, earlier[0])]  # report.md last: its presence says the rest is in
        for name in [*(opened[::-1]), *sorted(ours - set(made))]:  # the entries first, then the old files
            if name in ours:
                with contextlib.suppress(OSError):
                    (folder / name).unlink()
        rank = {name: i + 1 for i, name in enumerate(opened)}
        for name in sorted(made, key=lambda name: rank.get(name, 0)):  # the entries last; os.replace puts each file
            (folder / name).parent.mkdir(parents=True, exist_ok=True)  # in place of a link of its name, never
            os.replace(tmp / name, folder / name)  # through it
        atomic_write(listed, "".join(f"{name}\n" for name in made))
    finally:
        _remove(tmp)
    return [folder / name for name in made]


def _listed(path: Path) -> set[Path]:
    """The files a :data:`WRITTEN` list names, inside its folder only (no absolute path, no '..', none under a link
    in it: another folder's file, which a later write would remove)."""
    names = {Path(line) for line in path.read_text(errors="replace").splitlines() if line.strip()}
    return {name for name in names if not name.is_absolute() and ".." not in name.parts
            and not _through_link(path.parent, name)}


def _through_link(folder: Path, name: Path) -> bool:
    """Whether a folder on the way from ``folder`` to its file ``name`` (a relative path) is a symbolic link."""
    return any((folder / Path(*name.parts[:depth])).is_symlink() for depth in range(1, len(name.parts)))


def remove_stale_temporaries(*folders: Path, own: tuple[str, ...] | None = None) -> list[Path]:
    """Remove what a killed (or disk-full) writer left of an atomic write directly in ``folders`` (``*.tmp`` files
    and folders); returns them. Call only while holding the folders' lock. A temporary of a process of its own
    (``.<name>.<pid>.tmp``, ``.<name>.<pid>.old.tmp``) whose process is alive here is another writer's work in
    progress (a report built while a sweep starts): kept. ``own``: in a folder that may hold the user's files too (an
    experiment's), only the temporaries of these file names (``<name>.tmp``) and those named by a process are the
    harness's; any other ``*.tmp`` there is kept (the next write of that file replaces its own leftover anyway)."""
    stale = sorted(p for folder in folders if folder.is_dir() for p in folder.glob(f"*{TMP}")
                   if (own is None or _named_by_process(p) or p.name.removesuffix(TMP) in own)
                   and not _writer_alive(p))
    for path in stale:
        _remove(path)
    return stale


def remove_dead_writers_temporaries(path: Path) -> list[Path]:
    """Remove the temporaries of ``path`` that :func:`write_temporary` (``shared``) names by a process,
    ``.<name>.<pid>.tmp`` and a swap's ``.<name>.<pid>.old.tmp``, whose process is dead (a killed writer's; a live
    one's is its work in progress); returns them. Nothing else beside ``path`` is touched, however it is named."""
    own = re.compile(rf"\.{re.escape(path.name)}\.\d+(?:\.old)?{re.escape(TMP)}")
    stale = sorted(p for p in path.parent.glob(f".{glob.escape(path.name)}.*{TMP}")
                   if own.fullmatch(p.name) and not _writer_alive(p))
    for found in stale:
        _remove(found)
    return stale


def _named_by_process(path: Path) -> re.Match | None:
    """``path``'s name as a temporary named by its writer's process id (``shared``, or a folder swap's old copy)."""
    return re.fullmatch(rf"\..+\.(\d+)(?:\.old)?{re.escape(TMP)}", path.name)


def _writer_alive(path: Path) -> bool:
    """Whether ``path`` is a temporary named by its writer's process id and that process is alive on this machine."""
    found = _named_by_process(path)
    if not found or int(found.group(1)) <= 0:
        return False
    try:
        os.kill(int(found.group(1)), 0)  # signal 0: only whether the process exists
    except PermissionError:  # another user's, alive
        return True
    except (OSError, OverflowError):  # no such process
        return False
    return True


def special_file(path: Path) -> bool:
    """Whether ``path`` (a link followed) is there and neither a regular file nor a folder: a named pipe, a socket or a
    device, which a read or a write would block on or take what no run wrote from."""
    try:
        mode = path.stat().st_mode
    except OSError:  # absent, or a link to nothing
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def nearest_existing(folder: Path) -> tuple[Path, str | None]:
    """The nearest of ``folder`` and its parents that exists, and why the path below it cannot be made (None: it
    can, unless that parent is a file): a symbolic link to nothing, a loop of links, a name too long, ..."""
    problem = None
    for path in (folder, *folder.parents):
        try:
            path.stat()
        except (FileNotFoundError, NotADirectoryError):  # not there (under a file: the caller names the file)
            if path.is_symlink():  # a link to nothing: nothing can be made there
                problem = f"{path} is a symbolic link to a path that does not exist"
            continue
        except OSError as e:  # a loop of symbolic links (ELOOP), a name too long, ...: named at its top
            problem = f"{path}: {e.strerror or e}"
            continue
        return path, problem
    return Path("."), problem


def check_writable(folder: Path, what: str = "results folder",
                   fix: str = "give a folder you can write (results_dir=... or --run-dir ...)") -> None:
    """Refuse (ConfigError, one line, before anything is printed or touched) a folder that cannot be made: a file
    on its path, a missing or read-only mount (e.g. ``results_dir=/etc/passwd/x``, ``/proc/x``). Probed by making
    and removing an empty folder in its nearest existing parent (root's permissions pass os.access). ``what``: the
    folder's name in the message; ``fix``: what to do, its end."""
    parent, problem = nearest_existing(folder)
    if problem:
        raise ConfigError(f"cannot make {what} {folder}: {problem}; {fix}")
    if not parent.is_dir():
        raise ConfigError(f"cannot make {what} {folder}: {parent} is a file, not a folder; {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=parent))
    except OSError as e:
        raise ConfigError(f"cannot make {what} {folder}: {parent}: {e.strerror or e}; {fix}") from e
