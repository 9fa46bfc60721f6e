"""The outer-step template shared by DiLoCo, NoLoCo and SparseLoCo (local SGD with an outer step).

Each runs an inner optimizer (AdamW by default) on every replica without any inter-node traffic, and
every ``sync_every`` (H) steps takes one outer step through the link. They are ``torch.optim``
optimizers wrapping the inner one; the training loop calls ``zero_grad()``, ``backward()`` and
``step()`` as usual. :class:`OuterStepOptimizer` holds what they share; each method's module
(:mod:`lowband.optim.outer.diloco`, :mod:`lowband.optim.outer.noloco`, :mod:`lowband.optim.outer.sparseloco`) builds
its message and applies its outer update.

Phases of one ``step()``:

1. refuse a NaN/Inf gradient (the S ranks of a model copy agree through the node's shard group;
   nothing crosses nodes), optionally clip the gradient norm (intra-node only);
2. inner step on the local shards (FSDP2 leaves the intra-node mean gradient in ``p.grad``);
3. every H steps, the outer step: one message per rank through the link, over the replicate group
   (DiLoCo: one all-reduce) or to the n − 1 peers of a random group (NoLoCo: one exchange).
   With ``delay=τ`` (1 ≤ τ < H) the message is only started there; the τ inner steps that follow
   run while it travels, and the τ-th of them waits for it, updates φ and merges (see
   :class:`~lowband.optim.outer.diloco.DiLoCo`). τ = 0 (the default) blocks for the whole outer step.

A single process (``link=None``) or a single replica (R = 1) takes the same path and sends nothing.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lowband.comm.link import Link, LinkHandle
from lowband.compress.quant import BlockQuant
from lowband.optim._common import (
    BadMessageTally,
    NonFiniteGradientError,
    check_sharded,
    committed,
    grads_nonfinite,
    local,
    replica_state_like,
    run_closure,
    screening_counts,
    state_view,
)
from lowband.optim.outer.schedule import check_delay
from lowband.optim.outer.screen import ScreenMixin
from lowband.optim.protocol import OptimizerStats
from lowband.optim.robust import ClipTally, check_aggregate, robust_sum

__all__ = ["DROP", "InnerOptimizer", "OuterFlight", "OuterStepOptimizer", "check_unit_interval"]

log = logging.getLogger(__name__)

InnerOptimizer = Optimizer | Callable[[list[dict[str, Any]]], Optimizer] | None

#: What ``_end_outer`` returns when the outer step is dropped, not refused: no message that passed its
#: check is left to average, or an all-reduced result is bad (a sum cannot name its sender). State
#: unchanged, nothing raised; counted in ``dropped_steps``.
DROP = "\0drop"


def check_unit_interval(name: str, value: float) -> None:
    """Refuse a hyper-parameter ``name`` outside [0, 1) (momenta and decays)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


@dataclass
class OuterFlight:
    """An outer step whose message is in flight (or, τ = 0, already back)."""

    outer_index: int
    result: Any  # a LinkHandle, or the result itself (blocking, no link, no peers)
    message: torch.Tensor  # what this rank sent: fp (sealed) or the lossy encoding
    fp_flat: torch.Tensor  # the sealed fp message
    v: torch.Tensor | None  # lossy: values + error feedback, what the encoding approximates
    numel: int  # values in the message (the flag not counted)
    extra: dict = field(default_factory=dict)


def _tensors_of(params: list) -> list[torch.Tensor]:
    """The tensors of an optimizer's ``params`` argument (tensors, (name, tensor) pairs or groups)."""
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            inner = item["params"]
            out.extend(_tensors_of([inner] if isinstance(inner, torch.Tensor) else list(inner)))
        elif isinstance(item, tuple):
            out.append(item[1])
        else:
            out.append(item)
    return out


