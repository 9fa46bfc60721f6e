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

- ``"agree"``: members whose update points against most of the others' are left out of the step
  (R ≥ 3), then ``clip`` among the rest. Member j is kept when ⟨u_j, u_i⟩ > 0 for at least
  ⌈(R−1)/2⌉ of the others i (the sign of a cosine: its size does not matter); when no member is kept
  (nobody agrees with anybody: no evidence either way) all are. A sign-flipped update of honest size
  points against every honest member's, so it is left out, and a huge one is clipped. Works on top-k
  sparse messages too: honest members' top-k momentum components overlap little but consistently
  (FlexDeMo Top-2 of 128, 3 × t5-tiny: pairwise cosines 0.02-0.2, negative in 3 of 151 steps; a
  sign-flipping member's cosine with each honest one was negative in 146-148 of 151). With 2 members
  nobody can tell which is wrong: ``clip``.

  FlexDeMo and DeMo decide at every step on top-k components, and one step's signs are noisy: honest
  members are left out whenever their components happen to point apart (with 4 members, one step in
  three), and late in a run a flipper needs a positive inner product with only one of 2 honest members
  to be kept (the last 50 of 200 steps: left out of about 18). So they decide on the members' pairwise
  cosines *remembered* (:class:`AgreementMemory`: a running mean over the last steps, decay
  :data:`AGREEMENT_DECAY`, the rule above applied to it). Honest members' remembered cosines stay
  positive however noisy each step is; a member that keeps flipping has negative ones with all of them
  after about 7 steps. Measured on DeMo Top-2, t5-tiny (docs/trust.md): honest members are almost
  never left out, and the flipper as often as before or more. The memory restarts when the membership
  changes (a heal, a node lost: every member then starts afresh at the same step) and on a resume. The
  outer-step methods decide once per outer step on pseudo-gradients of H steps (a memory would let a
  new flipper through for about 7 outer steps) and NoLoCo's groups change every outer step (members
  would remember different histories): they decide on the step's signs.

Every rank holds the same messages and applies the same rule in the same order, so the replicas stay
identical. The norms are those of the rank's shard of each member's update (each shard is judged on
its own; no extra traffic).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import torch

__all__ = ["AGGREGATES", "AGREEMENT_DECAY", "AgreementMemory", "ClipTally", "agreeing", "check_aggregate", "clip_scales",
           "cosines", "dense_gram", "kept_clip_scales", "member_weights",
           "robust_pull", "robust_sum", "sparse_gram", "trimmed_mean", "weighted_sum"]

log = logging.getLogger(__name__)

AGGREGATES = ("mean", "clip", "trimmed", "agree")
#: Per decision, how much of a pair's remembered cosine (:class:`AgreementMemory`) is kept: about the last 10 count.
AGREEMENT_DECAY = 0.9
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


def agreeing(gram: torch.Tensor) -> torch.Tensor:
    """Which members ``aggregate="agree"`` keeps, from ``gram[i, j]`` = ⟨u_i, u_j⟩ (R × R): those with a positive
    inner product with at least ⌈(R−1)/2⌉ of the others; all of them when R < 3 or when none qualifies."""
    r = gram.shape[0]
    if r < 3:
        return torch.ones(r, dtype=torch.bool)
    positive = gram.detach().cpu() > 0
    positive.fill_diagonal_(False)
    keep = positive.sum(dim=1) >= r // 2  # ⌈(R−1)/2⌉ = ⌊R/2⌋
    return keep if bool(keep.any()) else torch.ones(r, dtype=torch.bool)


def cosines(gram: torch.Tensor) -> torch.Tensor:
    """The members' pairwise cosines from their gram matrix (0 where a member's update is zero)."""
    g = gram.detach().cpu().double()
    norms = g.diagonal().clamp_min(0).sqrt()
    outer = norms.unsqueeze(0) * norms.unsqueeze(1)
    return torch.where(outer > 0, g / outer.clamp_min(torch.finfo(g.dtype).tiny), torch.zeros_like(g))


