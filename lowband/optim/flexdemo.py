"""FlexDeMo: decoupled momentum over sharded model copies (DeMo when S = 1).

Paper: "FlexDeMo: Decoupled Momentum Optimization for Hybrid Sharded Data Parallel Training"
(From et al., 2025); DeMo: Peng, Quesnelle, Kingma, "Decoupled Momentum Optimization" (2024).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch.optim import Optimizer

from lowband.compress import WireFormat, dct, idct, scatter_chunks, to_chunks, topk_per_chunk
from lowband.link import Link
from lowband.optim._common import (
    NONFINITE_POLICIES,
    NonFiniteGradientError,
    check_sharded,
    grads_nonfinite,
    local,
    replica_state_like,
    state_view,
)

__all__ = ["FlexDeMo"]

log = logging.getLogger(__name__)


# Chunks are transformed in blocks of about this many elements, so the DCT's temporaries stay small.
_BLOCK_ELEMENTS = 1 << 20


def _blocks(flat: torch.Tensor, chunk: int):
    """(block, rows) over a flat tensor: views of whole chunks, then the zero-padded partial chunk.

    A block of whole chunks is a (rows, chunk) view into ``flat`` (writes go through); the last,
    partial chunk is a view of ``flat``'s tail, returned flat, with ``rows`` = 1 (pad it to use it
    as a chunk).
    """
    n = flat.numel()
    full = n // chunk
    per_block = max(1, _BLOCK_ELEMENTS // chunk)
    body = flat[: full * chunk].view(full, chunk)
    for r0 in range(0, full, per_block):
        blk = body[r0:r0 + per_block]
        yield blk, blk.shape[0]
    if full * chunk < n:
        yield flat[full * chunk:], 1


def _block_rows(flat: torch.Tensor, chunk: int):
    """:func:`_blocks` with each block's first chunk row: ((block, rows), first row)."""
    r0 = 0
    for blk, rows in _blocks(flat, chunk):
        yield (blk, rows), r0
        r0 += rows


