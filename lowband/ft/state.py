"""What a node that joins a fault-tolerant job copies from a live peer: this rank's local tensors.

The trainer (:class:`lowband.train.loop.Trainer`) hands torchft a state function and a load
function (:mod:`lowband.ft.node`); the optimizer's part of that state is built and loaded here, tensor by
tensor on this rank's shard, creating the per-replica state a new replica has not made yet.
"""

from __future__ import annotations

import torch

from lowband.distributed.topology import Topology

__all__ = ["load_optimizer_local_state", "local_tensor", "optimizer_local_state"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_local_state(opt) -> dict:
    """``opt``'s state and parameter groups as this rank holds them (local tensors), for a joining peer."""
    from lowband.ft.node import local_state

    params = [p for g in opt.param_groups for p in g["params"]]
    return {"state": {i: local_state(dict(opt.state[p])) for i, p in enumerate(params) if opt.state.get(p)},
            "groups": [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]}


def load_optimizer_local_state(opt, peer: dict, topology: Topology) -> None:
    """Load a peer's optimizer state (local tensors) into ``opt``, creating state this replica has not made yet."""
    from torch.distributed.tensor import DTensor

    from lowband.ft.node import load_local_state
    from lowband.optim._common import replica_state_like, state_view

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
