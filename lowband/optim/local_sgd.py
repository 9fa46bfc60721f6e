"""Local SGD with an outer step: DiLoCo (all replicas) and NoLoCo (small random groups).

Both run an inner optimizer (AdamW by default) on every replica without any inter-node traffic, and
every ``sync_every`` (H) steps take one outer step through the link. They are ``torch.optim``
optimizers wrapping the inner one; the training loop calls ``zero_grad()``, ``backward()`` and
``step()`` as usual.

Phases of one ``step()``:

1. refuse a NaN/Inf gradient (the S ranks of a model copy agree through the node's shard group;
   nothing crosses nodes), optionally clip the gradient norm (intra-node only);
2. inner step on the local shards (FSDP2 leaves the intra-node mean gradient in ``p.grad``);
3. every H steps, the outer step: one message per rank through the link, over the replicate group
   (DiLoCo: one all-reduce) or to the n − 1 peers of a random group (NoLoCo: one exchange).
   With ``delay=τ`` (1 ≤ τ < H) the message is only started there; the τ inner steps that follow
   run while it travels, and the τ-th of them waits for it, updates φ and merges (see
   :class:`DiLoCo`). τ = 0 (the default) blocks for the whole outer step.

A single process (``link=None``) or a single replica (R = 1) takes the same path and sends nothing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
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
from torch.optim import Adam, AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR

from lowband.compress.quant import BlockQuant
from lowband.link import Link, LinkHandle, PeerTimeoutError
from lowband.optim._common import (
    NonFiniteGradientError,
    check_sharded,
    committed,
    grads_nonfinite,
    local,
    replica_state_like,
    run_closure,
    state_view,
)

__all__ = ["DILOCO_INNER_DEFAULTS", "NOLOCO_INNER_DEFAULTS", "DiLoCo", "NoLoCo", "check_delay", "noloco_group_size",
           "noloco_groups", "unmerged_tail_note", "warmup_cosine", "warmup_cosine_factor"]

log = logging.getLogger(__name__)

#: The inner optimizer each method builds when given none (DiLoCo: AdamW as in the paper; NoLoCo:
#: Adam), also the defaults of ``lowband train``'s inner lr and weight decay.
DILOCO_INNER_DEFAULTS: dict[str, float] = {"lr": 4e-4, "weight_decay": 0.1}
NOLOCO_INNER_DEFAULTS: dict[str, float] = {"lr": 4e-4, "weight_decay": 0.0}

InnerOptimizer = Optimizer | Callable[[list[dict[str, Any]]], Optimizer] | None


def _check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


def check_delay(delay: Any, sync_every: int) -> int:
    """Validate τ (``delay``) against H (``sync_every``): an integer with 0 <= τ < H; returns it.

    The outer step started after inner step kH is merged after inner step kH + τ, which must come
    before the next one starts at (k + 1)H.
    """
    if not isinstance(delay, numbers.Integral) or isinstance(delay, bool) or delay < 0:
        raise ValueError(f"delay (τ, inner steps an outer step runs behind) must be an integer >= 0, got {delay!r}")
    if delay >= sync_every:
        raise ValueError(
            f"delay τ={delay} must be below sync_every H={sync_every}: the outer step started after inner step "
            f"kH is merged τ steps later, before the next one starts. Use delay <= {sync_every - 1} or raise H "
            f"to at least {int(delay) + 1}" + (" (H=1 leaves no room for overlap: use delay=0)" if sync_every == 1 else "")
        )
    return int(delay)


def unmerged_tail_note(steps: int, sync_every: int) -> str | None:
    """Why ``steps`` inner steps end between outer steps, or None when they end on one.

    The last ``steps % H`` inner steps of such a run are never merged by an outer step, so the
    final weights (and their validation) are each replica's own, not the replicas' agreed ones.
    """
    tail = steps % sync_every
    if tail == 0 or steps < sync_every:
        return None
    return (f"--steps {steps} is not a multiple of H={sync_every}: the last {tail} inner steps are never "
            "merged by an outer step, so the final weights and validation are one replica's own; give "
            f"--steps {steps - tail} or {steps - tail + sync_every}")


@dataclass
class _OuterFlight:
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
    """Inverse of :meth:`_LocalSGD._to_replica`: this replica's row, shaped and placed like ``p``'s state."""
    if not isinstance(value, torch.Tensor):
        return value
    row = state_view(value).clone()
    if isinstance(p, DTensor) and row.dim() > 0 and tuple(value.shape[1:]) == tuple(p.shape):
        return DTensor.from_local(row, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return row


class _LocalSGD(Optimizer):
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
    ) -> None:
        self.codec = BlockQuant(values, quant_block)  # validates both
        if not isinstance(sync_every, numbers.Integral) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1, got {sync_every!r}")
        self.delay = check_delay(delay, int(sync_every))
        self._flight: _OuterFlight | None = None
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
        return int(self.state[params[0]]["step"].item()) if params else 0

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
        for p in params:
            self.state[p]["step"] += 1
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
                    if what is not None:
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

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> _OuterFlight:
        raise NotImplementedError

    def _end_outer(self, flight: _OuterFlight, result: Any) -> str | None:
        """The outer update from what came back; None, or what was not finite (nothing changed)."""
        raise NotImplementedError

    def _wait_outer(self, flight: _OuterFlight) -> Any:
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
        v = flat[:numel].float() + self._error_flat()
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

    def _decoded_mean(self, messages: list[torch.Tensor], numel: int) -> torch.Tensor:
        """The mean of the decoded messages, summed in the given order (the same on every rank)."""
        mean = self.codec.decode(messages[0][:-1], numel).clone()
        for m in messages[1:]:
            mean.add_(self.codec.decode(m[:-1], numel))
        return mean.div_(len(messages))

    @staticmethod
    def _nonfinite_outer(what: str) -> NonFiniteGradientError:
        return NonFiniteGradientError(
            f"the {what} holds NaN or Inf on at least one replica; the outer step was refused and nothing "
            "non-finite was sent. Lower the inner learning rate or clip gradients (max_grad_norm)."
        )


class DiLoCo(_LocalSGD):
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
    (FSDP2 via :func:`lowband.sharding.shard_model`), each shard position synchronises its own
    shard with the ranks holding the same shard (the link's replicate group). All replicas must
    start from the same weights (e.g. the same seed), as with DDP. Inner optimizer states stay local.
    R = 1 or ``link=None``: the outer step runs on this replica's own pseudo-gradient.

    Param groups are shared with the inner optimizer: ``lr``, ``betas``, ``weight_decay`` ... are
    the inner optimizer's (an LR scheduler on this object schedules the inner lr, see
    :func:`warmup_cosine`); ``outer_lr``, ``outer_momentum``, ``nesterov`` are the outer step's.

    Checkpoints (torch.distributed.checkpoint, :func:`lowband.checkpoint.save_checkpoint`) may be
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
    ) -> None:
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        _check_unit_interval("outer_momentum", outer_momentum)
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
        )
        for group in self.param_groups:
            if not group["outer_lr"] > 0:
                raise ValueError(f"outer_lr must be > 0, got {group['outer_lr']}")
            _check_unit_interval("outer_momentum", group["outer_momentum"])

    def _init_outer_state(self, p: torch.Tensor, state: dict) -> None:
        state["momentum"] = replica_state_like(p, self._topology)

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> _OuterFlight:
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
        self._seal(flat, numel)
        if self.codec.lossy:
            # Quantised values cannot be summed on the way: all-gather them, every rank decodes
            # all R and averages them in replica order (identical φ on every replica).
            message, v = self._encode_outer(flat, numel)
            result = (self.link.all_gather(message, async_op=async_op) if self.link is not None
                      else message.unsqueeze(0))
            return _OuterFlight(outer_index, result, message, flat, v, numel)
        result = self.link.all_reduce(flat, op="avg", async_op=async_op) if self.link is not None else flat
        return _OuterFlight(outer_index, result, flat, flat, None, numel)

    def _end_outer(self, flight: _OuterFlight, result: Any) -> str | None:
        flat, numel = flight.fp_flat, flight.numel
        if self.codec.lossy:
            gathered = result
            if bool(gathered[:, -1].any()):
                return "pseudo-gradient"
            self._commit_error(flight.message, flight.v, numel)
            flat[:numel].copy_(self._decoded_mean(list(gathered), numel))
            flat[-1] = 0.0
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


def _mix_seed(seed: int, outer_index: int) -> int:
    digest = hashlib.sha256(f"lowband.noloco:{seed}:{outer_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def noloco_groups(num_replicas: int, group_size: int, *, seed: int, outer_index: int) -> list[list[int]]:
    """The groups of NoLoCo's outer step ``outer_index``: the same on every rank, without coordination.

    A permutation of the replicas from ``torch.Generator`` seeded with a hash of (seed, outer_index)
    is cut into ``num_replicas // group_size`` groups of ``group_size``; the r left over (r <
    group_size) join the first r groups one each (R = 3, n = 2: one group of three). Each group is
    sorted, which fixes the summation order so that all members compute the same means bit for bit.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if num_replicas == 1:
        return [[0]]
    if not 2 <= group_size <= num_replicas:
        raise ValueError(f"group_size must be in [2, R={num_replicas}], got {group_size}")
    gen = torch.Generator().manual_seed(_mix_seed(seed, outer_index))
    perm = torch.randperm(num_replicas, generator=gen).tolist()
    count = num_replicas // group_size
    groups = [perm[i * group_size:(i + 1) * group_size] for i in range(count)]
    for i, r in enumerate(perm[count * group_size:]):
        groups[i % count].append(r)
    return [sorted(g) for g in groups]


