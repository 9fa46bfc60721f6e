"""lowband/bench/config.py: the bench's plan (methods x bandwidths x shards x seeds) and its refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import lowband.commands.bench as bench
from lowband.bench.config import PRESETS, BenchConfig
from lowband.bench.plan import plan_runs
from tests.bench.fake_trainer import bench_args


def _config(*, data: str | None = None, **bench):
    """The bench of these ``[bench]`` keys on t5-tiny (and ``data``)."""
    return BenchConfig.from_tables({"bench": bench, "model": {"name": "t5-tiny"},
                                    **({"data": {"path": data}} if data is not None else {})})


@pytest.mark.timeout(120)
def test_plan_expands_bandwidths_and_shards() -> None:
    config = BenchConfig.from_tables({
        "bench": {"methods": "adamw,deto-full,demo,flexdemo:topk=1,flexdemo:topk=8", "bandwidths": "1gbit,100mbit",
                  "shards": "1,2", "steps": 3},
        "model": {"name": "t5-tiny"}})  # fmt: skip
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
    plans = plan_runs(_config(methods="demo,flexdemo,noloco:H=2,n=2", steps=3))
    assert [(p.method, p.shards) for p in plans] == [("demo", 1), ("flexdemo", 2), ("noloco", 2)]
    assert plans[2].train_args(_config(methods="adamw", steps=3), Path("/x"))[3:7] == [
        "--sync-every", "2", "--group-size", "2"]  # fmt: skip


def test_seeds_multiply_the_runs_seed_major() -> None:
    config = _config(methods="adamw,flexdemo", seeds="0,1,2", steps=5)
    plans = plan_runs(config)
    assert [(p.method, p.seed) for p in plans] == [
        ("adamw", 0), ("flexdemo", 0), ("adamw", 1), ("flexdemo", 1), ("adamw", 2), ("flexdemo", 2)]
    assert len({p.id for p in plans}) == 6
    argv = plans[3].train_args(config, __import__("pathlib").Path("/x"))
    assert argv[argv.index("--seed") + 1] == "1"
    assert config.as_dict()["seeds"] == [0, 1, 2]
    for bad, words in (("0,x", "'x' is not an integer"), ("1,1", "names a seed twice")):
        with pytest.raises(ValueError, match=words):
            _config(methods="adamw", seeds=bad, steps=5)


def test_nseeds_runs_a_variant_at_the_first_seeds_only() -> None:
    config = _config(methods=["adamw:lr=0.001,nseeds=1", "flexdemo"], seeds="0,1", steps=5)
    plans = plan_runs(config)
    assert [(p.method, p.seed) for p in plans] == [("adamw", 0), ("flexdemo", 0), ("flexdemo", 1)]
    assert "nseeds" not in plans[0].params  # a bench key: it never reaches the trainer
    assert "--nseeds" not in " ".join(plans[0].train_args(config, __import__("pathlib").Path("/x")))
    with pytest.raises(ValueError, match="nseeds=3 exceeds the 2 seed"):
        _config(methods="adamw:nseeds=3", seeds="0,1", steps=5)
    with pytest.raises(ValueError, match="nseeds must be >= 1"):
        _config(methods="adamw:nseeds=0", seeds="0,1", steps=5)


def test_meaningless_benches_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as err:
        _config(methods="diloco,noloco", steps=40)  # registry H = 50 > 40 steps
    assert "no outer step ever happens" in str(err.value) and "diloco:H=" in str(err.value)
    _config(methods="diloco:H=10", steps=40)
    with pytest.raises(ValueError, match="positive validation loss"):
        _config(methods="adamw", steps=5, target_loss=-1.0)


def test_a_run_that_ends_between_outer_steps_is_warned_about_with_the_fix(caplog) -> None:
    from lowband.train.config import TrainConfig

    with caplog.at_level("WARNING"):
        _config(methods="diloco:H=20,noloco:H=10", steps=150)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1  # NoLoCo's H=10 divides 150
    assert "diloco:H=20" in warned[0] and "last 10 inner steps are never merged" in warned[0]
    assert "--steps 140 or 160" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        _config(methods="diloco:H=20", steps=140)
        TrainConfig.from_tables({"method": {"name": "diloco", "sync_every": 20}, "schedule": {"steps": 140}}).validate()
    assert not caplog.records
    with caplog.at_level("WARNING"):
        TrainConfig.from_tables({"method": {"name": "noloco", "sync_every": 20}, "schedule": {"steps": 50}}).validate()
    assert ["--steps 40 or 60" in r.getMessage() for r in caplog.records] == [True]


def test_preset_settings_and_the_users_options_win() -> None:
    preset = PRESETS["quality"]
    config = bench.config_from_args(bench_args("--preset", "quality"))
    assert config.preset == "quality" and config.steps == preset.bench.steps
    assert len(config.seeds) >= 2 and config.bandwidths_bps == (1e8,)
    assert [str(m) for m in config.methods] == list(preset.bench.methods)
    assert {m.name for m in config.methods} >= {"adamw", "deto-full", "demo", "flexdemo", "diloco", "noloco"}
    config = bench.config_from_args(bench_args("--preset", "quality", "--steps", "60", "--seeds", "5",
                                          "--train-args=--val-every 7"))  # fmt: skip
    assert config.steps == 60 and config.seeds == (5,)
    assert config.train_args[-2:] == ("--val-every", "7")  # the user's train args come last and win


def test_group_size_and_data_columns_are_refused_before_any_process_starts(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"group size n=4 exceeds the 2 replicas.*use n <= 2"):
        _config(methods="noloco:H=5,n=4", steps=10)
    _config(methods="noloco:H=5,n=4", steps=10, nodes=4, ranks_per_node=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": "x", "b": "y"}\n')
    with pytest.raises(ValueError, match=r"no source column 'source' \(its first row has: a, b\).*--source-column"):
        _config(methods="adamw", steps=5, data=str(bad))
    _config(methods="adamw", steps=5, data=str(bad), train_args="--source-column a --target-column=b")
    csv_file = tmp_path / "pairs.csv"
    csv_file.write_text("source,summary\nx,y\n")
    with pytest.raises(ValueError, match="no target column 'target'"):
        _config(methods="adamw", steps=5, data=str(csv_file))
    with pytest.raises(ValueError, match="--export-hf would have every run of the bench export to one directory"):
        _config(methods="adamw", steps=5, train_args=f"--export-hf {tmp_path / 'hf'}")


HAS_TORCHFT = importlib.util.find_spec("torchft") is not None


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft not installed")
def test_faults_plan_a_fault_free_twin_and_ft_both_plans_off_and_on():
    cfg = _config(methods="flexdemo:topk=1,adamw", steps=50, nodes=3, faults="node2:kill@10,node2:start@20")
    plans = plan_runs(cfg)
    assert [(p.label, p.ft, bool(p.faults)) for p in plans] == [
        ("FlexDeMo Top1 FT", True, False), ("FlexDeMo Top1 FT faults", True, True),
        ("AdamW FT", True, False), ("AdamW FT faults", True, True)]
    both = plan_runs(_config(methods="adamw", steps=50, ft="both"))
    assert [(p.label, p.ft) for p in both] == [("AdamW", False), ("AdamW FT", True)]
    assert len({p.id for p in both}) == 2


@pytest.mark.parametrize("kwargs, needle", [
    (dict(methods="flexdemo:overlap=true", ft="on"), "overlap=true does not run under fault tolerance"),
    (dict(methods="demo", ft="on"), "--ranks-per-node 1 for DeMo"),
    (dict(methods="adamw", ft="sometimes"), "--ft 'sometimes'"),
    (dict(methods="adamw", faults="node5:kill@3"), "names node 5"),
])
@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft not installed")
def test_bad_fault_tolerance_settings_are_named_before_anything_starts(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _config(steps=50, **kwargs)


def test_frontier_preset_is_long_enough_for_local_methods_and_spans_the_bytes_axis() -> None:
    """Every local-step variant takes >= 30 outer steps and ends on an outer step; one pass over the data at
    most; a SparseLoCo variant sends, by its byte formula, >= 1,000x fewer bytes per step than AdamW."""
    from lowband.optim.outer.sparseloco import sparseloco_message_nbytes
    from lowband.train.config import TrainConfig
    from lowband.train.data.sources import default_corpus_path
    from lowband.train.methods import family_of

    config = bench.config_from_args(bench_args("--preset", "frontier"))
    assert config.preset == "frontier" and len(config.seeds) >= 2 and config.data is None
    local = [m for m in config.methods if family_of(m.name) == "local"]
    assert {m.name for m in local} == {"diloco", "noloco", "sparseloco"}
    for m in local:
        H = m.hp.sync_every
        assert config.steps % H == 0 and config.steps // H >= 30, (str(m), config.steps, H)
    assert all("lr" in m.given for m in config.methods), [str(m) for m in config.methods]  # tuned, not defaults
    global_batch = TrainConfig().schedule.batch_size * config.nodes * config.ranks_per_node
    pairs = len(__import__("json").loads(default_corpus_path().read_text())) - TrainConfig().data.val_size
    assert config.steps * global_batch <= pairs, (config.steps * global_batch, pairs)
    # t5-mini at vocab 8192 under S = 2: per node the two ranks' shards; AdamW sends 4n bytes per node and step.
    n = 1_967_872
    best = min(2 * sparseloco_message_nbytes([n // 2], chunk=m.hp.chunk, topk=m.hp.topk, values=m.hp.values)
               / m.hp.sync_every for m in local if m.name == "sparseloco")
    assert 4 * n / best >= 1000, 4 * n / best
