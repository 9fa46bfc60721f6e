"""lowband/report/render.py (and plots.py): ``lowband report``'s tables, markdown and plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import lowband.bench.runner as runner
import lowband.commands.bench as bench
import lowband.commands.report as report_cmd
from lowband.bench import quality
from lowband.bench.results import SCHEMA_VERSION, load_results
from lowband.report.plots import PLOT_FILES
from lowband.report.render import render_markdown, table1, table2
from tests.bench.fake_trainer import bench_args, in_process_launcher, load_fake
from tests.bench.records import run_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
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
    report_cmd.add_arguments(parser)
    assert report_cmd.main(parser.parse_args([str(out)])) == 0
    assert (out / "report.md").read_text().split("\n", 1)[1] == report.split("\n", 1)[1]
    assert all((out / name).read_bytes()[:8] == PNG_MAGIC for name in PLOT_FILES)
    assert report_cmd.main(parser.parse_args([str(tmp_path / "nowhere")])) == 2


def test_a_variant_that_misses_the_target_is_explained_by_loss_and_time_per_step() -> None:
    from lowband.report.render import why_not_reached_notes

    runs = [run_record("adamw", [8.0, 6.0, 5.0], label="AdamW", compute=0.5),
            run_record("flexdemo", [8.0, 6.5, 5.5], label="FlexDeMo Top1", dt=1.0, compute=0.6),
            run_record("diloco", [8.0, 5.5, 4.5], label="DiLoCo H=10", dt=1.0)]
    for r, exposed in zip(runs, (0.7, 0.01, 0.0), strict=True):
        r.exposed_comm_time_s = exposed
    results = quality.annotate_time_to_target({"runs": runs})
    notes = why_not_reached_notes(results)
    assert len(notes) == 1  # DiLoCo reached the target; AdamW is the reference
    assert notes[0].startswith("FlexDeMo Top1 did not reach the target in 20 steps: it ends +0.500")
    assert "computes 0.600 s and waits 0.010 s on the link, against 0.500 s and 0.700 s for AdamW" in notes[0]
    assert "its loss per step is what it lacks" in notes[0]
    assert "FlexDeMo Top1 did not reach" in render_markdown(results)
    # Two seeds each, and the variant's range overlaps AdamW's: it misses the mean by seed noise.
    runs = [run_record("adamw", [8.0, 6.0, 5.0], seed=0, label="AdamW"), run_record("adamw", [8.0, 6.0, 5.4], seed=1, label="AdamW"),
            run_record("flexdemo", [8.0, 6.0, 5.3], seed=0, label="Top8"), run_record("flexdemo", [8.0, 6.2, 5.5], seed=1, label="Top8")]
    notes = why_not_reached_notes(quality.annotate_time_to_target({"runs": runs}))
    assert len(notes) == 1 and notes[0].startswith("Top8 did not reach the target in 20 steps: it ends +0.200")
    assert "within the seed spread, so it misses the target (a mean over seeds) by seed noise" in notes[0]
    assert "what it lacks" not in notes[0]


def test_overlapping_and_compressed_variants_are_set_beside_their_plain_twin() -> None:
    from lowband.report.render import hiding_rows
    from lowband.train.methods import METHODS

    def local(label, losses, seed, nbytes, sync, **hiding):
        run = run_record("diloco", losses, seed=seed, label=label, nbytes=nbytes, params={"lr": 3e-3, **hiding})
        run.hyperparameters = {**METHODS["diloco"].hyperparameters, "lr": 3e-3, "sync_every": 20, **hiding}
        run.sync_time_s = sync
        return run

    runs = [local("DiLoCo", [8, 6, 5.00], 0, 8e5, 0.7), local("DiLoCo", [8, 6, 5.10], 1, 8e5, 0.8),
            local("DiLoCo overlap", [8, 6, 5.05], 0, 8e5, 0.001, overlap=True),
            local("DiLoCo overlap", [8, 6, 5.08], 1, 8e5, 0.003, overlap=True),
            local("DiLoCo int8", [8, 6, 5.30], 0, 2e5, 0.5, values="int8", quant_block=128),
            local("DiLoCo int8", [8, 6, 5.40], 1, 2e5, 0.5, values="int8", quant_block=128)]
    # A compressed variant at another lr has no plain twin in this bench: it is left out.
    other_lr = local("DiLoCo int4 lr", [8, 6, 5.2], 0, 1e5, 0.4, values="int4")
    other_lr.hyperparameters["lr"] = 1e-2
    vs = quality.variants([*runs, other_lr])
    assert quality.plain_variant(vs[0], vs) is None  # the plain one itself
    assert quality.plain_variant(vs[1], vs) is vs[0] and quality.plain_variant(vs[2], vs) is vs[0]
    assert quality.plain_variant(vs[3], vs) is None
    headers, rows = hiding_rows({"runs": [*runs, other_lr]})
    row = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    assert set(row) == {"DiLoCo overlap", "DiLoCo int8"}
    assert row["DiLoCo overlap"]["Δ loss"] == "+0.015 (within the seed spread)"
    assert row["DiLoCo int8"]["Δ loss"] == "+0.300 (worse, beyond the seed spread)"
    assert row["DiLoCo overlap"]["exposed s per exchange (this / plain)"] == "0.002 / 0.750"
    assert row["DiLoCo int8"]["plain bytes ÷ this"] == "4.00×"
    assert "## Hiding and compressing the link" in render_markdown({"runs": runs, "config": {}, "host": {},
                                                                    "emulation": {}})  # fmt: skip


def _config(*argv: str) -> dict:
    return bench.config_from_args(bench_args(*argv)).as_dict()


def _head(cfg: dict) -> str:
    """The report's set-up part: everything before the first section."""
    return render_markdown({"config": cfg, "host": {}, "emulation": {}, "runs": []}).split("No run was recorded")[0]


