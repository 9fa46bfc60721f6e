"""The full-synchronisation baselines (the FlexDeMo paper's two, and Muon's), through the same link.

Each takes the gradient shard FSDP2 leaves after backward (the intra-node mean) and all-reduces it
(mean) over the replicate group through the link, as one flat fp32 message per step. The result
equals HSDP's gradient (the mean over all W ranks), so:

- :class:`AdamWFullSync` is AdamW with hybrid sharding (the paper's "AdamW" baseline);
- :class:`DetoFull` is sign-SGD on the fully synchronised gradient (the paper's "Deto-Full");
- :class:`MuonFullSync` is Muon on the hidden weight matrices and AdamW on the rest
  (:class:`~lowband.optim.muon.MuonAdamW`) on that gradient: the full-synchronisation reference for
  the methods whose inner steps are Muon's (``inner=muon``).

A NaN/Inf anywhere is detected on every rank through one extra element of the same message:
the offending rank sends zeros and the flag, so nothing non-finite reaches a peer. The mean that
comes back is checked (an all-reduce cannot say who sent what): a flag no count of 0/1 flags gives,
or non-finite values with no flag, skip the step on every rank (state unchanged, a warning, and
``stats().bad_messages[-1]``) instead of stepping with NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.optim import AdamW, Optimizer

from lowband.comm.link import Link
from lowband.compress.check import UNATTRIBUTED, BadMessage, mean_flag_problem
from lowband.optim._common import (
    NONFINITE_POLICIES,
    BadMessageTally,
    NonFiniteGradientError,
    check_lr,
    check_sharded,
    committed,
    local,
    run_closure,
    screening_counts,
)
from lowband.optim.muon import MuonAdamW
from lowband.optim.protocol import OptimizerStats

__all__ = ["AdamWFullSync", "DetoFull", "MuonFullSync", "sync_gradients", "sync_gradients_checked"]

log = logging.getLogger(__name__)


def sync_gradients(grads: list[torch.Tensor], link: Link | None, *, shard_group=None) -> bool:
    """Average gradient shards over the replicate group in place; return True if any was non-finite.

    One fp32 message: all gradients flattened, plus one flag element. Collective. True too when the
    mean is impossible (:func:`~lowband.compress.check.mean_flag_problem`); :func:`sync_gradients_checked`
    tells the two apart.
    """
    return sync_gradients_checked(grads, link, shard_group=shard_group) is not None


def sync_gradients_checked(grads: list[torch.Tensor], link: Link | None, *, shard_group=None) -> str | None:
    """:func:`sync_gradients`: None (the gradients hold the mean), ``"nonfinite"`` (a member flagged a
    non-finite gradient) or, for a mean that no 0/1 flags and finite values give, what is wrong with it
    (an all-reduce cannot name its sender). The gradients are changed only on None."""
    bad = any(not torch.isfinite(g).all() for g in grads)
    device = grads[0].device if grads else torch.device("cpu")
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        f = torch.tensor([1 if bad else 0], dtype=torch.uint8, device=device)
        dist.all_reduce(f, op=dist.ReduceOp.MAX, group=shard_group)
        bad = bool(f.item())
    if link is None or link.group_size == 1:
        return "nonfinite" if bad else None
    numel = sum(g.numel() for g in grads)
    flat = torch.empty(numel + 1, dtype=torch.float32, device=device)
    if bad:
        flat.zero_()
        flat[-1] = 1.0
    else:
        offset = 0
        for g in grads:
            flat[offset:offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        flat[-1] = 0.0
    link.all_reduce(flat, op="avg")
    problem = mean_flag_problem(flat, getattr(link, "participants", link.group_size))
    if problem is not None:
        return problem
    if flat[-1].item() > 0:
        return "nonfinite"
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
    return None


class _FullSyncMixin:
    link: Link | None
    nonfinite: str
    skipped_steps: int

    def _init_sync(self, link: Link | None, nonfinite: str) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.link = link
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.dropped_steps = 0  # fault tolerance: steps whose exchange failed somewhere
        self.bad_messages = BadMessageTally()  # impossible all-reduced means (sender −1: unattributable)
        topo = link.topology if link is not None else None
        check_sharded(self.param_groups, topo)  # type: ignore[attr-defined]
        self._shard_group = (
            topo.shard_group() if topo is not None and topo.shards > 1 and topo.world_size > 1 else None
        )

    def communicates_next(self) -> bool:
        """Every step all-reduces its gradients."""
        return True

    def reset_replica_state(self) -> None:
        """After this replica copied a live peer's state (fault tolerance): nothing is per replica."""

    def flush(self) -> None:
        """Nothing is ever in flight: each step's all-reduce completes inside it."""

    def stats(self) -> OptimizerStats:
        return OptimizerStats(dropped_steps=self.dropped_steps, skipped_steps=self.skipped_steps,
                              **screening_counts(self.bad_messages))

    def state_owners(self) -> list:
        return [self]

    def _sync_gradients(self) -> bool:
        """All-reduce the gradients; True if the step may go ahead."""
        grads = [local(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]  # type: ignore[attr-defined]
        bad = sync_gradients_checked(grads, self.link, shard_group=self._shard_group)
        if not committed(self.link):
            self.dropped_steps += 1
            return False
        if self.link is not None and self.link.group_size > 1:  # the all-reduced mean was checked
            problem = [BadMessage(UNATTRIBUTED, bad)] if bad not in (None, "nonfinite") else []
            self.bad_messages.record(problem, [UNATTRIBUTED], f"{type(self).__name__} all-reduce",
                                     "the step is skipped (state unchanged)")
            if problem:
                self.skipped_steps += 1
                return False
        if bad:
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    "a gradient holds NaN or Inf on at least one rank; the step was refused before any "
                    "value was sent or changed. Lower the learning rate, clip gradients, or pass "
                    "nonfinite='skip' (lowband train: --nonfinite skip)."
                )
            self.skipped_steps += 1
            log.warning("non-finite gradient: step skipped (%d skipped so far)", self.skipped_steps)
            return False
        return True


