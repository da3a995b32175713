"""harness/run/atomic.py: a replaced file or folder is the old one or the new one, never a part, and no temporary is
left behind (a full disk, a failing writer)."""

from __future__ import annotations

import errno
import io
import os
import re

import pytest
import torch

from harness.run.atomic import DiskFullError, atomic_write, to_file, write_temporary
from harness.run.records import save_checkpoint
from tests.helpers.disk import fill_disk_at, temporaries


def test_atomic_write_keeps_the_old_file_and_no_temporary_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic_write(path, "old")
    fill_disk_at(monkeypatch, "summary.json.tmp")
    with pytest.raises(DiskFullError, match=r"disk full: could not write .*summary\.json \(.* free there\)"):
        atomic_write(path, "new")
    assert path.read_text() == "old" and temporaries(tmp_path) == []
    monkeypatch.undo()
    (tmp_path / "summary.json.tmp").write_text("half")  # a killed writer's leftover is replaced, not appended to
    atomic_write(path, "new")
    assert path.read_text() == "new" and temporaries(tmp_path) == []


def test_a_folder_is_replaced_whole_and_kept_when_its_writer_fails(tmp_path):
    folder = tmp_path / "report"

    def write(files: dict):
        def writer(tmp):
            tmp.mkdir()
            for name, text in files.items():
                if text is None:
                    raise RuntimeError("killed while writing")
                (tmp / name).write_text(text)
        return writer

    atomic_write(folder, write=write({"a.md": "old", "b.md": "old"}))
    with pytest.raises(RuntimeError, match="killed"):
        atomic_write(folder, write=write({"a.md": "new", "b.md": None}))
    assert sorted(p.name for p in folder.iterdir()) == ["a.md", "b.md"] and (folder / "a.md").read_text() == "old"
    atomic_write(folder, write=write({"c.md": "new"}), shared=True)  # shared: a temporary of this process's own
    assert [p.name for p in folder.iterdir()] == ["c.md"] and temporaries(tmp_path) == []


def test_a_folder_that_cannot_be_put_in_place_puts_the_old_one_back(tmp_path, monkeypatch):
    folder = tmp_path / "final"
    atomic_write(folder, write=lambda tmp: (tmp.mkdir(), (tmp / "w").write_text("old")))
    replace = os.replace

    def failing(src, dst):
        if str(src).endswith(".tmp") and ".old" not in str(src):  # the new folder's rename into place
            raise OSError(errno.EIO, "I/O error")
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write(folder, write=lambda tmp: (tmp.mkdir(), (tmp / "w").write_text("new")))
    monkeypatch.undo()
    assert (folder / "w").read_text() == "old" and temporaries(tmp_path) == []


@pytest.mark.parametrize("error, free_mib, full", [
    ("[enforce fail at inline_container.cc:672] . unexpected pos 3145728 vs 3145600", 2, True),  # less than it wrote
    ("[enforce fail at inline_container.cc:672] . unexpected pos 3145728 vs 3145600", 10, False),  # room to spare
    ("a bug in the writer", 2, False),  # not a failed write: only a disk with under 1 MiB free says full
])
def test_a_librarys_failed_write_is_a_full_disk_when_less_is_free_than_it_had_written(tmp_path, monkeypatch, error,
                                                                                       free_mib, full):
    """torch.save reports a refused write as "unexpected pos"; two runs writing checkpoints side by side on a
    nearly full disk can see it with more free than the failed write needed, the other run's failed part already
    removed."""
    def write(tmp):
        tmp.write_bytes(b"\0" * (3 << 20))  # 3 MiB written before the failure
        raise RuntimeError(error)

    monkeypatch.setattr("harness.run.atomic._free_bytes", lambda path: free_mib << 20)
    with pytest.raises(DiskFullError if full else RuntimeError, match="disk full" if full else re.escape(error)):
        atomic_write(tmp_path / "last.pt", write=write)
    assert temporaries(tmp_path) == []


