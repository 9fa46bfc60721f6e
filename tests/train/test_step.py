"""lowband/train/step.py: Gradient accumulation and activation checkpointing on a real 2 × 2 gloo mesh with t5-tiny.

* N micro-batches per step equal one step on the N-times larger batch (allclose), and FSDP2
  reduce-scatters inside the node only on the last micro-batch.
* Activation checkpointing per T5 block gives the same gradients as without (dropout on).
"""

from __future__ import annotations

import pytest

from lowband.testing.ranks import run_ranks

# Tolerances. The micro-batches sum their gradients in another order than one batch does, so in
# fp32 the gradients agree to rounding (relative norm over all parameters). AdamW divides by
# sqrt(v): for entries whose gradient is near eps, rounding moves the update by a visible share of
# lr (1e-2), hence 1e-4 on parameters. bf16: each micro-batch computes in bf16 (8 mantissa bits;
# bf16 against fp32 differs by ~8 % in relative norm here; N = 2 against N = 1 by 2.4 %) before
# the fp32 sum, so the bf16 case
# uses FlexDeMo with sign off (a step linear in the gradient, where rounding cannot flip a sign).
# The bf16 losses (about 7.1) of N = 2 and N = 1 differ by 1.02e-3 at the second step on a Xeon
# with AVX-512 BF16 (bf16 products in hardware; other CPUs round elsewhere), hence 2e-3.
TOL = {"fp32": dict(grad=1e-5, param=1e-4, loss=1e-5), "bf16": dict(grad=5e-2, param=1e-3, loss=2e-3)}


def _data(cache: str):
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from lowband.train.data import DataConfig, load_data

    return load_data(DataConfig(max_examples=200, val_size=20, max_source_len=32, max_target_len=16,
                                vocab_size=512))


CASES = [("adamw", "fp32"), ("flexdemo", "fp32"), ("flexdemo", "bf16")]


def _accumulation(rank: int, cache: str) -> dict:
    return {case: _accumulation_case(rank, cache, *case) for case in CASES}


def _accumulation_case(rank: int, cache: str, method: str, precision: str) -> dict:
    import torch.distributed as dist

    from lowband.comm.link import Link
    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology
    from lowband.testing.ranks import full_params
    from lowband.train.data import train_batch
    from lowband.train.methods import build_optimizer
    from lowband.train.models import build_model, transformer_blocks
    from lowband.train.step import split_batch, train_step

    data = _data(cache)
    # FlexDeMo with sign off; in bf16 also topk = chunk (no top-k choice for rounding to change).
    hp = {"lr": 1e-2} if method == "adamw" else {"lr": 0.3, "topk": 8 if precision == "fp32" else 128,
                                                 "sign": False, "values": "fp32"}
    calls = {"reduce_scatter": 0}
    # FSDP2 reduce-scatters through whichever of these this torch has; count calls of both.
    real = {name: getattr(dist, name) for name in ("reduce_scatter_tensor", "reduce_scatter_single")
            if hasattr(dist, name)}

    def counting(fn):
        def wrapper(output, input, *args, **kwargs):
            # FSDP2 reduce-scatters each unit's gradients as one flat (1-D) buffer; the tied
            # embedding's reduce-scatters (lowband.distributed.tied_embedding) carry 2-D activations, on every
            # micro-batch by necessity, and are not gradient synchronisation.
            if input.dim() == 1:
                calls["reduce_scatter"] += 1
            return fn(output, input, *args, **kwargs)
        return wrapper

    results = {}
    for n in (1, 2, 4):
        topo = Topology.from_env()
        spec = build_model("t5-tiny", vocab_size=data.vocab_size, seed=0)
        spec.model.eval()  # no dropout: micro-batches and the whole batch must see the same function
        model = shard_model(spec.model, topo, blocks=transformer_blocks(spec.model), precision=precision)
        link = Link(topo)
        opt = build_optimizer(method, model.named_parameters(), link=link, hp=hp)
        losses, rs, grads = [], [], []
        step_fn = opt.step

        def recording_step(*args, _step=step_fn, _grads=grads, _model=model, **kwargs):
            # The gradient the step uses, read as step() starts (FlexDeMo writes its momentum over it).
            _grads.append([p.grad.full_tensor() for p in _model.parameters()])
            return _step(*args, **kwargs)

        opt.step = recording_step
        for step in range(2):
            batch = train_batch(data, step=step, rank=rank, world_size=4, batch_size=4, seed=0)
            micro = split_batch(batch, n, kind="seq2seq")
            calls["reduce_scatter"] = 0
            for name, fn in real.items():
                setattr(dist, name, counting(fn))
            try:
                losses.append(train_step(model, opt, micro, kind="seq2seq"))
            finally:
                for name, fn in real.items():
                    setattr(dist, name, fn)
            rs.append(calls["reduce_scatter"])
            link.end_step()
        results[n] = {"params": full_params(model), "losses": losses, "reduce_scatters": rs, "grads": grads,
                      "micro_shapes": [tuple(b["input_ids"].shape) for b in micro]}
    ref = results[1]
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 units: the blocks and the root (the tied embedding is sharded outside FSDP2).
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    out = {"units": units, "reduce_scatters": {n: r["reduce_scatters"] for n, r in results.items()},
           "micro_shapes": {n: r["micro_shapes"] for n, r in results.items()}}
    for n in (2, 4):
        out[f"param_diff_{n}"] = max((a - b).abs().max().item()
                                     for a, b in zip(results[n]["params"], ref["params"], strict=True))
        out[f"grad_rel_diff_{n}"] = max(  # ||g_N - g_1|| / ||g_1|| over all parameters, per step
            (sum(((a - b) ** 2).sum() for a, b in zip(ga, gb, strict=True)).sqrt()
             / sum((b**2).sum() for b in gb).sqrt()).item()
            for ga, gb in zip(results[n]["grads"], ref["grads"], strict=True))
        out[f"loss_diff_{n}"] = max(abs(a - b) for a, b in zip(results[n]["losses"], ref["losses"], strict=True))
    out["moved"] = max((a - b).abs().max().item() for a, b in
                       zip(ref["params"], full_params(build_model("t5-tiny", vocab_size=data.vocab_size,
                                                                  seed=0).model), strict=True))
    return out