def _from_replica(value: Any, p: torch.Tensor) -> Any:
    """Inverse of :meth:`OuterStepOptimizer._to_replica`: this replica's row, shaped and placed like ``p``'s state."""
    if not isinstance(value, torch.Tensor):
        return value
    row = state_view(value).clone()
    if isinstance(p, DTensor) and row.dim() > 0 and tuple(value.shape[1:]) == tuple(p.shape):
        return DTensor.from_local(row, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return row


class OuterStepOptimizer(ScreenMixin, Optimizer):
    """Inner optimizer, step counting, the finite check, the delayed merge and per-replica checkpointing.

    Subclasses define ``_init_outer_state(p, state)``, ``_begin_outer(outer_index, async_op)`` (build
    the message and start its link operation), ``_end_outer(flight, result)`` (the outer update of
    φ from what came back; θ ← φ when τ = 0) and ``_OUTER_KEYS`` (the hyper-parameters of the outer
    step kept in each param group).
    """

    _OUTER_KEYS: tuple[str, ...] = ()
    #: Error-feedback state, one per segment of the outer message (lossy ``values`` only).
    _ERROR_KEYS: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable,
        inner_optimizer: InnerOptimizer,
        *,
        default_inner: Callable[[list[dict[str, Any]]], Optimizer],
        outer_defaults: dict[str, Any],
        link: Link | None,
        sync_every: int,
        max_grad_norm: float | None,
        values: str = "fp32",
        quant_block: int = 256,
        delay: int = 0,
        aggregate: str = "mean",
        dense: bool = True,
    ) -> None:
        self.codec = BlockQuant(values, quant_block)  # validates both
        #: How the members' updates are combined: "mean" (the papers'), "clip", "trimmed" or "agree" (lowband.optim.robust).
        self.aggregate = check_aggregate(aggregate, method=type(self).__name__, dense=dense)
        self.clip_tally = ClipTally()
        #: What may change this node's outgoing message (:class:`~lowband.optim.protocol.OutgoingHook`,
        #: installed from outside); None on an honest node.
        self.outgoing_hook = None
        if not isinstance(sync_every, numbers.Integral) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1, got {sync_every!r}")
        self.delay = check_delay(delay, int(sync_every))
        self._flight: OuterFlight | None = None
        self._refused_what = ""
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm}")
        params = list(params)
        if isinstance(inner_optimizer, Optimizer):
            mine = _tensors_of(params)
            theirs = [p for g in inner_optimizer.param_groups for p in g["params"]]
            if [id(p) for p in mine] != [id(p) for p in theirs]:
                raise ValueError(
                    "inner_optimizer must optimize exactly the parameters given to this optimizer, in the "
                    "same order; or pass a factory, e.g. functools.partial(torch.optim.AdamW, lr=1e-3)"
                )
            inner = inner_optimizer
            super().__init__(inner.param_groups, outer_defaults)  # the same group dicts
        else:
            if inner_optimizer is not None and not callable(inner_optimizer):
                raise ValueError(
                    "inner_optimizer must be a torch.optim.Optimizer over the same parameters, a factory "
                    f"taking param groups (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)) or None, "
                    f"got {type(inner_optimizer).__name__}"
                )
            super().__init__(params, outer_defaults)
            inner = (inner_optimizer or default_inner)(self.param_groups)
            if not isinstance(inner, Optimizer):
                raise ValueError(f"inner_optimizer factory must return a torch.optim.Optimizer, got {type(inner)}")
            if [id(p) for g in inner.param_groups for p in g["params"]] != [
                id(p) for g in self.param_groups for p in g["params"]
            ]:
                raise ValueError("inner_optimizer factory must build its optimizer over the param groups it is given")
        # One list of param groups for both: ``lr`` & co. are the inner optimizer's (LR schedulers
        # on this object drive the inner step); the ``_OUTER_KEYS`` are the outer step's.
        inner.param_groups = self.param_groups
        self.inner_optimizer = inner
        self.link = link
        self.sync_every = int(sync_every)
        self.max_grad_norm = max_grad_norm
        self.last_sync_time_s = 0.0
        self.dropped_outer_steps = 0  # fault tolerance: outer steps whose exchange failed somewhere
        self.bad_messages = BadMessageTally()  # received messages that failed their check, by sender
        self._topology = link.topology if link is not None else None
        check_sharded(self.param_groups, self._topology)
        topo = self._topology
        self._shard_group = (
            topo.shard_group() if topo is not None and topo.shards > 1 and topo.world_size > 1 else None
        )
        # State is created eagerly: torch.distributed.checkpoint loads into the tensors that
        # state_dict() returns, so a fresh optimizer must already hold them.
        for p in self._params():
            self._init_state(p)

    # ------------------------------------------------------------------ state
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        state["slow"] = replica_state_like(p, self._topology)
        state_view(state["slow"]).copy_(local(p))
        self._init_outer_state(p, state)
        if self.codec.lossy:
            for key in self._ERROR_KEYS:
                state[key] = replica_state_like(p, self._topology)
        if self.delay:
            self._init_merge_state(p, state)

    def _init_merge_state(self, p: torch.Tensor, state: dict) -> None:
        """τ > 0: θ as sent (``sent``) and the merge status (``merge``: 0 none, 1 merge, 2 refused), per replica."""
        state["sent"] = replica_state_like(p, self._topology)
        state["merge"] = replica_state_like(torch.zeros(1, device=local(p).device), self._topology)

    def _init_outer_state(self, p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key in self._OUTER_KEYS:
                group.setdefault(key, self.defaults[key])
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            inner.param_groups = self.param_groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:  # during __init__
            super().add_param_group(param_group)
            return
        inner.add_param_group(param_group)  # appends to the shared list
        group = self.param_groups[-1]
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        for p in group["params"]:
            self._init_state(p)

    @property
    def inner_steps(self) -> int:
        """Inner steps taken (``step()`` calls that went through)."""
        params = self._params()
        if not params:
            return 0
        counter = self.state[params[0]]["step"]
        # Read a few times per step: the value is kept until the counter is written (its version
        # moves) or replaced (a loaded state), so that a step reads it once.
        key = (id(counter), counter._version)
        cached = self.__dict__.get("_inner_steps_read")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_inner_steps_read"] = (key, int(counter.item()))
        return cached[1]

    @property
    def outer_steps(self) -> int:
        """Outer steps taken."""
        return self.inner_steps // self.sync_every

    @torch.no_grad()
    def _to_replica(self, t: Any) -> Any:
        """A copy of ``t`` as a replica DTensor (leading replica dim) that DCP keeps per replica.

        Scalars (the inner optimizer's step count) are the same on every replica, which step in
        lockstep: they stay plain tensors (DCP keeps one copy, every rank loads it).
        """
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0:
            return t.detach().clone()
        r = replica_state_like(t, self._topology, dtype=t.dtype)
        state_view(r).copy_(local(t))
        return r

    @torch.no_grad()
    def _inner_state_templates(self) -> dict[torch.Tensor, dict]:
        """The inner optimizer's state; if it has none yet, the shape of the state it will have.

        torch.distributed.checkpoint loads into the tensors of ``state_dict()``, so a fresh
        optimizer must show the inner state's tensors. Like DCP's own ``_init_optim_state``, take
        one inner step with zero gradients and lr 0, keep the state's structure, and undo
        everything (state, gradients, lr, parameters).
        """
        inner = self.inner_optimizer
        params = self._params()
        if any(inner.state.get(p) for p in params):
            return {p: inner.state[p] for p in params if inner.state.get(p)}
        grads = [p.grad for p in params]
        saved = [local(p).clone() for p in params]
        lrs = [g.get("lr") for g in self.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            for g in self.param_groups:
                if "lr" in g:
                    g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
            inner.step()
            templates = {p: dict(inner.state[p]) for p in params if inner.state.get(p)}
        finally:
            inner.state = defaultdict(dict)
            for g, lr in zip(self.param_groups, lrs, strict=True):
                if lr is not None:
                    g["lr"] = lr
            for p, grad, x in zip(params, grads, saved, strict=True):
                p.grad = grad
                local(p).copy_(x)
        return templates

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The state, with every per-replica tensor as a replica DTensor.

        Per parameter: ``step``, ``slow`` (φ) and the outer momentum as kept; plus ``theta``, a copy
        of this replica's parameter (the model's own state dict holds one replica's θ only, since
        DCP de-duplicates it), and ``inner``, the inner optimizer's state converted the same way.
        With τ > 0 and an outer step in flight, it is waited for first and its φ update done
        (:meth:`_settle`); ``sent`` and ``merge`` keep what the merge at step kH + τ needs.
        """
        self._settle()
        sd = super().state_dict()
        templates = self._inner_state_templates()
        state = {}
        for index, p in enumerate(self._params()):
            st = dict(sd["state"][index])
            st["theta"] = self._to_replica(p)
            if p in templates:
                st["inner"] = {k: self._to_replica(v) for k, v in templates[p].items()}
            state[index] = st
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output: restore θ into the parameters and the inner state."""
        state_dict = dict(state_dict)
        carried: dict[Any, tuple[Any, Any]] = {}
        plain: dict[Any, dict] = {}
        for key, st in state_dict["state"].items():
            st = dict(st)
            carried[key] = (st.pop("theta", None), st.pop("inner", None))
            plain[key] = st
        state_dict["state"] = plain
        if self._flight is not None:  # replaced by what the checkpoint holds
            self._wait_outer(self._flight)
            self._flight = None
        super().load_state_dict(state_dict)
        self._check_merge_state()
        keys = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        inner_state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        with torch.no_grad():
            for key, p in zip(keys, self._params(), strict=True):
                theta, inner = carried.get(key, (None, None))
                if theta is not None:
                    local(p).copy_(state_view(theta))
                # Before the first step the inner optimizer has no state; what was saved is a template.
                if inner and self.state[p]["step"].item() > 0:
                    inner_state[p] = {k: _from_replica(v, p) for k, v in inner.items()}
        self.inner_optimizer.state = inner_state

    def _check_merge_state(self) -> None:
        """After loading: τ > 0 needs the merge state (zeros when the checkpoint has none); τ = 0
        cannot take over an outer step that a τ > 0 run saved before merging it."""
        for p in self._params():
            state = self.state[p]
            if self.delay:
                if "sent" not in state or "merge" not in state:
                    self._init_merge_state(p, state)
            elif "merge" in state:
                if state_view(state["merge"]).item() != 0:
                    raise ValueError(
                        "this checkpoint holds an outer step that was started but not yet merged (it was saved "
                        "with delay > 0); resume it with the same delay (overlap) setting"
                    )
                del state["merge"]
                state.pop("sent", None)

    # ------------------------------------------------------------------ step
    def _check_and_clip(self, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        if grads_nonfinite([local(g) for g in grads], None, shard_group=self._shard_group):
            raise NonFiniteGradientError(
                "a gradient holds NaN or Inf on this model copy; the inner step was refused and nothing "
                "was changed or sent. Lower the learning rate or clip gradients (max_grad_norm). The other "
                "replicas will wait for this one at the next outer step until their link timeout."
            )
        if self.max_grad_norm is not None and grads:
            total = torch.nn.utils.get_total_norm(grads, 2.0)
            if isinstance(total, DTensor):  # FSDP2 shards: the norm over the node's shards
                total = total.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One inner step; every ``sync_every`` steps also the outer step (collective)."""
        loss = run_closure(closure)
        params = self._params()
        self._check_and_clip([p for p in params if p.grad is not None])
        first = self.inner_steps == 0
        if first:
            # The outer weights start from the weights the training starts from (which may have been
            # loaded after this optimizer was built).
            for p in params:
                state_view(self.state[p]["slow"]).copy_(local(p))
        self.inner_optimizer.step()
        torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
        steps = self.inner_steps
        if self.delay and steps > self.sync_every and steps % self.sync_every == self.delay:
            start = time.perf_counter()
            try:
                self._merge()
            finally:
                self.last_sync_time_s += time.perf_counter() - start
        if steps % self.sync_every == 0:
            start = time.perf_counter()
            outer_index = steps // self.sync_every - 1
            if self.delay:
                for p in params:
                    state_view(self.state[p]["sent"]).copy_(local(p))
                self._flight = self._begin_outer(outer_index, async_op=True)
            else:
                flight = self._begin_outer(outer_index, async_op=False)
                if committed(self.link):
                    what = self._end_outer(flight, flight.result)
                    if what == DROP:
                        self.dropped_outer_steps += 1
                    elif what is not None:
                        raise self._nonfinite_outer(what)
                else:
                    # The outer step failed between nodes: φ stays; the inner weights keep their H steps
                    # and the next outer step's pseudo-gradient covers them (nothing trained is lost).
                    self.dropped_outer_steps += 1
            self.last_sync_time_s = time.perf_counter() - start
            log.debug("%s outer step %d took %.3f s", type(self).__name__, self.outer_steps, self.last_sync_time_s)
        return loss

    # ------------------------------------------------------------------ fault tolerance
    def communicates_next(self) -> bool:
        """Whether the next :meth:`step` takes an outer step (its exchange between nodes)."""
        return (self.inner_steps + 1) % self.sync_every == 0

    @torch.no_grad()
    def reset_replica_state(self) -> None:
        """After this replica copied a live peer's state (fault tolerance): θ ← φ, error feedback 0.

        The outer weights φ, the outer momentum and the inner optimizer's moments are the peer's
        (φ and the outer momentum are equal on every replica; the moments are an estimate of the
        gradient's, as good as any). The peer's inner weights hold its own inner steps since the last
        outer step: this replica starts its inner steps from φ instead, so that no replica's progress
        is counted twice in the next outer mean. Error feedback is per replica: zero.
        """
        for p in self._params():
            state = self.state[p]
            local(p).copy_(state_view(state["slow"]))
            for key in self._ERROR_KEYS:
                if key in state:
                    state_view(state[key]).zero_()

    def skip_to_outer_step(self) -> int:
        """Count the inner steps left in this window as taken, up to the one before the outer step.

        For a replica that has just copied a peer's state mid-window (fault tolerance's window quorum,
        after :meth:`reset_replica_state`: θ = φ): it goes on at the window's last inner step, the same
        one whichever peer, and whenever in the window, its shards were copied from, and takes part in
        the outer step with that one inner step, as a replica healed right before the outer step does.
        The skipped steps are not trained on this replica. Returns how many were skipped.
        """
        skip = self.sync_every - 1 - self.inner_steps % self.sync_every
        for p in self._params():
            self.state[p]["step"] += skip
        return skip

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> OuterFlight:
        raise NotImplementedError

    def _end_outer(self, flight: OuterFlight, result: Any) -> str | None:
        """The outer update from what came back; None, or what was not finite (nothing changed)."""
        raise NotImplementedError

    def _wait_outer(self, flight: OuterFlight) -> Any:
        return flight.result.wait() if isinstance(flight.result, LinkHandle) else flight.result

    # ------------------------------------------------------------------ delayed merge (τ > 0)
    def _merge_status(self) -> int:
        params = self._params()
        return int(state_view(self.state[params[0]]["merge"]).item()) if params else 0

    def _set_merge_status(self, status: int) -> None:
        for p in self._params():
            state_view(self.state[p]["merge"]).fill_(status)

    @torch.no_grad()
    def _settle(self) -> None:
        """τ > 0: wait for the outer step in flight and update φ (and momenta, error feedback) from it.

        θ is not touched: the merge waits for step kH + τ. The outcome is kept in the state
        (``merge`` = 1, or 2 when a replica flagged a non-finite message), so a checkpoint taken
        now resumes exactly.
        """
        flight, self._flight = self._flight, None
        if flight is None:
            return
        what = self._end_outer(flight, self._wait_outer(flight))
        if what == DROP:  # φ unchanged; θ keeps its local steps, as for a dropped exchange
            self.dropped_outer_steps += 1
            self._set_merge_status(0)
            return
        self._refused_what = what or ""
        self._set_merge_status(1 if what is None else 2)

    @torch.no_grad()
    def _merge(self) -> None:
        """Step kH + τ: θ ← φ_new + (θ − θ_sent); or, if the outer step was refused, raise (φ unchanged)."""
        self._settle()
        status = self._merge_status()
        if status == 0:
            return
        self._set_merge_status(0)
        if status == 2:
            raise self._nonfinite_outer(self._refused_what or "outer message of a replica (a merge waiting in a "
                                        "checkpoint)")
        for p in self._params():
            state = self.state[p]
            local(p).sub_(state_view(state["sent"])).add_(state_view(state["slow"]))

    @torch.no_grad()
    def flush(self) -> None:
        """τ > 0: merge the outer step still in flight now (call it after the last step). No-op otherwise.

        The training loop calls it at the end, so the final weights hold the last outer step.
        """
        if self.delay:
            self._merge()

    def stats(self) -> OptimizerStats:
        """Dropped outer steps; non-finite pseudo-gradients raise (never skipped); outer steps taken."""
        return OptimizerStats(dropped_steps=self.dropped_outer_steps, outer_steps=self.outer_steps,
                              **screening_counts(self.bad_messages, self.clip_tally))

    def state_owners(self) -> list[Optimizer]:
        return [self, self.inner_optimizer]

    # ------------------------------------------------------------------ outer step helpers
    def _message_dtype(self, params: list[torch.Tensor]) -> torch.dtype:
        return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32

    def _seal(self, flat: torch.Tensor, numel: int) -> None:
        """Agree inside the node whether the payload is finite; if not, send zeros and the flag."""
        bad = not bool(torch.isfinite(flat[:numel]).all())
        if self._shard_group is not None:
            f = torch.tensor([1 if bad else 0], dtype=torch.uint8, device=flat.device)
            dist.all_reduce(f, op=dist.ReduceOp.MAX, group=self._shard_group)
            bad = bool(f.item())
        if bad:
            flat.zero_()
            flat[-1] = 1.0
        else:
            flat[-1] = 0.0

    def _error_flat(self) -> torch.Tensor:
        """The error-feedback states in the message's layout: segment by segment, parameter by parameter."""
        params = self._params()
        return torch.cat([state_view(self.state[p][key]).reshape(-1).float()
                          for key in self._ERROR_KEYS for p in params])

    def _encode_outer(self, flat: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A sealed fp message (``numel`` values + flag) -> (uint8 message, v) in the lossy format.

        v = values + e (error feedback) is what was meant to be sent; the message is its encoding
        and one flag byte. A flagged message stays zeros + flag: nothing non-finite is sent.
        """
        codec = self.codec
        message = torch.zeros(codec.nbytes(numel) + 1, dtype=torch.uint8, device=flat.device)
        if flat[-1].item() > 0:
            message[-1] = 1
            return message, None
        v = flat[:numel].float() + self._error_flat() if codec.lossy else flat[:numel].float()
        if not bool(torch.isfinite(v).all()):  # cannot happen with finite values and errors
            message[-1] = 1
            return message, None
        message[:-1] = codec.encode(v)
        return message, v

    @torch.no_grad()
    def _commit_error(self, message: torch.Tensor, v: torch.Tensor, numel: int) -> None:
        """e ← v − decode(what was sent), once the outer step is accepted."""
        err = v - self.codec.decode(message[:-1], numel)
        offset = 0
        for key in self._ERROR_KEYS:
            for p in self._params():
                e = state_view(self.state[p][key])
                e.copy_(err[offset:offset + e.numel()].view_as(e))
                offset += e.numel()

    def _decoded_mean(self, messages: list[torch.Tensor], numel: int, members: list[int]) -> torch.Tensor:
        """The mean of the decoded messages under ``aggregate``, summed in the given order (the same on every rank)."""
        decoded = (self.codec.decode(m[:-1], numel) for m in messages)
        return self._robust_sum(decoded, members).div_(len(messages))

    def _robust_sum(self, updates, members: list[int]) -> torch.Tensor:
        """R × the members' mean under ``aggregate`` (:func:`lowband.optim.robust.robust_sum`). ``updates``
        may be a generator: the plain mean then decodes and adds one member at a time (one update in memory)."""
        if self.aggregate == "mean":
            it = iter(updates)
            total = next(it).clone()
            for u in it:
                total.add_(u)
            return total
        return robust_sum(list(updates), self.aggregate, members=members, tally=self.clip_tally,
                          where=f"{type(self).__name__} outer step {self.outer_steps}")

    def _hook_update(self, tensors: list[torch.Tensor]) -> bool:
        """The outgoing update through :attr:`outgoing_hook` (in place), if one is installed; True if it changed."""
        return self.outgoing_hook is not None and self.outgoing_hook.update_(tensors, self.inner_steps)

    def _hook_dense(self, message: torch.Tensor, lo: int, hi: int, *, numel: int, codec=None) -> torch.Tensor:
        """A sealed dense message as sent through :attr:`outgoing_hook`: ``message`` itself without one."""
        if self.outgoing_hook is None:
            return message
        return self.outgoing_hook.dense(message, lo, hi, step=self.inner_steps, numel=numel, codec=codec)

    @staticmethod
    def _nonfinite_outer(what: str) -> NonFiniteGradientError:
        return NonFiniteGradientError(
            f"the {what} holds NaN or Inf on at least one replica; the outer step was refused and nothing "
            "non-finite was sent. Lower the inner learning rate or clip gradients (max_grad_norm)."
        )
