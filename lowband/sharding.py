"""Sharding a model copy over the ranks of one node with FSDP2.

``fully_shard`` is applied over the node's 1-D mesh (``mesh["shard"]``), per transformer block and
then on the root. After backward each rank holds only its gradient shard, the mean over the S ranks
of its node, as a DTensor in ``p.grad``; the inter-node part is the optimizer's, through the link.
(FSDP2's own 2-D HSDP with ``set_requires_all_reduce(False)`` keeps the reduce-scattered gradient in
a private buffer and leaves ``p.grad`` as None, so it does not serve.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from lowband.topology import Topology

__all__ = ["shard_model"]


def shard_model(
    model: nn.Module,
    topology: Topology,
    *,
    blocks: Iterable[nn.Module] = (),
    reshard_after_forward: bool = True,
    mp_policy=None,
) -> nn.Module:
    """Apply FSDP2 over the node's ranks (S > 1); return the model unchanged when S = 1.

    Args:
        model: the model copy (identical initial weights on every rank, e.g. the same seed).
        topology: the job's topology.
        blocks: modules to shard on their own (transformer blocks), before the root.
        reshard_after_forward: FSDP2's option (free unsharded weights after forward).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (e.g. bf16 params on GPUs), or None.
    """
    if topology.shards == 1 or topology.world_size == 1:
        return model
    if not dist.is_initialized():
        raise ValueError("sharding over several ranks needs torch.distributed to be initialised (torchrun)")
    from torch.distributed.fsdp import fully_shard

    mesh = topology.mesh()["shard"]
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model

