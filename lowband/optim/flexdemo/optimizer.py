"""FlexDeMo: decoupled momentum over sharded model copies (DeMo when S = 1).

Paper: "FlexDeMo: Decoupled Momentum Optimization for Hybrid Sharded Data Parallel Training"
(From et al., 2025); DeMo: Peng, Quesnelle, Kingma, "Decoupled Momentum Optimization" (2024).

The optimizer is here; its parts are beside it: the layout of a param group in blocks of chunk rows
(:mod:`lowband.optim.flexdemo.blocks`), the 2-D tile path (:mod:`lowband.optim.flexdemo.tiles`), the
overlapped exchange (:mod:`lowband.optim.flexdemo.overlap`) and the screening of what the exchange
brings (:mod:`lowband.optim.flexdemo.screen`), none of which imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lowband.comm.link import Link
from lowband.compress import WireFormat, idct_sparse, topk_per_chunk
from lowband.optim._common import (
    NONFINITE_POLICIES,
    BadMessageTally,
    check_lr,
    check_sharded,
    committed,
    local,
    nonfinite_flag,
    replica_state_like,
    run_closure,
    screening_counts,
    state_view,
)
from lowband.optim.flexdemo.blocks import (
    BlockPlan,
    Seg,
    Work,
    Workspace,
    gather_block,
    make_plan,
    scatter_views,
    view_block,
)
from lowband.optim.flexdemo.overlap import OverlapMixin
from lowband.optim.flexdemo.screen import _NOT_COUNTED, Screened, ScreenMixin
from lowband.optim.flexdemo.tiles import (
    add_tiled_updates,
    basis_of,
    is_tiled,
    num_rows,
    row_width,
    tiled_flat,
    tiled_flats,
    untile_all,
    untile_deltas,
    width_name,
)
from lowband.optim.protocol import OptimizerStats
from lowband.optim.robust import AgreementMemory, ClipTally, check_aggregate, kept_clip_scales, sparse_gram

__all__ = ["BLOCK_LAYOUTS", "FlexDeMo", "OVERLAP_APPLY"]

#: With overlap: "local" steps with the replica's own update at once and corrects to the mean when it
#: arrives; "stale" steps with the mean one step late.
OVERLAP_APPLY = ("local", "stale")

log = logging.getLogger(__name__)


# Chunks are transformed in blocks of about this many elements, so the DCT's temporaries stay small.
_BLOCK_ELEMENTS = 1 << 20
# A parameter with at least this many elements of whole chunks is transformed in place, in views of
# its own storage; smaller ones (and the partial last chunk of every parameter) are copied into shared
# blocks, many parameters to a block. At c = 128 that is 512 chunks: below it, the copies in and out
# (about 4 passes over the elements) cost less than one block's own dozen or so torch calls.
_VIEW_MIN_ELEMENTS = 1 << 16
# The "group" layout's largest block: it bounds the temporaries (about three blocks) of a large shard.
_GROUP_BLOCK_ELEMENTS = 1 << 26

#: How a param group's chunk rows are cut into blocks: "cache" (about 2^20 elements, which stay in a CPU's
#: caches), "group" (the whole group: a few kernels per step, for GPUs), "auto" (group off the CPU).
BLOCK_LAYOUTS = ("auto", "group", "cache")


class FlexDeMo(OverlapMixin, ScreenMixin, Optimizer):
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
    (q, and the mean Q) sum the basis rows that a chunk's k (or R·k) coefficients select,
    IDCT(scatter(I, V)) = Σ_j v_j·B[i_j] (:func:`lowband.compress.idct_sparse`: one fused
    gather-multiply-add, the dense product above 48 terms per chunk), and Top-1 is an argmax. The
    work is done per block of chunk rows, not per tensor: a param group's parameters (those with a
    gradient) are the rows of one (Σ chunks, c) matrix, each parameter zero-padded to whole chunks
    on its own so that it decodes alone, cut into blocks as ``blocks`` says. ``"cache"`` (the CPU's
    default): blocks of about 2^20 elements, which stay in the caches between the passes; a parameter
    with at least 2^16 elements of whole chunks is used in place, in views of its storage; smaller
    ones and every partial last chunk are copied into shared blocks, many parameters to a block.
    ``"group"`` (the default on a GPU, where a step of thousands of small kernels is bound by the
    host): every parameter copied into as few blocks as possible (one per dtype, up to 2^26
    elements), so that a step launches a few dozen kernels whatever the number of parameters
    (``benchmarks/step_cost.py`` counts them), at the price of temporaries of about three times the
    group's size. Per block run the momentum, the DCT product, the top-k and both inverse
    transforms, into block buffers reused within the step; per group the encoding, the finite check
    of the values to send, and the decoding (:meth:`lowband.compress.WireFormat.encode_many`: the
    same bytes as the tensors' payloads one by one). Both layouts give the same bytes and updates
    (up to the rounding of a BLAS kernel chosen by a block's size). The step reads the device once:
    after the exchange, the flags, the checks of the received messages and its own verdict together.
    The momentum is computed once, over the gradient (see below), and the
    picks compare magnitudes as integers (:func:`lowband.compress.topk_per_chunk`). What step()
    costs against AdamW's (``benchmarks/step_cost.py``) is in docs/algorithms.md.

    **2-D tiles** (``tile=t > 0``; Psyche's DisTrO transforms 64 × 64 tiles): each local shard of a
    parameter with two or more dimensions is read as a matrix (dim 0, FSDP2's row split, by the
    other dimensions flattened), zero-padded to multiples of t in both dimensions and cut into t × t
    tiles; each tile gets the separable 2-D DCT-II and keeps its ``topk`` largest coefficients, so
    ``chunk`` is not used and the density is k/t². A tile is a chunk row of t² elements under the
    basis B_t ⊗ B_t (:func:`lowband.compress.dct_basis_2d`), so the machinery above runs unchanged on
    a tiled copy of each matrix (tiles are not views of the row-major storage): the gradient is
    copied in tiles (that copy is the step's scratch; ``p.grad`` keeps the gradient), δ is read in
    tiles and written back from them, and the update is decoded in tiles and added back. 1-D and 0-D
    parameters (biases, norms' gains) go in 1-D chunks of t² elements with the 1-D DCT, so every
    row has t² elements and ``topk`` means the same density; a group's payloads are its matrices',
    then its other parameters'. Padding: a ragged edge (a shard's rows or columns not a multiple of
    t, an uneven FSDP2 split included) pads zeros that the transform mixes into its tile's
    coefficients; they cost nothing on the wire beyond the edge tiles themselves (each tile sends
    k coefficients, however much of it is padding), and what the decoded update puts into the
    padding is dropped. A shard with no rows has no tiles.

    All parameters' payloads (each tensor's :class:`lowband.compress.WireFormat` payload, in the
    order of the param groups and their parameters; with tiles, see above) travel as one flat uint8
    message per step through the link (one all-gather over the replicate group: one round trip between nodes).
    R = 1: nothing is exchanged (plain sign-SGD on shards).

    The non-finite check rides in the same message. Phase 1 computes the payload from β·δ + lr·g
    (written over the gradients, see below), changing no state; the S ranks of a model copy agree
    over the fast shard group whether any value to send holds NaN/Inf (which covers the gradients:
    a NaN or Inf anywhere in a chunk makes its DCT coefficients non-finite, and those are
    picked first, so no pass over the gradients of its own is needed); the message ends with one flag
    byte (1: refuse), and a refusing copy sends zeros instead of its payload, so nothing
    non-finite leaves a rank. After the all-gather every rank sees the R flags, so all take the
    same decision: if any is set, ``nonfinite="raise"`` raises :class:`NonFiniteGradientError`
    on every rank and ``"skip"`` leaves parameters and state untouched and counts the skip in
    ``self.skipped_steps``. Otherwise δ ← β·δ + lr·g − q is committed and the mean is applied.

    **The gradients are the step's scratch**: phase 1 writes β·δ + lr·g over each parameter's
    (flat, local) gradient, and the commit reads it from there, exactly what was compressed, so the
    momentum is computed once and δ needs no copy to stay as it was when the step is refused. After
    ``step()`` (accepted or refused, also for a non-finite gradient) ``p.grad`` holds that
    momentum, not the gradient (tiled matrices excepted, see above): read or clip gradients before
    ``step()`` and zero them before the next backward, as training loops do (DeMo's reference
    optimizer also overwrites its gradients).
    Bytes per rank and step: :meth:`payload_bytes` + 1 (the flag), all-gathered.

    With ``overlap=True`` the exchange of step t runs while step t+1 computes (Psyche's and
    DeToNATION's delayed apply). ``overlap_apply`` says what the parameters hold meanwhile.

    ``"local"`` (default): each replica steps with its own update at once and corrects to the mean
    when it arrives; step t of every rank::

        wait for the all-gather of step t−1 (started one step ago; hidden behind this step's
            forward and backward); x ← a (the agreed parameters kept at step t−1); then, if any
            replica flagged step t−1, δ returns to its value before it and the step is refused
            (raise or skip, as above); else x ← x − lr_{t−1}·sign(Q_{t−1}); x ← x − lr_{t−1}·wd·x
        compress β·δ + lr_t·g_t as above (g_t was computed at the parameters before this settle)
        keep a copy of δ, commit δ ← β·δ + lr_t·g_t − q_t
        start the all-gather of (q_t, flag); a ← x;
        x ← x − lr_t·sign(q_t); x ← x − lr_t·wd·x        # the own update, decoded from the message
            (skipped when this replica refuses the step)

    So the agreed parameters a follow the blocking rule exactly (a_{t+1} = a_t − lr_t·sign(Q_t),
    with the lr of the step), and the gradient of step t+1 is taken at a_{t+1} + lr_t·(sign(Q_t) −
    sign(q_t)): the replica's own newest step stands in for the mean until it arrives, instead of
    no step at all. Replicas differ by that step only and are bit-identical after each settle (and
    after :meth:`flush`); with R = 1 this is the blocking variant bit for bit. A refused step
    returns x to a exactly on every replica. Costs: a copy of δ and one of the parameters (with
    gradients), the message in flight, and a second decode of the own message (the top-k inverse
    transform: the sparse sum, not a DCT). :meth:`state_dict` settles the step in flight (the
    model is checkpointed once, not per replica, so it must hold the agreed parameters; a refusal
    is kept, ``pending_status`` 2, and raised or skipped by the next step): a resumed run follows
    the run that saved bit for bit, but the run that saved takes the next gradient at the agreed
    parameters, not at its own step, so it is not the run that did not save.

    ``"stale"``: the parameters lag one exchange behind the momentum; step t applies the mean of
    step t−1 with step t's lr, x_{t+1} = x_t − lr·sign(Q_{t−1}), so the gradient of step t+1 is
    taken at parameters that do not yet hold Q_t. Costs: a copy of δ and the message in flight.
    Checkpoints are exact against the run that did not save: :meth:`state_dict` waits for the
    exchange in flight and keeps its outcome in the state (``pending``: the decoded update per
    parameter, ``pending_status``: 1 apply, 2 refused, 0 none); the next step applies it.

    Either way the link carries one operation per step (payload + flag, the blocking message), and
    :meth:`flush` settles the last exchange (call it after the last step). What each costs in loss
    (t5-mini, 160 steps) is in docs/algorithms.md.

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
        overlap_apply: with overlap, "local" (default: step with the own update at once, correct to the
            mean one step later) or "stale" (step with the mean one step late).
        tile: 0 (default): 1-D chunks of ``chunk`` elements; t > 0: a 2-D DCT over t × t tiles of each
            matrix shard, ``topk`` per tile (1 ≤ topk ≤ t²; indices fit uint8 for t ≤ 16).
        blocks: how a param group's chunk rows are cut into blocks: ``"auto"`` (default: ``"group"`` on
            an accelerator, ``"cache"`` on the CPU), ``"group"`` or ``"cache"`` (see above).
        aggregate: ``"mean"`` (default), ``"clip"``: each replica's kept values (per param group) scaled
            to at most the replicas' median norm before the mean (:mod:`lowband.optim.robust`; no
            extra bytes; with ``values="sign"`` every value has the same size and nothing is clipped), or
            ``"agree"`` (3 or more replicas): a replica whose values point against most of the others' (a
            negative inner product) is left out of the step, then ``clip`` among the rest.
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
        overlap_apply: str = "local",
        tile: int = 0,
        aggregate: str = "mean",
        blocks: str = "auto",
    ) -> None:
        check_lr(lr)
        if blocks not in BLOCK_LAYOUTS:
            raise ValueError(f"blocks must be one of {', '.join(BLOCK_LAYOUTS)}, got {blocks!r}")
        self.blocks = blocks
        self.aggregate = check_aggregate(aggregate, method="FlexDeMo", dense=False)
        self.clip_tally, self.agreement = ClipTally(), AgreementMemory()  # agree: each pair's cosine remembered
        self._senders: list[int] = []  # the replica indices of the messages _screen kept, in order
        #: What may change this node's outgoing message (:class:`~lowband.optim.protocol.OutgoingHook`,
        #: installed from outside); None on an honest node.
        self.outgoing_hook = None
        self.sends_indices = True  # its messages carry indices (an outgoing hook may change them)
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0:
            raise ValueError(f"tile must be an integer >= 0 (0: 1-D chunks), got {tile!r}")
        width = tile * tile if tile else chunk
        if not isinstance(topk, int) or not 1 <= topk <= width:
            raise ValueError(f"topk must be an integer in [1, {width_name(tile, width)}], got {topk!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if overlap_apply not in OVERLAP_APPLY:
            raise ValueError(f"overlap_apply must be one of {OVERLAP_APPLY}, got {overlap_apply!r}")
        WireFormat(width, topk, values)  # validates values
        defaults = dict(lr=lr, topk=topk, chunk=chunk, decay=decay, sign=sign, weight_decay=weight_decay,
                        values=values, tile=tile)
        super().__init__(params, defaults)
        self.link = link
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.dropped_steps = 0  # fault tolerance: steps whose exchange failed somewhere
        self.bad_messages = BadMessageTally()  # received messages that failed their check, by sender
        self.overlap = bool(overlap)
        self.overlap_apply = overlap_apply
        # overlap: the step whose exchange is in flight: (handle or gathered tensor, work, backups).
        self._flight: tuple | None = None
        self._plans: dict = {}  # layout of each group's parameters, per set of parameters with a gradient
        self._topology = link.topology if link is not None else None
        check_sharded(self.param_groups, self._topology)
        for group in self.param_groups:
            if not isinstance(group["tile"], int) or group["tile"] < 0:
                raise ValueError(f"tile must be an integer >= 0 (0: 1-D chunks), got {group['tile']!r}")
            if not 1 <= group["topk"] <= row_width(group):
                raise ValueError(f"topk must be in [1, {width_name(group['tile'], row_width(group))}], "
                                 f"got {group['topk']}")
            if not 0.0 <= group["decay"] < 1.0:
                raise ValueError(f"decay must be in [0, 1), got {group['decay']}")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("sign", True)
            group.setdefault("weight_decay", 0.0)
            group.setdefault("values", "bf16")
            group.setdefault("tile", 0)
        self.__dict__.setdefault("_plans", {})
        self.__dict__.setdefault("blocks", "auto")
        self.__dict__.setdefault("overlap_apply", "stale")  # pickled before "local" existed
        self.__dict__.setdefault("bad_messages", BadMessageTally())

    # ------------------------------------------------------------------ helpers
    def _shard_group(self):
        topo = self._topology
        if topo is None or topo.shards == 1 or topo.world_size == 1:
            return None
        return topo.shard_group()

    def _plan(self, group: dict, params: list, tile: int) -> BlockPlan:
        """The layout of ``params`` (tile > 0: their tiled copies, whole tiles, so no padding rows)."""
        wire = WireFormat(row_width(group), group["topk"], group["values"])
        shards = [local(p) for p in params]
        numels = [num_rows(x, group) * wire.chunk if tile else x.numel() for x in shards]
        layout = self.blocks if self.blocks != "auto" else "group" if shards and shards[0].device.type != "cpu" else "cache"
        # "group" copies every parameter in: a view block per large parameter would be kernels per parameter.
        sizes = (_BLOCK_ELEMENTS, _VIEW_MIN_ELEMENTS) if layout == "cache" else (_GROUP_BLOCK_ELEMENTS, None)
        key = (id(group), wire, tile, sizes,
               tuple((id(p), n, x.dtype) for p, n, x in zip(params, numels, shards, strict=True)))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[key] = make_plan(wire, numels, [x.dtype for x in shards], block_elements=sizes[0],
                                                view_min_elements=sizes[1])._replace(batched=layout == "group")
        return plan

    def _works(self, group: dict) -> list[Work]:
        """A group's parameters with a gradient: one work, or with ``tile`` set its matrices (tiles),
        then its other parameters (1-D chunks of t²), each with its own transform."""
        params = [p for p in group["params"] if p.grad is not None]
        tile = group["tile"]
        parts = [(params, 0)] if not tile else [([p for p in params if is_tiled(local(p))], tile),
                                                 ([p for p in params if not is_tiled(local(p))], 0)]
        return [Work(group, ps, self._plan(group, ps, t), t) for ps, t in parts if ps]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        loss = run_closure(closure)

        work = [w for group in self.param_groups for w in self._works(group)]
        if not work and self.link is None:
            return loss

        # Flat gradients, per work; phase 1 writes the momentum over them (the step's scratch). Tiles:
        # a tiled copy of each gradient (tiles are not views of the row-major storage) is the scratch.
        grads = [tiled_flats([local(p.grad) for p in w.params], w.tile) if w.tile and w.plan.batched
                 else [tiled_flat(local(p.grad), w.tile) if w.tile else local(p.grad).reshape(-1) for p in w.params]
                 for w in work]
        if self.overlap:
            self._settle()
        picks, refuse = self._compress(work, grads)
        device = grads[0][0].device if grads else torch.device("cpu")
        message = self._message(picks, refuse, device)
        if self.overlap:
            self._start_overlapped(work, grads, picks, message)
            return loss
        counted = self.link is None or self.link.participating
        if not counted:  # healing during this step (fault tolerance, async quorum): send nothing that counts
            message.zero_()
            message[-1] = _NOT_COUNTED
        gathered = self._exchange(message)
        if not committed(self.link):
            self.dropped_steps += 1
            return loss
        screened = self._screen(work, gathered, refuse)  # bad messages are left out (named and counted)
        if _NOT_COUNTED in screened.flags:
            self._senders = [s for s, f in zip(self._senders, screened.flags, strict=True) if f != _NOT_COUNTED]
            screened = screened.without(_NOT_COUNTED)
        if not screened.flags:  # nobody counted (torchft always keeps a live node at the newest step)
            self.dropped_steps += 1
            return loss
        if self._refused(screened.flags):
            return loss
        if counted and picks is not None and not screened.own_refused:
            self._commit(work, grads, picks)
        else:  # healing (the peer's state was loaded: δ = 0), or its refusal outvoted (skip): steps counted
            self._count_step(work)
        self._apply(work, screened)
        return loss

    # ------------------------------------------------------------------ fault tolerance
    def communicates_next(self) -> bool:
        """Every step exchanges its compressed momentum."""
        return True

    @torch.no_grad()
    def reset_replica_state(self) -> None:
        """After this replica copied a live peer's state (fault tolerance): δ ← 0. δ is this replica's own
        residual, what its gradients have not yet sent: a copy of a peer's δ would send the peer's residual
        twice (once from each), so a joining replica starts as a new DeMo replica does, with δ = 0;
        parameters, step counts and hyper-parameters are the peer's."""
        for st in self.state.values():
            if "delta" in st:
                state_view(st["delta"]).zero_()

    @torch.no_grad()
    def flush(self) -> None:
        """overlap: apply the step still in flight now (at the end of training). No-op otherwise."""
        if self.overlap:
            self._settle()

    def stats(self) -> OptimizerStats:
        return OptimizerStats(dropped_steps=self.dropped_steps, skipped_steps=self.skipped_steps,
                              **screening_counts(self.bad_messages, self.clip_tally))

    def state_owners(self) -> list[Optimizer]:
        return [self]

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
    def _compress(self, work: list[Work], grads: list[list[torch.Tensor]]) -> tuple[list | None, torch.Tensor]:
        """Phase 1: this step's momentum, compressed, without changing any state (the momentum is
        written over the flat gradients ``grads``, the step's scratch; δ and the parameters are untouched).

        Returns per param group ``(idx, sent_vals, payload)`` (the kept indices and the values as the
        peers will decode them, (Σ chunks, k) in the layout of its plan, and the wire bytes), and the
        verdict: a one-element uint8 tensor on the device, 1 when a value to send is not finite on any
        rank of this model copy (agreed over the shard group). It is not read here: it travels as the
        flag and is read with the exchange (:meth:`_screen`); only an outgoing hook reads it at once
        (and gets None for the picks of a refusal).
        """
        picks = []
        for w, gflats in zip(work, grads, strict=True):
            idx, vals = self._topk_of_momentum(w, gflats)
            payload, sent_vals = w.plan.wire.encode_many(idx, vals, w.plan.rows)  # sent: what peers unpack
            if self.outgoing_hook is not None:
                # The peers get what the hook made of the update, and this node's δ loses what it would have
                # sent (its state stays honest). Removing a flipped or scaled update from δ instead would make δ
                # grow wherever it was picked until the node's own momentum overflowed: a poisoner (fault
                # injection) would end itself, and with it an attack a real one would keep up.
                changed = vals.clone()
                if self.outgoing_hook.update_([changed], self._steps_taken(work)):
                    payload = w.plan.wire.encode_many(idx, changed, w.plan.rows)[0]
            picks.append((idx, sent_vals, payload))
        # One check covers the gradients too (no pass over them of its own): a NaN or Inf anywhere in a
        # chunk of β·δ + lr·g makes the chunk's DCT coefficients non-finite (every coefficient sums all
        # the chunk's elements times basis entries; NaN or Inf times any entry, 0 included, is not
        # finite; and the first basis row, of B_t ⊗ B_t too, is a non-zero constant, so even a BLAS that skips zero
        # entries leaves at least that coefficient non-finite), and the top-k picks non-finite
        # magnitudes first: the values to send are finite exactly when the gradients, δ and the
        # transform are.
        device = grads[0][0].device if grads else torch.device("cpu")
        refuse = nonfinite_flag([sv for _, sv, _ in picks], device)
        shard_group = self._shard_group()
        if shard_group is not None:
            dist.all_reduce(refuse, op=dist.ReduceOp.MAX, group=shard_group)
        if self.outgoing_hook is not None:
            if bool(refuse.item()):
                return None, refuse
            step = self._steps_taken(work)  # a message changed after the sender's check passed
            for i, (w, (idx, sent_vals, _)) in enumerate(zip(work, picks, strict=True)):
                wire = w.plan.wire
                bad_idx, bad_vals = self.outgoing_hook.sparse(idx, sent_vals, step, chunk=wire.chunk,
                                                              index_max=torch.iinfo(wire.index_dtype).max)
                if bad_idx is not idx or bad_vals is not sent_vals:
                    picks[i] = (idx, sent_vals, wire.encode_many(bad_idx, bad_vals, w.plan.rows)[0])
        return picks, refuse

    def _flats(self, params: list, tile: int = 0, batched: bool = False) -> list[torch.Tensor | None]:
        """This replica's δ of each parameter, flat (a view: writes go through); None before its first step.

        ``tile`` > 0: a tiled copy of δ (for reading; writes do not go through); ``batched``: the
        matrices of one shape tiled together."""
        if tile and batched:
            return tiled_flats([state_view(self.state[p]["delta"]) if self.state.get(p) else None for p in params],
                               tile)
        out = []
        for p in params:
            state = self.state.get(p)
            delta = state_view(state["delta"]) if state else None
            if delta is not None and tile:
                delta = tiled_flat(delta, tile)
            out.append(delta.view(-1) if delta is not None else None)
        return out

    def _block_momentum(self, seg: Seg, deltas: list, gflats: list, group: dict, chunk: int,
                        ws: Workspace) -> torch.Tensor:
        """Phase 1's β·δ + lr·g of one block (rows, chunk), written over the gradient, δ unchanged.

        The gradient is this step's scratch: the momentum goes into its storage (a view block's rows
        of it, or each piece of a packed block, which is computed in the workspace and copied back),
        so that the commit reads it back instead of computing it a second time, and no copy of δ is
        needed to leave δ as it was when the step is refused.
        """
        decay, lr = group["decay"], group["lr"]
        if seg.view:
            g_blk = view_block(seg, gflats, chunk)
            if deltas[seg.pieces[0][0]] is None:  # before the first step δ = 0: β·0 + lr·g
                return g_blk.mul_(lr)
            m = torch.mul(view_block(seg, deltas, chunk), decay,
                          out=ws("m", seg.rows, chunk, g_blk.dtype, g_blk.device))
            return torch.add(m, g_blk, alpha=lr, out=g_blk)
        like = gflats[seg.pieces[0][0]]
        m = gather_block(seg, deltas, chunk, like, out=ws("m", seg.rows, chunk, like.dtype, like.device))
        g = gather_block(seg, gflats, chunk, like, out=ws("g", seg.rows, chunk, like.dtype, like.device))
        m.mul_(decay).add_(g, alpha=lr)
        torch._foreach_copy_(*scatter_views(seg, gflats, m))
        return m

    def _block_committed(self, seg: Seg, gflats: list, chunk: int, ws: Workspace) -> torch.Tensor:
        """The commit's view of a block's momentum, as phase 1 left it in the gradient's storage."""
        if seg.view:
            return view_block(seg, gflats, chunk)
        like = gflats[seg.pieces[0][0]]  # a packed block: its pieces again, zero-padded as in phase 1
        return gather_block(seg, gflats, chunk, like, out=ws("m", seg.rows, chunk, like.dtype, like.device))

    def _topk_of_momentum(self, w: Work, gflats: list[torch.Tensor]):
        """Top-k DCT coefficients of β·δ + lr·g over the group's chunk rows, block by block (the momentum
        written over the flat gradients ``gflats``, δ unchanged)."""
        group, chunk = w.group, w.plan.wire.chunk
        deltas = self._flats(w.params, w.tile, w.plan.batched)
        picks = []
        ws = Workspace(w.plan)
        for seg in w.plan.segs:
            m = self._block_momentum(seg, deltas, gflats, group, chunk, ws).float()
            basis_t = basis_of(w, m.dtype, m.device).T
            coeffs = torch.mm(m, basis_t, out=ws("X", seg.rows, chunk, m.dtype, m.device))  # the DCT
            picks.append(topk_per_chunk(coeffs, group["topk"], workspace=ws("A", seg.rows, chunk, m.dtype, m.device)))
        if not picks:  # only empty shards (FSDP2 gives the last ranks nothing of a tiny parameter)
            device = gflats[0].device
            return (torch.empty(0, group["topk"], dtype=torch.long, device=device),
                    torch.empty(0, group["topk"], device=device))
        if len(picks) == 1:
            return picks[0]
        return torch.cat([i for i, _ in picks]), torch.cat([v for _, v in picks])

    def _message(self, picks: list | None, refuse: torch.Tensor, device: torch.device) -> torch.Tensor:
        """One flat uint8 message: every parameter's payload, then the verdict as flag byte (1: refuse).

        A refused step sends zeros of the same length (zeroed on the device by the verdict): nothing
        non-finite leaves the rank, and every rank's message has the same size."""
        if picks is None:
            message = torch.zeros(self.payload_bytes() + 1, dtype=torch.uint8, device=device)
            message[-1] = 1
            return message
        message = torch.cat([pl for _, _, pl in picks] + [refuse.to(device)])
        message[:-1].mul_(1 - message[-1])
        return message

    def _exchange(self, message: torch.Tensor) -> torch.Tensor:
        if self.link is not None:
            return self.link.all_gather(message)
        return message.unsqueeze(0)

    def _commit(self, work: list[Work], grads: list[list[torch.Tensor]], picks: list) -> None:
        """Phase 2 (every replica accepted the step): δ ← β·δ + lr·g − q, with q what was sent.

        β·δ + lr·g is read back from ``grads``, where phase 1 wrote it: exactly what was compressed."""
        self._count_step(work)
        for w, gflats, (idx, sent_vals, _) in zip(work, grads, picks, strict=True):
            chunk = w.plan.wire.chunk
            basis = basis_of(w, sent_vals.dtype, sent_vals.device)
            deltas = self._flats(w.params)
            if w.tile:  # δ is written in tiles over the tiled scratch (block by block, each read before it is
                # written; whole tiles, so every element), then untiled into δ
                deltas, untiled = gflats, deltas
            ws = Workspace(w.plan)
            for seg in w.plan.segs:
                m = self._block_committed(seg, gflats, chunk, ws)
                rows = slice(seg.row0, seg.row0 + seg.rows)
                q = idct_sparse(idx[rows], sent_vals[rows], chunk, basis=basis,
                                out=ws("q", seg.rows, chunk, sent_vals.dtype, sent_vals.device))
                if seg.view:
                    torch.sub(m, q.to(m.dtype), out=view_block(seg, deltas, chunk))
                else:  # a packed copy: write its pieces back
                    m.sub_(q.to(m.dtype))
                    torch._foreach_copy_(*scatter_views(seg, deltas, m))
            if w.tile and w.plan.batched:
                untile_all(w.params, deltas, untiled, w.tile)
            elif w.tile:
                untile_deltas(w.params, deltas, untiled, chunk)

    def _count_step(self, work: list[Work]) -> None:
        """Count the step in every parameter's state (created here at the first step: step 0, δ = 0)."""
        steps = []
        for w in work:
            for p in w.params:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["delta"] = replica_state_like(p, self._topology)
                steps.append(state["step"])
        torch._foreach_add_(steps, 1.0)

    def _steps_taken(self, work: list[Work]) -> int:
        state = self.state[work[0].params[0]] if work and work[0].params else {}
        return int(state["step"].item()) if "step" in state else 0

    def _apply(self, work: list[Work], gathered: Screened | torch.Tensor, into: dict | None = None,
               lrs: list[float] | None = None) -> None:
        """Phase 3: decode the mean over replicas and step (or, ``into``, store the update per parameter).

        ``gathered``: the screened exchange (its rows already decoded) or messages to decode.
        ``lrs``: the lr of each work (default: its group's lr now)."""
        decoded = gathered.decoded if isinstance(gathered, Screened) else None
        messages = gathered.rows if isinstance(gathered, Screened) else gathered
        replicas = messages.shape[0]
        offset = 0
        for i, w in enumerate(work):
            plan, group = w.plan, w.group
            chunk, lr = plan.wire.chunk, group["lr"] if lrs is None else lrs[i]
            if decoded is not None:
                idx, vals = decoded[i]
            else:
                idx, vals = plan.wire.unpack_many(messages[:, offset:offset + plan.nbytes], plan.rows)
            offset += plan.nbytes
            if into is not None:
                targets = [into.get(p) for p in w.params]
            else:
                targets = [local(p) for p in w.params]  # in place: x must be contiguous
            if all(s is None for s in targets):
                continue
            if w.tile:  # decoded into tiled buffers (copied, not added), then untiled into the targets
                sinks = [x.new_empty(r * chunk) if x is not None else None
                         for x, r in zip(targets, plan.rows, strict=True)]
            else:
                sinks = [x.view(-1) if x is not None else None for x in targets]
            kept = replicas
            if self.aggregate != "mean" and replicas > 1:  # clip: each replica's values bounded by the median norm
                where = f"FlexDeMo step {self._steps_taken(work)}"
                agree = self.aggregate == "agree" and replicas >= 3  # with 2, nobody can tell which is wrong: clip
                members = self._senders if len(self._senders) == replicas else list(range(replicas))
                keep = (self.agreement.agreeing(sparse_gram(idx, vals), members, slot=i) if agree
                        else torch.ones(replicas, dtype=torch.bool))
                norms = torch.linalg.vector_norm(vals.double().reshape(replicas, -1), dim=1).cpu()
                scales = kept_clip_scales(norms, keep)  # agree: the others left out (scale 0)
                self.clip_tally.record_left_out(members, keep, where)
                self.clip_tally.record([m for m, k in zip(members, keep.tolist(), strict=True) if k], norms[keep],
                                       scales[keep], where)
                vals = vals.mul_(scales.to(vals.dtype).to(vals.device).view(-1, *([1] * (vals.dim() - 1))))
                kept = int(keep.sum())
            vals = vals.div_(kept)  # (Σ_r v_r)/R·B[i] as (Σ_r v_r/R)·B[i]: the same floats for R = 2^j
            basis = basis_of(w, vals.dtype, vals.device)
            ws = Workspace(plan)
            for seg in plan.segs:  # block by block, so that the temporaries stay one block's size
                rows = slice(seg.row0, seg.row0 + seg.rows)
                update = idct_sparse(idx[:, rows], vals[:, rows], chunk, basis=basis,
                                     out=ws("u", seg.rows, chunk, vals.dtype, vals.device)).to(seg.dtype)
                if group["sign"]:
                    update.sign_()
                if seg.view:
                    t, start, stop, _, _ = seg.pieces[0]
                    dst, src = ([sinks[t][start:stop]], [update.view(-1)]) if sinks[t] is not None else ([], [])
                else:
                    dst, src = scatter_views(seg, sinks, update)
                if not dst:
                    continue
                if into is None and not w.tile:
                    torch._foreach_add_(dst, src, alpha=-lr)
                else:
                    torch._foreach_copy_(dst, src)
            if w.tile and plan.batched:
                untile_all(w.params, sinks, [x.view(-1) if x is not None else None for x in targets], w.tile,
                           alpha=-lr if into is None else None)
            elif w.tile:
                add_tiled_updates(targets, sinks, w.tile, chunk, lr, add=into is None)
            if into is None and group["weight_decay"] > 0:
                torch._foreach_mul_([local(p) for p in w.params], 1.0 - lr * group["weight_decay"])

    # ------------------------------------------------------------------ accounting
    def payload_bytes(self) -> int:
        """Bytes of this rank's message per step (before the all-gather multiplies it)."""
        total = 0
        for group in self.param_groups:
            wire = WireFormat(row_width(group), group["topk"], group["values"])
            for p in group["params"]:
                total += wire.payload_nbytes(num_rows(local(p), group))
        return total
