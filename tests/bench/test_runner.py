"""``lowband bench`` / ``lowband report`` without real training.

A fake trainer (a script that writes the files ``lowband train`` writes: per-rank summaries and
rank 0's metrics.jsonl) stands in for the training entry point, so that planning, launching,
aggregation, failure handling, tables and plots are tested on their own. Most tests call the
fake in-process through a stand-in launcher; one runs it under real torchrun (loopback), and one
in network namespaces where they can be built.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import lowband.bench as bench
import lowband.bench.runner as runner
from lowband.bench.config import make_config, plan_runs
from lowband.bench.methods import METHODS, parse_method_list, parse_method_spec
from lowband.bench.plots import PLOT_FILES
from lowband.bench.record import RunRecord
from lowband.bench.report import table1, table2
from lowband.bench.results import SCHEMA_VERSION, aggregate_run, load_results, read_summaries, write_results
from lowband.cluster import list_namespaces
from lowband.testing import default_sigint
from lowband.traffic import OpTally

pytestmark = pytest.mark.timeout(120)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The fake trainer. It reads only what the bench passes and writes what the contract promises.
# Bytes per step and step time follow the method, so tables have distinct, checkable numbers.
FAKE_TRAINER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    from lowband.train.summary import RunSummary

    from lowband.train.cli import parse_train_args

    def main(args, env):
        assert args[0] == "train", args
        cfg = parse_train_args(args[1:])  # the run's config file, --out beside it
        method, out, steps = cfg.method.name, Path(cfg.run.out), cfg.schedule.steps
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        per_node = int(env["LOCAL_WORLD_SIZE"])
        if method in env.get("FAKE_FAIL_METHODS", "").split(","):
            print(f"RuntimeError: fake trainer: {method} blew up on purpose", file=sys.stderr, flush=True)
            return 1
        if method in env.get("FAKE_HANG_METHODS", "").split(","):
            out.mkdir(parents=True, exist_ok=True)
            (out / f"started-{rank}").touch()
            __import__("time").sleep(300)
        shards = cfg.model.shards
        topk, chunk = getattr(cfg.method.hp, "topk", None), getattr(cfg.method.hp, "chunk", None)
        bw = cfg.link.bandwidth_bps or 1e8  # shaping is in the run's configuration
        per_rank = {"adamw": 1e6, "deto-full": 1e6}.get(method, 3.0 * (topk or 1) * 1e6 / 128)
        per_rank = per_rank * 2 / shards  # smaller shards: more of them cross per node
        comm = per_rank * per_node * 8 / bw
        node = rank // per_node
        # Loss falls with the step, faster for FlexDeMo-family methods (so targets are reached at known steps).
        rate = 1.5 if method in ("flexdemo", "demo") else 1.0
        history = [{"step": s, "epoch": 0, "tokens": 100 * s, "train_time_s": (0.1 + comm) * s, "wall_s": 0.5 * s,
                    "val_loss": 5.0 - rate * s / steps} for s in range(0, steps + 1, max(1, steps // 3))]
        summary = {
            "rank": rank, "node": node, "method": method, "topk": topk, "chunk": chunk, "shards": shards,
            "nodes": world // per_node, "ranks_per_node": per_node, "replicas": world // shards,
            "steps": steps, "model": cfg.model.name, "num_params": 1234, "status": "ok", "batch_size": 8,
            "hp": {"lr": 0.001, "topk": topk, "chunk": chunk},
            "step_time_s": 0.1 + comm, "compute_time_s": 0.1, "comm_time_s": comm,
            "inter_node_bytes_per_step": per_rank, "node_inter_node_bytes_per_step": per_rank * per_node,
            "link_ops": {"all_gather": {"count": steps, "bytes": int(per_rank * steps),
                                        "inter_node_bytes": int(per_rank * steps), "largest_group": world // shards}},
            "peak_rss_mb": 100.0 + rank, "val_loss": history[-1]["val_loss"], "val_history": history,
            "train_time_s": history[-1]["train_time_s"], "tokens": 100 * steps,
            "train_loss": 4.0, "shaping": {"bandwidth_bps": bw, "latency_s": 0.0},
            "start_step": 0, "data": "fake", "grad_accum": 1, "precision": "fp32", "activation_checkpointing": False,
            "memory": {}, "exposed_comm_time_s": comm, "sync_time_s": None, "outer_steps": None,
            "wall_time_s": 1.0, "config": {},
        }
        out.mkdir(parents=True, exist_ok=True)
        RunSummary(**summary).write(out)  # the trainer's schema: a missing field fails here
        if rank == 0:
            with open(out / "metrics.jsonl", "w") as f:
                for point in history:
                    f.write(json.dumps({"type": "val", **point}) + "\\n")
        return 0

    if __name__ == "__main__":
        sys.exit(main(sys.argv[1:], os.environ))
    """
)


