"""lowband/distributed/tied_embedding.py: The row-sharded tied embedding: the same values and gradients as one unsharded weight, without
ever moving the whole weight (rows schedule), on real gloo processes."""

from __future__ import annotations

import pytest

from lowband.testing.ranks import run_ranks

VOCAB, DIM, PAD = 7, 4, 1  # 7 rows: uneven shards on 2 ranks (4, 3) and on 3 ranks (3, 3, 1)


def _ids(rank: int, n: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    if n:
        ids[0] = PAD  # the padding row is looked up, and gets no lookup gradient
    return ids


def _tied_model(padding_idx=None):
    """An embedding and a bias-free head sharing one (VOCAB × DIM) weight."""
    from torch import nn

    model = nn.Module()
    model.emb = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
    model.head = nn.Linear(DIM, VOCAB, bias=False)
    model.head.weight = model.emb.weight
    return model


def _loss(model, ids):
    import torch

    h = torch.tanh(model.emb(ids)) * 1.5
    logits = model.head(h)
    target = torch.arange(logits.shape[-1], dtype=logits.dtype)
    return (logits.float().log_softmax(-1) * target).sum() + (h.float() ** 2).sum(), logits


def _tied_ops(rank: int, counts: list[int], bf16: bool) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lowband.distributed.tied_embedding import (
        ShardedEmbedding,
        ShardedTiedProjection,
        shard_tied_embedding,
    )

    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    ref = _tied_model(padding_idx=PAD)
    model = copy.deepcopy(ref)
    dtype = torch.bfloat16 if bf16 else None
    param = shard_tied_embedding(model, model.emb, model.head, mesh, dtype)
    assert isinstance(model.emb, ShardedEmbedding) and isinstance(model.head, ShardedTiedProjection)
    assert model.emb.weight is param and model.head.weight is param

    loss, logits = _loss(model, _ids(rank, counts[rank]))
    loss.backward()
    # The reference: every rank's loss on the whole weight, gradients averaged over the ranks.
    if bf16:
        ref = ref.to(torch.bfloat16)
    total = 0
    for r in range(size):
        ref_loss, ref_logits = _loss(ref, _ids(r, counts[r]))
        total = total + ref_loss
        if r == rank:
            mine = ref_logits.detach()
    (total / size).backward()
    return {
        "logits": (logits.detach().float() - mine.float()).abs().amax(dim=(0, 1)).item() if counts[rank] else 0.0,
        "logits_shape": tuple(logits.shape),
        "logits_dtype": str(logits.dtype),
        "grad": (param.grad.full_tensor() - ref.emb.weight.grad.float()).abs().max().item(),
        "grad_scale": ref.emb.weight.grad.float().abs().max().item(),
        "local_rows": param.to_local().shape[0],
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,counts,rows", [
    (2, [3, 2], [4, 3]),  # m = 3 ≤ D: the rows schedule (logits traded, the weight never moves)
    (2, [6, 5], [4, 3]),  # m = 6 > D: the gather schedule
    (3, [2, 4, 1], [3, 3, 1]),  # three uneven shards, m = 4 = D: rows
    (3, [5, 0, 6], [3, 3, 1]),  # a rank without tokens, m = 6: gather
])
def test_sharded_tied_embedding_matches_one_unsharded_weight(world, counts, rows):
    for r, res in enumerate(run_ranks(_tied_ops, world_size=world, args=(counts, False), timeout_s=120)):
        assert res["local_rows"] == rows[r]
        assert res["logits_shape"] == (counts[r], VOCAB)
        assert res["logits"] < 1e-6, res
        assert res["grad"] < 1e-5 * max(1.0, res["grad_scale"]), res


@pytest.mark.multiprocess
@pytest.mark.parametrize("counts", [[3, 2], [6, 5]])
def test_sharded_tied_embedding_in_bf16_computes_in_bf16_and_accumulates_in_fp32(counts):
    for res in run_ranks(_tied_ops, world_size=2, args=(counts, True), timeout_s=120):
        assert res["logits_dtype"] == "torch.bfloat16"
        # the reference is all-bf16 (its gradient too); the sharded gradient is summed in fp32
        assert res["logits"] < 0.05, res
        assert res["grad"] < 0.02 * max(1.0, res["grad_scale"]), res


def _out_of_range(rank: int) -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lowband.distributed.tied_embedding import shard_tied_embedding

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _tied_model()
    shard_tied_embedding(model, model.emb, model.head, mesh, None)
    ids = torch.tensor([0, VOCAB]) if rank == 1 else torch.tensor([0, 1])
    try:
        model.emb(ids)
    except IndexError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_an_id_out_of_range_on_one_rank_raises_on_every_rank_instead_of_hanging():
    msgs = run_ranks(_out_of_range, world_size=2, timeout_s=60)
    assert "ids lie in [0, 7]" in msgs[1] and "ids must lie in [0, 6]" in msgs[1], msgs
    assert "on another rank" in msgs[0], msgs


def _t5_sharded(rank: int, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from torch.distributed.tensor import DTensor

    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology
    from lowband.train.data import DataConfig, load_data, train_batch
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    data = load_data(DataConfig(max_examples=200, val_size=20, max_source_len=32, max_target_len=16, vocab_size=512))
    spec = build_model("t5-tiny", vocab_size=data.vocab_size, seed=0)
    model = shard_model(spec.model, Topology.from_env(), blocks=transformer_blocks(spec.model))
    weight = model.shared.weight
    import lowband.distributed.tied_embedding as te

    gathered = []  # calls of the gather schedule, which all-gathers the whole weight
    original = te._gather_weight
    te._gather_weight = lambda *a: gathered.append(1) or original(*a)
    try:
        compute_loss(model, train_batch(data, step=0, rank=rank, world_size=4, batch_size=2, seed=0)).backward()
    finally:
        te._gather_weight = original
    root = model._get_fsdp_state()._fsdp_param_group
    return {
        "root": [fp._param_fqn for fp in root.fsdp_params] if root is not None else [],
        "lookups": sorted({type(m).__name__ for m in (model.shared, model.encoder.embed_tokens,
                                                      model.decoder.embed_tokens, model.lm_head)}),
        "same_param": model.lm_head.weight is weight and model.encoder.embed_tokens.weight is weight,
        "placements": str(weight.placements),
        "grad_is_shard": isinstance(weight.grad, DTensor) and weight.grad.to_local().shape == weight.to_local().shape,
        "gathered": len(gathered),
    }


@pytest.mark.multiprocess
def test_t5_tied_weight_is_row_sharded_outside_fsdp_and_never_gathered_whole(tmp_path_factory):
    """shard_model on t5-tiny, 2 × 2: the tied weight is one DTensor Shard(0) shared by the three
    lookups and the head, FSDP2's root does not manage it, its gradient is a shard, and 16 target
    tokens per rank take the rows schedule: nothing gathers the whole weight (the gradients'
    values: test_sharding)."""
    cache = str(tmp_path_factory.mktemp("cache"))
    for r in run_ranks(_t5_sharded, world_size=4, ranks_per_node=2, args=(cache,), timeout_s=240):
        assert "shared.weight" not in r["root"], r["root"]
        assert r["lookups"] == ["ShardedEmbedding", "ShardedTiedProjection"], r
        assert r["same_param"] and r["grad_is_shard"], r
        assert r["placements"] == "(Shard(dim=0),)", r
        assert r["gathered"] == 0, r
