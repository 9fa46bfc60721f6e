"""``lowband bench --ft/--faults`` without processes: the plan syntax, the runs it plans, the report rows."""

from __future__ import annotations

import importlib.util

import pytest

from lowband.bench.config import make_config, plan_runs
from lowband.bench.faults import FaultEvent, parse_faults
from lowband.bench.ft_report import cost_rows, fault_events, fault_rows, ft_section
from lowband.bench.record import RunRecord

HAS_TORCHFT = importlib.util.find_spec("torchft") is not None


def test_fault_plan_parses_steps_and_times():
    plan = parse_faults("node1:kill@30, node1:start@60,node2:kill@90s", nodes=3, steps=100)
    assert plan == (FaultEvent(node=1, action="kill", step=30), FaultEvent(node=1, action="start", step=60),
                    FaultEvent(node=2, action="kill", at_s=90.0))
    assert str(plan[2]) == "node2:kill@90s"
    assert parse_faults("node0:kill@1.5m", nodes=2)[0].at_s == 90.0


@pytest.mark.parametrize("text, needle", [
    ("node1:explode@3", "cannot read"),
    ("node3:kill@3", "names node 3, but the bench has nodes 0..2"),
    ("node1:start@3", "starts node 1, which is running"),
    ("node1:kill@3,node1:kill@5", "kills node 1, which is not running"),
    ("node0:kill@3,node1:kill@4,node2:kill@5", "would kill the last live node"),
    ("node1:kill@300", "runs have 100 steps"),
    ("node1:kill@30,node1:start@10", "list events in the order"),
    ("node1:kill@2.5", "a step is a whole number"),
    ("", "no event given"),
])
def test_bad_fault_plans_are_named(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_faults(text, nodes=3, steps=100)


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft not installed")
def test_faults_plan_a_fault_free_twin_and_ft_both_plans_off_and_on():
    cfg = make_config(methods="flexdemo:topk=1,adamw", steps=50, model="t5-tiny", nodes=3,
                      faults="node2:kill@10,node2:start@20")
    plans = plan_runs(cfg)
    assert [(p.label, p.ft, bool(p.faults)) for p in plans] == [
        ("FlexDeMo Top1 FT", True, False), ("FlexDeMo Top1 FT faults", True, True),
        ("AdamW FT", True, False), ("AdamW FT faults", True, True)]
    both = plan_runs(make_config(methods="adamw", steps=50, model="t5-tiny", ft="both"))
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
        make_config(steps=50, model="t5-tiny", **kwargs)


def _run(label, *, faults=None, loss, seed=0, step_time=0.1, bytes_=1e5, ft=None):
    return RunRecord(label=label, method="flexdemo", shards=2, seed=seed, bandwidth_bps=1e8, status="ok",
                     val_loss=loss, step_time_s=step_time, inter_node_bytes_per_step=bytes_, nodes=3,
                     val_history=[{"step": 0, "val_loss": 9.0}, {"step": 50, "val_loss": loss}],
                     fault_tolerance=ft if ft is not None else ({"faults": faults} if faults else None))


def _faulted_ft():
    t_kill, t_start = 1000.0, 1020.0
    return {
        "faults": ["node2:kill@10", "node2:start@20"], "steady_node": 0,
        "events": [
            {"event": "start", "node": 0, "unix_s": 990.0},
            {"event": "kill", "node": 2, "unix_s": t_kill, "planned": "node2:kill@10", "job_step": 10, "t_s": 10.0},
            {"event": "start", "node": 2, "unix_s": t_start, "planned": "node2:start@20", "job_step": 20, "t_s": 30.0},
        ],
        "nodes": {
            "0": {"membership": [{"step": 11, "replicas": 2, "was": 3, "quorum_s": 1.1, "unix_s": t_kill + 1.3}],
                  "replicas_by_step": [[10, 3, False], [11, 3, True], [12, 2, False]],
                  "end": {"dropped_steps": 1, "healed": []}},
            "2": {"membership": [], "replicas_by_step": [],
                  "end": {"dropped_steps": 0,
                          "healed": [{"step": 35, "unix_s": t_start + 15.0, "bytes": 2_500_000, "quorum_s": 0.2}]}},
        },
    }


def test_fault_report_rows_set_a_faulted_run_beside_its_twin():
    runs = [_run("FlexDeMo Top1 FT", loss=7.00, ft={"faults": []}),
            _run("FlexDeMo Top1 FT faults", loss=7.05, ft=_faulted_ft())]
    results = {"runs": runs}
    evs = fault_events(runs[1])
    assert evs[0]["detect_s"] == pytest.approx(1.3) and evs[0]["resumed_step"] == 11
    assert evs[1]["healed_step"] == 35 and evs[1]["heal_mb"] == pytest.approx(2.5)
    headers, rows = fault_rows(results)
    (row,) = rows
    assert row[3] == "1"  # steps dropped
    assert "node2:kill@10: 1.30" in row[4] and "node2:start@20: 35, 2.50, 0.20" in row[5]
    assert row[6:9] == ["7.0500", "7.0000", "+0.0500"]
    assert row[9] == "one seed: unknown"  # no claim about a spread that was not measured
    assert any("## Faults" in line for line in ft_section(results))


def test_cost_rows_compare_ft_on_with_off_side_by_side():
    runs = [_run("AdamW", loss=7.0, step_time=0.20, bytes_=2e6),
            _run("AdamW FT", loss=7.0, step_time=0.21, bytes_=2e6, ft={"faults": []})]
    headers, rows = cost_rows({"runs": runs})
    assert rows == [["AdamW", "0", "100 Mbit/s", "0.200", "0.210", "1.050", "2.0000", "2.0000", "1.000"]]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [pytest.param("netns", marks=pytest.mark.netns), "shaped"])
