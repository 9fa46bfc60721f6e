"""DiLoCo: H local steps of an inner optimizer, then a Nesterov outer step on the mean pseudo-gradient.

The outer-step template (inner step, finite check, delayed merge, checkpointing) is
:class:`~lowband.optim.outer.base.OuterStepOptimizer`; this module builds DiLoCo's message (one
all-reduce, or an all-gather of quantised messages) and applies its outer update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import AdamW

from lowband.comm.link import Link
from lowband.compress.check import dense_problems
from lowband.optim._common import local, replica_state_like, state_view
from lowband.optim.outer.base import (
    DROP,
    InnerOptimizer,
    OuterFlight,
    OuterStepOptimizer,
    check_unit_interval,
)

__all__ = ["DILOCO_INNER_DEFAULTS", "DiLoCo"]

#: The inner optimizer DiLoCo builds when given none (AdamW, as in the paper), also the defaults of
#: ``lowband train``'s inner lr and weight decay.
DILOCO_INNER_DEFAULTS: dict[str, float] = {"lr": 4e-4, "weight_decay": 0.1}


class DiLoCo(OuterStepOptimizer):
    r"""DiLoCo: H local steps of an inner optimizer, then a Nesterov outer step on the mean pseudo-gradient.

    Paper: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
    2023, https://arxiv.org/abs/2311.08105 (design after torchft's ``local_sgd.DiLoCo``).

    On every replica (a model copy: R of them, each sharded over S ranks of a node)::

        θ ← InnerOpt(θ, g)                       # every step, no inter-node traffic
        every H steps:
            Δ ← mean over replicas of (φ − θ)     # one all-reduce through the link (per shard)
            b ← μ·b + Δ
            φ ← φ − η·(Δ + μ·b)    (nesterov)     or   φ ← φ − η·b   (heavy ball)
            θ ← φ

    φ (the outer weights) starts as θ at the first step. With the model sharded inside a node
    (FSDP2 via :func:`lowband.distributed.sharding.shard_model`), each shard position synchronises its own
    shard with the ranks holding the same shard (the link's replicate group). All replicas must
    start from the same weights (e.g. the same seed), as with DDP. Inner optimizer states stay local.
    R = 1 or ``link=None``: the outer step runs on this replica's own pseudo-gradient.

    Param groups are shared with the inner optimizer: ``lr``, ``betas``, ``weight_decay`` ... are
    the inner optimizer's (an LR scheduler on this object schedules the inner lr, see
    :func:`lowband.train.schedule.warmup_cosine`); ``outer_lr``, ``outer_momentum``, ``nesterov``
    are the outer step's.

    Checkpoints (torch.distributed.checkpoint, :func:`lowband.checkpoint.dcp.save_checkpoint`) may be
    taken at any step, also in the middle of an inner phase. Between outer steps the replicas hold
    different θ and inner states, while DCP keeps one copy of replicated data (the model's
    parameters have the same name on every replica). So :meth:`state_dict` adds, per parameter,
    ``theta`` (a copy of this replica's θ) and ``inner`` (the inner optimizer's state), both as
    DTensors with a leading replica dimension (:func:`~lowband.optim._common.replica_state_like`),
    as φ and b are kept (the inner step count, equal on all replicas, stays a plain scalar);
    :meth:`load_state_dict` copies θ back into the parameters (after the model's own, de-duplicated,
    values) and rebuilds the inner optimizer's state. Cost: the checkpoint holds R copies of φ, b, θ
    and the inner state (what the replicas really hold). State is created in ``__init__``, not
    lazily, because DCP loads into the tensors ``state_dict()`` returns; for the same reason a
    fresh inner optimizer shows its state's structure through one inner step with zero gradients and
    lr 0 that is undone at once (as DCP's own ``_init_optim_state`` does; it fires the inner
    optimizer's step hooks). Counters and hyper-parameters (``step``, the param groups) come back too.

    The pseudo-gradient travels as one flat fp32 message with one extra flag element: a rank whose
    pseudo-gradient is not finite (its node's ranks agree first) sends zeros and the flag, and every
    rank raises :class:`NonFiniteGradientError`. A NaN/Inf *gradient* is refused before the inner
    step on the ranks of that model copy (nothing is sent; the others then wait at the next outer
    step until the process group's timeout).

    **Overlap** (``delay=τ``, 1 ≤ τ < H; Streaming DiLoCo's delayed merge without fragments): the
    outer step leaves the critical path. With θ_sent the weights the message was built from::

        after inner step kH:       θ_sent ← θ;  start the all-reduce (all-gather) of φ − θ_sent
        inner steps kH+1 .. kH+τ:  θ ← InnerOpt(θ, g) while the message travels
        after inner step kH + τ:   wait;  Δ, b, φ as above (the same arithmetic, the same messages)
                                   θ ← φ + (θ − θ_sent)                      # the merge

    The merge keeps the τ steps of local progress on top of the new outer weights: nothing is
    discarded and nothing counts twice, since the next pseudo-gradient φ − θ contains those steps
    exactly once. At τ = 0 it is the blocking rule θ ← φ (and τ = 0 runs the blocking code).
    Streaming DiLoCo (Douillard et al. 2025) merges θ ← (1 − α)·θ_local + α·φ instead; with α = 1 it
    throws the τ local steps away (their gradients are computed and lost), with α < 1 it keeps a
    share of θ_local − φ (θ's drift from the outer weights, not only the τ new steps) and adds a
    hyper-parameter; the difference θ − θ_sent is exactly the progress made while the message was
    in flight, so this rule needs none. Its cost: one more copy of θ (``sent``) per replica.
    A non-finite message is refused at step kH + τ (every rank raises, φ and b unchanged, θ keeps
    its local steps). A checkpoint taken while the message is in flight waits for it and performs
    the φ update at save time; ``sent`` and a per-replica ``merge`` status are saved, and the merge
    itself happens at step kH + τ as in the uninterrupted run (a resumed run follows it bit for
    bit). :meth:`flush` merges a step still in flight (after the last step; the training loop calls
    it). ``outer_steps`` counts outer steps started.

    Args:
        params: parameters (FSDP2 shards when S > 1), (name, parameter) pairs or param groups.
        inner_optimizer: a factory called with the param groups (e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-3)``), an optimizer over the same
            parameters, or None: AdamW(lr=4e-4, weight_decay=0.1) as in the paper.
        link: the inter-node link; None for a single process.
        sync_every: H, inner steps per outer step (>= 1; paper 500).
        outer_lr: η (> 0; paper 0.7).
        outer_momentum: μ in [0, 1) (paper 0.9).
        nesterov: Nesterov (default, as the paper) or heavy-ball outer momentum.
        max_grad_norm: clip the inner gradient's norm (over the model copy) to this; None: no clipping.
        values: wire format of the outer message, see :mod:`lowband.compress.quant`: ``"fp32"``
            (default; one all-reduce), or ``"bf16"``, ``"int8"``, ``"int4"`` (per-block scales):
            then each replica sends Q(Δ_i + e_i) with error feedback e_i ← Δ_i + e_i − Q(Δ_i + e_i)
            (kept per replica, checkpointed), the messages are all-gathered and every rank
            averages the R decoded messages in replica order. Bytes per rank: fp32 all-reduce
            2(R−1)/R·(4n + 4); lossy all-gather (R−1)·(nbytes(n) + 1), nbytes as in
            :class:`~lowband.compress.quant.BlockQuant` (int8 ≈ n, int4 ≈ n/2, plus 4 bytes per block).
            The all-gather grows with R: at R = 2 int8 sends 4× less than fp32, at R ≥ 9 more.
        quant_block: elements per scale for int8/int4 (default 256).
        delay: τ, inner steps between the start of an outer step's exchange and its merge
            (0 ≤ τ < H; 0: blocking). The bench spec's ``overlap=true`` means τ = 1.
        aggregate: how the members' pseudo-gradients are combined (:mod:`lowband.optim.robust`):
            ``"mean"`` (default, the paper's), ``"clip"`` (each bounded by the members' median norm),
            ``"trimmed"`` (coordinate-wise, the largest and smallest dropped; R ≥ 3) or ``"agree"`` (a
            member pointing against most of the others' left out, then clip; R ≥ 3). Any rule but
            the mean all-gathers the messages (fp32 too): (R−1)·(nbytes(n) + 1) bytes per rank instead
            of the all-reduce's 2(R−1)/R·(4n + 4).

    Attributes:
        inner_optimizer: the inner optimizer. ``last_sync_time_s``: wall time of the last outer step
        (the link records its operations' times). ``inner_steps``, ``outer_steps``: counters.
    """

    _OUTER_KEYS = ("outer_lr", "outer_momentum", "nesterov")
    _ERROR_KEYS = ("error",)

    def __init__(
        self,
        params: Iterable,
        inner_optimizer: InnerOptimizer = None,
        *,
        link: Link | None = None,
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        max_grad_norm: float | None = None,
        values: str = "fp32",
        quant_block: int = 256,
        delay: int = 0,
        aggregate: str = "mean",
    ) -> None:
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        check_unit_interval("outer_momentum", outer_momentum)
        super().__init__(
            params,
            inner_optimizer,
            default_inner=lambda groups: AdamW(groups, **DILOCO_INNER_DEFAULTS),
            outer_defaults=dict(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov),
            link=link,
            sync_every=sync_every,
            max_grad_norm=max_grad_norm,
            values=values,
            quant_block=quant_block,
            delay=delay,
            aggregate=aggregate,
        )
        for group in self.param_groups:
            if not group["outer_lr"] > 0:
                raise ValueError(f"outer_lr must be > 0, got {group['outer_lr']}")
            check_unit_interval("outer_momentum", group["outer_momentum"])

    def _init_outer_state(self, p: torch.Tensor, state: dict) -> None:
        state["momentum"] = replica_state_like(p, self._topology)

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> OuterFlight:
        params = self._params()
        numel = sum(local(p).numel() for p in params)
        device = local(params[0]).device
        flat = torch.empty(numel + 1, dtype=self._message_dtype(params), device=device)
        offset = 0
        for p in params:
            x = local(p)
            seg = flat[offset:offset + x.numel()]
            seg.copy_(state_view(self.state[p]["slow"]).reshape(-1))
            seg.sub_(x.reshape(-1))
            offset += x.numel()
        self._hook_update([flat[:numel]])
        self._seal(flat, numel)
        if self._gathers:
            # Quantised values cannot be summed on the way, nor judged one by one in a sum: all-gather
            # them, every rank decodes all R and averages them in replica order (identical φ on every replica).
            message, v = self._encode_outer(flat, numel)
            sent = self._hook_dense(message, 0, numel, numel=numel, codec=self.codec)  # else the message itself
            result = (self.link.all_gather(self._counting(sent), async_op=async_op) if self.link is not None
                      else sent.unsqueeze(0))
            return OuterFlight(outer_index, result, message, flat, v, numel)
        sent = self._hook_dense(flat, 0, numel, numel=numel)  # else flat itself
        if sent is not flat:  # the all-reduce writes the mean over flat: the node's own values are not needed
            flat.copy_(sent)
        result = self.link.all_reduce(flat, op="avg", async_op=async_op) if self.link is not None else flat
        return OuterFlight(outer_index, result, flat, flat, None, numel)

    @property
    def _gathers(self) -> bool:
        """All-gather the messages (lossy values, or robust aggregation) instead of one all-reduce."""
        return self.codec.lossy or self.aggregate != "mean"

    def _end_outer(self, flight: OuterFlight, result: Any) -> str | None:
        flat, numel = flight.fp_flat, flight.numel
        if self._gathers:
            # Every message is checked; a bad one is left out and the mean is over the others.
            kept = self._kept_senders(result, nbytes=flight.message.numel(), payload=dense_problems(self.codec, numel))
            if not kept:
                return DROP
            if any(bool(result[r][-1]) for r in kept):
                return "pseudo-gradient"
            mean = self._decoded_mean([result[r] for r in kept], numel, kept)
            if not self._mean_finite(mean):
                return DROP
            if self.codec.lossy:
                self._commit_error(flight.message, flight.v, numel)
            flat[:numel].copy_(mean)
            flat[-1] = 0.0
        elif not self._check_mean(flat):  # one all-reduce: its sum cannot name a sender
            return DROP
        if flat[-1].item() > 0:
            return "pseudo-gradient"
        offset = 0
        for group in self.param_groups:
            lr, mu = group["outer_lr"], group["outer_momentum"]
            for p in group["params"]:
                state = self.state[p]
                phi, b = state_view(state["slow"]), state_view(state["momentum"])
                delta = flat[offset:offset + phi.numel()].view_as(phi)
                offset += phi.numel()
                b.mul_(mu).add_(delta)
                if group["nesterov"]:
                    phi.add_(delta.add_(b, alpha=mu), alpha=-lr)
                else:
                    phi.add_(b, alpha=-lr)
                if not self.delay:
                    local(p).copy_(phi)
        return None