@pytest.fixture()
def fake_trainer(tmp_path: Path) -> Path:
    path = tmp_path / "fake_trainer.py"
    path.write_text(FAKE_TRAINER)
    return path


def _load_fake(path: Path):
    namespace: dict = {"__name__": "fake_trainer"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["main"]


def in_process_launcher(fake_main, calls: list):
    """A stand-in for launch_nodes: runs the fake trainer's main for every rank, in this process."""

    def launch(*, num_nodes, ranks_per_node, module_args, env, net, timeout_s, log_dir, **entry):
        calls.append(list(module_args))
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        world = num_nodes * ranks_per_node
        rcs = []
        for node in range(num_nodes):
            rc = 0
            for local in range(ranks_per_node):
                rank_env = {**os.environ, **env, "RANK": str(node * ranks_per_node + local),
                            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(ranks_per_node)}  # fmt: skip
                rc = rc or fake_main(list(module_args), rank_env)
            rcs.append(rc)
        logs = [Path(log_dir) / f"node{i}.log" for i in range(num_nodes)]
        for p in logs:
            p.write_text("fake log\n")
        ok = all(rc == 0 for rc in rcs)
        return SimpleNamespace(
            ok=ok, wall_time_s=0.01, returncodes=rcs, log_paths=logs, timed_out=False, killed=[False] * num_nodes,
            failure_message=lambda: "" if ok else f"node 0: exit status 1; last lines:\nfake failure {rcs}",
        )  # fmt: skip

    return launch


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


# ------------------------------------------------------------------------------------ method specs


def test_method_spec_parsing() -> None:
    from lowband.train.methods import method_config

    spec = parse_method_spec("flexdemo:topk=8,chunk=64")
    assert spec.name == "flexdemo" and spec.given_values() == {"topk": 8, "chunk": 64}
    assert spec.hp == method_config("flexdemo", {"topk": 8, "chunk": 64})  # typed, checked: the trainer's config
    assert str(spec) == "flexdemo:topk=8,chunk=64"
    assert parse_method_spec(" AdamW ").name == "adamw"
    noloco = parse_method_spec("noloco:H=10,n=2,alpha=0.5")
    # Aliases resolve to the config's field names; the spec prints with the aliases.
    assert noloco.given_values() == {"sync_every": 10, "group_size": 2, "alpha": 0.5}
    assert str(noloco) == "noloco:H=10,n=2,alpha=0.5"
    assert parse_method_spec("diloco:sync_every=10,clip=none").given_values() == {"sync_every": 10,
                                                                               "max_grad_norm": None}
    assert parse_method_spec("deto-full:sign=false").given_values() == {"sign": False}
    # Commas separate specs and a spec's keys alike: key=value pieces belong to the spec before them.
    specs = parse_method_list("adamw,flexdemo:topk=8,chunk=64,demo")
    assert [str(s) for s in specs] == ["adamw", "flexdemo:topk=8,chunk=64", "demo"]
    assert [str(s) for s in parse_method_list(["adamw", "noloco:H=10,n=2"])] == ["adamw", "noloco:H=10,n=2"]
    for bad, words in [
        ("flexdemo:topk=eight", ["topk", "integer"]),
        ("flexdemo:topk=256", ["topk=256", "chunk=128"]),
        ("flexdemo:topk=8,topk=1", ["twice"]),
        ("flexdemo:topk", ["key=value", "chunk"]),
        ("flexdemo:values=int4", ["bf16", "fp32", "sign"]),
        ("demo:shards=2", ["shards", "flexdemo:shards"]),
        ("diloco:lr=0", ["lr", "> 0"]),
        ("diloco:H=5,sync_every=6", ["twice"]),
        ("adamw:nonfinite=maybe", ["raise", "skip"]),
    ]:
        with pytest.raises(ValueError) as err:
            parse_method_spec(bad)
        assert all(w in str(err.value) for w in words), (bad, str(err.value))


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


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--methods", "adamw,sgd"], ["'sgd'", "adamw", "deto-full", "demo", "flexdemo", "diloco", "noloco"]),
        (["--methods", "flexdemo:topk=8,rank=3"], ["'rank'", "topk", "chunk", "decay"]),
        (["--bandwidth", "100mbit,fast"], ["'fast'", "mbit", "gbit"]),
        (["--model", "t5-huge"], ["'t5-huge'", "t5-tiny", "t5-small", "gpt-small"]),
        (["--data", "/nonexistent/train.jsonl"], ["/nonexistent/train.jsonl", ".jsonl", ".csv"]),
        (["--shards", "3"], ["shards=3", "accepted: 1, 2"]),
        (["--latency", "soon"], ["'soon'", "20ms"]),
        (["--steps", "0"], ["steps=0"]),
    ],
)
def test_bad_input_is_named_before_anything_starts(
    argv: list[str], words: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a process or network was started despite bad input")

    monkeypatch.setattr(runner, "launch_nodes", forbidden)
    monkeypatch.setattr(runner, "EmulatedNetwork", forbidden)
    monkeypatch.setattr(runner, "netns_available", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    out = tmp_path / "bench"
    rc = bench.main(_bench_args(*argv, "--out", str(out), "--emulation", "auto"))
    err = capsys.readouterr().err
    assert rc == 2
    assert all(w in err for w in words), err
    assert not out.exists()


# ------------------------------------------------------------------------------------ aggregation


def test_aggregation_of_rank_summaries(tmp_path: Path, fake_trainer: Path) -> None:
    fake = _load_fake(fake_trainer)
    for rank in range(4):
        env = {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
        argv = ["train", "--method", "flexdemo", "--topk", "8", "--chunk", "128", "--shards", "2",
                "--model", "m", "--steps", "6", "--out", str(tmp_path), "--link-bandwidth", "1e8"]  # fmt: skip
        assert fake(argv, env) == 0
    summaries = read_summaries(tmp_path, 4)
    summaries[3].inter_node_bytes_per_step = 500.0  # node 1's ranks differ: per-node sums
    summaries[2].inter_node_bytes_per_step = 100.0
    summaries[1].step_time_s = summaries[0].step_time_s + 0.2
    record = RunRecord(method="flexdemo", nodes=2, ranks_per_node=2, steps=6, status="failed")
    aggregate_run(record, summaries, wire_bytes_by_node=[6000, 12000])
    s0 = summaries[0]
    per_rank = s0.inter_node_bytes_per_step
    assert record.inter_node_bytes_per_step_by_node == [2 * per_rank, 600.0]
    assert record.inter_node_bytes_per_step == pytest.approx((2 * per_rank + 600.0) / 2)
    assert record.step_time_s == pytest.approx(s0.step_time_s + 0.05)
    assert record.measured_wire_bytes_per_step_by_node == [1000.0, 2000.0]
    assert record.measured_wire_bytes_per_step == 1500.0
    assert record.peak_rss_mb == 103.0 and record.peak_rss_mb_by_rank == [100.0, 101.0, 102.0, 103.0]
    assert record.link_ops["all_gather"].count == 4 * 6
    assert record.link_ops["all_gather"].largest_group == 2
    assert record.topk == 8 and record.chunk == 128 and record.shards == 2 and record.replicas == 2
    assert record.hyperparameters == {"lr": 0.001, "topk": 8, "chunk": 128} and record.batch_size == 8
    assert record.val_loss == s0.val_loss
    assert [p["step"] for p in record.val_history] == [p["step"] for p in s0.val_history]
    assert [p["val_loss"] for p in record.val_history] == [p["val_loss"] for p in s0.val_history]
    # Tokens are every rank's: summed over the 4 ranks; the training clock is rank 0's.
    assert [p["tokens"] for p in record.val_history] == [4 * p["tokens"] for p in s0.val_history]
    assert record.tokens == 4 * s0.tokens and record.train_time_s == s0.train_time_s
    assert record.status == "ok" and record.error is None
    assert record.link_effective_bps == pytest.approx(
        record.inter_node_bytes_per_step * 8 / record.comm_time_s
    )
    record = aggregate_run(RunRecord(method="adamw", nodes=2, ranks_per_node=2), summaries)
    assert [h["step"] for h in record.val_history] == [0, 2, 4, 6]
    assert record.topk is None and record.chunk is None
    # A summary that lacks a field the trainer always writes is refused, naming the field and the file.
    path = tmp_path / "summary_rank0.json"
    broken = json.loads(path.read_text())
    del broken["val_history"]
    path.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=r"summary_rank0\.json.*missing val_history"):
        read_summaries(tmp_path, 4)


# ------------------------------------------------------------------------------------ results.json

#: The keys of a run record as results.json has always written them, in order: the file stays the same
#: for the people and tools that read it.
RUN_KEYS = (
    "id", "label", "method", "spec", "params", "hyperparameters", "batch_size", "topk", "chunk", "shards", "nodes",
    "ranks_per_node", "replicas", "model", "steps", "seed", "data", "num_params", "bandwidth_bps", "latency_s",
    "emulation", "status", "error", "wall_time_s", "step_time_s", "compute_time_s", "comm_time_s",
    "exposed_comm_time_s", "sync_time_s", "outer_steps", "inter_node_bytes_per_step",
    "inter_node_bytes_per_step_by_node", "measured_wire_bytes_per_step", "measured_wire_bytes_per_step_by_node",
    "link_effective_bps", "val_loss", "best_val_loss", "train_time_s", "tokens", "steps_to_target",
    "tokens_to_target", "time_to_target_s", "adamw_steps_to_final", "adamw_time_to_final_s", "train_loss",
    "peak_rss_mb", "peak_rss_mb_by_rank", "link_ops", "val_history", "run_dir", "logs", "command", "fault_tolerance",
)  # fmt: skip


def _full_record() -> RunRecord:
    """A run record with every field set (none left None), as a finished FlexDeMo run's would be."""
    return RunRecord(
        id="00-flexdemo-top8-s2-100mbit-seed0", label="FlexDeMo Top8", method="flexdemo", spec="flexdemo:topk=8",
        params={"topk": 8, "shards": 2}, hyperparameters={"lr": 0.001, "topk": 8, "chunk": 128}, batch_size=8,
        topk=8, chunk=128, shards=2, nodes=2, ranks_per_node=2, replicas=2, model="t5-tiny", steps=6, seed=0,
        data="fake", num_params=1234, bandwidth_bps=1e8, latency_s=0.005, emulation="netns", status="ok",
        error="none really", wall_time_s=12.5, step_time_s=0.13, compute_time_s=0.1, comm_time_s=0.03,
        exposed_comm_time_s=0.03, sync_time_s=0.5, outer_steps=3, inter_node_bytes_per_step=375000.0,
        inter_node_bytes_per_step_by_node=[375000.0, 375000.0], measured_wire_bytes_per_step=400000.0,
        measured_wire_bytes_per_step_by_node=[390000.0, 410000.0], link_effective_bps=1e8, val_loss=3.5,
        best_val_loss=3.4, train_time_s=0.8, tokens=2400, steps_to_target=4.5, tokens_to_target=1800.0,
        time_to_target_s=0.6, adamw_steps_to_final=5.0, adamw_time_to_final_s=0.7, train_loss=4.0,
        peak_rss_mb=103.0, peak_rss_mb_by_rank=[100.0, 101.0, 102.0, 103.0],
        link_ops={"all_gather": OpTally(count=24, bytes=4500000, inter_node_bytes=4500000, largest_group=2)},
        val_history=[{"step": 0, "epoch": 0, "tokens": 0, "train_time_s": 0.0, "wall_s": 0.0, "val_loss": 5.0},
                     {"step": 6, "epoch": 0, "tokens": 2400, "train_time_s": 0.8, "wall_s": 3.0, "val_loss": 3.5}],
        run_dir="runs/00-flexdemo-top8-s2-100mbit-seed0", logs=["runs/00/logs/node0.log", "runs/00/logs/node1.log"],
        command=["train", "--method", "flexdemo"], fault_tolerance={"faults": [], "notes": []},
    )  # fmt: skip


def _results(runs: list[RunRecord], version: int = SCHEMA_VERSION) -> dict:
    return {"schema_version": version, "created": "2026-01-01T00:00:00+00:00", "finished": None,
            "interrupted": False, "command": None, "host": {}, "config": {}, "emulation": {}, "runs": runs}  # fmt: skip


def test_a_run_record_round_trips_through_results_json_with_the_same_keys_in_the_same_order(tmp_path: Path) -> None:
    record = _full_record()
    assert all(getattr(record, key) is not None for key in RunRecord.field_names())
    assert RunRecord.field_names() == RUN_KEYS
    path = write_results(tmp_path, _results([record, RunRecord(id="empty", status="failed")]))
    written = json.loads(path.read_text())
    assert written["schema_version"] == 3 and tuple(written["runs"][0]) == RUN_KEYS
    assert written["runs"][0]["link_ops"] == {"all_gather": {"count": 24, "bytes": 4500000,
                                                            "inter_node_bytes": 4500000, "largest_group": 2}}
    assert tuple(written["runs"][1]) == RUN_KEYS and written["runs"][1]["val_loss"] is None  # null unless given
    loaded = load_results(tmp_path)
    assert loaded["runs"] == [record, RunRecord(id="empty", status="failed")]
    assert isinstance(loaded["runs"][0].link_ops["all_gather"], OpTally)
    assert RunRecord.from_dict(record.to_dict()) == record


def test_a_run_record_with_a_key_it_does_not_know_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not run-record fields: val_los, zzz"):
        RunRecord.from_dict({"id": "a", "val_los": 3.0, "zzz": 1})
    with pytest.raises(TypeError):
        RunRecord(val_los=3.0)  # a misspelt field is an error when built, too
    record = RunRecord(id="a")
    with pytest.raises(AttributeError):
        record.val_los = 3.0  # and when set: the record has slots, no attribute appears on the side
    data = _results([{**_full_record().to_dict(), "extra": 1}])
    (tmp_path / "results.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"results\.json: run 0 \(00-flexdemo-top8-s2-100mbit-seed0\) .*: extra"):
        load_results(tmp_path)


def test_a_results_json_of_another_schema_version_is_refused_saying_to_rerun_the_bench(tmp_path: Path, capsys) -> None:
    old = _results([], version=2)
    old["runs"] = [_full_record().to_dict()]  # version 2 had these very keys: the version decides
    path = tmp_path / "results.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError) as info:
        load_results(tmp_path)
    message = str(info.value)
    assert str(path) in message and "schema_version 2" in message and "schema_version 3" in message
    assert "Re-run the bench" in message
    parser = argparse.ArgumentParser()
    bench.add_report_arguments(parser)
    assert bench.report_main(parser.parse_args([str(tmp_path)])) == 2  # `lowband report` says so and stops
    assert "Re-run the bench" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ report and plots


def test_report_tables_and_plots(tmp_path: Path, fake_trainer: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    calls: list = []
    monkeypatch.setattr(runner, "launch_nodes", in_process_launcher(_load_fake(fake_trainer), calls))
    out = tmp_path / "bench"
    argv = ["--methods", "adamw", "deto-full", "flexdemo:topk=1", "flexdemo:topk=8", "--bandwidth", "100mbit,1gbit",
            "--shards", "1,2", "--steps", "6", "--model", "t5-tiny", "--emulation", "shaped", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert bench.main(_bench_args(*argv)) == 0
    stdout = capsys.readouterr().out
    assert "shaped in-process, not measured" in stdout and "FlexDeMo Top8" in stdout
    assert len(calls) == 14
    # Each run's ranks read its whole configuration from the run's config.toml, shaping included
    # (nothing reaches the trainer through the environment, nor as a flag but where it writes).
    import tomllib

    assert all(c[:2] == ["train", "--config"] and c[3] == "--out" and len(c) == 5 for c in calls)
    jobs = [tomllib.loads(Path(c[2]).read_text()) for c in calls]
    assert {j["link"]["bandwidth_bps"] for j in jobs} == {1e8, 1e9} and {j["link"]["latency_s"] for j in jobs} == {0}
    assert all(Path(c[2]).parent == Path(c[4]) for c in calls)  # in the run's directory, which re-runs it
    results = load_results(out)
    assert results["schema_version"] == SCHEMA_VERSION and results["emulation"]["mode"] == "shaped"
    assert results["finished"] is not None and results["interrupted"] is False and len(results["runs"]) == 14
    assert [link["measured_throughput_bps"] for link in results["emulation"]["links"]] == [None, None]
    run = next(r for r in results["runs"]
               if r.method == "flexdemo" and r.topk == 8 and r.shards == 2 and r.bandwidth_bps == 1e8)
    # A RunRecord has every field in every record, so presence says nothing: check that the values
    # the fake trainer wrote for this run (2 × 2, 6 steps, 187,500 B per rank at 100 Mbit/s) arrived.
    assert (run.status, run.error, run.nodes, run.chunk, run.replicas) == ("ok", None, 2, 128, 2)
    assert run.compute_time_s == pytest.approx(0.1)
    assert run.comm_time_s == pytest.approx(187_500 * 2 * 8 / 1e8)  # the node's ranks share the uplink
    assert run.step_time_s == pytest.approx(0.1 + 187_500 * 2 * 8 / 1e8)
    assert run.val_loss == 5.0 - 1.5 and [h["step"] for h in run.val_history] == [0, 2, 4, 6]
    assert run.peak_rss_mb == 103.0 and run.link_ops["all_gather"].count == 4 * 6
    assert run.emulation == "shaped" and run.measured_wire_bytes_per_step is None
    assert run.inter_node_bytes_per_step == pytest.approx(2 * 3.0 * 8 * 1e6 / 128)

    headers, rows = table1(results)
    assert headers[0] == "Link" and [r[0] for r in rows] == ["100 Mbit/s", "1 Gbit/s"]
    assert {"AdamW", "Deto-Full S=1", "Deto-Full S=2", "DeMo Top1", "FlexDeMo Top1", "DeMo Top8",
            "FlexDeMo Top8"} == set(headers[1:])  # fmt: skip
    tables = table2(results)
    assert [bw for bw, _, _ in tables] == [1e8, 1e9]
    _, headers2, rows2 = tables[0]
    assert headers2 == ["", "Shards", "Deto-Full", "Top1", "Top8"]
    assert [r[:2] for r in rows2] == [["DeMo", "1"], ["FlexDeMo", "2"]]
    assert all(cell != "-" for r in rows2 for cell in r)

    report = (out / "report.md").read_text()
    assert "## Table 1" in report and "## Table 2" in report
    assert "| Link | " in report and "| 100 Mbit/s |" in report and "| 1 Gbit/s |" in report
    assert "|  | Shards | Deto-Full | Top1 | Top8 |" in report
    assert "| DeMo | 1 |" in report and "| FlexDeMo | 2 |" in report
    for name in PLOT_FILES:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert f"]({name})" in report
    import matplotlib.image

    assert matplotlib.image.imread(out / PLOT_FILES[2]).ndim == 3

    # `lowband report` re-renders from results.json alone.
    (out / "report.md").unlink()
    for name in PLOT_FILES:
        (out / name).unlink()
    parser = argparse.ArgumentParser()
    bench.add_report_arguments(parser)
    assert bench.report_main(parser.parse_args([str(out)])) == 0
    assert (out / "report.md").read_text().split("\n", 1)[1] == report.split("\n", 1)[1]
    assert all((out / name).read_bytes()[:8] == PNG_MAGIC for name in PLOT_FILES)
    assert bench.report_main(parser.parse_args([str(tmp_path / "nowhere")])) == 2


# ------------------------------------------------------------------------------------ real launches


@pytest.mark.multiprocess
def test_failed_run_is_recorded_and_the_others_run(
    tmp_path: Path, fake_trainer: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Under real torchrun (loopback, shaped): adamw's trainer exits 1, FlexDeMo succeeds."""
    monkeypatch.setenv("FAKE_FAIL_METHODS", "adamw")
    out = tmp_path / "bench"
    argv = ["--methods", "adamw,flexdemo:topk=8", "--steps", "4", "--model", "t5-tiny", "--emulation", "shaped",
            "--entry", str(fake_trainer), "--out", str(out), "--no-progress", "--latency", "5ms"]  # fmt: skip
    assert bench.main(_bench_args(*argv)) == 1
    assert "00-adamw-s2-100mbit-seed0 failed: RuntimeError: fake trainer: adamw blew up on purpose" in capsys.readouterr().out
    results = load_results(out)
    failed, ok = results["runs"]
    assert failed.method == "adamw" and failed.status == "failed"
    assert "blew up on purpose" in failed.error and "node 0: exit status 1" in failed.error
    assert "ChildFailedError" not in failed.error  # torchrun's own report is condensed
    assert failed.step_time_s is None
    assert ok.method == "flexdemo" and ok.status == "ok" and ok.error is None
    assert ok.step_time_s > 0 and ok.val_loss is not None and ok.latency_s == 0.005
    assert (out / ok.logs[0]).is_file()
    report = (out / "report.md").read_text()
    assert "## Failed runs" in report and "blew up on purpose" in report


@pytest.mark.multiprocess
@pytest.mark.netns
def test_netns_mode_measures_the_link(tmp_path: Path, fake_trainer: Path) -> None:
    out = tmp_path / "bench"
    argv = ["--methods", "flexdemo:topk=8", "--steps", "4", "--model", "t5-tiny", "--emulation", "netns",
            "--bandwidth", "100mbit", "--entry", str(fake_trainer), "--out", str(out), "--no-progress"]  # fmt: skip
    assert bench.main(_bench_args(*argv)) == 0
    results = load_results(out)
    assert results["emulation"]["mode"] == "netns"
    (link,) = results["emulation"]["links"]
    assert 80e6 < link["measured_throughput_bps"] < 101e6
    (run,) = results["runs"]
    assert run.emulation == "netns" and run.status == "ok"
    # The rendezvous alone crosses the link: the wire counter sees it.
    assert run.measured_wire_bytes_per_step > 0 and len(run.measured_wire_bytes_per_step_by_node) == 2
    assert "measured" in (out / "report.md").read_text()


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                pids.append(int(entry))
    return pids


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "mode, signum",
    [
        pytest.param("netns", signal.SIGINT, marks=pytest.mark.netns),
        ("shaped", signal.SIGTERM),
    ],
)
def test_interrupt_leaves_nothing_behind(tmp_path: Path, fake_trainer: Path, mode: str, signum: int) -> None:
    """Ctrl-C (netns) or SIGTERM (shaped) while a run hangs: no namespace or process is left behind,
    results.json says interrupted, and the report is written."""
    out = tmp_path / "bench"
    env = {**os.environ, "FAKE_HANG_METHODS": "flexdemo"}
    argv = [sys.executable, "-m", "lowband", "bench", "--methods", "flexdemo,adamw", "--steps", "3", "--model",
            "t5-tiny", "--emulation", mode, "--entry", str(fake_trainer), "--out", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=default_sigint)
    try:
        started = out / "runs" / "00-flexdemo-top1-s2-100mbit-seed0" / "started-3"
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the hanging run never started"
            time.sleep(0.1)
        proc.send_signal(signum)
        output = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (130 if signum == signal.SIGINT else 128 + signum), output
    assert not [n for n in list_namespaces() if n.startswith(f"lb-{proc.pid}-")]
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(fake_trainer)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(str(fake_trainer)) == []
    results = load_results(out)
    assert results["interrupted"] is True and results["finished"] is not None
    (run,) = results["runs"]  # adamw never started
    assert run.method == "flexdemo" and run.status == "failed" and "interrupted" in run.error
    assert (out / "report.md").is_file()


def test_methods_registry_is_listed_in_help() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    text = parser.format_help()
    assert all(name in text for name in METHODS)
