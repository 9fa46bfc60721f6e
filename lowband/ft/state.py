"""What a node that joins a fault-tolerant job copies from a live peer: this rank's local tensors.

The trainer (:class:`lowband.train.loop.Trainer`) hands torchft a state function and a load
function (:mod:`lowband.ft.node`); the optimizer's part of that state is built and loaded here, tensor by
tensor on this rank's shard, creating the per-replica state a new replica has not made yet.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lowband.distributed.topology import Topology
from lowband.ft.node import load_local_state, local_state
from lowband.optim._common import replica_state_like, state_view

__all__ = ["check_peer_state", "load_optimizer_local_state", "local_tensor", "optimizer_local_state"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""

    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_local_state(opt) -> dict:
    """``opt``'s state and parameter groups as this rank holds them (local tensors), for a joining peer."""

    params = [p for g in opt.param_groups for p in g["params"]]
    return {"state": {i: local_state(dict(opt.state[p])) for i, p in enumerate(params) if opt.state.get(p)},
            "groups": [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]}


def load_optimizer_local_state(opt, peer: dict, topology: Topology) -> None:
    """Load a peer's optimizer state (local tensors) into ``opt``, creating state this replica has not made yet."""


    params = [p for g in opt.param_groups for p in g["params"]]
    if len(peer["groups"]) != len(opt.param_groups):
        raise ValueError("healing: the peer's optimizer has another number of parameter groups")
    for group, theirs in zip(opt.param_groups, peer["groups"], strict=True):
        group.update(theirs)
    for i, entries in peer["state"].items():
        p = params[int(i)]
        st = opt.state[p]
        lp = local_tensor(p)
        for k, v in entries.items():
            if isinstance(st.get(k), torch.Tensor):
                load_local_state(st[k], v, what=f"optimizer state {k}")
            elif isinstance(v, torch.Tensor) and tuple(v.shape) == (1, *lp.shape):
                r = replica_state_like(p, topology, dtype=v.dtype)
                state_view(r).copy_(v[0])
                st[k] = r
            elif isinstance(v, torch.Tensor) and v.shape == lp.shape and isinstance(p, DTensor):
                st[k] = DTensor.from_local(v.to(lp.device).clone(), p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
            else:
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v


def _plain_kind(v) -> str:
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__


def check_peer_state(peer: Any, own: dict, *, steps: int | None, param_shapes: list[list[tuple[int, ...]]]) -> None:
    """Refuse (ValueError, naming what is wrong) a live peer's trainer state that this node must not load, before
    anything of it is loaded: a step outside [0, ``steps``] (the job's), a training clock that is not a finite
    non-negative number, parameters or buffers other than this node's (by name), another number of optimizers or
    parameter groups, a group or schedule whose settings are not this node's (by name and kind), optimizer state for
    a parameter this node does not have, or a tensor of it whose shape fits neither the parameter nor a per-replica
    copy (``param_shapes``: each optimizer's local parameter shapes, in order). Dtypes and shapes of the tensors this
    node holds too, and non-finite values, are the transport's checks (:mod:`lowband.ft.transport`); this is what
    would otherwise fail, or load a wrong state, half-way through :meth:`~lowband.ft.session.FaultTolerantSession.load`.
    """
    if not isinstance(peer, dict):
        raise ValueError("the peer's state is not a dict")
    for key in ("trainer", "params", "buffers", "optimizer", "scheduler"):
        if key in own and not isinstance(peer.get(key), type(own[key])):
            raise ValueError(f"the peer's state has no {key} of the kind this node's has")
    trainer = peer["trainer"]
    step = trainer.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or (steps is not None and step > steps):
        raise ValueError(f"the peer's step {str(step)[:40]} is outside the job's [0, {steps}]")
    for key in ("train_time_s", "tokens"):
        v = trainer.get(key)
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"the peer's training clock {key} = {str(v)[:40]} is not a finite number >= 0")
    for key in ("params", "buffers"):
        if set(peer[key]) != set(own[key]):
            diff = sorted(map(str, set(peer[key]) ^ set(own[key])))
            raise ValueError(f"the peer's {key} differ from this node's in {diff[:5]}")
        for name, t in peer[key].items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"the peer's {key}.{name} is not a tensor")
    if len(peer["optimizer"]) != len(own["optimizer"]) or len(param_shapes) != len(own["optimizer"]):
        raise ValueError(f"the peer has {len(peer['optimizer'])} optimizers, this node {len(own['optimizer'])}")
    for o, (theirs, mine, shapes) in enumerate(zip(peer["optimizer"], own["optimizer"], param_shapes, strict=True)):
        if not (isinstance(theirs, dict) and isinstance(theirs.get("groups"), list)
                and isinstance(theirs.get("state"), dict)):
            raise ValueError(f"the peer's optimizer {o} is not a state and groups")
        if len(theirs["groups"]) != len(mine["groups"]):
            raise ValueError(f"the peer's optimizer {o} has {len(theirs['groups'])} parameter groups, this node "
                             f"{len(mine['groups'])}")
        for g, (a, b) in enumerate(zip(theirs["groups"], mine["groups"], strict=True)):
            if not isinstance(a, dict) or set(a) != set(b) or any(_plain_kind(a[k]) != _plain_kind(b[k]) for k in b):
                raise ValueError(f"the peer's optimizer {o} group {g} has other settings than this node's")
        for i, entries in theirs["state"].items():
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(shapes) or not isinstance(entries, dict):
                raise ValueError(f"the peer's optimizer {o} holds state for parameter {str(i)[:20]}, which this node "
                                 f"does not have (0..{len(shapes) - 1})")
            for k, v in entries.items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) not in ((), shapes[i], (1, *shapes[i])):
                    raise ValueError(f"the peer's optimizer {o} state {k} of parameter {i} has shape {tuple(v.shape)}, "
                                     f"neither the parameter's {shapes[i]} nor a replica's")
    sched_theirs, sched_mine = peer["scheduler"], own["scheduler"]
    if set(sched_theirs) != set(sched_mine) or any(_plain_kind(sched_theirs[k]) != _plain_kind(sched_mine[k])
                                                   for k in sched_mine):
        raise ValueError("the peer's learning-rate schedule has other settings than this node's")
    epoch = sched_theirs.get("last_epoch")
    if isinstance(epoch, int) and not -1 <= epoch <= (steps if steps is not None else epoch) + 1:
        raise ValueError(f"the peer's schedule is at step {epoch}, outside the job's [0, {steps}]")