class FlexDeMo(Optimizer):
    r"""Decoupled momentum with compressed exchange of its fast components.

    For each parameter shard x with gradient g (after FSDP's intra-node reduce-scatter, the mean
    over the S ranks of the node), every step::

        δ ← β·δ + lr·g                      # decoupled momentum ("decay" β)
        X ← DCT(chunks(δ))                  # orthonormal DCT-II per chunk of c elements (zero-padded)
        (I, V) ← top-k |X| per chunk
        q ← IDCT(scatter(I, V̂))             # V̂ = V as sent (bf16 / fp32 / 1-bit sign·scale)
        δ ← δ − q                           # error feedback: what is sent leaves the momentum
        Q ← (1/R)·Σ_r IDCT(scatter(I_r, V̂_r))   # all-gather over the R replicas, true mean
        x ← x − lr·sign(Q)   (sign=True)   or   x ← x − lr·Q
        x ← x − lr·wd·x                     # decoupled weight decay, when wd > 0

    lr enters twice (in δ and in the step), as in DeMo and DeToNATION: with sign off the
    effective step on the gradient is lr². With topk = chunk, fp32 values and sign off, the
    momentum empties every step and this is SGD with learning rate lr² on the mean gradient.

    All parameters' payloads travel as one flat uint8 message per step through the link (one
    all-gather over the replicate group). R = 1: nothing is exchanged (plain sign-SGD on shards).

    Before anything is sent or changed, all ranks agree whether any gradient holds NaN/Inf
    (one byte through the link). ``nonfinite="raise"`` raises :class:`NonFiniteGradientError` on
    every rank; ``"skip"`` leaves parameters and state untouched and counts the skip in
    ``self.skipped_steps``.

    Args:
        params: parameters (FSDP2 shards when S > 1) or param groups; named parameters
            (``model.named_parameters()``) give errors with names.
        lr: learning rate (> 0).
        topk: coefficients kept per chunk, 1 ≤ topk ≤ chunk (paper: 1, 8, 16, 32).
        chunk: DCT chunk size c (paper: 128). Indices fit uint8 for c ≤ 256.
        decay: momentum decay β in [0, 1) (default 0.999).
        sign: step with sign(Q) (default) or Q itself.
        weight_decay: decoupled weight decay (≥ 0).
        values: wire format of the kept values: "bf16" (default), "fp32" or "sign" (1 bit + scale).
        link: the inter-node link; None for a single process (R = 1).
        nonfinite: "raise" (default) or "skip" when a gradient holds NaN/Inf.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        topk: int = 1,
        chunk: int = 128,
        decay: float = 0.999,
        sign: bool = True,
        weight_decay: float = 0.0,
        values: str = "bf16",
        link: Link | None = None,
        nonfinite: str = "raise",
    ) -> None:
        if not isinstance(lr, torch.Tensor) and not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
        if not isinstance(topk, int) or not 1 <= topk <= chunk:
            raise ValueError(f"topk must be an integer in [1, chunk={chunk}], got {topk!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        WireFormat(chunk, topk, values)  # validates values
        defaults = dict(lr=lr, topk=topk, chunk=chunk, decay=decay, sign=sign, weight_decay=weight_decay,
                        values=values)
        super().__init__(params, defaults)
        self.link = link
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._topology = link.topology if link is not None else None
        check_sharded(self.param_groups, self._topology)
        for group in self.param_groups:
            if not 1 <= group["topk"] <= group["chunk"]:
                raise ValueError(f"topk must be in [1, chunk={group['chunk']}], got {group['topk']}")
            if not 0.0 <= group["decay"] < 1.0:
                raise ValueError(f"decay must be in [0, 1), got {group['decay']}")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("sign", True)
            group.setdefault("weight_decay", 0.0)
            group.setdefault("values", "bf16")

    # ------------------------------------------------------------------ helpers
    def _shard_group(self):
        topo = self._topology
        if topo is None or topo.shards == 1 or topo.world_size == 1:
            return None
        return topo.shard_group()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        work = []  # (group, param) for every parameter with a gradient
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                work.append((group, p))
        if not work and self.link is None:
            return loss

        grads = [local(p.grad) for _, p in work]
        if grads_nonfinite(grads, self.link, shard_group=self._shard_group()):
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    "a gradient holds NaN or Inf on at least one rank; the step was refused before "
                    "anything was sent or changed. Lower the learning rate, clip gradients, or pass "
                    "nonfinite='skip' to skip such steps."
                )
            self.skipped_steps += 1
            log.warning("non-finite gradient: step skipped (%d skipped so far)", self.skipped_steps)
            return loss

        # Phase 1: momentum, compression, error feedback; one payload per parameter.
        payloads: list[torch.Tensor] = []
        meta = []  # (x shard, n_chunks, wire, group)
        for (group, p), g in zip(work, grads, strict=True):
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["delta"] = replica_state_like(p, self._topology)
            state["step"] += 1
            delta = state_view(state["delta"])
            lr, chunk, topk = group["lr"], group["chunk"], group["topk"]
            wire = WireFormat(chunk, topk, group["values"])

            delta.mul_(group["decay"]).add_(g, alpha=lr)
            flat = delta.view(-1)  # a view: the error feedback below writes through it
            # Blocks of chunks keep the transform's temporaries small (a few MB, not 5x the shard).
            picks = [topk_per_chunk(dct(to_chunks(blk.float(), chunk)), topk) for blk, _ in _blocks(flat, chunk)]
            if not picks:  # an empty shard (FSDP2 gives the last ranks nothing of a tiny parameter)
                picks = [(torch.empty(0, topk, dtype=torch.long, device=flat.device),
                          torch.empty(0, topk, device=flat.device))]
            idx = torch.cat([i for i, _ in picks])
            payload = wire.pack(idx, torch.cat([v for _, v in picks]))
            _, sent_vals = wire.unpack(payload, idx.shape[0])  # exactly what peers will see
            for (blk, rows), r0 in _block_rows(flat, chunk):
                q = idct(scatter_chunks(idx[r0:r0 + rows], sent_vals[r0:r0 + rows], chunk))
                blk.sub_(q.view(-1)[:blk.numel()].view_as(blk).to(blk.dtype))
            payloads.append(payload)
            meta.append((local(p), idx.shape[0], wire, group))

        # Phase 2: one all-gather of all payloads over the replicate group.
        message = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8)
        if self.link is not None:
            gathered = self.link.all_gather(message)
        else:
            gathered = message.unsqueeze(0)
        replicas = gathered.shape[0]

        # Phase 3: decode the mean over replicas and step.
        offset = 0
        for x, n_chunks, wire, group in meta:
            nbytes = wire.payload_nbytes(n_chunks)
            idx, vals = wire.unpack(gathered[:, offset:offset + nbytes], n_chunks)
            offset += nbytes
            lr = group["lr"]
            for (blk, rows), r0 in _block_rows(x.view(-1), wire.chunk):  # in place: x must be contiguous
                coeffs = scatter_chunks(idx[:, r0:r0 + rows], vals[:, r0:r0 + rows], wire.chunk).div_(replicas)
                update = idct(coeffs).view(-1)[:blk.numel()].view_as(blk).to(blk.dtype)
                if group["sign"]:
                    update.sign_()
                blk.add_(update, alpha=-lr)
            if group["weight_decay"] > 0:
                x.mul_(1.0 - lr * group["weight_decay"])
        return loss

    # ------------------------------------------------------------------ accounting
    def payload_bytes(self) -> int:
        """Bytes of this rank's message per step (before the all-gather multiplies it)."""
        total = 0
        for group in self.param_groups:
            wire = WireFormat(group["chunk"], group["topk"], group["values"])
            for p in group["params"]:
                n = local(p).numel()
                total += wire.payload_nbytes(-(-n // group["chunk"]))
        return total
