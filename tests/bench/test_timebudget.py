"""lowband/bench/timebudget.py: --time-budget (equal training time) in the bench, with the fake trainer."""

from __future__ import annotations

from pathlib import Path

import pytest

import lowband.bench.runner as runner
import lowband.commands.bench as bench
from lowband.bench.results import load_results
from lowband.bench.timebudget import AUTO, STEP_CAP_FACTOR
from tests.bench.fake_trainer import bench_args, in_process_launcher, load_fake


def _config(*argv: str):
    return bench.config_from_args(bench_args(*argv))


def test_a_plain_bench_runs_at_equal_time_and_a_preset_or_a_bench_without_the_reference_does_not() -> None:
    parser_default = bench_args()
    parser_default.time_budget = None  # as the CLI parses no --time-budget
    assert bench.config_from_args(parser_default).time_budget == AUTO
    for argv in (("--preset", "quality"), ("--methods", "flexdemo:topk=1")):
        args = bench_args(*argv)
        args.time_budget = None
        assert bench.config_from_args(args).time_budget is None, argv
    assert _config("--time-budget", "90s").time_budget == 90.0
    # The reference runs first under auto: it sets the others' budget.
    cfg = _config("--methods", "flexdemo:topk=1", "adamw", "--time-budget", "auto")
    assert [m.name for m in cfg.methods] == ["adamw", "flexdemo"]


@pytest.mark.parametrize(("argv", "needle"), [
    (("--methods", "flexdemo:topk=1", "--time-budget", "auto"), "has no adamw; add adamw to --methods"),
    (("--time-budget", "soon"), "--time-budget 'soon': give seconds (e.g. 90 or 90s), 'auto'"),
    (("--time-budget", "0"), "give a positive number of seconds"),
    (("--time-budget", "60", "--ft", "on"), "not supported with --ft/--faults"),
])  # fmt: skip
def test_a_bad_time_budget_is_refused_before_anything_starts(argv, needle, capsys) -> None:
    with pytest.raises(ValueError) as e:
        _config(*argv)
    assert needle in str(e.value)


def _run(tmp_path: Path, fake_trainer: Path, monkeypatch, *argv: str):
    calls: list = []
    monkeypatch.setattr(runner, "launch_nodes", in_process_launcher(load_fake(fake_trainer), calls))
    out = tmp_path / "bench"
    argv = ("--steps", "12", "--model", "t5-tiny", "--emulation", "shaped", "--out", str(out), "--no-progress", *argv)
    assert bench.main(bench_args(*argv)) == 0
    return load_results(out), out, calls


@pytest.mark.timeout(120)
def test_auto_gives_every_method_the_references_measured_training_time(tmp_path, fake_trainer, monkeypatch,
                                                                       capsys) -> None:  # fmt: skip
    results, out, calls = _run(tmp_path, fake_trainer, monkeypatch, "--methods", "flexdemo:topk=1", "adamw",
                               "--seeds", "0,1", "--time-budget", "auto")
    runs = results["runs"]
    # Seed-major: AdamW first at each seed, then FlexDeMo with AdamW's training time at that seed.
    assert [(r.method, r.seed) for r in runs] == [("adamw", 0), ("flexdemo", 0), ("adamw", 1), ("flexdemo", 1)]
    adamw, flex = runs[0], runs[1]
    assert adamw.time_budget_s is None and adamw.max_steps is None and adamw.steps == 12
    assert flex.time_budget_s == pytest.approx(adamw.train_time_s) and flex.max_steps == STEP_CAP_FACTOR * 12
    # The fake trainer's FlexDeMo Top-1 steps are cheaper than AdamW's: it takes more of them in the same time,
    # stopping at the first step past the budget.
    step_s = flex.step_time_s
    assert flex.steps == int(flex.time_budget_s // step_s) + 1 > 12
    assert flex.train_time_s > flex.time_budget_s >= flex.train_time_s - step_s
    report = (out / "report.md").read_text()
    first_table = report.index("## At equal training time")
    assert report.index("## Recommendation") < first_table < report.index("## Time to target")
    assert report.index("| Run |") > first_table  # no table before it
    row = next(line for line in report.splitlines()[report[:first_table].count("\n"):]
               if line.startswith("| FlexDeMo Top1 |"))
    assert f"| {flex.steps} [{flex.steps}–{flex.steps}] |" in row and f"| {flex.time_budget_s:.1f} |" in row
    assert "At equal training time (--time-budget auto)" in capsys.readouterr().out
    # The job file of the budgeted run carries the budget and the cap.
    import tomllib

    job = tomllib.loads(Path(calls[1][2]).read_text())
    assert job["schedule"]["time_budget_s"] == pytest.approx(adamw.train_time_s)
    assert job["schedule"]["steps"] == STEP_CAP_FACTOR * 12


@pytest.mark.timeout(120)
def test_a_budget_in_seconds_applies_to_every_run(tmp_path, fake_trainer, monkeypatch) -> None:
    results, _, _ = _run(tmp_path, fake_trainer, monkeypatch, "--methods", "adamw", "flexdemo:topk=1",
                         "--time-budget", "1.5")
    for r in results["runs"]:
        assert r.time_budget_s == 1.5 and r.max_steps == STEP_CAP_FACTOR * 12
        assert r.steps == int(1.5 // r.step_time_s) + 1