def noloco_group_size(group_size: int, live_replicas: int) -> int:
    """The group size n of an outer step with ``live_replicas`` replicas: min(n, live replicas).

    Without fault tolerance n ≤ R is checked when NoLoCo is built and this is n. Under fault
    tolerance the live nodes change from one outer step's quorum to the next: with fewer live than
    n, the step takes all live replicas as one group (an exchange needs no replica that is not
    there, and a run that lost nodes goes on rather than stopping mid-run); with one, nothing is
    exchanged.
    """
    if live_replicas < 1:
        raise ValueError(f"live_replicas must be >= 1, got {live_replicas}")
    return max(min(group_size, live_replicas), 1)


class NoLoCo(_LocalSGD):
    r"""NoLoCo: local steps, then an outer step that averages only inside small random groups.

    Paper: Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training Method for Large
    Models", 2025, https://arxiv.org/abs/2506.10911. Sign and γ as in the authors' code (see
    docs/algorithms.md, "NoLoCo": +β, γ = β by default).

    On replica i, with φ the slow (outer) weights, θ the fast (inner) weights::

        θ_i ← InnerOpt(θ_i, g)                   # every step (Adam, gradients clipped to 1.0)
        every H steps (outer step k):
            G ← the group of i in noloco_groups(R, n, seed, k)     # same on every rank
            exchange (φ_i, θ_i − φ_i) with the other members of G  # point-to-point, one message
            δ_i ← α·δ_i + β·mean_{j∈G}(θ_j − φ_j) − γ·(φ_i − mean_{j∈G} φ_j)
            φ_i ← φ_i + δ_i ;  θ_i ← φ_i

    No collective spans all replicas: each rank sends one flat buffer (φ and θ − φ of all its
    parameters, and a flag element) to its n − 1 peers with ``Link.exchange`` (batch_isend_irecv).
    With G = all replicas the γ term vanishes and this is DiLoCo with heavy-ball outer momentum
    (η = β, μ = α). When n does not divide R the replicas left over join groups (groups of n + 1).
    A peer that does not answer within ``timeout_s`` raises :class:`~lowband.link.PeerTimeoutError`
    naming it and the group (the process group is then unusable: stop, restart from a checkpoint). A non-finite payload is replaced by zeros and the flag: the whole group raises
    :class:`NonFiniteGradientError` (other groups go on, and meet it at a later outer step).

    Checkpointing is as for :class:`DiLoCo` (φ and δ differ between replicas for good; θ and the
    inner state are stored per replica as well); the seed, group size and counters come back with
    the checkpoint, so a resumed run draws the same groups.

    **Overlap** (``delay=τ``, 1 ≤ τ < H) as for :class:`DiLoCo`: the exchange of (φ_i, θ_sent − φ_i)
    starts after inner step kH (``Link.exchange(..., async_op=True)``, the same bytes), τ inner
    steps run while it travels, then δ_i and φ_i are updated as above from the same messages and
    θ_i ← φ_i + (θ_i − θ_sent). Still point-to-point inside the group only; a refused group raises
    at step kH + τ; checkpoints in flight resume bit for bit; a peer's timeout is raised by the wait.

    **Fault tolerance** (a link with ``ft``, blocking outer step only): the replicas are the live nodes
    of each outer step's torchft quorum, R = ``link.group_size`` and i = ``link.group_rank`` (its
    place in the quorum, the same order on every node); the groups are drawn from them as above, n
    clipped to the live count (:func:`noloco_group_size`: n is checked against the node slots,
    ``--ft-max-nodes``, when NoLoCo is built; alone, a node exchanges nothing). A peer lost during
    the exchange is not raised: the outer step is dropped on this node (φ, δ, θ unchanged, asked
    through ``Link.commit()`` before any change), and at the next quorum torchft heals the node
    from a peer that committed it, if any did (see :meth:`reset_replica_state`). The wait for a
    peer is bounded by ``--ft-timeout``, not ``timeout_s``.

    Param groups are shared with the inner optimizer (``lr`` is the inner lr); ``alpha``, ``beta``,
    ``gamma`` are per group, ``group_size`` and ``seed`` must be the same in all groups.

    Args:
        params: parameters (FSDP2 shards when S > 1), (name, parameter) pairs or param groups.
        inner_optimizer: a factory called with the param groups, an optimizer over the same
            parameters, or None: Adam(lr=4e-4).
        link: the inter-node link; None for a single process.
        sync_every: H, inner steps per outer step (>= 1; paper 50).
        alpha: momentum α of δ, in [0, 1) (paper 0.5).
        beta: weight β of the mean pseudo-gradient, in [0, 1) (paper 0.7); the paper's analysis needs β > α.
        gamma: weight γ ≥ 0 of the pull towards the group's mean φ; None: γ = β.
        group_size: n, replicas per group, 2 ≤ n ≤ R (paper 2).
        seed: seed of the group draws (the same on every rank).
        timeout_s: how long to wait for a peer (> 0); None: the link's ``timeout_s``.
        max_grad_norm: clip the inner gradient's norm to this (paper 1.0); None: no clipping.
        values: wire format of the exchanged φ and θ − φ: ``"fp32"`` (default), ``"bf16"``,
            ``"int8"`` or ``"int4"`` (:mod:`lowband.compress.quant`), each half with its own error
            feedback (``error_phi``, ``error_delta``, per replica); the group mean is taken over the
            decoded messages, the sender's own included, so all members compute the same mean.
            Bytes per peer: 8n + 4 (fp32) or nbytes(2n) + 1.
        quant_block: elements per scale for int8/int4 (default 256).
        delay: τ, as for :class:`DiLoCo` (0 ≤ τ < H; 0: blocking).

    Attributes:
        last_group: global ranks of this rank's group in the last outer step (under fault tolerance:
            replica ranks in that step's quorum).
        ``last_sync_time_s``, ``inner_steps``, ``outer_steps``: as :class:`DiLoCo`.
    """

    _OUTER_KEYS = ("alpha", "beta", "gamma", "group_size", "seed")
    _ERROR_KEYS = ("error_phi", "error_delta")

    def __init__(
        self,
        params: Iterable,
        inner_optimizer: InnerOptimizer = None,
        *,
        link: Link | None = None,
        sync_every: int = 50,
        alpha: float = 0.5,
        beta: float = 0.7,
        gamma: float | None = None,
        group_size: int = 2,
        seed: int = 0,
        timeout_s: float | None = None,
        max_grad_norm: float | None = 1.0,
        values: str = "fp32",
        quant_block: int = 256,
        delay: int = 0,
    ) -> None:
        gamma = beta if gamma is None else gamma
        # Under fault tolerance the live replicas are known only at each outer step's quorum: n is
        # checked against the node slots here and clipped to the live nodes at the outer step.
        replicas = link.max_group_size if link is not None else 1
        self._validate(alpha, beta, gamma, group_size, replicas)
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds (or None: the link's timeout), got {timeout_s}")
        if replicas == 1:
            log.warning("NoLoCo with a single replica: group_size=%d is ignored and nothing is exchanged",
                        group_size)
        if timeout_s is not None and link is not None and link.ft is not None:
            log.warning("NoLoCo timeout_s=%g is not used under fault tolerance: --ft-timeout bounds the wait "
                        "for a peer", timeout_s)
        super().__init__(
            params,
            inner_optimizer,
            default_inner=lambda groups: Adam(groups, **NOLOCO_INNER_DEFAULTS),
            outer_defaults=dict(alpha=alpha, beta=beta, gamma=gamma, group_size=group_size, seed=seed),
            link=link,
            sync_every=sync_every,
            max_grad_norm=max_grad_norm,
            values=values,
            quant_block=quant_block,
            delay=delay,
        )
        self.timeout_s = timeout_s
        self.last_group: list[int] = []
        self._clipped_for: int | None = None  # the live count n was last clipped to (one warning per change)
        for group in self.param_groups:
            self._validate(group["alpha"], group["beta"], group["gamma"], group["group_size"], replicas)
        if len({(g["group_size"], g["seed"]) for g in self.param_groups}) != 1:
            raise ValueError("group_size and seed must be the same in all param groups (one exchange per outer step)")

    @staticmethod
    def _validate(alpha: float, beta: float, gamma: float, group_size: int, replicas: int) -> None:
        _check_unit_interval("alpha", alpha)
        _check_unit_interval("beta", beta)
        if not gamma >= 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool) or group_size < 2:
            raise ValueError(f"group_size (n) must be an integer >= 2, got {group_size!r}")
        if replicas > 1 and group_size > replicas:
            raise ValueError(f"group_size (n) must be in [2, R={replicas}] (the replicas), got {group_size}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint; its group size n (kept with the state) must fit this run's replicas.

        A run resumed on fewer replicas than n (e.g. after losing nodes) is refused here, before any
        step, rather than at its first outer step.
        """
        replicas = self.link.max_group_size if self.link is not None else 1
        for group in state_dict.get("param_groups", []):
            n = group.get("group_size")
            if n is not None and replicas > 1 and n > replicas:
                raise ValueError(
                    f"the checkpoint's NoLoCo group size n={n} is larger than this run's {replicas} replicas "
                    f"(a checkpoint keeps its hyper-parameters). Resume on at least {n} replicas (nodes × ranks "
                    "per node / --shards), or on a single replica, which exchanges nothing"
                )
        super().load_state_dict(state_dict)

    def _init_outer_state(self, p: torch.Tensor, state: dict) -> None:
        state["delta"] = replica_state_like(p, self._topology)

    @torch.no_grad()
    def reset_replica_state(self) -> None:
        """After this replica copied a live peer's state (fault tolerance): θ ← φ, error feedback 0, δ kept.

        As for :class:`DiLoCo`: the inner weights restart from φ (the peer's inner steps since the last
        outer step would otherwise count twice in the next group mean) and the error feedback
        (``error_phi``, ``error_delta``: what this replica's messages have not sent yet) is zero.
        φ is the peer's, and so is δ, NoLoCo's outer momentum, on purpose: δ is per replica, but it
        is never sent (the messages carry φ and θ − φ), so a copy counts nothing twice; it is the
        momentum of the φ just copied, and (φ, δ) together are where the peer's outer trajectory
        is. Zero would make this replica's next outer step differ from its twin's for no reason
        other than the restart. The replica is then a copy of the peer until the groups and the data
        (each node reads its own slice) make them differ again. (torchft picks the peer per rank: a
        node sharded over several ranks may copy its shards from different peers at the same step.)
        """
        super().reset_replica_state()

    @contextlib.contextmanager
    def _group_timeout(self, outer_index: int, me: int, members: list[int], peers: list[int]):
        """The optimizer's ``timeout_s`` on the link while it waits for the group; a timeout names the group."""
        link = self.link
        saved_timeout = link.timeout_s  # type: ignore[union-attr]
        if self.timeout_s is not None:
            link.timeout_s = self.timeout_s  # type: ignore[union-attr]
        try:
            yield
        except PeerTimeoutError as e:
            raise PeerTimeoutError(
                f"NoLoCo outer step {outer_index}: rank {link.rank} (replica {me}) waited in vain for "  # type: ignore[union-attr]
                f"peer rank(s) {peers} of its group (replicas {members}). {e}"
            ) from e
        finally:
            link.timeout_s = saved_timeout  # type: ignore[union-attr]

    def _wait_outer(self, flight: _OuterFlight) -> Any:
        if not isinstance(flight.result, LinkHandle):
            return flight.result
        with self._group_timeout(flight.outer_index, **flight.extra):
            return flight.result.wait()

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> _OuterFlight:
        params = self._params()
        link = self.link
        group0 = self.param_groups[0]
        if link is not None:
            # The live replicas (under fault tolerance: the nodes of this outer step's quorum).
            replicas, me, ranks = link.group_size, link.group_rank, link.group_ranks
        else:
            replicas, me, ranks = 1, 0, [0]
        n = self._live_group_size(group0["group_size"], replicas)
        members = next(g for g in noloco_groups(replicas, n, seed=group0["seed"], outer_index=outer_index)
                       if me in g)
        peers = [ranks[j] for j in members if j != me]
        self.last_group = [ranks[j] for j in members]

        # One message: φ of all parameters, then θ − φ, then the flag.
        numel = sum(local(p).numel() for p in params)
        device = local(params[0]).device
        flat = torch.empty(2 * numel + 1, dtype=self._message_dtype(params), device=device)
        offset = 0
        for p in params:
            x, phi = local(p).reshape(-1), state_view(self.state[p]["slow"]).reshape(-1)
            flat[offset:offset + x.numel()].copy_(phi)
            flat[numel + offset:numel + offset + x.numel()].copy_(x).sub_(phi)
            offset += x.numel()
        self._seal(flat, 2 * numel)
        fp_flat = flat
        v = None
        if self.codec.lossy:
            flat, v = self._encode_outer(fp_flat, 2 * numel)
        received: Any = []
        extra = dict(me=me, members=members, peers=peers)
        if peers:
            with self._group_timeout(outer_index, **extra):
                received = link.exchange(flat, peers, async_op=async_op)  # type: ignore[union-attr]
        return _OuterFlight(outer_index, received, flat, fp_flat, v, 2 * numel, extra)

    def _live_group_size(self, n: int, replicas: int) -> int:
        """n for this outer step: :func:`noloco_group_size`, with a warning each time the clip changes."""
        live_n = noloco_group_size(n, replicas)
        if live_n != n and replicas > 1 and replicas != self._clipped_for:
            log.warning("NoLoCo: %d live replicas, fewer than group_size n=%d: this outer step averages over all "
                        "of them (one group)", replicas, n)
        self._clipped_for = replicas if live_n != n else None
        return live_n

    def _end_outer(self, flight: _OuterFlight, result: Any) -> str | None:
        flat, fp_flat, numel = flight.message, flight.fp_flat, flight.numel // 2
        me, members = flight.extra["me"], flight.extra["members"]
        by_replica = {me: flat, **dict(zip([j for j in members if j != me], result, strict=True))}
        if any(by_replica[j][-1].item() > 0 for j in members):
            return "slow weights or pseudo-gradient of a group member"
        # The same summation order on every member: identical means.
        if self.codec.lossy:
            self._commit_error(flat, flight.v, 2 * numel)
            mean = self._decoded_mean([by_replica[j] for j in members], 2 * numel).to(fp_flat.dtype)
        else:
            mean = by_replica[members[0]][:-1].clone()
            for j in members[1:]:
                mean.add_(by_replica[j][:-1])
            mean.div_(len(members))

        offset = 0
        for group in self.param_groups:
            alpha, beta, gamma = group["alpha"], group["beta"], group["gamma"]
            for p in group["params"]:
                state = self.state[p]
                phi, d = state_view(state["slow"]), state_view(state["delta"])
                n = phi.numel()
                mean_phi = mean[offset:offset + n].view_as(phi)
                mean_delta = mean[numel + offset:numel + offset + n].view_as(phi)
                offset += n
                d.mul_(alpha).add_(mean_delta, alpha=beta)
                if gamma != 0:
                    d.sub_(phi - mean_phi, alpha=gamma)
                phi.add_(d)
                if not self.delay:
                    local(p).copy_(phi)
        return None


def warmup_cosine(optimizer: Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> LambdaLR:
    """Linear warm-up to the peak lr, then cosine decay to ``min_ratio`` × peak (NoLoCo's schedule).

    The factor at step s is (s + 1) / warmup_steps during warm-up, then
    min_ratio + (1 − min_ratio)·(1 + cos(π·t))/2 with t = (s − warmup_steps) / (total_steps −
    warmup_steps), held at min_ratio after ``total_steps``. On :class:`DiLoCo` / :class:`NoLoCo` it
    schedules the inner lr (the param groups are shared).
    """
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if not isinstance(total_steps, int) or total_steps <= warmup_steps:
        raise ValueError(f"total_steps must be an integer > warmup_steps={warmup_steps}, got {total_steps!r}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")

    return LambdaLR(optimizer, functools.partial(warmup_cosine_factor, warmup_steps=warmup_steps,
                                                 total_steps=total_steps, min_ratio=min_ratio))


def warmup_cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The lr factor of :func:`warmup_cosine` at ``step``; ``min_ratio=1`` gives warm-up, then constant."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))
