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
the largest parameter and sit in the root unit, which FSDP2 keeps unsharded, with its unsharded
gradient, from the start of backward to its end. Their backward is arranged to hold less
(``tied_embedding_memory=True``, the default; the same gradients up to float summation order):

* the lookups add their gradient rows in place into the weight's gradient
  (:class:`InPlaceGradEmbedding`). Backward computes the output projection's dense gradient
  first (its use is the last of the forward); a plain ``nn.Embedding`` would then allocate a
  dense vocabulary-sized gradient per lookup, and even a sparse one (``nn.Embedding.sparse``) is
  added to the dense gradient out of place by autograd, a second vocabulary-sized tensor for an
  instant in the middle of backward. Here only the rows of the batch's tokens are added
  (``index_add_``), into the gradient that the projection left in ``weight.grad``;
* the root is resharded as soon as the output projection's backward has run: the rest of the
  backward needs no parameter of the root (a lookup's gradient needs only the token ids), so the
  unsharded weight is freed there instead of at the end of backward. For that, every other module
  of the root that owns parameters (final layer norms, a position embedding) gets a unit of its own,
  so the root holds nothing else.

Activation checkpointing (``activation_checkpointing=True``) is torch's composable
``checkpoint`` on every transformer block, applied before ``fully_shard``: a block keeps only its
inputs from forward and recomputes its activations in backward (RNG state restored, so dropout
masks repeat). Parameter names are unchanged, so checkpoints load with or without it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowband.topology import Topology

__all__ = ["PRECISIONS", "InPlaceGradEmbedding", "add_lookup_grads_in_place", "mixed_precision_policy",
           "set_gradient_sync", "shard_model"]

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
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether FSDP2 reduce-scatters gradients in the next backward (all units); no-op without FSDP2.

    Off for the first N − 1 micro-batches of an accumulation: their unsharded gradients are summed
    locally (in the reduce dtype) and reduce-scattered once, on the last micro-batch.
    """
    from torch.distributed.fsdp import FSDPModule

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
        tied_embedding_memory: with tied input/output embeddings, sparse lookup gradients and
            the root resharded after the output projection's backward (see the module docstring).

    Raises:
        ValueError: an unknown precision; several shards (or bf16) without a process group.
    """
    blocks = list(blocks)
    policy = mp_policy if mp_policy is not None else mixed_precision_policy(precision)
    if activation_checkpointing:
        if not blocks:
            raise ValueError("activation checkpointing is per transformer block, but no blocks were given")
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block)
    one_rank = topology.shards == 1 or topology.world_size == 1
    if one_rank and policy is None:
        return model
    if not dist.is_initialized():
        what = "mixed precision (FSDP2's casts)" if one_rank else "sharding over several ranks"
        raise ValueError(f"{what} needs torch.distributed to be initialised (torchrun; a single process "
                         "can use a one-rank group: dist.init_process_group('gloo', store=dist.HashStore(), "
                         "rank=0, world_size=1))")
    from torch.distributed.fsdp import fully_shard

    mesh = topology.mesh()["shard"]
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if policy is not None:
        kwargs["mp_policy"] = policy
    tied = _tied_embeddings(model) if tied_embedding_memory else None
    owners = _root_parameter_owners(model, blocks, tied=tied[1].weight) if tied is not None else None
    if owners is None:
        tied = None
    for block in blocks:
        fully_shard(block, **kwargs)
    if tied is not None:
        for module in owners:
            fully_shard(module, **kwargs)
        add_lookup_grads_in_place(model, tied[1].weight)
    # The root keeps its parameters unsharded from forward into backward: what the forward uses last
    # (the output projection) is what the backward needs first, so resharding it after forward only
    # costs a second all-gather of the same weights a moment later, at the same peak.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    if tied is not None:
        _reshard_after_head_backward(model, tied[1])
    return model


