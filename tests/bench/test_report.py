"""lowband/bench/report.py (and plots.py): ``lowband report``'s tables, markdown and plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import lowband.bench as bench
import lowband.bench.runner as runner
from lowband.bench.plots import PLOT_FILES
from lowband.bench.report import table1, table2
from lowband.bench.results import SCHEMA_VERSION, load_results
from tests.bench.fake_trainer import bench_args, in_process_launcher, load_fake

pytestmark = pytest.mark.timeout(120)


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_tables_and_plots(tmp_path: Path, fake_trainer: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    calls: list = []
    monkeypatch.setattr(runner, "launch_nodes", in_process_launcher(load_fake(fake_trainer), calls))
    out = tmp_path / "bench"
    argv = ["--methods", "adamw", "deto-full", "flexdemo:topk=1", "flexdemo:topk=8", "--bandwidth", "100mbit,1gbit",
            "--shards", "1,2", "--steps", "6", "--model", "t5-tiny", "--emulation", "shaped", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert bench.main(bench_args(*argv)) == 0
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