def test_the_report_describes_the_data_and_model_that_ran_not_the_presets(tmp_path) -> None:
    data = tmp_path / "my_texts.txt"
    data.write_text("one text\nanother text\n")
    head = _head(_config("--preset", "quality", "--data", str(data), "--model", "gpt-mini"))
    assert "Model gpt-mini on `my_texts.txt`, blocks of 128 packed tokens, 140 steps, seeds 0, 1" in head
    assert "from the preset: methods, link, steps, seeds, train args" in head
    assert "overridden on the command line: model gpt-mini (preset: t5-mini); data `my_texts.txt` " \
           "(preset: the embedded corpus)" in head
    # Nothing that holds only for the embedded data and t5-mini, and no "best lr" claim.
    for embedded_only in ("6.84", "unigram", "Wikipedia pairs (64/16 tokens), 140", "at its best lr from"):
        assert embedded_only not in head
    # The preset as it is: its description and the embedded data's facts.
    head = _head(_config("--preset", "quality"))
    assert "Model t5-mini on the embedded corpus, 64 source / 16 target tokens, 140 steps" in head
    assert "Preset `quality`, as it is:" in head and "unigram cross-entropy is 6.84 nats" in head
    # Other settings overridden, same data and model: the overrides are named, the data's facts still hold.
    head = _head(_config("--preset", "quality", "--steps", "60", "--train-args=--val-every 7"))
    assert "overridden on the command line: steps 60 (preset: 140); train args --val-every 7 added" in head
    assert "6.84 nats" in head and "as it is" not in head
    # Other target lengths: the unigram figure of 16 target tokens no longer holds.
    assert "6.84" not in _head(_config("--preset", "quality", "--train-args=--max-target-len 32"))
    # No preset: no preset text at all.
    head = _head(_config("--steps", "5", "--model", "t5-tiny", "--methods", "adamw"))
    assert "Preset" not in head and "Model t5-tiny on the embedded corpus, 128 source / 32 target tokens" in head


def test_the_lr_caveat_appears_exactly_when_data_or_model_differ_from_the_tuning_ones(tmp_path) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"source": "a b", "target": "a"}\n')
    caveat = "The preset's lrs were tuned on t5-mini on the embedded Wikipedia pairs"
    for argv, expected in ((("--preset", "quality"), False),
                           (("--preset", "quality", "--steps", "60", "--seeds", "3"), False),
                           (("--preset", "quality", "--data", str(data)), True),
                           (("--preset", "quality", "--model", "t5-tiny"), True),
                           (("--preset", "quality", "--model", "gpt-mini", "--data", str(data.with_suffix(".txt"))), True)):
        if argv[-1].endswith(".txt"):
            data.with_suffix(".txt").write_text("a b\n")
        head = _head(_config(*argv))
        assert (caveat in head) is expected, argv
        if expected:
            assert "not on this run's" in head and "adamw:lr=0.001 adamw:lr=0.003" in head
    # Methods of the user's own (their own lrs): the preset's tuning says nothing about them.
    assert caveat not in _head(_config("--preset", "quality", "--model", "t5-tiny", "--methods", "adamw:lr=0.01"))