class AgreementMemory:
    """``aggregate="agree"`` over time: per pair of members, a running mean of their updates' cosine.

    :meth:`agreeing` updates the means with this decision's gram matrix and returns the members that
    :func:`agreeing` keeps on them. A pair's mean starts at its first cosine. Members are named by their
    ids (replica indices), so a member left out of one exchange for a bad message keeps its history.
    ``slot`` separates independent decisions of one step (FlexDeMo's buckets of parameters). Every rank
    of the exchange sees the same messages in the same order, so every rank remembers the same means.
    """

    def __init__(self, decay: float = AGREEMENT_DECAY) -> None:
        self.decay = decay
        self._mean: dict[tuple[Hashable, int, int], float] = {}
        self._members: Any = None

    def membership(self, key: Any) -> None:
        """Forget everything when the exchange's members (:func:`lowband.optim._common.membership_key`) change."""
        if key != self._members:
            self._mean.clear()
            self._members = key

    def agreeing(self, gram: torch.Tensor, members: Sequence[int], slot: Hashable = 0) -> torch.Tensor:
        r = gram.shape[0]
        if r < 3:
            return torch.ones(r, dtype=torch.bool)
        now, remembered = cosines(gram), torch.zeros(r, r, dtype=torch.float64)
        for a in range(r):
            for b in range(a + 1, r):
                key = (slot, *sorted((members[a], members[b])))
                before = self._mean.get(key)
                c = float(now[a, b]) if before is None else self.decay * before + (1 - self.decay) * float(now[a, b])
                self._mean[key] = remembered[a, b] = remembered[b, a] = c
        return agreeing(remembered)


