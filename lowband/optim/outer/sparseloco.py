"""SparseLoCo: DiLoCo's local steps, then a sparse, quantised outer step with per-replica error feedback.

Paper: Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
2025, https://arxiv.org/abs/2508.15706 (Templar). See docs/algorithms.md, "SparseLoCo".
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import AdamW

from lowband.comm.link import Link
from lowband.compress.check import index_and_value_problems, payload_faults, sparse_problems
from lowband.compress.dct import dct, idct, num_chunks, scatter_chunks, topk_per_chunk
from lowband.compress.sparse import SPARSE_VALUE_FORMATS, SparseCodec
from lowband.optim._common import local, nonfinite_flag, replica_state_like, state_view
from lowband.optim.outer.base import (
    DROP,
    InnerOptimizer,
    OuterFlight,
    OuterStepOptimizer,
    check_unit_interval,
)

__all__ = ["SPARSELOCO_INNER_DEFAULTS", "SPARSELOCO_TRANSFORMS", "SparseLoCo", "sparseloco_message_nbytes"]

log = logging.getLogger(__name__)

#: The inner optimizer SparseLoCo builds when given none (AdamW, as DiLoCo's).
SPARSELOCO_INNER_DEFAULTS: dict[str, float] = {"lr": 4e-4, "weight_decay": 0.1}
SPARSELOCO_TRANSFORMS = ("none", "dct")


def sparseloco_message_nbytes(numels: Iterable[int], *, chunk: int, topk: int, values: str,
                              quant_block: int = 256) -> int:
    """Bytes of one replica's outer message for local shards of ``numels`` elements (flag byte included).

    N = Σ ⌈n_p / c⌉ chunks (each parameter zero-padded to whole chunks), K = N·k kept values; the
    payload is :meth:`SparseCodec.nbytes` and one flag byte follows. The link's all-gather then
    sends (R − 1) times this per rank.
    """
    n_chunks = sum(num_chunks(int(n), chunk) for n in numels)
    return SparseCodec(chunk, topk, values, quant_block).nbytes(n_chunks) + 1


class SparseLoCo(OuterStepOptimizer):
    r"""SparseLoCo: H inner steps, then each replica sends the top-k of its error-feedback accumulator, quantised.

    On replica r, with φ the outer weights (equal on every replica) and θ_r its inner weights::

        θ_r ← InnerOpt(θ_r, g)                              # every step, no inter-node traffic
        every H steps:
            v_r ← β·e_r + (φ − θ_r)                          # error feedback + pseudo-gradient
            X_r ← chunks_c(v_r)     (transform="dct": DCT-II of each chunk, as DeMo)
            (I_r, V_r) ← the k entries of largest |X_r| in each chunk
            m_r ← pack(I_r, Q(V_r)) + flag byte               # one message; Q: 2bit, 1bit, bf16, fp32
            all-gather m over the R replicas                  # the only inter-node traffic
            q_j ← decode(m_j)   (inverse transform)           # every rank decodes every replica's
            e_r ← v_r − q_r                                   # what was sent leaves e, rounding stays
            φ ← φ − α·(1/R)·Σ_j q_j     (summed in replica order: identical φ everywhere)
            θ_r ← φ                     (delay τ > 0: θ_r ← φ + (θ_r − θ_sent) at step kH + τ)

    No outer momentum: the accumulator e_r (per replica, checkpointed) replaces it. Each parameter
    (the local shard under FSDP2) is zero-padded to whole chunks on its own, so every chunk
    belongs to one parameter; the values of all parameters form one message, quantised in blocks
    of ``quant_block`` kept values with one fp32 scale each (:class:`~lowband.compress.sparse.SparseCodec`).

    Bytes per rank and outer step: (R − 1)·M with M = :func:`sparseloco_message_nbytes` (an
    all-gather; the link counts exactly the message). A replica whose v holds NaN/Inf (its node's
    ranks agree first) sends zeros and the flag; every rank then raises
    :class:`~lowband.optim.NonFiniteGradientError` and nothing changes (φ, e). A NaN/Inf gradient
    is refused before the inner step, as in DiLoCo.

    Args:
        params: parameters (FSDP2 shards when S > 1), (name, parameter) pairs or param groups.
        inner_optimizer: a factory called with the param groups, an optimizer over the same
            parameters, or None: AdamW(lr=4e-4, weight_decay=0.1).
        link: the inter-node link; None for a single process.
        sync_every: H, inner steps per outer step (paper 30 for the headline runs).
        outer_lr: α (> 0).
        decay: β, the error feedback's decay, in [0, 1).
        topk: k, values kept per chunk (1 ≤ k ≤ c).
        chunk: c, the chunk size (paper: k/c ≈ 1.56 %, e.g. 2 of 128).
        values: ``"2bit"`` (default), ``"1bit"`` (sign × block scale), ``"bf16"`` or ``"fp32"`` (lossless).
        transform: ``"none"`` (chunks of the flat pseudo-gradient) or ``"dct"`` (DCT-II per chunk).
        quant_block: kept values per fp32 scale (2bit, 1bit).
        max_grad_norm: clip the inner gradient's norm to this; None: no clipping.
        delay: τ, inner steps between the start of an outer step's all-gather and its merge
            (0 ≤ τ < H; 0: blocking), as DiLoCo's: the τ inner steps after step kH run while the
            messages travel, step kH + τ decodes them, updates φ and e, and merges
            θ ← φ_new + (θ − θ_sent). The bench spec's ``overlap=true`` means τ = 1.
        aggregate: ``"mean"`` (default), ``"clip"``: each member's decoded message bounded by the
            members' median norm (:mod:`lowband.optim.robust`; no extra bytes), or ``"agree"``: a member
            whose message points against most of the others' left out, then clip (R ≥ 3).
    """

    _OUTER_KEYS = ("outer_lr", "decay")
    _ERROR_KEYS = ("error",)

    def __init__(
        self,
        params: Iterable,
        inner_optimizer: InnerOptimizer = None,
        *,
        link: Link | None = None,
        sync_every: int = 30,
        outer_lr: float = 1.0,
        decay: float = 0.95,
        topk: int = 2,
        chunk: int = 128,
        values: str = "2bit",
        transform: str = "none",
        quant_block: int = 256,
        max_grad_norm: float | None = None,
        delay: int = 0,
        aggregate: str = "mean",
    ) -> None:
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        check_unit_interval("decay", decay)
        for name, value in (("topk", topk), ("chunk", chunk)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if topk > chunk:
            raise ValueError(f"topk={topk} exceeds chunk={chunk}; topk must lie in 1..chunk")
        if values not in SPARSE_VALUE_FORMATS:
            raise ValueError(f"values must be one of {', '.join(SPARSE_VALUE_FORMATS)}, got {values!r}")
        if transform not in SPARSELOCO_TRANSFORMS:
            raise ValueError(f"transform must be one of {', '.join(SPARSELOCO_TRANSFORMS)}, got {transform!r}")
        self.wire = SparseCodec(int(chunk), int(topk), values, quant_block)
        self.sends_indices = True  # its messages carry indices (an outgoing hook may change them)
        self.transform = transform
        super().__init__(
            params,
            inner_optimizer,
            default_inner=lambda groups: AdamW(groups, **SPARSELOCO_INNER_DEFAULTS),
            outer_defaults=dict(outer_lr=outer_lr, decay=decay),
            link=link,
            sync_every=sync_every,
            max_grad_norm=max_grad_norm,
            quant_block=quant_block,
            delay=delay,
            aggregate=aggregate,
            dense=False,
        )
        for group in self.param_groups:
            if not group["outer_lr"] > 0:
                raise ValueError(f"outer_lr must be > 0, got {group['outer_lr']}")
            check_unit_interval("decay", group["decay"])

    def _init_outer_state(self, p: torch.Tensor, state: dict) -> None:
        state["error"] = replica_state_like(p, self._topology)

    # ------------------------------------------------------------------ sizes
    def _rows(self) -> list[int]:
        return [num_chunks(local(p).numel(), self.wire.chunk) for p in self._params()]

    def message_nbytes(self) -> int:
        """Bytes of this rank's outer message (flag byte included): what the link counts per copy."""
        return sparseloco_message_nbytes([local(p).numel() for p in self._params()], chunk=self.wire.chunk,
                                         topk=self.wire.topk, values=self.wire.values,
                                         quant_block=self.wire.block)

    # ------------------------------------------------------------------ outer step
    def _places(self, params: list) -> dict:
        """Each parameter's elements in the flat (N, c) chunk matrix: every parameter zero-padded to whole chunks."""
        places, offset = {}, 0
        for p in params:
            n = local(p).numel()
            places[p] = slice(offset, offset + n)
            offset += num_chunks(n, self.wire.chunk) * self.wire.chunk
        return places

    def _chunks_of(self, params: list, dtype: torch.dtype) -> torch.Tensor:
        """v = (φ − θ) + β·e of every parameter, each zero-padded to whole chunks, in one (N, c) matrix.

        A few multi-tensor ops whatever the number of parameters: the matrix is zeroed once and each
        parameter's rows are views of it."""
        x = torch.zeros(sum(self._rows()), self.wire.chunk, dtype=dtype, device=local(params[0]).device)
        views = {p: x.view(-1)[place] for p, place in self._places(params).items()}
        torch._foreach_copy_(list(views.values()), [state_view(self.state[p]["slow"]).reshape(-1) for p in params])
        torch._foreach_sub_(list(views.values()), [local(p).reshape(-1) for p in params])
        for group in self.param_groups:
            ps = group["params"]
            torch._foreach_add_([views[p] for p in ps], [state_view(self.state[p]["error"]).reshape(-1) for p in ps],
                                alpha=group["decay"])
        return x

    def _decode_dense(self, message: torch.Tensor, n_chunks: int) -> torch.Tensor:
        """One replica's message -> its decoded values, (N, c) in the parameters' space."""
        idx, vals = self.wire.decode(message[:-1], n_chunks)
        dense = scatter_chunks(idx, vals, self.wire.chunk)
        return idct(dense) if self.transform == "dct" else dense

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> OuterFlight:
        params = self._params()
        dtype = self._message_dtype(params)
        v = self._chunks_of(params, dtype)
        n_chunks = v.shape[0]
        device = v.device
        # The verdict (v not finite on any rank of this model copy) stays on the device and becomes the
        # flag; a refusing copy's payload is zeroed by it, so nothing non-finite is sent and the host does
        # not wait here. Only an outgoing hook (fault injection) reads it at once.
        refuse = nonfinite_flag([v], device)
        if self._shard_group is not None:  # the S ranks of a model copy agree
            dist.all_reduce(refuse, op=dist.ReduceOp.MAX, group=self._shard_group)
        x = dct(v) if self.transform == "dct" else v
        idx, vals = topk_per_chunk(x.contiguous(), self.wire.topk)
        message = torch.cat([self.wire.encode(idx, vals), refuse])
        message[:-1].mul_(1 - message[-1])
        sent = message
        if self.outgoing_hook is not None and not bool(refuse.item()):
            sent = message.clone()  # what the hook sends instead of the message, whose error feedback stays honest
            bad_idx, bad_vals = self.outgoing_hook.sparse(idx, vals, self.inner_steps, chunk=self.wire.chunk,
                                                          index_max=torch.iinfo(self.wire.index_dtype).max)
            bad_vals = bad_vals.clone()
            self._hook_update([bad_vals])
            sent[:-1] = self.wire.encode(bad_idx, bad_vals)
        result = self.link.all_gather(self._counting(sent), async_op=async_op) if self.link is not None \
            else sent.unsqueeze(0)
        return OuterFlight(outer_index, result, message, message, None, n_chunks, extra=dict(v=v))

    def _end_outer(self, flight: OuterFlight, result: Any) -> str | None:
        n_chunks, v = flight.numel, flight.extra["v"]
        # Every message is checked first; a bad one is left out and the mean is over the others. The
        # plain mean of well-formed messages is computed with the checks and read with them, once.
        kept, mean, own = self._screened_mean(result, nbytes=flight.message.numel(), n_chunks=n_chunks)
        if not kept:
            return DROP
        if mean is None:  # a refusal
            return "error-feedback accumulator (β·e + pseudo-gradient)"
        if not isinstance(mean, torch.Tensor):  # a message left out, or a robust aggregate: decoded again
            mean = self._robust_sum((self._decode_dense(result[r], n_chunks) for r in kept), kept)
            if not self._mean_finite(mean):
                return DROP
        if own is None:
            own = self._decode_dense(flight.message, n_chunks)
        params = self._params()
        replicas = len(kept)
        err = (v - own.to(v.dtype)).view(-1)
        mean = mean.view(-1)
        rows = self._places(params)
        errors = [state_view(self.state[p]["error"]) for p in params]
        torch._foreach_copy_(errors, [err[rows[p]].view_as(e) for p, e in zip(params, errors, strict=True)])
        for group in self.param_groups:
            ps = group["params"]
            phis = [state_view(self.state[p]["slow"]) for p in ps]
            torch._foreach_add_(phis, [mean[rows[p]].view_as(phi).to(phi.dtype) for p, phi in zip(ps, phis, strict=True)],
                                alpha=-group["outer_lr"] / replicas)
            if not self.delay:  # τ > 0: θ is merged at step kH + τ (OuterStepOptimizer._merge)
                torch._foreach_copy_([local(p) for p in ps], phis)
        return None

    def _screened_mean(self, result: torch.Tensor, *, nbytes: int, n_chunks: int):
        """(kept senders, mean, own): the senders whose message passed its check, R × their mean (decoded,
        summed in replica order), None if one of them refused, or False when it must be computed anew
        (a message was left out, or ``aggregate`` is not the plain mean); and this rank's own message
        decoded, taken from its row of the gather (None: decode it from what it sent).

        Every message is decoded and checked on the device, and the sum of all of them is taken at
        once; their flags, the checks and whether that sum is finite are read back together: one host
        synchronisation for a clean outer step."""
        replicas = result.shape[0]
        if result.dim() != 2 or result.dtype != torch.uint8 or result.shape[1] != nbytes:
            kept = self._kept_senders(result, nbytes=nbytes, payload=sparse_problems(self.wire, n_chunks))
            return kept, False, None
        # Its own row holds what it sent (the all-gather's bytes), unless a hook changed what it sent.
        if self.outgoing_hook is not None:
            mine = None
        else:
            mine = 0 if self.link is None else getattr(self.link, "group_rank", None)
        own = None
        decoded = [self.wire.decode(result[r, :-1], n_chunks) for r in range(replicas)]
        faults = torch.stack([payload_faults(i.unsqueeze(0), v.unsqueeze(0), self.wire.chunk)[0] for i, v in decoded])
        total = None
        if self.aggregate == "mean":
            for r, (i, v) in enumerate(decoded):  # a bad index is clamped: a sum with a bad message is not used
                dense = scatter_chunks(i.clamp(0, self.wire.chunk - 1), v, self.wire.chunk)
                dense = idct(dense) if self.transform == "dct" else dense
                if r == mine:
                    own = dense
                total = (dense.clone() if r == mine else dense) if total is None else total.add_(dense)
        finite = torch.isfinite(total).all().reshape(1) if total is not None else torch.ones(1, dtype=torch.bool,
                                                                                              device=result.device)
        host = torch.cat([result[:, -1].long(), faults.long(), finite.long()]).tolist()  # the one host read
        flags, bad_rows = host[:replicas], [r for r in range(replicas) if host[replicas + r]]

        def payload(rows: torch.Tensor) -> list:  # the rows with flag 0, in order: reasons only where a check failed
            clean = [r for r in range(replicas) if flags[r] == 0]
            return [index_and_value_problems(decoded[r][0].unsqueeze(0), decoded[r][1].unsqueeze(0), self.wire.chunk)[0]
                    if r in bad_rows else None for r in clean]

        kept = self._kept_senders(result, nbytes=nbytes, payload=payload, flags=flags)
        own = own if mine in kept else None
        if not kept or any(flags[r] for r in kept):
            return kept, None, own
        if total is None or len(kept) < replicas:
            return kept, False, own
        if not host[-1]:
            self._mean_finite(total)  # warned and counted: the outer step is dropped
            return [], None, own
        return kept, total, own
