"""FSDP2 over the node's ranks: gradients are shards of the intra-node mean, never the whole model."""

from __future__ import annotations

import pytest

from lowband.testing import run_ranks


def _sharded_grads(rank: int, cache: str, name: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from torch.distributed.tensor import DTensor

    from lowband.sharding import shard_model
    from lowband.topology import Topology
    from lowband.train.data import DataConfig, load_data, train_batch
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    kind = "causal" if name.startswith("gpt") else "seq2seq"
    data = load_data(DataConfig(kind=kind, max_examples=200, val_size=20, max_source_len=32, max_target_len=16,
                                vocab_size=512))
    topo = Topology.from_env()
    spec = build_model(name, vocab_size=data.vocab_size, seed=0)
    spec.model.eval()  # no dropout: the sharded and the reference gradients must agree
    model = shard_model(spec.model, topo, blocks=transformer_blocks(spec.model))
    node = topo.node_of(rank)
    compute_loss(model, train_batch(data, step=0, rank=rank, world_size=4, batch_size=2, seed=0)).backward()
    ref = build_model(name, vocab_size=data.vocab_size, seed=0).model.eval()
    # FSDP's gradient is the mean over the S ranks of this node only.
    peers = topo.shard_group_ranks(rank)
    loss = sum(compute_loss(ref, train_batch(data, step=0, rank=r, world_size=4, batch_size=2, seed=0))
               for r in peers) / len(peers)
    loss.backward()
    all_dtensor = all(isinstance(p.grad, DTensor) for p in model.parameters())
    local_numel = sum(p.grad.to_local().numel() for p in model.parameters())
    full_numel = sum(p.numel() for p in ref.parameters())
    diff = max((p.grad.full_tensor() - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    from lowband.tied_embedding import ShardedEmbedding

    row_sharded = isinstance(model.get_input_embeddings(), ShardedEmbedding)
    return {"node": node, "all_dtensor": all_dtensor, "local": local_numel, "full": full_numel, "diff": diff,
            "row_sharded": row_sharded}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["t5-tiny", "gpt-tiny"])  # both tie the embedding to the output projection
def test_sharded_gradients_equal_the_unsharded_mean_and_stay_sharded(tmp_path_factory, name):
    cache = str(tmp_path_factory.mktemp("cache"))
    results = run_ranks(_sharded_grads, world_size=4, ranks_per_node=2, args=(cache, name), timeout_s=180)
    for r in results:
        assert r["all_dtensor"]
        # Each rank holds about half of the gradient (FSDP pads dim 0 of each parameter).
        assert r["local"] <= r["full"] / 2 * 1.02, (r["local"], r["full"])
        assert r["diff"] < 1e-6
        assert r["row_sharded"]  # the tied embedding took lowband.tied_embedding's path


def test_shard_model_needs_a_process_group_for_several_shards():
    from torch import nn

    from lowband.sharding import shard_model
    from lowband.topology import Topology

    with pytest.raises(ValueError, match="torch.distributed"):
        shard_model(nn.Linear(2, 2), Topology(num_nodes=1, ranks_per_node=2))