def sparse_gram(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """⟨u_i, u_j⟩ of top-k messages without decoding them: ``idx``/``vals`` (R, rows, k), each row's k indices
    distinct; the inner product in the coefficient space equals the decoded one's (an orthonormal transform)."""
    r = idx.shape[0]
    gram = torch.zeros(r, r, dtype=torch.float64)
    v = vals.float()
    for a in range(r):
        for b in range(a, r):
            same = idx[a].unsqueeze(-1) == idx[b].unsqueeze(-2)  # (rows, k, k)
            dot = float((v[a].unsqueeze(-1) * v[b].unsqueeze(-2)).masked_fill_(~same, 0).sum(dtype=torch.float64))
            gram[a, b] = gram[b, a] = dot
    return gram


def dense_gram(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """⟨u_i, u_j⟩ of dense updates (R × R, float64)."""
    r = len(vectors)
    flat = [v.reshape(-1).float() for v in vectors]
    gram = torch.zeros(r, r, dtype=torch.float64)
    for a in range(r):
        for b in range(a, r):
            gram[a, b] = gram[b, a] = float(torch.dot(flat[a], flat[b]))
    return gram


def kept_clip_scales(norms: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`clip_scales` over the kept members (their median), 0 for the others."""
    scales = torch.zeros_like(norms)
    scales[keep] = clip_scales(norms[keep])
    return scales


class ClipTally:
    """How often each member's update was clipped or left out, and a warning the first time one is far above the
    median or points against the others."""

    def __init__(self) -> None:
        self.clipped: Counter[int] = Counter()
        self.left_out: Counter[int] = Counter()
        self.decisions = 0  # how many times the rule ran (per step and bucket, or per outer step)
        self._named: set[int] = set()
        self._named_out: set[int] = set()

    def record_left_out(self, members: Sequence[int], keep: torch.Tensor, where: str) -> None:
        """Count one decision of the rule (called for every aggregation, whoever is kept) and who it left out."""
        self.decisions += 1
        for j, k in zip(members, keep.tolist(), strict=True):
            if k:
                continue
            self.left_out[j] += 1
            if j not in self._named_out:
                self._named_out.add(j)
                log.warning("%s: member %d's update points against most of the others'; it was left out of the step "
                            "(aggregate='agree'). A member that keeps doing this may be poisoning the job: check the "
                            "node, or remove it", where, j)

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


def member_weights(vectors: Sequence[torch.Tensor], aggregate: str, *, members: Sequence[int] | None = None,
                   tally: ClipTally | None = None, where: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, scales) of ``clip`` and ``agree`` over R ≥ 2 ``vectors``: which members count (``agree``, R ≥ 3:
    :func:`agreeing`; else all) and each one's scale, min(1, m/‖u_j‖) over the kept ones (0 for the others)."""
    members = list(members) if members is not None else list(range(len(vectors)))
    agree = aggregate == "agree" and len(vectors) >= 3  # with 2, nobody can tell which is wrong: clip
    keep = agreeing(dense_gram(vectors)) if agree else torch.ones(len(vectors), dtype=torch.bool)
    norms = torch.stack([torch.linalg.vector_norm(v.double()) for v in vectors])
    scales = kept_clip_scales(norms, keep)
    if tally is not None:
        tally.record_left_out(members, keep, where)
        tally.record([j for j, k in zip(members, keep.tolist(), strict=True) if k], norms[keep], scales[keep], where)
    return keep, scales


def robust_sum(vectors: Sequence[torch.Tensor], aggregate: str, *, members: Sequence[int] | None = None,
               tally: ClipTally | None = None, where: str = "") -> torch.Tensor:
    """R times the members' mean under ``aggregate`` (a new tensor), for callers that divide by R themselves.

    ``mean``: Σ u_j, summed in the order given (every rank gets the same floats; the papers' rule,
    bit for bit as before). ``clip``: Σ min(1, m/‖u_j‖)·u_j. ``trimmed``: R · :func:`trimmed_mean`
    (with 2 members, ``clip``: the rule that applies to two). ``agree``: R/K · the clipped sum over the K
    members :func:`agreeing` keeps (with 2 members, ``clip``).
    """
    if not vectors:
        raise ValueError("robust_sum needs at least one vector")
    if aggregate == "trimmed" and len(vectors) >= 3:
        return trimmed_mean(vectors).mul_(len(vectors))
    if aggregate in ("clip", "trimmed", "agree") and len(vectors) >= 2:
        keep, scales = member_weights(vectors, aggregate, members=members, tally=tally, where=where)
        return weighted_sum(vectors, scales).mul_(len(vectors) / int(keep.sum()))  # R × the kept members' mean
    total = vectors[0].clone()
    for v in vectors[1:]:
        total.add_(v)
    return total


def weighted_sum(vectors: Sequence[torch.Tensor], scales: torch.Tensor) -> torch.Tensor:
    """Σ s_j·u_j (a new tensor), in the order given: every rank gets the same floats."""
    total = vectors[0] * float(scales[0])
    for v, s in zip(vectors[1:], scales[1:].tolist(), strict=True):
        total.add_(v, alpha=s)
    return total


def robust_pull(weights: Sequence[torch.Tensor], own: int, aggregate: str,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """The group's mean of its members' weights as member ``own`` should pull towards it (NoLoCo's φ half).

    A member's weights are not an update: one member's are trusted by itself, and a poisoner's are bounded by
    how far they lie from them. ``mean``: the plain mean. ``trimmed`` (R ≥ 3): the coordinate-wise
    :func:`trimmed_mean`. ``clip`` and ``agree``: own + Σ_j s_j·(w_j − own) / K over the members ``keep`` keeps
    (``agree``'s verdict on the same members' updates; own always counts), K of them own included, where s_j
    bounds each deviation by the lower median of the kept others' deviation norms (:func:`clip_scales`): with
    two others the larger deviation is brought to the smaller's, so a member that sends its weights flipped
    or 1,000 times too large moves the pull no further than an honest member does. With one other (a group
    of 2) nothing tells an honest deviation from a poisoned one, and it is averaged as under ``mean``.
    """
    r = len(weights)
    if aggregate == "trimmed" and r >= 3:
        return trimmed_mean(weights)
    if aggregate not in ("clip", "trimmed", "agree") or r < 2:
        total = weights[0].clone()
        for w in weights[1:]:
            total.add_(w)
        return total.div_(r)
    keep = torch.ones(r, dtype=torch.bool) if keep is None else keep.clone()
    keep[own] = True
    others = [j for j in range(r) if j != own and bool(keep[j])]
    base = weights[own]
    deviations = [weights[j] - base for j in others]
    total = base.clone()
    if deviations:
        norms = torch.stack([torch.linalg.vector_norm(d.double()) for d in deviations])
        scales = clip_scales(norms) if len(deviations) >= 2 else torch.ones_like(norms)
        total.add_(weighted_sum(deviations, scales).div_(len(others) + 1))
    return total


def trimmed_mean(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per coordinate, the mean of the R values without the largest and the smallest (R ≥ 3)."""
    if len(vectors) < 3:
        raise ValueError(f"a trimmed mean needs at least 3 members, got {len(vectors)}")
    middle = torch.sort(torch.stack(list(vectors)), dim=0).values[1:-1]
    return middle.sum(0).div_(len(vectors) - 2)
