"""lowband/bench/results.py and record.py: rank summaries aggregate to one run record; results.json round-trips and refuses what it does not know."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import lowband.commands.report as report_cmd
from lowband.bench.record import RunRecord
from lowband.bench.results import SCHEMA_VERSION, aggregate_run, load_results, read_summaries, write_results
from lowband.comm.traffic import OpTally
from tests.bench.fake_trainer import load_fake

pytestmark = pytest.mark.timeout(120)


def test_aggregation_of_rank_summaries(tmp_path: Path, fake_trainer: Path) -> None:
    fake = load_fake(fake_trainer)
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


#: The keys of a run record as results.json has always written them, in order: the file stays the same
#: for the people and tools that read it.
RUN_KEYS = (
    "id", "label", "method", "spec", "params", "hyperparameters", "batch_size", "topk", "chunk", "shards", "nodes",
    "ranks_per_node", "replicas", "model", "steps", "time_budget_s", "max_steps", "seed", "data", "num_params", "bandwidth_bps", "latency_s",
    "emulation", "status", "error", "wall_time_s", "step_time_s", "compute_time_s", "comm_time_s",
    "exposed_comm_time_s", "sync_time_s", "outer_steps", "inter_node_bytes_per_step",
    "inter_node_bytes_per_step_by_node", "measured_wire_bytes_per_step", "measured_wire_bytes_per_step_by_node",
    "link_effective_bps", "val_loss", "best_val_loss", "train_time_s", "tokens", "steps_to_target",
    "tokens_to_target", "time_to_target_s", "reference_steps_to_final", "reference_time_to_final_s", "train_loss",
    "peak_rss_mb", "peak_rss_mb_by_rank", "link_ops", "val_history", "run_dir", "logs", "command", "fault_tolerance",
    "screened",
)  # fmt: skip


def _full_record() -> RunRecord:
    """A run record with every field set (none left None), as a finished FlexDeMo run's would be."""
    return RunRecord(
        id="00-flexdemo-top8-s2-100mbit-seed0", label="FlexDeMo Top8", method="flexdemo", spec="flexdemo:topk=8",
        params={"topk": 8, "shards": 2}, hyperparameters={"lr": 0.001, "topk": 8, "chunk": 128}, batch_size=8,
        topk=8, chunk=128, shards=2, nodes=2, ranks_per_node=2, replicas=2, model="t5-tiny", steps=6, time_budget_s=1.5, max_steps=24, seed=0,
        data="fake", num_params=1234, bandwidth_bps=1e8, latency_s=0.005, emulation="netns", status="ok",
        error="none really", wall_time_s=12.5, step_time_s=0.13, compute_time_s=0.1, comm_time_s=0.03,
        exposed_comm_time_s=0.03, sync_time_s=0.5, outer_steps=3, inter_node_bytes_per_step=375000.0,
        inter_node_bytes_per_step_by_node=[375000.0, 375000.0], measured_wire_bytes_per_step=400000.0,
        measured_wire_bytes_per_step_by_node=[390000.0, 410000.0], link_effective_bps=1e8, val_loss=3.5,
        best_val_loss=3.4, train_time_s=0.8, tokens=2400, steps_to_target=4.5, tokens_to_target=1800.0,
        time_to_target_s=0.6, reference_steps_to_final=5.0, reference_time_to_final_s=0.7, train_loss=4.0,
        peak_rss_mb=103.0, peak_rss_mb_by_rank=[100.0, 101.0, 102.0, 103.0],
        link_ops={"all_gather": OpTally(count=24, bytes=4500000, inter_node_bytes=4500000, largest_group=2)},
        val_history=[{"step": 0, "epoch": 0, "tokens": 0, "train_time_s": 0.0, "wall_s": 0.0, "val_loss": 5.0},
                     {"step": 6, "epoch": 0, "tokens": 2400, "train_time_s": 0.8, "wall_s": 3.0, "val_loss": 3.5}],
        run_dir="runs/00-flexdemo-top8-s2-100mbit-seed0", logs=["runs/00/logs/node0.log", "runs/00/logs/node1.log"],
        command=["train", "--method", "flexdemo"], fault_tolerance={"faults": [], "notes": []},
        screened={"bad_messages": {"1": 2}, "clipped": {}, "left_out": {"2": 5}, "evicted": [1],
                  "aggregations": 9},
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
    assert written["schema_version"] == 4 and tuple(written["runs"][0]) == RUN_KEYS
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
    old = _results([], version=3)
    old["runs"] = [_full_record().to_dict()]  # the keys fit: the version decides
    path = tmp_path / "results.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError) as info:
        load_results(tmp_path)
    message = str(info.value)
    assert str(path) in message and "schema_version 3" in message and "schema_version 4" in message
    assert "Re-run the bench" in message
    parser = argparse.ArgumentParser()
    report_cmd.add_arguments(parser)
    assert report_cmd.main(parser.parse_args([str(tmp_path)])) == 2  # `lowband report` says so and stops
    assert "Re-run the bench" in capsys.readouterr().err
