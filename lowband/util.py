"""Small helpers that several layers share: yes/no values from text and back, atomic file and directory writes.

Each exists once, here; the CLI parsers, the bench's spec parser and the caches call these. Numbers
with units (durations, bandwidths, sizes) and comma-separated lists are :mod:`lowband.units`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["BoolParseError", "atomic_dir", "atomic_path", "file_digest", "format_value", "lazy_exports", "parse_bool"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class BoolParseError(ValueError, argparse.ArgumentTypeError):
    """Not a yes/no value. A ValueError, and argparse shows its message as it is."""


def parse_bool(text: str | bool) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case) -> bool; anything else is a :class:`BoolParseError`."""
    if isinstance(text, bool):
        return text
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise BoolParseError(f"expected true or false (or yes/no, on/off, 1/0), got {text!r}")


@contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``target`` to write to; renamed onto ``target`` when the block succeeds.

    Readers see the old file or the whole new one, never a partial one (``os.replace`` is atomic
    within a file system). If the block raises, the temporary file is removed and ``target`` is
    untouched. The name is unique per process and thread, so concurrent writers do not collide
    (the last rename wins).
    """
    target = Path(target)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A new, empty temporary directory beside ``target`` to fill; it becomes ``target`` when the block succeeds.

    If the block raises, the temporary directory is removed and ``target`` is untouched, so a failure
    leaves nothing half-written. An existing ``target`` is replaced only once the new one is complete:
    it is renamed aside, the new one renamed into place, then the old one removed (a crash between the
    two renames leaves ``target`` missing and the old one beside it as ``.NAME.old-PID``). Whether an
    existing ``target`` may be replaced is the caller's to decide.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    old = target.with_name(f".{target.name}.old-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def format_value(value: Any) -> str:
    """A value as it is written in a spec or on a command line (floats round-trip exactly: repr)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file's content, or of a directory's files (names and contents, sorted): what a
    data file or a tokenizer is, whatever path names it. Cached per (path, size, mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    return _digest(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        if p.is_dir():
            h.update(str(f.relative_to(p)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]):
    """A package's ``__getattr__`` and ``__dir__`` that import each exported name from its module when first used.

    ``exports`` maps a name to the module that defines it; the value is kept in ``namespace`` (the package's
    globals) once imported. A package whose names pull in heavy or optional dependencies (torch, transformers,
    torchft, matplotlib) exports them this way, so importing the package stays cheap.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
