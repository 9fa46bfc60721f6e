"""FlexDeMo: decoupled momentum over sharded model copies (DeMo when S = 1).

Paper: "FlexDeMo: Decoupled Momentum Optimization for Hybrid Sharded Data Parallel Training"
(From et al., 2025); DeMo: Peng, Quesnelle, Kingma, "Decoupled Momentum Optimization" (2024).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lowband.compress import WireFormat, dct, idct_sparse, to_chunks, topk_per_chunk
from lowband.link import Link
from lowband.optim._common import (
    NONFINITE_POLICIES,
    NonFiniteGradientError,
    all_finite,
    check_sharded,
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


def _rows_of(delta: torch.Tensor | None, r0: int, rows: int, chunk: int, like: torch.Tensor) -> torch.Tensor:
    """The block of δ that matches ``like`` (chunk rows r0.. of the flat shard); zeros before the first step."""
    if delta is None:
        return torch.zeros_like(like)
    flat = delta.reshape(-1)
    if like.dim() == 2:
        return flat[r0 * chunk:(r0 + rows) * chunk].view(rows, chunk)
    return flat[r0 * chunk:]


def _momentum(delta_blk: torch.Tensor, g_blk: torch.Tensor, group: dict) -> torch.Tensor:
    """β·δ + lr·g for one block, as a new tensor (phase 1 and the commit run exactly this)."""
    return delta_blk.mul(group["decay"]).add_(g_blk, alpha=group["lr"])


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

    Cost: the forward DCT is the one c × c product per element and step. Both inverse transforms
    (q, and the mean Q) gather the basis rows that a chunk's k (or R·k) coefficients select,
    IDCT(scatter(I, V)) = Σ_j v_j·B[i_j] (:func:`lowband.compress.idct_sparse`, the dense product
    above a few terms per chunk), and Top-1 is an argmax.

    All parameters' payloads travel as one flat uint8 message per step through the link (one
    all-gather over the replicate group: one round trip between nodes). R = 1: nothing is
    exchanged (plain sign-SGD on shards).

    The non-finite check rides in the same message. Phase 1 computes the payload from β·δ + lr·g
    into temporaries, changing no state; the S ranks of a model copy agree over the fast shard
    group whether any gradient or value to send holds NaN/Inf; the message ends with one flag
    byte (1: refuse), and a refusing copy sends zeros instead of its payload, so nothing
    non-finite leaves a rank. After the all-gather every rank sees the R flags, so all take the
    same decision: if any is set, ``nonfinite="raise"`` raises :class:`NonFiniteGradientError`
    on every rank and ``"skip"`` leaves parameters and state untouched and counts the skip in
    ``self.skipped_steps``. Otherwise δ ← β·δ + lr·g − q is committed (recomputed with the same
    arithmetic as phase 1, so it is exactly what was compressed) and the mean is applied.
    Bytes per rank and step: :meth:`payload_bytes` + 1 (the flag), all-gathered.

    With ``overlap=True`` the exchange of step t runs while step t+1 computes (Psyche's and
    DeToNATION's delayed apply); step t of every rank::

        wait for the all-gather of step t−1 (started one step ago; hidden behind this step's
            forward and backward): if any replica flagged it, δ returns to its value before step t−1
            and step t−1 is refused (raise or skip, as above); else
            x ← x − lr_t·sign(Q_{t−1});  x ← x − lr_t·wd·x          # lr and wd of step t
        compress β·δ + lr_t·g_t as above (g_t was computed at x before this update)
        keep a copy of δ, commit δ ← β·δ + lr_t·g_t − q_t
        start the all-gather of (q_t, flag) and return

    So the parameters lag one exchange behind the momentum: x_{t+1} = x_t − lr·sign(Q_{t−1}), the
    gradient of step t+1 is taken at parameters that do not yet hold Q_t. The link still carries
    one operation per step (payload + flag). Costs: one copy of δ (to roll back a step a peer
    refuses) and the message in flight. :meth:`flush` applies the last exchange (call it after
    the last step). Checkpoints are exact: :meth:`state_dict` waits for the exchange in flight and
    keeps its outcome in the state (``pending``: the decoded update per parameter, ``pending_status``:
    1 apply, 2 refused, 0 none); the next step applies it, so a resumed run follows the
    uninterrupted one bit for bit.

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
        overlap: apply each exchange one step later so that it overlaps the next step's compute.
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
        overlap: bool = False,
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
        self.overlap = bool(overlap)
        # overlap: the step whose exchange is in flight: (handle or gathered tensor, work, backups).
        self._flight: tuple | None = None
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
        if self.overlap:
            self._settle()
        picks = self._compress(work, grads)
        device = grads[0].device if grads else torch.device("cpu")
        message = self._message(picks, device)
        if self.overlap:
            # Keep δ as it was until every replica accepted this step (known at the next step).
            backups = [(p, state_view(self.state[p]["delta"]).clone(), self.state[p]["step"].clone())
                       if self.state.get(p) else (p, None, None) for _, p in work] if picks is not None else []
            if picks is not None:
                self._commit(work, grads, picks)
            handle = self.link.all_gather(message, async_op=True) if self.link is not None else message.unsqueeze(0)
            self._flight = (handle, work, backups)
            return loss
        gathered = self._exchange(message)
        if self._refused(gathered):
            return loss
        self._commit(work, grads, picks)
        self._apply(work, gathered)
        return loss

    # ------------------------------------------------------------------ overlap
    def _settle(self) -> None:
        """overlap: finish the step in flight (or the one a checkpoint drained): apply or refuse it."""
        if self._flight is not None:
            handle, work, backups = self._flight
            self._flight = None
            gathered = handle if isinstance(handle, torch.Tensor) else handle.wait()
            if bool(gathered[:, -1].any()):
                self._roll_back(backups)
                self._refused(gathered)  # raises, or counts the skip
                return
            self._apply(work, gathered)
            return
        status = self._drained_status()
        params = [p for p, st in self.state.items() if "pending_status" in st]
        if status == 1:
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state.get(p)
                    if st and "pending_status" in st:
                        self._apply_update(group, local(p), state_view(st["pending"]))
        for p in params:
            self.state[p].pop("pending", None)
            self.state[p].pop("pending_status", None)
        if status == 2:
            self._refused(torch.ones(1, 1, dtype=torch.uint8))

    def _drained_status(self) -> int:
        for st in self.state.values():
            if "pending_status" in st:
                return int(round(float(st["pending_status"].item())))
        return 0

    def _roll_back(self, backups: list) -> None:
        for p, delta, step in backups:
            if delta is None:
                self.state.pop(p, None)
            else:
                state_view(self.state[p]["delta"]).copy_(delta)
                self.state[p]["step"].copy_(step)

    def _drain(self) -> None:
        """overlap: wait for the step in flight and keep its outcome in the state (for a checkpoint).

        Accepted: every parameter's decoded update (sign applied, as :meth:`_apply` would add it)
        goes to ``state["pending"]`` (per replica, like δ) with ``pending_status`` 1; refused: δ is
        rolled back and ``pending_status`` is 2. The next :meth:`step` applies (or refuses) it.
        """
        if self._flight is None:
            # Nothing in flight: the same keys (status 0), so that every checkpoint has one layout.
            for p, st in self.state.items():
                if st and "pending_status" not in st:
                    st["pending"] = replica_state_like(p, self._topology)
                    st["pending_status"] = torch.tensor(0.0)
            return
        handle, work, backups = self._flight
        self._flight = None
        gathered = handle if isinstance(handle, torch.Tensor) else handle.wait()
        refused = bool(gathered[:, -1].any())
        if refused:
            self._roll_back(backups)
        for p, st in self.state.items():
            if st:
                st["pending"] = replica_state_like(p, self._topology)
                st["pending_status"] = torch.tensor(2.0 if refused else 1.0)
        if not refused:
            self._apply(work, gathered, into={p: state_view(self.state[p]["pending"]) for _, p in work
                                              if self.state.get(p)})

    @torch.no_grad()
    def flush(self) -> None:
        """overlap: apply the step still in flight now (at the end of training). No-op otherwise."""
        if self.overlap:
            self._settle()

    @torch.no_grad()
    def state_dict(self):  # type: ignore[override]
        if self.overlap:
            self._drain()
        return super().state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:  # type: ignore[override]
        if self._flight is not None:  # e.g. DCP's zero-lr initialisation step: its outcome is replaced
            handle = self._flight[0]
            if not isinstance(handle, torch.Tensor):
                handle.wait()
            self._flight = None
        super().load_state_dict(state_dict)

    # ------------------------------------------------------------------ phases
    def _compress(self, work: list, grads: list[torch.Tensor]) -> list | None:
        """Phase 1: this step's momentum, compressed, without changing any state.

        Returns per parameter ``(idx, sent_vals, payload)``: the kept indices, the values as the
        peers will decode them, and the wire bytes; or None when a gradient or a value to send is
        not finite on any rank of this model copy (the node's ranks agree over the fast shard
        group, so every rank of a copy sends the same verdict).
        """
        bad = not all_finite(grads)
        picks: list | None = None
        if not bad:
            picks = []
            for (group, p), g in zip(work, grads, strict=True):
                wire = WireFormat(group["chunk"], group["topk"], group["values"])
                delta = self._delta_or_none(p)
                idx, vals = self._topk_of_momentum(delta, g, group)
                payload = wire.pack(idx, vals)
                sent_vals = wire.sent_values(vals)  # exactly what peers will unpack
                picks.append((idx, sent_vals, payload))
            bad = not all_finite([sv for _, sv, _ in picks])  # one host sync for every parameter
        shard_group = self._shard_group()
        if shard_group is not None:
            device = grads[0].device if grads else torch.device("cpu")
            flag = torch.tensor([1 if bad else 0], dtype=torch.uint8, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard_group)
            bad = bool(flag.item())
        return None if bad else picks

    def _delta_or_none(self, p: torch.Tensor) -> torch.Tensor | None:
        state = self.state.get(p)
        return state_view(state["delta"]) if state else None

    def _topk_of_momentum(self, delta: torch.Tensor | None, g: torch.Tensor, group: dict):
        """Top-k DCT coefficients of β·δ + lr·g, computed block by block into temporaries."""
        chunk = group["chunk"]
        flat_g = g.reshape(-1)
        picks = []
        for (gblk, rows), r0 in _block_rows(flat_g, chunk):
            m = _momentum(_rows_of(delta, r0, rows, chunk, gblk), gblk, group)
            picks.append(topk_per_chunk(dct(to_chunks(m.float(), chunk)), group["topk"]))
        if not picks:  # an empty shard (FSDP2 gives the last ranks nothing of a tiny parameter)
            return (torch.empty(0, group["topk"], dtype=torch.long, device=g.device),
                    torch.empty(0, group["topk"], device=g.device))
        if len(picks) == 1:
            return picks[0]
        return torch.cat([i for i, _ in picks]), torch.cat([v for _, v in picks])

    def _message(self, picks: list | None, device: torch.device) -> torch.Tensor:
        """One flat uint8 message: every parameter's payload, then one flag byte (1: refuse).

        A refused step sends zeros of the same length: nothing non-finite leaves the rank and the
        message size, hence the collective, is the same on every rank.
        """
        if picks is None:
            message = torch.zeros(self.payload_bytes() + 1, dtype=torch.uint8, device=device)
            message[-1] = 1
            return message
        return torch.cat([pl for _, _, pl in picks] + [torch.zeros(1, dtype=torch.uint8, device=device)])

    def _exchange(self, message: torch.Tensor) -> torch.Tensor:
        if self.link is not None:
            return self.link.all_gather(message)
        return message.unsqueeze(0)

    def _refused(self, gathered: torch.Tensor) -> bool:
        """True if any replica flagged its step; every rank sees the same flags, so all agree."""
        if not bool(gathered[:, -1].any()):
            return False
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                "a gradient holds NaN or Inf on at least one rank; the step was refused before anything "
                "non-finite was sent or anything was changed. Lower the learning rate, clip gradients, or "
                "pass nonfinite='skip' (lowband train: --nonfinite skip) to skip such steps."
            )
        self.skipped_steps += 1
        log.warning("non-finite gradient: step skipped (%d skipped so far)", self.skipped_steps)
        return True

    def _commit(self, work: list, grads: list[torch.Tensor], picks: list) -> None:
        """Phase 2 (every replica accepted the step): δ ← β·δ + lr·g − q, with q what was sent."""
        for _, p in work:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["delta"] = replica_state_like(p, self._topology)
        torch._foreach_add_([self.state[p]["step"] for _, p in work], 1.0)
        for (group, p), g, (idx, sent_vals, _) in zip(work, grads, picks, strict=True):
            state = self.state[p]
            chunk = group["chunk"]
            flat = state_view(state["delta"]).view(-1)  # a view: writes go through
            for (blk, rows), r0 in _block_rows(flat, chunk):
                gblk = _rows_of(g.reshape(-1), r0, rows, chunk, blk)
                blk.mul_(group["decay"]).add_(gblk, alpha=group["lr"])  # _momentum's arithmetic, in place
                q = idct_sparse(idx[r0:r0 + rows], sent_vals[r0:r0 + rows], chunk)
                blk.sub_(q.view(-1)[:blk.numel()].view_as(blk).to(blk.dtype))

    def _apply(self, work: list, gathered: torch.Tensor, into: dict | None = None) -> None:
        """Phase 3: decode the mean over replicas and step (or, ``into``, store the update per parameter)."""
        replicas = gathered.shape[0]
        offset = 0
        for group, p in work:
            x = local(p)
            wire = WireFormat(group["chunk"], group["topk"], group["values"])
            n_chunks = -(-x.numel() // wire.chunk)
            nbytes = wire.payload_nbytes(n_chunks)
            idx, vals = wire.unpack(gathered[:, offset:offset + nbytes], n_chunks)
            offset += nbytes
            target = into.get(p) if into is not None else None
            if into is not None and target is None:
                continue
            lr = group["lr"]
            sink = x if target is None else target
            vals = vals.div_(replicas)  # (Σ_r v_r)/R·B[i] as (Σ_r v_r/R)·B[i]: the same floats for R = 2^j
            for (blk, rows), r0 in _block_rows(sink.view(-1), wire.chunk):  # in place: x must be contiguous
                update = idct_sparse(idx[:, r0:r0 + rows], vals[:, r0:r0 + rows], wire.chunk)
                update = update.view(-1)[:blk.numel()].view_as(blk).to(blk.dtype)
                if group["sign"]:
                    update.sign_()
                if target is None:
                    blk.add_(update, alpha=-lr)
                else:
                    blk.copy_(update)
            if target is None and group["weight_decay"] > 0:
                x.mul_(1.0 - lr * group["weight_decay"])

    def _apply_update(self, group: dict, x: torch.Tensor, update: torch.Tensor) -> None:
        """x ← x − lr·u (block by block, as :meth:`_apply`), then weight decay: a drained update."""
        lr = group["lr"]
        for ((blk, _), _), ((ublk, _), _) in zip(_block_rows(x.view(-1), group["chunk"]),
                                                  _block_rows(update.reshape(-1), group["chunk"]), strict=True):
            blk.add_(ublk, alpha=-lr)
        if group["weight_decay"] > 0:
            x.mul_(1.0 - lr * group["weight_decay"])

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
