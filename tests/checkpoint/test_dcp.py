"""lowband/checkpoint/dcp.py: Resume on a different topology: a checkpoint of 2 replicas × 2 shards onto 1 × 2 and 2 × 1.

One launch writes FlexDeMo and DiLoCo (int8 outer messages, so with error feedback) checkpoints on
the 2 × 2 mesh, mid-way through DiLoCo's inner phase so that the replicas' θ, inner AdamW state and
error feedback differ; two launches of two ranks load them, as 1 node × 2 shards (R 2 → 1) and as
2 nodes × 1 shard (S 2 → 1), and train on. The parent checks the rule of lowband.checkpoint.dcp:
R′ < R takes the mean over the old replicas, an unchanged R keeps every replica's own state.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from lowband.testing.ranks import full_params, run_ranks, tiny_loss, tiny_model

LR = 0.02


def _optimizer(name: str, model, link, **kw):
    from lowband.optim import DiLoCo, FlexDeMo, NoLoCo

    if name == "flexdemo":
        return FlexDeMo(model.parameters(), lr=LR, topk=3, chunk=32, decay=0.9, link=link)
    if name == "diloco":
        return DiLoCo(model.parameters(), functools.partial(torch.optim.AdamW, lr=LR), link=link, sync_every=2,
                      values="int8")
    return NoLoCo(model.parameters(), functools.partial(torch.optim.AdamW, lr=LR), link=link, sync_every=2, **kw)


def _portable(obj):
    """Tensors as numpy arrays: results cross the process boundary by pickle, not by shared memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v) for v in obj]
    return obj


def _replica_states(opt) -> dict:
    """Every per-replica tensor of the optimizer's state dict, gathered in full: (R, *shape) each."""
    from torch.distributed.tensor import DTensor

    out = {}
    for index, st in opt.state_dict()["state"].items():
        flat = {**{k: v for k, v in st.items() if k != "inner"},
                **{f"inner.{k}": v for k, v in st.get("inner", {}).items()}}
        out[index] = {k: v.full_tensor() for k, v in flat.items() if isinstance(v, DTensor)}
    return out


def _train(model, opt, link, rank: int, steps) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = tiny_loss(model, rank, step)
        loss.backward()
        opt.step()
        link.end_step()
        losses.append(loss.item())
    return losses


def _sharded(topology, seed: int = 0, hidden: int = 37):
    from torch import nn

    from lowband.distributed.sharding import shard_model

    model = tiny_model(seed)
    if hidden != 37:  # another model size: the first block 13 -> hidden
        torch.manual_seed(seed)
        model = nn.Sequential(type(model[0])(13, hidden), type(model[1])(hidden, 29), nn.Linear(29, 3))
    return shard_model(model, topology, blocks=[model[0], model[1]])


def _write(rank: int, ckpt_dir: str) -> dict:
    from lowband.checkpoint.dcp import save_checkpoint
    from lowband.comm.link import Link
    from lowband.distributed.topology import Topology

    topo = Topology.from_env()
    out = {}
    for name in ("flexdemo", "diloco"):
        model = _sharded(topo)
        link = Link(topo)
        opt = _optimizer(name, model, link)
        _train(model, opt, link, rank, range(3))  # DiLoCo (H = 2): one outer step, then one inner step
        save_checkpoint(f"{ckpt_dir}/{name}", model=model, optimizer=opt, extra={"method": name, "step": 3})
        out[name] = _portable({"params": full_params(model), "states": _replica_states(opt)})
    # NoLoCo with groups of 4 on 4 replicas (one shard each): cannot go on with 2 replicas.
    topo4 = Topology.from_env(shards=1)
    model = _sharded(topo4)
    link = Link(topo4)
    opt = _optimizer("noloco", model, link, group_size=4)
    _train(model, opt, link, rank, range(1))
    save_checkpoint(f"{ckpt_dir}/noloco_n4", model=model, optimizer=opt, extra={"method": "noloco"})
    return out


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _resume(rank: int, ckpt_dir: str) -> dict:
    from lowband.checkpoint.dcp import load_checkpoint
    from lowband.comm.link import Link
    from lowband.distributed.topology import Topology

    topo = Topology.from_env()
    out = {"replicas": topo.replicas, "shards": topo.shards}
    for name in ("flexdemo", "diloco"):
        model = _sharded(topo, seed=123)  # another init: everything must come from the checkpoint
        link = Link(topo)
        opt = _optimizer(name, model, link)
        extra = load_checkpoint(f"{ckpt_dir}/{name}", model=model, optimizer=opt, method=name)
        link.end_step()
        out[name] = _portable({"step": extra["step"], "params": full_params(model), "states": _replica_states(opt),
                               "losses": _train(model, opt, link, rank, range(3, 9))})

    def other_method():
        model = _sharded(topo)
        link = Link(topo)
        load_checkpoint(f"{ckpt_dir}/flexdemo", model=model, optimizer=_optimizer("diloco", model, link),
                        method="diloco")

    def other_state():  # the same without the method's name: the state's layout tells
        model = _sharded(topo)
        link = Link(topo)
        load_checkpoint(f"{ckpt_dir}/flexdemo", model=model, optimizer=_optimizer("diloco", model, link))

    def other_model():
        model = _sharded(topo, hidden=41)
        link = Link(topo)
        load_checkpoint(f"{ckpt_dir}/flexdemo", model=model, optimizer=_optimizer("flexdemo", model, link),
                        method="flexdemo")

    def noloco_on_fewer_replicas():
        model = _sharded(topo)
        link = Link(topo)
        load_checkpoint(f"{ckpt_dir}/noloco_n4", model=model,
                        optimizer=_optimizer("noloco", model, link, group_size=2), method="noloco")

    out["refused"] = {"method": _refusal(other_method), "state": _refusal(other_state),
                      "model": _refusal(other_model)}
    if topo.replicas > 1:
        out["refused"]["noloco"] = _refusal(noloco_on_fewer_replicas)
    return out


