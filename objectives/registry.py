"""A name -> object registry with helpful errors; shared by objectives, advantage estimators and tasks. And the
import of every module of a package (objectives/), which says in one line which file does not import."""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import re
import traceback
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised for a name that is not registered; the message lists the choices and the closest match."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


class ModuleImportError(ImportError):
    """A module of a package whose every file is imported (objectives/) failed to import; the message names the
    file, the line and the error, in one line."""


def where(item) -> str:
    """``module.QualifiedName`` of a registered class or function."""
    return f"{getattr(item, '__module__', '?')}.{getattr(item, '__qualname__', repr(item))}"


def import_every_module(package: str, path) -> None:
    """Import each module of ``package`` (``path``: its ``__path__``), which registers what it defines. A module that
    raises while it is imported (a syntax error, a missing package, a name registered twice) raises
    :class:`ModuleImportError` naming its file and line, chained to the error itself."""
    for module in pkgutil.iter_modules(path):
        try:
            importlib.import_module(f"{package}.{module.name}")
        except ModuleImportError:
            raise
        except Exception as error:
            name = f"{module.name}/__init__.py" if module.ispkg else f"{module.name}.py"
            file = os.path.join(module.module_finder.path, name)
            said = error.msg if isinstance(error, SyntaxError) else error  # its str repeats the file and line
            raise ModuleImportError(f"{package}/{name}, line {failing_line(error, file)}: "
                                    f"{type(error).__name__}: {said}. Every file in {package}/ is imported: fix "
                                    f"this one, or move it out of the folder (its traceback: python -c 'import "
                                    f"{package}')") from error


def failing_line(error: Exception, file: str) -> int | str:
    """The line of ``file`` where ``error`` was raised (a syntax error's own line; else the innermost frame of the
    traceback in that file), '?' when none is."""
    if isinstance(error, SyntaxError) and error.filename == file:
        return error.lineno
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == file]
    return lines[-1] if lines else "?"


NAME = re.compile(r"[a-z][a-z0-9_]*")  # a registered name: a config's value, part of a run's folder name


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{self.kind} name {name!r}: use lower-case letters, digits and _, starting with a letter "
                             "(a config names it, and so do its runs' folders)")

        def decorator(item: T) -> T:
            if name in self._items and self._items[name] is not item:
                raise ValueError(f"{self.kind} {name!r} is registered twice: by {where(self._items[name])} and by "
                                 f"{where(item)}; give one of them another name")
            self._items[name] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        if name not in self._items:
            raise UnknownNameError(self.unknown_message(name))
        return self._items[name]

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(str(name).lower(), self.names(), n=1, cutoff=0.4)  # names are lower-case
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}.{hint} Registered: {', '.join(self.names())}."

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
