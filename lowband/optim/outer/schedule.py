"""The outer methods' schedule, checked before a run: H (``sync_every``), τ (``delay``) and the steps.

Used by the method registry (:mod:`lowband.train.methods`) and the bench's configuration, which
check a job before any process starts; the optimizers themselves live in :mod:`lowband.optim.outer.base`.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["check_delay", "unmerged_tail_note"]


def check_delay(delay: Any, sync_every: int) -> int:
    """Validate τ (``delay``) against H (``sync_every``): an integer with 0 <= τ < H; returns it.

    The outer step started after inner step kH is merged after inner step kH + τ, which must come
    before the next one starts at (k + 1)H.
    """
    if not isinstance(delay, numbers.Integral) or isinstance(delay, bool) or delay < 0:
        raise ValueError(f"delay (τ, inner steps an outer step runs behind) must be an integer >= 0, got {delay!r}")
    if delay >= sync_every:
        raise ValueError(
            f"delay τ={delay} must be below sync_every H={sync_every}: the outer step started after inner step "
            f"kH is merged τ steps later, before the next one starts. Use delay <= {sync_every - 1} or raise H "
            f"to at least {int(delay) + 1}" + (" (H=1 leaves no room for overlap: use delay=0)" if sync_every == 1 else "")
        )
    return int(delay)


def unmerged_tail_note(steps: int, sync_every: int) -> str | None:
    """Why ``steps`` inner steps end between outer steps, or None when they end on one.

    The last ``steps % H`` inner steps of such a run are never merged by an outer step, so the
    final weights (and their validation) are each replica's own, not the replicas' agreed ones.
    """
    tail = steps % sync_every
    if tail == 0 or steps < sync_every:
        return None
    return (f"--steps {steps} is not a multiple of H={sync_every}: the last {tail} inner steps are never "
            "merged by an outer step, so the final weights and validation are one replica's own; give "
            f"--steps {steps - tail} or {steps - tail + sync_every}")
