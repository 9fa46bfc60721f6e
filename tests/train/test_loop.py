"""lowband/train/loop.py: the training loop on a 2 × 2 gloo mesh: outputs, checkpoints and an exact
resume, a run's config file run again, and every method in bf16 (parameters, gradients and
optimizer state fp32, compute bf16; finite, falling losses; the per-phase memory profile in the
run summary)."""

from __future__ import annotations

import json

import pytest

from lowband.testing.ranks import run_ranks


def _train(rank: int, out: str, cache: str, method: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    def cfg(steps: int, out: str, checkpoint: dict) -> TrainConfig:
        return TrainConfig.from_tables({
            "method": {"name": method, **({"H": 2} if method in ("diloco", "noloco") else {})},
            "model": {"name": "t5-tiny"}, "schedule": {"steps": steps, "batch_size": 2},
            "data": {"max_examples": 300, "val_size": 16, "max_source_len": 32, "max_target_len": 8, "vocab_size": 512},
            "run": {"val_batches": 2, "val_every": 2, "progress": False, "out": out}, "checkpoint": checkpoint,
        })  # fmt: skip

    straight = Trainer(cfg(5, f"{out}/straight", {})).run()
    Trainer(cfg(3, f"{out}/resumed", {"every": 3})).run()
    resumed = Trainer(cfg(5, f"{out}/resumed", {"resume": "auto"})).run()
    return {"straight": straight.to_dict(), "resumed": resumed.to_dict()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["flexdemo", "noloco"])
def test_training_writes_its_outputs_and_resumes_exactly(tmp_path, tmp_path_factory, method):
    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    results = run_ranks(_train, world_size=4, ranks_per_node=2, args=(str(tmp_path), cache, method), timeout_s=300)
    for rank, r in enumerate(results):
        s, c = r["straight"], r["resumed"]
        assert s["status"] == "ok" and s["nodes"] == 2 and s["ranks_per_node"] == 2 and s["rank"] == rank
        assert c["start_step"] == 3
        # The resumed run ends exactly where the uninterrupted one does.
        assert c["val_loss"] == s["val_loss"], (s["val_loss"], c["val_loss"])
        assert c["train_loss"] == s["train_loss"]
        assert s["inter_node_bytes_per_step"] > 0
        # The training clock and the token count go on across the resume.
        assert c["tokens"] == s["tokens"] > 0
        assert 0 < s["train_time_s"] < s["wall_time_s"]
        assert c["val_history"][-1]["tokens"] == s["val_history"][-1]["tokens"]
        assert (tmp_path / "straight" / f"summary_rank{rank}.json").exists()
    lines = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["type"] == "train"] == [1, 2, 3, 4, 5]
    vals = [x for x in lines if x["type"] == "val"]
    assert [x["step"] for x in vals] == [0, 2, 4, 5]
    assert vals[0]["tokens"] == 0 and vals[0]["train_time_s"] == 0
    assert all(a["tokens"] < b["tokens"] and a["train_time_s"] < b["train_time_s"] for a, b in zip(vals, vals[1:], strict=False))
    # Validation is left out of the training clock: it is the sum of the steps' clock.
    train = [x for x in lines if x["type"] == "train"]
    assert train[-1]["train_time_s"] == vals[-1]["train_time_s"] < vals[-1]["wall_s"]
    resumed_lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in resumed_lines if x["type"] == "train"] == [1, 2, 3, 4, 5]
    straight_losses = [x["loss"] for x in lines if x["type"] == "train"]
    assert [x["loss"] for x in resumed_lines if x["type"] == "train"] == straight_losses
    assert (tmp_path / "resumed" / "checkpoints" / "step_000003" / ".metadata").exists()


def test_bad_configuration_is_refused_before_anything_starts(tmp_path):
    from lowband.train.config import TrainConfig

    cases = [
        ({"method": {"name": "sgd"}}, "unknown method 'sgd'; choose one of: adamw"),
        ({"method": {"name": "adamw", "topk": 1}}, "method 'adamw' has no hyper-parameter 'topk'; accepted: lr"),
        ({"model": {"name": "t5-huge"}}, "unknown model 't5-huge'; named sizes: t5-tiny"),
        ({"data": {"path": str(tmp_path / "missing.jsonl")}}, "does not exist"),
        ({"schedule": {"steps": 0}}, "--steps must be >= 1"),
        ({"schedule": {"lr_schedule": "linear"}}, "--schedule must be 'constant' or 'cosine'"),
        ({"schedule": {"step": 10}}, "[schedule] has no key step; its keys are: steps"),
    ]
    for tables, needle in cases:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            TrainConfig.from_tables(tables).validate()
        assert needle in str(e.value), (tables, str(e.value))


def _train_then_again(rank: int, out: str, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    import argparse

    from lowband.train.args import add_arguments, config_from_args
    from lowband.train.loop import Trainer

    def run(*argv: str):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return Trainer(config_from_args(p.parse_args(list(argv)))).run().to_dict()

    first = run("--method", "diloco", "--sync-every", "2", "--max-grad-norm", "none", "--model", "t5-tiny",
                "--max-examples", "300", "--val-size", "16", "--val-batches", "2", "--batch-size", "2",
                "--max-source-len", "32", "--max-target-len", "8", "--vocab-size", "512", "--steps", "4",
                "--seed", "3", "--no-progress", "--out", f"{out}/first")
    again = run("--config", f"{out}/first/config.toml", "--out", f"{out}/again")
    return {"first": first, "again": again}


@pytest.mark.multiprocess
def test_a_runs_config_file_runs_it_again_exactly(tmp_path, tmp_path_factory):
    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    results = run_ranks(_train_then_again, world_size=4, ranks_per_node=2, args=(str(tmp_path), cache),
                        timeout_s=300)
    for r in results:
        a, b = r["first"], r["again"]
        assert (b["method"], b["steps"], b["hp"]) == (a["method"], a["steps"], a["hp"])
        assert b["train_loss"] == a["train_loss"] and b["val_loss"] == a["val_loss"]
    assert (tmp_path / "again" / "config.toml").read_text() == (tmp_path / "first" / "config.toml").read_text()


METHODS = ("adamw", "deto-full", "flexdemo", "demo", "diloco", "noloco")


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
