"""Test-side helpers of the DiLoCo and NoLoCo launches: the tiny model under short names, replicas
compared through a test-side all-gather, sends watched for non-finite tensors, traffic by kind."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowband.comm.link import Link
from lowband.distributed.topology import Topology
from lowband.testing.ranks import tiny_loss, tiny_model, tiny_sharded, tiny_steps

make_model = tiny_model
loss_of = tiny_loss


sharded = tiny_sharded


def maxdiff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def gather_replicas(t: torch.Tensor, topo: Topology) -> torch.Tensor:
    """(R, *t.shape): ``t`` of every replica holding the same shard (a test-side collective)."""
    bufs = [torch.empty_like(t) for _ in range(topo.replicas)]
    dist.all_gather(bufs, t.detach().contiguous(), group=topo.replicate_group())
    return torch.stack(bufs)


def replicas_equal(model, topo: Topology) -> bool:
    for p in model.parameters():
        g = gather_replicas(p.to_local() if hasattr(p, "to_local") else p, topo)
        if not all(torch.equal(g[0], x) for x in g[1:]):
            return False
    return True


run = tiny_steps


def watch_sends(link: Link, method: str) -> list[bool]:
    """Record, for every call of ``link.<method>``, whether the tensor this rank sends is finite."""
    seen: list[bool] = []
    original = getattr(link, method)

    def wrapper(tensor, *args, **kwargs):
        seen.append(bool(torch.isfinite(tensor).all()))
        return original(tensor, *args, **kwargs)

    setattr(link, method, wrapper)
    return seen


def kinds(traffic) -> list[dict]:
    return [{k: (v.count, v.largest_group) for k, v in t.by_kind().items()} for t in traffic]
