"""The learning-rate schedule of the trainer: linear warm-up, then cosine decay (or constant).

Works on any optimizer; on :class:`~lowband.optim.DiLoCo`, :class:`~lowband.optim.NoLoCo` and
:class:`~lowband.optim.SparseLoCo` it schedules the inner lr (their param groups are the inner
optimizer's).
"""

from __future__ import annotations

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["warmup_cosine", "warmup_cosine_factor"]


def warmup_cosine(optimizer: Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> LambdaLR:
    """Linear warm-up to the peak lr, then cosine decay to ``min_ratio`` × peak (NoLoCo's schedule).

    The factor at step s is (s + 1) / warmup_steps during warm-up, then
    min_ratio + (1 − min_ratio)·(1 + cos(π·t))/2 with t = (s − warmup_steps) / (total_steps −
    warmup_steps), held at min_ratio after ``total_steps``.
    """
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if not isinstance(total_steps, int) or total_steps <= warmup_steps:
        raise ValueError(f"total_steps must be an integer > warmup_steps={warmup_steps}, got {total_steps!r}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")

    return LambdaLR(optimizer, functools.partial(warmup_cosine_factor, warmup_steps=warmup_steps,
                                                 total_steps=total_steps, min_ratio=min_ratio))


def warmup_cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The lr factor of :func:`warmup_cosine` at ``step``; ``min_ratio=1`` gives warm-up, then constant."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))