def _tied_embeddings(model: nn.Module) -> tuple[nn.Embedding, nn.Module] | None:
    """(input embedding, output projection) when they share one weight, else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    embedding, head = get_in(), get_out()
    if not isinstance(embedding, nn.Embedding) or head is None or getattr(head, "weight", None) is not embedding.weight:
        return None
    return embedding, head


def _root_parameter_owners(model: nn.Module, blocks: list[nn.Module], *, tied: nn.Parameter) -> list[nn.Module] | None:
    """Modules outside ``blocks`` that own parameters directly, other than ``tied``; innermost first.

    None when the model itself owns such a parameter (it would stay in the root and could be needed
    after the output projection's backward).
    """
    def own(module):
        return [p for p in module.parameters(recurse=False) if p is not tied]

    if own(model):
        return None
    inside = {id(m) for b in blocks for m in b.modules()}
    owners = []
    for module in reversed(list(model.modules())):
        if id(module) in inside or module is model:
            continue
        params = own(module)
        if params and len(params) != len(list(module.parameters(recurse=False))):
            return None  # a module with the tied weight and others: leave the root as it is
        if params:
            owners.append(module)
    return owners


def _reshard_after_head_backward(model: nn.Module, head: nn.Module) -> None:
    """Free the root's unsharded parameters once the output projection's backward has run.

    A hook on the projection's input gradient fires after the one backward node that computes
    both the input's and the weight's gradient, so the weight is no longer needed; the root's
    other uses in backward are embedding lookups (their gradient needs only the token ids). FSDP2
    still reduce-scatters the root's gradient at the end of backward; its own reshard then finds
    the parameters sharded already.
    """

    def reshard(_grad):
        model.reshard()

    def register(_module, args, _output):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(reshard)

    head.register_forward_hook(register)


class _LookupIntoGrad(torch.autograd.Function):
    """``F.embedding`` whose backward adds the rows' gradients into ``weight.grad`` in place.

    The weight is not an input autograd sees (it comes in a tuple), so the lookup adds no edge to
    the weight's gradient accumulator: the other use of the weight (the output projection) has
    its gradient accumulated into ``weight.grad`` as soon as it is computed, and this backward
    adds to it. ``anchor`` is an empty tensor that requires grad, only so that the output does.

    So the rows reach ``weight.grad`` after the weight's own gradient hooks have run: whatever reads
    the gradient must do so after backward, as FSDP2 does for the root unit (its reduce-scatter
    runs in the callback at the end of backward). A hook on the weight's gradient, or DDP's reducer,
    would miss the lookups' rows; ``shard_model`` uses this only under FSDP2.
    """

    @staticmethod
    def forward(ctx, anchor, ids, weight_box, padding_idx):
        (weight,) = weight_box
        ctx.weight, ctx.padding_idx = weight, padding_idx
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight.detach(), padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        idx, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            keep = idx != ctx.padding_idx
            idx, rows = idx[keep], rows[keep]
        if weight.grad is None:  # no earlier use has a gradient yet (e.g. a model without the head)
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, idx, rows.to(weight.grad.dtype))
        return None, None, None, None


class InPlaceGradEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose backward adds its rows into ``weight.grad`` in place (see
    :class:`_LookupIntoGrad`); the same forward and the same gradient as ``nn.Embedding``, up to the
    order in which float additions are done. Without gradients it is ``nn.Embedding``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return super().forward(input)
        anchor = torch.empty(0, device=weight.device, requires_grad=True)
        return _LookupIntoGrad.apply(anchor, input, (weight,), self.padding_idx)


def add_lookup_grads_in_place(model: nn.Module, weight: nn.Parameter) -> int:
    """Turn every ``nn.Embedding`` of ``model`` that looks up ``weight`` into an
    :class:`InPlaceGradEmbedding` (T5: ``shared``, the encoder's and the decoder's ``embed_tokens``);
    return how many. Embeddings with ``max_norm`` or ``scale_grad_by_freq`` are left as they are.
    """
    count = 0
    for module in model.modules():
        if (type(module) is nn.Embedding and module.weight is weight and module.max_norm is None
                and not module.scale_grad_by_freq):
            module.sparse = False
            module.__class__ = InPlaceGradEmbedding
            count += 1
    return count