@pytest.mark.multiprocess
def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch(tmp_path_factory):
    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    results = run_ranks(_accumulation, world_size=4, ranks_per_node=2, args=(cache,), timeout_s=600)
    for (method, precision), r in ((case, by_case[case]) for by_case in results for case in CASES):
        tol = TOL[precision]
        assert r["moved"] > 10 * tol["param"], r  # the steps did something
        for n in (2, 4):
            assert r[f"grad_rel_diff_{n}"] < tol["grad"], (method, precision, n, r)
            assert r[f"param_diff_{n}"] < tol["param"], (method, precision, n, r)
            assert r[f"loss_diff_{n}"] < tol["loss"], (method, precision, n, r)
        # One reduce-scatter per FSDP unit (T5 blocks + root) per step, whatever N is.
        assert r["reduce_scatters"][1] == [r["units"], r["units"]]
        assert r["reduce_scatters"][2] == r["reduce_scatters"][1]
        assert r["reduce_scatters"][4] == r["reduce_scatters"][1]
        # Each micro-batch of N = 4 holds one example, trimmed to its own length.
        assert all(s[0] == 1 for s in r["micro_shapes"][4])


def _checkpointing(rank: int, cache: str) -> dict:
    import torch

    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology
    from lowband.train.data import train_batch
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    data = _data(cache)
    grads = {}
    for ac in (False, True):
        spec = build_model("t5-tiny", vocab_size=data.vocab_size, seed=0)  # train mode: dropout on
        model = shard_model(spec.model, Topology.from_env(), blocks=transformer_blocks(spec.model),
                            activation_checkpointing=ac)
        batch = train_batch(data, step=0, rank=rank, world_size=4, batch_size=4, seed=0)
        torch.manual_seed(123 + rank)
        compute_loss(model, batch).backward()
        grads[ac] = [p.grad.full_tensor() for p in model.parameters()]
        names = [n for n, _ in model.named_parameters()]
        grads[f"names_{ac}"] = names
    diff = max((a - b).abs().max().item() for a, b in zip(grads[False], grads[True], strict=True))
    return {"diff": diff, "same_names": grads["names_False"] == grads["names_True"],
            "norm": sum(float(g.norm()) for g in grads[False])}


@pytest.mark.multiprocess
def test_activation_checkpointing_gives_identical_gradients(tmp_path_factory):
    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    for r in run_ranks(_checkpointing, world_size=4, ranks_per_node=2, args=(cache,), timeout_s=300):
        assert r["norm"] > 0
        assert r["diff"] == 0.0, r  # the recompute repeats forward exactly, dropout masks included
        assert r["same_names"]  # checkpoints load with or without it


def test_split_batch_refuses_uneven_splits_and_trims_padding():
    import torch

    from lowband.train.step import loss_tokens, split_batch

    batch = {"input_ids": torch.tensor([[5, 6, 7], [5, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
             "labels": torch.tensor([[8, 9], [8, -100]])}
    with pytest.raises(ValueError, match="--grad-accum"):
        split_batch(batch, 3, kind="seq2seq")
    a, b = split_batch(batch, 2, kind="seq2seq")
    assert a["input_ids"].shape == (1, 3) and b["input_ids"].shape == (1, 1) and b["labels"].tolist() == [[8]]
    assert loss_tokens(batch, kind="seq2seq") == 3
    causal = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}
    assert loss_tokens(causal, kind="causal") == 2  # the first token of a row is never a target
    assert split_batch(causal, 2, kind="causal")[1]["labels"].tolist() == [[5]]