@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft not installed")
def test_bench_with_faults_end_to_end(tmp_path, mode):
    """The real thing, small: 3 nodes x 1 rank, FlexDeMo, node 2 killed and restarted; twin beside it."""
    import argparse
    import json

    from lowband import bench
    from lowband.bench.results import load_results

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench"
    args = parser.parse_args([
        # 100 ms per message makes a step take ~0.2 s, so the restarted node (~15 s to start) rejoins a live job.
        "--methods", "flexdemo:topk=2", "--steps", "200", "--model", "t5-tiny", "--nodes", "3", "--latency", "100ms",
        "--ranks-per-node", "1", "--bandwidth", "1gbit", "--emulation", mode, "--out", str(out), "--no-progress",
        "--faults", "node2:kill@15,node2:start@30",
        "--train-args", "--max-examples 1500 --val-size 64 --vocab-size 512 --batch-size 4 --val-batches 2 "
                        "--val-every 20"])
    assert bench.main(args) == 0, (out / "report.md").read_text() if (out / "report.md").exists() else ""
    results = load_results(out)
    twin, faulted = results["runs"]
    assert twin.label == "DeMo Top2 FT" and faulted.label == "DeMo Top2 FT faults"  # one rank per node
    assert twin.status == faulted.status == "ok"
    ft = faulted.fault_tolerance
    assert [e["planned"] for e in ft["events"] if e.get("planned")] == ["node2:kill@15", "node2:start@30"]
    steady = ft["nodes"]["0"]
    seen = [m["replicas"] for m in steady["membership"]]
    assert 2 in seen and seen[-1] == 3, seen  # 3 -> 2 -> 3
    assert steady["end"]["dropped_steps"] <= 1
    healed = ft["nodes"]["2"]["end"]["healed"]
    assert healed and healed[-1]["bytes"] > 0
    report = (out / "report.md").read_text()
    assert "## Faults: each faulted run beside its fault-free twin" in report
    assert (out / "faults.png").is_file()
    json.dumps(json.loads((out / "results.json").read_text()))  # plain JSON as written