def test_a_checkpoint_refused_by_the_disk_is_a_full_disk_whatever_space_is_free_when_checked(tmp_path, monkeypatch):
    """torch.save writes the checkpoint through a Python file, so the kernel's ENOSPC reaches the harness as such
    (to a path of its own, torch says "unexpected pos ..." and the error number is lost)."""
    real_open = open

    class Refusing:  # a file whose writes the disk refuses after its first KiB
        def __init__(self, *args, **kwargs):
            self.file, self.written = real_open(*args, **kwargs), 0

        def write(self, data):
            self.written += len(data)
            if self.written > 1024:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr("harness.run.atomic.open", Refusing, raising=False)
    monkeypatch.setattr("harness.run.atomic._free_bytes", lambda path: 10 << 30)  # 10 GiB free by then
    with pytest.raises(DiskFullError, match=r"disk full: could not write .*last\.pt"):
        save_checkpoint(tmp_path, {"policy": {"w": torch.zeros(1 << 16)}})
    assert temporaries(tmp_path) == [] and not (tmp_path / "checkpoints" / "last.pt").exists()


def test_ctrl_c_during_a_checkpoints_torch_save_stops_as_an_interruption_not_an_error(tmp_path):
    """Ctrl-C that cuts torch.save short makes its zip writer's clean-up raise "unexpected pos ..." while the
    KeyboardInterrupt is handled; the write raises the KeyboardInterrupt (the run stops as interrupted, exit 130, not
    failed with a traceback) and leaves no temporary behind."""
    class CutShort(io.RawIOBase):  # a file that Ctrl-C interrupts after `left` bytes
        def __init__(self, file, left: int):
            self.file, self.left = file, left

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            if self.left <= 0:
                raise KeyboardInterrupt
            self.left -= len(data)
            return self.file.write(data)

    with pytest.raises(KeyboardInterrupt):
        write_temporary(tmp_path / "last.pt", write=to_file(lambda f: torch.save({"w": torch.arange(1e4)},
                                                                               CutShort(f, 5000))))
    assert list(tmp_path.iterdir()) == []


def test_weights_written_through_a_librarys_own_temporary_get_the_mode_open_gives(tmp_path, tiny_model):
    """safetensors (0.8) writes through a temporary file of its own, mode 0600; through atomic_write, weights get the
    mode every other file written gets (0666 less the umask), so that those who can read a shared results folder's or
    cache's metrics can read its weights too: a file (as the warm start caches its weights) and a folder a library
    writes (save_pretrained, as a run's final/ and the embedded model's cache)."""
    from safetensors.torch import save_model

    from harness.run.atomic import FILE_MODE

    model, tokenizer = tiny_model
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    assert plain.stat().st_mode & 0o777 == FILE_MODE  # open()'s mode, the reference
    atomic_write(tmp_path / "weights.safetensors", write=lambda tmp: save_model(model, str(tmp)))
    atomic_write(tmp_path / "final", write=lambda tmp: model.save_pretrained(tmp))
    written = [tmp_path / "weights.safetensors", *(tmp_path / "final").iterdir()]
    assert (tmp_path / "final" / "model.safetensors") in written
    assert {p.name: p.stat().st_mode & 0o777 for p in written} == {p.name: FILE_MODE for p in written}


def test_a_file_system_that_refuses_a_mode_change_still_gets_the_file(tmp_path, monkeypatch):
    """Some network mounts refuse chmod: the weights are written all the same, with the mode the mount gives."""
    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    def write_private(tmp):  # as safetensors writes: mode 0600, which the writer then tries to change
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(b"w")

    monkeypatch.setattr(os, "chmod", refused)
    atomic_write(tmp_path / "weights.bin", write=write_private)
    assert (tmp_path / "weights.bin").read_bytes() == b"w" and not temporaries(tmp_path)
    assert (tmp_path / "weights.bin").stat().st_mode & 0o777 == 0o600  # the mode change was tried and refused
