"""lowband/distributed/sharding.py: FSDP2 over the node's ranks: gradients are shards of the intra-node mean,
never the whole model; bf16 mixed precision (FSDP2's MixedPrecisionPolicy): lowband's AdamW through
the link equals FSDP2's own 2-D HSDP with the same policy, on a real 2 × 2 gloo mesh; clip_grad_norm_
on the shards is the norm of the node's whole gradient (what the README and the FlexDeMo example rely on)."""

from __future__ import annotations

import pytest

from lowband.testing.ranks import run_ranks


def _sharded_grads(rank: int, cache: str, name: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from torch.distributed.tensor import DTensor

    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology
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
    from lowband.distributed.tied_embedding import ShardedEmbedding

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
        assert r["row_sharded"]  # the tied embedding took lowband.distributed.tied_embedding's path


def test_shard_model_needs_a_process_group_for_several_shards():
    from torch import nn

    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology

    with pytest.raises(ValueError, match="torch.distributed"):
        shard_model(nn.Linear(2, 2), Topology(num_nodes=1, ranks_per_node=2))


# HSDP and lowband reduce the same fp32 gradients in another order (HSDP: reduce-scatter then
# all-reduce inside FSDP2; lowband: reduce-scatter, then the link's all-reduce), from the same bf16
# forward and backward, so they agree to fp32 rounding of the reduction, seen through AdamW.
HSDP_ATOL = 1e-5


def _vs_hsdp(rank: int) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard

    from lowband.comm.link import Link
    from lowband.distributed.sharding import mixed_precision_policy, shard_model
    from lowband.distributed.topology import Topology
    from lowband.optim import AdamWFullSync, FlexDeMo
    from lowband.testing.ranks import full_params, tiny_loss, tiny_model

    topo = Topology.from_env()
    policy = mixed_precision_policy("bf16")
    model = tiny_model()
    model = shard_model(model, topo, blocks=[model[0], model[1]], precision="bf16")
    opt = AdamWFullSync(model.parameters(), lr=1e-2, link=Link(topo), weight_decay=0.01)
    ref = tiny_model()
    mesh = topo.mesh()
    for m in (ref[0], ref[1], ref):
        fully_shard(m, mesh=mesh, mp_policy=policy)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    fp32 = tiny_model()
    fp32 = shard_model(fp32, topo, blocks=[fp32[0], fp32[1]])
    losses = {"bf16": [], "hsdp": [], "fp32": []}
    for step in range(3):
        for name, m, o in (("bf16", model, opt), ("hsdp", ref, ref_opt)):
            o.zero_grad()
            loss = tiny_loss(m, rank, step)
            loss.backward()
            o.step()
            losses[name].append(loss.item())
        opt.link.end_step()
    losses["fp32"].append(tiny_loss(fp32, rank, 0).item())
    p = next(iter(model.parameters()))
    out = {
        "maxdiff": max((a - b).abs().max().item() for a, b in zip(full_params(model), full_params(ref), strict=True)),
        "moved": max((a - b).abs().max().item() for a, b in zip(full_params(model), full_params(tiny_model()),
                                                               strict=True)),
        "losses": losses,
        "dtypes": [str(p.dtype), str(p.grad.dtype), str(opt.state[p]["exp_avg"].dtype)],
    }
    flex = tiny_model()
    flex = shard_model(flex, topo, blocks=[flex[0], flex[1]], precision="bf16")
    fopt = FlexDeMo(flex.parameters(), lr=0.05, link=Link(topo))
    fopt.zero_grad()
    tiny_loss(flex, rank, 0).backward()
    fopt.step()
    q = next(iter(flex.parameters()))
    out["flex_dtypes"] = [str(q.dtype), str(q.grad.dtype), str(fopt.state[q]["delta"].dtype)]
    return out


@pytest.mark.multiprocess
def test_bf16_adamw_through_the_link_matches_fsdp2_hsdp_with_the_same_policy():
    for r in run_ranks(_vs_hsdp, world_size=4, ranks_per_node=2, timeout_s=300):
        assert r["moved"] > 100 * HSDP_ATOL
        assert r["maxdiff"] < HSDP_ATOL, r
        # Same bf16 forward: identical step-1 losses; and bf16 is really used (fp32 differs).
        assert r["losses"]["bf16"][0] == r["losses"]["hsdp"][0]
        assert r["losses"]["bf16"][0] != r["losses"]["fp32"][0]
        assert abs(r["losses"]["bf16"][0] - r["losses"]["fp32"][0]) < 2e-2
        assert r["dtypes"] == ["torch.float32"] * 3  # shard, its gradient, AdamW's moment
        assert r["flex_dtypes"] == ["torch.float32"] * 3  # FlexDeMo's momentum too


def _clip_on_shards(rank: int) -> tuple[float, float, float]:
    """(unsharded norm of the node's mean gradient, clip_grad_norm_'s norm on the shards, norm after the clip)."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import GPT2Config, GPT2LMHeadModel

    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology
    from lowband.train.models import transformer_blocks

    config = GPT2Config(vocab_size=512, n_positions=16, n_embd=64, n_layer=2, n_head=2, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def ids(r: int) -> torch.Tensor:
        return torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(r))

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    topo = Topology.from_env()
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(config)
    node = topo.shard_group_ranks(rank)
    (sum(ref(input_ids=ids(r), labels=ids(r), use_cache=False).loss for r in node) / len(node)).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model = shard_model(model, topo, blocks=transformer_blocks(model))
    model(input_ids=ids(rank), labels=ids(rank), use_cache=False).loss.backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)).item()
    after = full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])).item()
    return expected, norm, after


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # the timeout of tests/e2e/test_examples.py, where this test was
def test_clip_grad_norm_on_fsdp2_shards_is_the_model_copys() -> None:
    """What the README and the FlexDeMo example rely on: clip_grad_norm_ on a sharded model (tied embedding
    row-sharded too) takes the norm of the node's whole gradient and scales every shard by the same factor."""
    from transformers import GPT2LMHeadModel  # noqa: F401 - imported once here; the forked ranks inherit it

    from lowband.testing.ranks import run_ranks

    results = run_ranks(_clip_on_shards, world_size=4, ranks_per_node=2, timeout_s=120)
    for expected, norm, after in results:
        assert norm == pytest.approx(expected, rel=1e-5), results
        assert after == pytest.approx(0.1, rel=1e-4), results
    assert results[0][1] == results[1][1] and results[2][1] == results[3][1], results  # one norm per node
    assert results[0][1] != results[2][1], results  # each node clips its own gradient