class _LocalOnSyncedGradient(_FullSyncMixin):
    """``LOCAL`` (a torch-style optimizer class, the second base) stepping on the all-reduced gradient."""

    LOCAL: type[Optimizer]

    def __init__(self, params: Iterable, lr: float = 1e-3, *, link: Link | None = None,
                 nonfinite: str = "raise", **kwargs) -> None:
        check_lr(lr)
        self.LOCAL.__init__(self, params, lr=lr, **kwargs)
        self._init_sync(link, nonfinite)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        loss = run_closure(closure)
        if self._sync_gradients():
            self.LOCAL.step(self)
        return loss


class AdamWFullSync(_LocalOnSyncedGradient, AdamW):
    """AdamW on the gradient all-reduced over the replicate group (HSDP-equivalent).

    Args:
        params, lr, betas, eps, weight_decay: as :class:`torch.optim.AdamW` (foreach/fused too).
        link: the inter-node link; None for a single process.
        nonfinite: "raise" (default) or "skip" when a gradient holds NaN/Inf.
    """

    LOCAL = AdamW


class MuonFullSync(_LocalOnSyncedGradient, MuonAdamW):
    """Muon on the hidden weight matrices and AdamW on the rest (:class:`~lowband.optim.muon.MuonAdamW`),
    on the gradient all-reduced over the replicate group: what ``inner=muon`` steps with, every step on
    the full gradient. The reference a low-bandwidth method with Muon's inner steps is measured against
    (AdamW is the other optimizer's).

    Args:
        params, lr, weight_decay, betas, eps, muon_*: as :class:`~lowband.optim.muon.MuonAdamW`.
        link: the inter-node link; None for a single process.
        nonfinite: "raise" (default) or "skip" when a gradient holds NaN/Inf.
    """

    LOCAL = MuonAdamW


class DetoFull(_FullSyncMixin, Optimizer):
    """Sign-SGD on the fully synchronised gradient: x ← x − lr·sign(ḡ); x ← x − lr·wd·x.

    Args:
        params: parameters or param groups.
        lr: learning rate (> 0).
        sign: step with sign(ḡ) (default) or ḡ.
        weight_decay: decoupled weight decay (≥ 0).
        link: the inter-node link; None for a single process.
        nonfinite: "raise" (default) or "skip".
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, *, sign: bool = True, weight_decay: float = 0.0,
                 link: Link | None = None, nonfinite: str = "raise") -> None:
        check_lr(lr)
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        Optimizer.__init__(self, params, dict(lr=lr, sign=sign, weight_decay=weight_decay))
        self._init_sync(link, nonfinite)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        loss = run_closure(closure)
        if not self._sync_gradients():
            return loss
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                x, g = local(p), local(p.grad)
                x.add_(g.sign() if group["sign"] else g, alpha=-lr)
                if group["weight_decay"] > 0:
                    x.mul_(1.0 - lr * group["weight_decay"])
        return loss
