"""Sharding a model copy over the ranks of one node with FSDP2; its precision and checkpointing.

``fully_shard`` is applied over the node's 1-D mesh (``mesh["shard"]``), per transformer block and
then on the root. After backward each rank holds only its gradient shard, the mean over the S ranks
of its node, as a DTensor in ``p.grad``; the inter-node part is the optimizer's, through the link.
(FSDP2's own 2-D HSDP with ``set_requires_all_reduce(False)`` keeps the reduce-scattered gradient in
a private buffer and leaves ``p.grad`` as None, so it does not serve.)

Precision (``precision="bf16"``) is FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`:

* the sharded parameters stay fp32; they are what the optimizer sees and steps, so every
  optimizer's state (AdamW's moments, FlexDeMo's momentum δ and its DCT, DiLoCo's slow weights)
  is fp32 and lives on the fp32 shard;
* the all-gather casts each unit's parameters to bf16; forward and backward compute in bf16;
* the gradients are cast to fp32 before the intra-node reduce-scatter, which is done in fp32, and
  ``p.grad`` is the fp32 shard. Without gradient synchronisation (micro-batches of an
  accumulation) FSDP2 accumulates the unsharded gradients in fp32, too.

With S = 1 (DeMo, or one rank per node) there is nothing to shard, but bf16 still needs FSDP2's
casts: the model is then wrapped in ``fully_shard`` over the 1-rank shard mesh (a no-op shard
of each parameter, the same casts and fp32 gradients), so one mechanism serves every method.

Tied embeddings (the input embedding is the output projection's weight, as in T5 and GPT-2) are
usually the largest parameter. Left to FSDP2 they sit in the root unit: the whole (V × D) weight
all-gathered through the forward and its dense gradient formed in backward, two vocabulary-sized
tensors on every rank at the peak. With ``tied_embedding_memory=True`` (the default, S > 1) the
weight is instead sharded by vocabulary rows and kept out of FSDP2
(:mod:`lowband.distributed.tied_embedding`): the lookups and the output projection compute on each rank's
rows and exchange token ids, embeddings and logits within the node, and the gradient is the same
mean over the node's ranks, a DTensor shard like every other. The parameter is the same DTensor
``Shard(0)`` that FSDP2 would store, so checkpoints are the same and reshard the same.

Activation checkpointing (``activation_checkpointing=True``) is torch's composable
``checkpoint`` on every transformer block, applied before ``fully_shard``: a block keeps only its
inputs from forward and recomputes its activations in backward (RNG state restored, so dropout
masks repeat). Parameter names are unchanged, so checkpoints load with or without it.

Compilation (``compile_backend="inductor"``, ``lowband train --compile``) is ``torch.compile`` on every
transformer block (:mod:`lowband.distributed.compile`), applied after activation checkpointing and
before ``fully_shard``, in torchtitan's order.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lowband.distributed.compile import compile_blocks
from lowband.distributed.tied_embedding import shard_tied_embedding
from lowband.distributed.topology import Topology

__all__ = ["PRECISIONS", "mixed_precision_policy", "set_gradient_sync", "shard_model"]

PRECISIONS = ("fp32", "bf16")


def mixed_precision_policy(precision: str):
    """FSDP2's policy for ``precision``: bf16 parameters and compute with fp32 reduction, or None (fp32).

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether FSDP2 reduce-scatters gradients in the next backward (all units); no-op without FSDP2.

    Off for the first N − 1 micro-batches of an accumulation: their unsharded gradients are summed
    locally (in the reduce dtype) and reduce-scattered once, on the last micro-batch.
    """

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def shard_model(
    model: nn.Module,
    topology: Topology,
    *,
    blocks: Iterable[nn.Module] = (),
    reshard_after_forward: bool = True,
    mp_policy=None,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    tied_embedding_memory: bool = True,
    compile_backend: str | None = None,
    compile_dynamic: bool | None = True,
) -> nn.Module:
    """Apply FSDP2 over the node's ranks (S > 1); return the model unchanged when S = 1 in fp32.

    Args:
        model: the model copy (identical initial weights on every rank, e.g. the same seed).
        topology: the job's topology.
        blocks: modules to shard on their own (transformer blocks), before the root.
        reshard_after_forward: FSDP2's option for the blocks (free their unsharded weights after
            forward); the root always keeps its own into backward, which needs them first.
        mp_policy: an FSDP2 ``MixedPrecisionPolicy``, or None; overrides ``precision``.
        precision: "fp32" or "bf16" (:func:`mixed_precision_policy`).
        activation_checkpointing: recompute each block's activations in backward.
        tied_embedding_memory: with tied input/output embeddings and S > 1, shard their weight by
            vocabulary rows outside FSDP2 (see the module docstring).
        compile_backend: compile each block with ``torch.compile`` on this backend ("inductor", or
            "aot_eager" for tests); None: eager.
        compile_dynamic: :func:`~lowband.distributed.compile.compile_blocks`'s ``dynamic``: True for batches
            whose length changes (padded), None for data of one shape (packed blocks).

    Raises:
        ValueError: an unknown precision or compile backend; several shards (or bf16) without a process
            group; checkpointing or compilation without blocks.
    """
    blocks = list(blocks)
    policy = mp_policy if mp_policy is not None else mixed_precision_policy(precision)
    if activation_checkpointing:
        if not blocks:
            raise ValueError("activation checkpointing is per transformer block, but no blocks were given")
        for block in blocks:
            checkpoint(block)
    if compile_backend is not None:
        compile_blocks(blocks, compile_backend, dynamic=compile_dynamic)
    one_rank = topology.shards == 1 or topology.world_size == 1
    if one_rank and policy is None:
        return model
    if not dist.is_initialized():
        what = "mixed precision (FSDP2's casts)" if one_rank else "sharding over several ranks"
        raise ValueError(f"{what} needs torch.distributed to be initialised (torchrun; a single process "
                         "can use a one-rank group: dist.init_process_group('gloo', store=dist.HashStore(), "
                         "rank=0, world_size=1))")

    mesh = topology.mesh()["shard"]
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if policy is not None:
        kwargs["mp_policy"] = policy
    # fully_shard's ignored_params (torch >= 2.7) keeps the row-sharded weight out of FSDP2.
    can_ignore = "ignored_params" in inspect.signature(fully_shard).parameters
    tied = _tied_embeddings(model) if tied_embedding_memory and not one_rank and can_ignore else None
    if tied is not None:
        param = shard_tied_embedding(model, *tied, mesh, policy.param_dtype if policy is not None else None)
        if param is not None:
            kwargs["ignored_params"] = {param}
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root keeps its parameters unsharded from forward into backward: what the forward uses last
    # (the output projection, when the embedding is not row-sharded) is what the backward needs first,
    # so resharding it after forward only costs a second all-gather of the same weights a moment later.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    if mesh.device_type == "cpu":
        _no_backward_prefetch(model)
    return model


def _no_backward_prefetch(model: nn.Module) -> None:
    """Each unit all-gathers its own weights in backward, not the next unit's ahead of time.

    FSDP2 prefetches the next unit's all-gather in backward so that it overlaps the current unit's
    computation on another CUDA stream. On the CPU there are no streams: the all-gather (gloo,
    synchronous) runs on the calling thread either way, so the prefetch overlaps nothing and only
    holds a second unit's unsharded weights, and its all-gather buffer, through the current unit's
    backward (about 11 MiB off t5-small's peak, 2 x 2). A unit listed as its own prefetch target turns the
    default prefetch off (its own unshard is then a no-op).
    """

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_modules_to_backward_prefetch([module])


def _tied_embeddings(model: nn.Module) -> tuple[nn.Embedding, nn.Module] | None:
    """(input embedding, output projection) when they share one weight, else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    embedding, head = get_in(), get_out()
    if not isinstance(embedding, nn.Embedding) or head is None or getattr(head, "weight", None) is not embedding.weight:
        return None
    return embedding, head
