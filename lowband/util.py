"""Small helpers that several layers share: durations and yes/no values from text and back, atomic file writes.

Each exists once, here; the CLI parsers, the bench's spec parser and the caches call these.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["BoolParseError", "atomic_path", "format_value", "parse_bool", "parse_duration"]

_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUMBER_UNIT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_duration(text: str | float | int, *, what: str = "latency") -> float:
    """``"20ms"``, ``"0.02"``, ``"0.02s"``, ``"500us"`` -> seconds (finite, >= 0); ``what`` names it in errors."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _NUMBER_UNIT.fullmatch(text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _DURATION_UNITS:
            raise ValueError(
                f"cannot parse {what} {text!r}: give seconds or a number with a unit, e.g. 0.02, 20ms, 500us "
                "(units: s, ms, us)"
            )
        value = float(m.group(1)) * _DURATION_UNITS[unit]
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be >= 0 s, got {text!r}")
    return value


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


def format_value(value: Any) -> str:
    """A value as it is written in a spec or on a command line (floats round-trip exactly: repr)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)
