"""Numbers with units, and comma-separated lists, from text and back: the one copy of each.

Parsers (text → number; a plain int or float is taken as it is, in the base unit):

- :func:`parse_bandwidth`: ``"100mbit"``, ``"1gbit"``, ``"500Mbps"``, ``"2.5e8"`` → bit/s (> 0);
- :func:`parse_duration`: ``"20ms"``, ``"0.02"``, ``"0.02s"``, ``"500us"`` → seconds (>= 0);
- :func:`parse_size`: ``"4MiB"``, ``"4MB"``, ``"4194304"`` → bytes (>= 1);
- :func:`parse_count`: ``"125e6"``, ``"125M"``, ``"1.3B"`` → a count (> 0);
- :func:`split_list`, :func:`parse_int_list`: ``"0,1,2"`` (or a sequence of such strings) → items.

Formatters (number → text, decimal prefixes): :func:`format_bandwidth` and :func:`format_rate`
(bit/s), :func:`format_bytes`, :func:`format_count`.

Every parser raises ValueError naming the bad value and the accepted form; the CLIs, the bench's
configuration and ``lowband simulate`` call these.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = [
    "format_bandwidth",
    "format_bytes",
    "format_count",
    "format_rate",
    "parse_bandwidth",
    "parse_count",
    "parse_duration",
    "parse_int_list",
    "parse_size",
    "split_list",
]

# ------------------------------------------------------------------------------------------------ parsing

#: A number (decimal, optional exponent) and an optional alphabetic unit, blanks around either.
_NUMBER_UNIT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")

_BANDWIDTH_UNITS = {"": 1, "bit": 1, "bps": 1, "k": 1e3, "kbit": 1e3, "m": 1e6, "mbit": 1e6, "mbps": 1e6,
                    "g": 1e9, "gbit": 1e9, "gbps": 1e9}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}


def _number_and_unit(text: str) -> tuple[float, str] | None:
    """``" 4 MiB "`` -> ``(4.0, "mib")``; None when ``text`` is not a number with an optional unit."""
    m = _NUMBER_UNIT.fullmatch(text)
    return None if m is None else (float(m.group(1)), m.group(2).lower())


def parse_bandwidth(text: str | float | int) -> float:
    """Parse '100mbit', '1gbit', '500Mbps', '2.5e8' into bits per second (> 0).

    Case, blanks and a trailing ``/s`` are ignored (``"100 Mbit/s"``); a bare number is bit/s.
    """
    if isinstance(text, int | float):
        value = float(text)
    else:
        s = text.strip().lower().replace(" ", "").removesuffix("/s")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        if unit not in _BANDWIDTH_UNITS or not num:
            raise ValueError(
                f"cannot parse bandwidth {text!r}: use a number with a unit, e.g. 100mbit, 500mbit, "
                f"1gbit, 2.5gbit (units: {', '.join(u for u in _BANDWIDTH_UNITS if u)}) or plain bits per second"
            )
        try:
            value = float(num) * _BANDWIDTH_UNITS[unit]
        except ValueError as e:
            raise ValueError(f"cannot parse bandwidth {text!r}: {num!r} is not a number") from e
    if not value > 0:
        raise ValueError(f"bandwidth must be > 0 bit/s, got {text!r}")
    return value


def parse_duration(text: str | float | int, *, what: str = "latency") -> float:
    """``"20ms"``, ``"0.02"``, ``"0.02s"``, ``"500us"`` -> seconds (finite, >= 0); ``what`` names it in errors."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        parsed = _number_and_unit(text)
        if parsed is None or parsed[1] not in _DURATION_UNITS:
            raise ValueError(
                f"cannot parse {what} {text!r}: give seconds or a number with a unit, e.g. 0.02, 20ms, 500us "
                "(units: s, ms, us)"
            )
        value = parsed[0] * _DURATION_UNITS[parsed[1]]
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be >= 0 s, got {text!r}")
    return value


def _scaled(text: str, units: dict[str, float], *, what: str, example: str, bad_unit: str) -> float:
    """``text`` as a number times its unit's factor in ``units``; the errors name ``what``."""
    parsed = _number_and_unit(text)
    if parsed is None:
        raise ValueError(f"cannot parse {what} {text!r}: give a number with an optional unit, e.g. {example}")
    value, unit = parsed
    if unit not in units:
        raise ValueError(f"cannot parse {what} {text!r}: {bad_unit}")
    return value * units[unit]


