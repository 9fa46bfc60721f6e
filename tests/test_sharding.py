"""FSDP2 over the node's ranks: gradients are shards of the intra-node mean, never the whole model."""

from __future__ import annotations

import pytest

from lowband.testing import run_ranks


def _t5_grads(rank: int, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from torch.distributed.tensor import DTensor

    from lowband.sharding import shard_model
    from lowband.topology import Topology
    from lowband.train.data import DataConfig, load_data, train_batch
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    data = load_data(DataConfig(max_examples=200, val_size=20, max_source_len=32, max_target_len=16, vocab_size=512))
    topo = Topology.from_env()
    spec = build_model("t5-tiny", vocab_size=data.vocab_size, seed=0)
    spec.model.eval()  # no dropout: the sharded and the reference gradients must agree
    model = shard_model(spec.model, topo, blocks=transformer_blocks(spec.model))
    node = topo.node_of(rank)
    compute_loss(model, train_batch(data, step=0, rank=rank, world_size=4, batch_size=2, seed=0)).backward()
    ref = build_model("t5-tiny", vocab_size=data.vocab_size, seed=0).model.eval()
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
    return {"node": node, "all_dtensor": all_dtensor, "local": local_numel, "full": full_numel, "diff": diff}


@pytest.mark.multiprocess
def test_sharded_t5_gradients_equal_the_unsharded_mean_and_stay_sharded(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    results = run_ranks(_t5_grads, world_size=4, ranks_per_node=2, args=(cache,), timeout_s=180)
    for r in results:
        assert r["all_dtensor"]
        # Each rank holds about half of the gradient (FSDP pads dim 0 of each parameter).
        assert r["local"] <= r["full"] / 2 * 1.02, (r["local"], r["full"])
        assert r["diff"] < 1e-6


def test_shard_model_needs_a_process_group_for_several_shards():
    from torch import nn

    from lowband.sharding import shard_model
    from lowband.topology import Topology

    with pytest.raises(ValueError, match="torch.distributed"):
        shard_model(nn.Linear(2, 2), Topology(num_nodes=1, ranks_per_node=2))


def _tied_embedding_backward(rank: int, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from lowband.sharding import shard_model
    from lowband.topology import Topology
    from lowband.train.data import DataConfig, load_data, train_batch
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    data = load_data(DataConfig(max_examples=200, val_size=20, max_source_len=32, max_target_len=16, vocab_size=512))
    spec = build_model("t5-tiny", vocab_size=data.vocab_size, seed=0)
    model = shard_model(spec.model, Topology.from_env(), blocks=transformer_blocks(spec.model))
    root = model._get_fsdp_state()._fsdp_param_group
    seen = []  # whether the root is sharded when the encoder's lookup (the last of backward) gets its gradient

    def watch(_module, _args, out):
        out.register_hook(lambda _grad: seen.append(root.is_sharded))

    model.encoder.embed_tokens.register_forward_hook(watch)
    for step in range(1):
        model.zero_grad(set_to_none=True)
        compute_loss(model, train_batch(data, step=step, rank=rank, world_size=4, batch_size=2, seed=0)).backward()
    return {"sharded_at_lookup": seen, "root": [fp._param_fqn for fp in root.fsdp_params],
            "lookups": [type(m).__name__ for m in (model.shared, model.encoder.embed_tokens, model.decoder.embed_tokens)],
            "grad_layout": str(model.shared.weight.grad.to_local().layout)}


@pytest.mark.multiprocess
def test_tied_embedding_root_is_resharded_before_the_lookups_backward(tmp_path_factory):
    """The root holds only the tied weight, frees it after the output projection's backward, and the
    lookups add their rows into the dense gradient in place; the gradient that reaches the optimizer is
    a dense shard."""
    cache = str(tmp_path_factory.mktemp("cache"))
    for r in run_ranks(_tied_embedding_backward, world_size=4, ranks_per_node=2, args=(cache,), timeout_s=240):
        assert r["sharded_at_lookup"] == [True], r
        assert r["root"] == ["shared.weight"], r["root"]
        assert r["lookups"] == ["InPlaceGradEmbedding"] * 3
        assert r["grad_layout"] == "torch.strided"


def _tied_lookup_model(*, padding_idx=None, in_place: bool):
    import torch
    from torch import nn

    from lowband.sharding import add_lookup_grads_in_place

    torch.manual_seed(0)
    model = nn.Module()
    model.shared = nn.Embedding(50, 8, padding_idx=padding_idx)
    model.other = nn.Embedding(50, 8, padding_idx=padding_idx)
    model.other.weight = model.shared.weight  # a second lookup of the same weight (T5's encoder/decoder)
    changed = add_lookup_grads_in_place(model, model.shared.weight) if in_place else 0
    return model, changed


def _tied_lookup_backward(model, ids):
    import torch
    import torch.nn.functional as F

    h = model.shared(ids) + 2 * model.other(ids.flip(0))
    logits = F.linear(torch.tanh(h), model.shared.weight)  # the output projection, last in forward
    logits.logsumexp(-1).square().mean().backward()
    return model.shared.weight.grad


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_in_place_lookups_give_nn_embeddings_gradient_without_a_vocabulary_sized_add(padding_idx):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    ids = torch.tensor([[1, 3, 3, 7, 49], [0, 3, 7, 7, 2]])
    plain, _ = _tied_lookup_model(padding_idx=padding_idx, in_place=False)
    expected = _tied_lookup_backward(plain, ids)
    model, changed = _tied_lookup_model(padding_idx=padding_idx, in_place=True)
    assert changed == 2

    class VocabularySizedAdds(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.out_of_place = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.add.Tensor and args[0].shape == (50, 8):
                self.out_of_place += 1
            return func(*args, **(kwargs or {}))

    with VocabularySizedAdds() as adds:
        got = _tied_lookup_backward(model, ids)
    assert adds.out_of_place == 0  # nn.Embedding's path (dense or sparse) makes two here
    # ids hold the padding index: nn.Embedding gives its row no lookup gradient, nor does this one
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # no gradient: the plain lookup
        torch.testing.assert_close(model.other(ids), plain.other(ids))


def test_in_place_lookups_need_no_earlier_gradient():
    import torch

    model, _ = _tied_lookup_model(in_place=True)
    ids = torch.tensor([[4, 4, 9]])
    model.other(ids).sum().backward()  # no output projection: the lookup starts the gradient itself
    expected = torch.zeros(50, 8)
    expected[4], expected[9] = 2.0, 1.0
    torch.testing.assert_close(model.shared.weight.grad, expected)
