"""bf16 mixed precision (FSDP2's MixedPrecisionPolicy) on a real 2 × 2 gloo mesh.

* lowband's AdamW through the link equals FSDP2's own 2-D HSDP with the same policy;
* parameters, gradients and optimizer state stay fp32 (the fp32 shard); compute is bf16;
* every method trains in bf16 with finite losses and a falling validation loss;
* the per-phase memory profile is in the run summary.
"""

from __future__ import annotations

import pytest

from lowband.testing import run_ranks

# HSDP and lowband reduce the same fp32 gradients in another order (HSDP: reduce-scatter then
# all-reduce inside FSDP2; lowband: reduce-scatter, then the link's all-reduce), from the same bf16
# forward and backward, so they agree to fp32 rounding of the reduction, seen through AdamW.
HSDP_ATOL = 1e-5
METHODS = ("adamw", "deto-full", "flexdemo", "demo", "diloco", "noloco")


def _vs_hsdp(rank: int) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard

    from lowband.link import Link
    from lowband.optim import AdamWFullSync, FlexDeMo
    from lowband.sharding import mixed_precision_policy, shard_model
    from lowband.testing import full_params, tiny_loss, tiny_model
    from lowband.topology import Topology

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


def _train_all(rank: int, out: str, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    results = {}
    for method in METHODS:
        hp = {"lr": 3e-3}
        if method in ("diloco", "noloco"):
            hp.update(H=2)
        if method in ("flexdemo", "demo", "deto-full"):
            hp = {"lr": 1e-2}
        s = Trainer(TrainConfig.from_tables({
            "method": {"name": method, **hp}, "model": {"name": "t5-tiny", "precision": "bf16"},
            "schedule": {"steps": 6, "batch_size": 4},
            "data": {"max_examples": 300, "val_size": 16, "max_source_len": 32, "max_target_len": 8, "vocab_size": 512},
            "run": {"val_batches": 2, "progress": False, "out": f"{out}/{method}"},
        })).run().to_dict()  # fmt: skip
        results[method] = {k: s[k] for k in ("val_history", "train_loss", "precision", "memory", "status")}
    return results


@pytest.mark.multiprocess
def test_every_method_trains_in_bf16_with_finite_falling_losses(tmp_path, tmp_path_factory):
    import math

    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    results = run_ranks(_train_all, world_size=4, ranks_per_node=2, args=(str(tmp_path), cache), timeout_s=900)
    for r in results:
        for method in METHODS:
            s = r[method]
            assert s["status"] == "ok" and s["precision"] == "bf16"
            vals = [p["val_loss"] for p in s["val_history"]]
            assert all(math.isfinite(v) for v in vals) and math.isfinite(s["train_loss"]), (method, s)
            assert vals[-1] < vals[0], (method, vals)
            mem = s["memory"]
            assert mem["forward_peak_mb"] > 0 and mem["backward_peak_mb"] > 0 and mem["step_peak_mb"] > 0


def test_unknown_precision_is_refused_with_the_choices():
    from lowband.train.config import TrainConfig

    with pytest.raises(ValueError, match="--precision must be one of fp32, bf16"):
        TrainConfig.from_tables({"model": {"precision": "fp16"}}).validate()
    with pytest.raises(ValueError, match="--grad-accum must be >= 1"):
        TrainConfig.from_tables({"schedule": {"grad_accum": 0}}).validate()