def parse_size(text: str | int) -> int:
    """``"4MiB"``, ``"4MB"``, ``"4194304"`` -> bytes (> 0)."""
    if isinstance(text, int):
        value = float(text)
    else:
        value = _scaled(text, _SIZE_UNITS, what="size", example="4MiB, 4MB, 4194304",
                        bad_unit="units are B, kB, MB, GB, KiB, MiB, GiB (a bare number is bytes)")
    if not value >= 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def parse_count(text: str | float) -> float:
    """``"125e6"``, ``"125M"``, ``"1.3B"`` (billion), ``"350k"`` -> a number of parameters (> 0)."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        value = _scaled(text, _COUNT_UNITS, what="parameter count", example="125e6, 125M, 1.3B",
                        bad_unit="suffixes are k, M, B (billion); or a plain number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the model must have > 0 parameters, got {text!r}")
    return value


def split_list(value: str | Sequence[str]) -> list[str]:
    """``"a, b,,c"`` (or several such strings) -> ``["a", "b", "c"]``: split at commas, blanks and empty pieces dropped."""
    items = [value] if isinstance(value, str) else list(value)
    return [piece.strip() for item in items for piece in str(item).split(",") if piece.strip()]


def parse_int_list(value: int | str | Sequence[int | str], *, what: str, example: str,
                   minimum: int | None = None, maximum: int | None = None,
                   allow_empty: bool = False) -> list[int]:
    """A comma-separated list of integers (or an int, or a sequence of them), each in [minimum, maximum].

    ``what`` (a flag, e.g. ``"--seeds"``) and ``example`` (e.g. ``"0,1,2"``) name the value in the
    errors. An empty list is refused unless ``allow_empty``.
    """
    items = [str(value)] if isinstance(value, int) else split_list(value)
    if not items and not allow_empty:
        raise ValueError(f"{what} is empty; e.g. {what} {example}")
    values = []
    for item in items:
        try:
            n = int(item)
        except ValueError:
            raise ValueError(f"{what}: {item!r} is not an integer; give a comma-separated list of integers, "
                             f"e.g. {what} {example}") from None
        if (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
            low = "-inf" if minimum is None else minimum
            high = "inf" if maximum is None else maximum
            raise ValueError(f"{what}: {n} is out of range; each must be in [{low}, {high}]")
        values.append(n)
    return values


# ------------------------------------------------------------------------------------------------ formatting

_RATE_PREFIXES = ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s"))


def _with_prefix(value: float, prefixes: tuple[tuple[float, str], ...], spec: str, sep: str) -> str | None:
    """``value`` scaled by the largest prefix it reaches, or None when it reaches none."""
    for scale, unit in prefixes:
        if value >= scale:
            return f"{value / scale:{spec}}{sep}{unit}"
    return None


def format_bandwidth(bandwidth_bps: float) -> str:
    """``1e8`` -> ``"100 Mbit/s"``, ``1e9`` -> ``"1 Gbit/s"``, ``2.5e9`` -> ``"2.5 Gbit/s"`` (4 significant digits)."""
    return _with_prefix(bandwidth_bps, _RATE_PREFIXES, ".4g", " ") or f"{bandwidth_bps:.4g} bit/s"


def format_rate(bps: float) -> str:
    """``1e9`` -> ``"1 Gbit/s"``, ``9.564e7`` -> ``"95.6 Mbit/s"`` (3 significant digits)."""
    return _with_prefix(bps, _RATE_PREFIXES, ".3g", " ") or f"{bps:.3g} bit/s"


def format_bytes(nbytes: float) -> str:
    """``5e8`` -> ``"500 MB"``; ``4194304`` -> ``"4.19 MB"`` (decimal units)."""
    return _with_prefix(nbytes, ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")), ".3g", " ") or f"{nbytes:.0f} B"


def format_count(count: float) -> str:
    """``125e6`` -> ``"125M"``, ``1.3e9`` -> ``"1.3B"`` (billion), ``350e3`` -> ``"350k"``."""
    return _with_prefix(count, ((1e9, "B"), (1e6, "M"), (1e3, "k")), ".4g", "") or f"{count:.4g}"
