"""Robust aggregation: the members' updates averaged so that one poisoning member cannot steer the step.

A member that holds the job's secret and sends well-formed, finite messages passes every check of
:mod:`lowband.compress.check`; it can still send an update a thousand times too large, or the honest
update with its sign flipped. With ``aggregate="mean"`` (the default, the papers' rule) such a member
moves every replica as far as it likes. The other rules bound what one member can do:

- ``"clip"``: a norm bound against the members' median (as Karimireddy et al.'s centred clipping
  and Templar's norm checks do, in its simplest form). Each member's decoded update u_j is scaled to
  at most the median of the members' norms, u_j ← u_j · min(1, m / ‖u_j‖), then averaged as before.
  m is the lower median (the ⌈R/2⌉-th smallest norm), so with 2 members the larger update is
  brought to the smaller's norm, and with R ≥ 3 a minority of huge updates is bounded by an honest
  member's norm. Works on every message (dense or top-k sparse): it only rescales whole updates.
  A sign-flipped update of honest size is not caught: it costs one member's share of the step.
- ``"trimmed"``: the coordinate-wise trimmed mean of dense updates (R ≥ 3): per coordinate the
  largest and the smallest of the R values are dropped and the rest averaged (with R = 3, the
  median). Catches both huge and sign-flipped updates of one member, at the price of a noisier
  step; only for dense messages (DiLoCo), since on a top-k message most coordinates are zero in
  all but one member and the trim would drop the signal.

Every rank holds the same messages and applies the same rule in the same order, so the replicas stay
identical. The norms are those of the rank's shard of each member's update (each shard is judged on
its own; no extra traffic).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import torch

__all__ = ["AGGREGATES", "ClipTally", "check_aggregate", "clip_scales", "robust_sum", "trimmed_mean"]

log = logging.getLogger(__name__)

AGGREGATES = ("mean", "clip", "trimmed")
#: A member whose update's norm is above this many times the median is named in a warning (once per member).
SUSPECT_FACTOR = 4.0


def check_aggregate(aggregate: str, *, method: str, dense: bool) -> str:
    """``aggregate`` if ``method`` supports it, else a ValueError that names the choices."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"{method}: aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}")
    if aggregate == "trimmed" and not dense:
        raise ValueError(f"{method}: aggregate='trimmed' needs dense updates (a top-k message is zero in most "
                         "coordinates of all but one member, and the trim would drop the signal); use "
                         "aggregate='clip', which bounds each member's update by the members' median norm")
    return aggregate


def clip_scales(norms: torch.Tensor) -> torch.Tensor:
    """Per member, min(1, m / norm) with m the lower median of ``norms`` (a zero norm keeps scale 1)."""
    m = torch.sort(norms).values[(norms.numel() - 1) // 2]
    return torch.where(norms > m, m / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.ones_like(norms))


class ClipTally:
    """How often each member's update was clipped, and a warning the first time one is far above the median."""

    def __init__(self) -> None:
        self.clipped: Counter[int] = Counter()
        self._named: set[int] = set()

    def record(self, members: Sequence[int], norms: torch.Tensor, scales: torch.Tensor, where: str) -> None:
        ratios = (1.0 / scales.clamp_min(1e-30)).tolist()
        for j, r in zip(members, ratios, strict=True):
            if r > 1.0:
                self.clipped[j] += 1
            if r > SUSPECT_FACTOR and j not in self._named:
                self._named.add(j)
                log.warning("%s: member %d's update is %.3g times the members' median norm; it was clipped to "
                            "the median (aggregate='clip'). A member that keeps doing this may be poisoning the "
                            "job: check the node, or remove it", where, j, r)


def robust_sum(vectors: Sequence[torch.Tensor], aggregate: str, *, members: Sequence[int] | None = None,
               tally: ClipTally | None = None, where: str = "") -> torch.Tensor:
    """R times the members' mean under ``aggregate`` (a new tensor), for callers that divide by R themselves.

    ``mean``: Σ u_j, summed in the order given (every rank gets the same floats; the papers' rule,
    bit for bit as before). ``clip``: Σ min(1, m/‖u_j‖)·u_j. ``trimmed``: R · :func:`trimmed_mean`
    (with 2 members, ``clip``: the rule that applies to two).
    """
    if not vectors:
        raise ValueError("robust_sum needs at least one vector")
    if aggregate == "trimmed" and len(vectors) >= 3:
        return trimmed_mean(vectors).mul_(len(vectors))
    if aggregate in ("clip", "trimmed") and len(vectors) >= 2:
        norms = torch.stack([torch.linalg.vector_norm(v.double()) for v in vectors])
        scales = clip_scales(norms)
        if tally is not None:
            tally.record(list(members) if members is not None else list(range(len(vectors))), norms, scales, where)
        total = vectors[0] * float(scales[0])
        for v, s in zip(vectors[1:], scales[1:].tolist(), strict=True):
            total.add_(v, alpha=s)
        return total
    total = vectors[0].clone()
    for v in vectors[1:]:
        total.add_(v)
    return total


def trimmed_mean(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per coordinate, the mean of the R values without the largest and the smallest (R ≥ 3)."""
    if len(vectors) < 3:
        raise ValueError(f"a trimmed mean needs at least 3 members, got {len(vectors)}")
    middle = torch.sort(torch.stack(list(vectors)), dim=0).values[1:-1]
    return middle.sum(0).div_(len(vectors) - 2)