def _mean(rows: np.ndarray) -> np.ndarray:
    """The rule: the mean over the old replicas (rows), taken in float64."""
    return rows.astype(np.float64).mean(0).astype(rows.dtype)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("resume-topology"))
    results = run_ranks(_write, world_size=4, ranks_per_node=2, args=(ckpt_dir,), timeout_s=240)
    return ckpt_dir, results


def _check_refusals(refused: dict, *, replicas: int) -> None:
    assert "written by method 'flexdemo', this run uses 'diloco'" in refused["method"], refused["method"]
    assert "--method flexdemo" in refused["method"]
    assert "the optimizer state does not match" in refused["state"], refused["state"]
    assert "the model does not match" in refused["model"] and "(37, 13)" in refused["model"], refused["model"]
    assert "(41, 13)" in refused["model"]
    if replicas > 1:
        assert "NoLoCo group size n=4 is larger than this run's 2 replicas" in refused["noloco"], refused["noloco"]
        assert "Resume on at least 4 replicas" in refused["noloco"]


@pytest.mark.multiprocess
def test_two_nodes_onto_one_averages_the_replicas(saved):
    ckpt_dir, before = saved
    after = run_ranks(_resume, world_size=2, ranks_per_node=2, args=(ckpt_dir,), timeout_s=240)
    for r in after:
        assert (r["replicas"], r["shards"]) == (1, 2)
        # FlexDeMo: every replica holds the same parameters, so the model is exactly the saved one;
        # the momentum of the one new replica is the mean of the two old replicas' momenta.
        old, new = before[0]["flexdemo"], r["flexdemo"]
        assert new["step"] == 3
        for a, b in zip(old["params"], new["params"], strict=True):
            assert np.array_equal(a, b)
        for index, states in old["states"].items():
            assert set(states) == {"delta"}
            rows = states["delta"]
            assert rows.shape[0] == 2 and not np.array_equal(rows[0], rows[1])  # the replicas did differ
            assert np.array_equal(new["states"][index]["delta"], _mean(rows)[None])
        # DiLoCo mid-phase: θ (the parameters), the inner AdamW moments and the int8 error feedback
        # differ between the old replicas and are averaged; φ and the outer momentum are equal on
        # both and stay exactly what they were.
        old, new = before[0]["diloco"], r["diloco"]
        for index, states in old["states"].items():
            assert {"slow", "momentum", "theta", "error", "inner.exp_avg", "inner.exp_avg_sq"} <= set(states)
            for key, rows in states.items():
                assert np.array_equal(new["states"][index][key], _mean(rows)[None]), (index, key)
            assert not np.array_equal(states["theta"][0], states["theta"][1])
            assert np.array_equal(states["slow"][0], states["slow"][1])
            assert np.array_equal(new["states"][index]["slow"][0], states["slow"][0])
            assert np.array_equal(new["params"][index], _mean(states["theta"]))
        for name in ("flexdemo", "diloco"):
            losses = r[name]["losses"]
            assert all(math.isfinite(x) for x in losses) and max(losses) < 3, (name, losses)
        _check_refusals(r["refused"], replicas=1)
    # One replica: both ranks train the same copy.
    assert np.array_equal(after[0]["diloco"]["params"][0], after[1]["diloco"]["params"][0])


