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
from lowband.compress.check import sparse_problems
from lowband.compress.dct import dct, idct, num_chunks, scatter_chunks, to_chunks, topk_per_chunk
from lowband.compress.sparse import SPARSE_VALUE_FORMATS, SparseCodec
from lowband.optim._common import local, replica_state_like, state_view
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
    def _chunks_of(self, v_parts: list[torch.Tensor]) -> torch.Tensor:
        """Each parameter's flat v, zero-padded to whole chunks, stacked: (N, c) (transformed with dct)."""
        x = torch.cat([to_chunks(v, self.wire.chunk) for v in v_parts])
        return dct(x) if self.transform == "dct" else x

    def _decode_dense(self, message: torch.Tensor, n_chunks: int) -> torch.Tensor:
        """One replica's message -> its decoded values, (N, c) in the parameters' space."""
        idx, vals = self.wire.decode(message[:-1], n_chunks)
        dense = scatter_chunks(idx, vals, self.wire.chunk)
        return idct(dense) if self.transform == "dct" else dense

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> OuterFlight:
        params = self._params()
        dtype = self._message_dtype(params)
        v_parts = []
        for group in self.param_groups:
            beta = group["decay"]
            for p in group["params"]:
                state = self.state[p]
                v = state_view(state["slow"]).reshape(-1).to(dtype) - local(p).reshape(-1).to(dtype)
                v.add_(state_view(state["error"]).reshape(-1).to(dtype), alpha=beta)
                v_parts.append(v)
        rows = self._rows()
        n_chunks = sum(rows)
        device = local(params[0]).device
        message = torch.zeros(self.wire.nbytes(n_chunks) + 1, dtype=torch.uint8, device=device)
        bad = not all(bool(torch.isfinite(v).all()) for v in v_parts)
        if self._shard_group is not None:  # the S ranks of a model copy agree
            f = torch.tensor([1 if bad else 0], dtype=torch.uint8, device=device)
            dist.all_reduce(f, op=dist.ReduceOp.MAX, group=self._shard_group)
            bad = bool(f.item())
        sent = message
        if bad:
            message[-1] = 1
        else:
            x = self._chunks_of(v_parts)
            idx, vals = topk_per_chunk(x.contiguous(), self.wire.topk)
            message[:-1] = self.wire.encode(idx, vals)
            if self.outgoing_hook is not None:  # what the hook sends instead of the message, whose error
                sent = message.clone()  # feedback stays honest
                bad_idx, bad_vals = self.outgoing_hook.sparse(idx, vals, self.inner_steps, chunk=self.wire.chunk,
                                                              index_max=torch.iinfo(self.wire.index_dtype).max)
                bad_vals = bad_vals.clone()
                self._hook_update([bad_vals])
                sent[:-1] = self.wire.encode(bad_idx, bad_vals)
        result = self.link.all_gather(sent, async_op=async_op) if self.link is not None else sent.unsqueeze(0)
        return OuterFlight(outer_index, result, message, message, None, n_chunks, extra=dict(v=v_parts))

    def _end_outer(self, flight: OuterFlight, result: Any) -> str | None:
        n_chunks, v_parts = flight.numel, flight.extra["v"]
        # Every message is checked first; a bad one is left out and the mean is over the others.
        kept = self._kept_senders(result, nbytes=flight.message.numel(), payload=sparse_problems(self.wire, n_chunks))
        if not kept:
            return DROP
        if any(bool(result[r][-1]) for r in kept):
            return "error-feedback accumulator (β·e + pseudo-gradient)"
        # Every replica's decoded message, summed in replica order (the same on every rank).
        mean = self._robust_sum((self._decode_dense(result[r], n_chunks) for r in kept), kept).reshape(-1)
        if not self._mean_finite(mean):
            return DROP
        own = self._decode_dense(flight.message, n_chunks).reshape(-1)
        offset, i = 0, 0
        replicas = len(kept)
        for group in self.param_groups:
            lr = group["outer_lr"]
            for p in group["params"]:
                state = self.state[p]
                phi, e = state_view(state["slow"]), state_view(state["error"])
                n = phi.numel()
                padded = num_chunks(n, self.wire.chunk) * self.wire.chunk
                e.copy_((v_parts[i] - own[offset:offset + n].to(v_parts[i].dtype)).view_as(e))
                step = mean[offset:offset + n].view_as(phi).to(phi.dtype)
                phi.add_(step, alpha=-lr / replicas)
                if not self.delay:  # τ > 0: θ is merged at step kH + τ (OuterStepOptimizer._merge)
                    local(p).copy_(phi)
                offset += padded
                i += 1
        return None
