"""Table formatting shared by the report's sections (:mod:`lowband.report.render`,
:mod:`lowband.report.quality`, :mod:`lowband.report.faults`): cells, aligned text and markdown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["MISSING", "markdown_table", "mean_range", "number_cell", "text_table"]

MISSING = "-"


def number_cell(value: Any, fmt: str, scale: float = 1.0) -> str:
    """``value / scale`` in ``fmt``, or :data:`MISSING` when there is none (or it is not a number)."""
    if value is None:
        return MISSING
    try:
        return format(float(value) / scale, fmt)
    except (TypeError, ValueError):
        return MISSING


def _is_numeric(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned columns (numbers right-aligned) with a dashed rule under the header."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(_is_numeric(str(r[i])) or r[i] == MISSING for r in rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        out = [str(c).rjust(w) if num else str(c).ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; numeric columns right-aligned."""
    numeric = [bool(rows) and all(_is_numeric(str(r[i])) or r[i] == MISSING for r in rows) for i in range(len(headers))]

    def esc(cell: Any) -> str:
        return str(cell).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)



def mean_range(stat: tuple[float, float, float] | None, fmt: str, n: int, scale: float = 1.0) -> str:
    """A ``(mean, min, max)`` over ``n`` seeds as ``mean [min–max]`` (the mean alone for one seed)."""
    if stat is None:
        return MISSING
    mean, lo, hi = (x / scale for x in stat)
    if n < 2:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(lo, fmt)}–{format(hi, fmt)}]"