@pytest.mark.multiprocess
def test_two_shards_onto_one_keeps_each_replica(saved):
    ckpt_dir, before = saved
    after = run_ranks(_resume, world_size=2, ranks_per_node=1, args=(ckpt_dir,), timeout_s=240)
    for rank, r in enumerate(after):
        assert (r["replicas"], r["shards"]) == (2, 1)
        for name in ("flexdemo", "diloco"):
            old, new = before[0][name], r[name]
            # Replica `rank` (one rank now) holds exactly its old state, resharded from two shards.
            for index, states in old["states"].items():
                for key, rows in states.items():
                    assert np.array_equal(new["states"][index][key], rows), (name, index, key)
            params = old["params"] if name == "flexdemo" else [s["theta"][rank] for s in old["states"].values()]
            for a, b in zip(params, new["params"], strict=True):
                assert np.array_equal(a, b), name
            losses = new["losses"]
            assert all(math.isfinite(x) for x in losses) and max(losses) < 3, (name, losses)
        _check_refusals(r["refused"], replicas=2)


def test_replica_sources_mean_when_fewer_copy_when_more():
    from lowband.checkpoint.dcp import replica_sources

    assert replica_sources(saved=2, new=1, replica=0) == [0, 1]
    assert [replica_sources(saved=4, new=2, replica=j) for j in range(2)] == [[0, 1], [2, 3]]
    assert [replica_sources(saved=3, new=2, replica=j) for j in range(2)] == [[0, 1], [2]]
    assert [replica_sources(saved=1, new=2, replica=j) for j in range(2)] == [[0], [0]]
    assert [replica_sources(saved=2, new=4, replica=j) for j in range(4)] == [[0], [0], [1], [1]]
    assert [replica_sources(saved=3, new=3, replica=j) for j in range(3)] == [[0], [1], [2]]
    with pytest.raises(ValueError, match="0 <= replica < new"):
        replica_sources(saved=2, new=1, replica=1)


def _loop(rank: int, out: str, cache: str, steps: int, resume: str | None) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from lowband.train.config import TrainConfig
    from lowband.train.loop import run_training

    return run_training(TrainConfig.from_tables({
        "method": {"name": "flexdemo"}, "model": {"name": "t5-tiny"}, "schedule": {"steps": steps, "batch_size": 2},
        "data": {"max_examples": 300, "val_size": 16, "max_source_len": 32, "max_target_len": 8, "vocab_size": 512},
        "run": {"val_batches": 2, "progress": False, "out": out}, "checkpoint": {"every": 3, "resume": resume},
    }))  # fmt: skip


@pytest.mark.multiprocess
def test_lowband_train_resumes_on_one_node_with_resume_auto(tmp_path, tmp_path_factory):
    import json

    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    out = str(tmp_path / "run")
    first = run_ranks(_loop, world_size=4, ranks_per_node=2, args=(out, cache, 3, None), timeout_s=400)
    assert first[0].replicas == 2
    extra = json.loads((tmp_path / "run" / "checkpoints" / "step_000003" / "lowband_extra.json").read_text())
    assert extra["method"] == "flexdemo" and extra["topology"]["replicas"] == 2 and extra["global_batch"] == 8
    second = run_ranks(_loop, world_size=2, ranks_per_node=2, args=(out, cache, 5, "auto"), timeout_s=400)
    for s in second:
        assert s.start_step == 3 and s.replicas == 1 and s.shards == 2 and s.status == "ok"
        assert math.isfinite(s.train_loss) and math.isfinite(s.val_loss)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["type"] == "train"]
    assert [x["step"] for x in train] == [1, 2, 3, 4, 5]  # the global step goes on
    assert all(math.isfinite(x["loss"]) for x in train)
    vals = [x["val_loss"] for x in lines if x["type"] == "val"]
    assert vals[-1] < vals[0], vals  # it went on learning: below the untrained model's loss
    assert train[3]["tokens"] > train[2]["tokens"]  # the token count continues from the checkpoint's
