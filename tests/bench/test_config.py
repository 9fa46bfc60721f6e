"""lowband/bench/config.py: the bench's plan (methods x bandwidths x shards x seeds) and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowband.bench.config import make_config, plan_runs

pytestmark = pytest.mark.timeout(120)


def test_plan_expands_bandwidths_and_shards() -> None:
    config = make_config(
        methods="adamw,deto-full,demo,flexdemo:topk=1,flexdemo:topk=8", bandwidths="1gbit,100mbit", shards="1,2",
        steps=3, model="t5-tiny",
    )  # fmt: skip
    plans = plan_runs(config)
    first = [(p.method, p.topk, p.shards) for p in plans if p.bandwidth_bps == 1e9]
    # demo at shards=2 is flexdemo:topk=1 at shards=2: run once.
    assert first == [
        ("adamw", None, 2), ("deto-full", None, 1), ("deto-full", None, 2), ("demo", 1, 1), ("flexdemo", 1, 2),
        ("demo", 8, 1), ("flexdemo", 8, 2),
    ]  # fmt: skip
    assert len(plans) == 14 and len({p.id for p in plans}) == 14
    argv = next(p for p in plans if p.method == "flexdemo" and p.topk == 8).train_args(config, Path("/x"))
    assert argv[:3] == ["train", "--method", "flexdemo"]
    assert argv[argv.index("--topk") + 1] == "8" and argv[argv.index("--chunk") + 1] == "128"
    assert argv[argv.index("--shards") + 1] == "2" and argv[argv.index("--out") + 1] == "/x"
    # Without --shards every method keeps its own: DeMo 1, the rest ranks per node.
    plans = plan_runs(make_config(methods="demo,flexdemo,noloco:H=2,n=2", steps=3, model="t5-tiny"))
    assert [(p.method, p.shards) for p in plans] == [("demo", 1), ("flexdemo", 2), ("noloco", 2)]
    assert plans[2].train_args(make_config(methods="adamw", steps=3, model="t5-tiny"), Path("/x"))[3:7] == [
        "--sync-every", "2", "--group-size", "2"]  # fmt: skip
