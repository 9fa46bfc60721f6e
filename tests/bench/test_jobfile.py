"""lowband/bench/job.py, jobfile.py, args.py: the bench's job file, its flags derived from the tables, and
OUT/bench.toml replaying a bench."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import lowband.bench.runner as runner
import lowband.commands.bench as bench
from lowband.bench import jobfile
from lowband.bench.config import BenchConfig
from lowband.bench.job import BenchTable, flag_of
from lowband.bench.presets import PRESETS
from lowband.bench.results import load_results
from lowband.train.fields import job_fields
from tests.bench.fake_trainer import bench_args, in_process_launcher, load_fake


def _pairs(path: Path) -> Path:
    path.write_text("".join(json.dumps({"src": f"text {i}", "tgt": f"t {i}"}) + "\n" for i in range(20)))
    return path


def _args(*argv: str) -> argparse.Namespace:
    """``lowband bench`` options as the CLI parses them (bench_args adds --time-budget off)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_give_tables_that_a_written_bench_toml_gives_back(tmp_path: Path) -> None:
    data = _pairs(tmp_path / "pairs.jsonl")
    argv = ("--methods", "adamw:lr=0.01", "flexdemo:topk=8,chunk=64", "--bandwidth", "100mbit,2.5gbit", "--seeds", "0,3",
            "--steps", "20", "--shards", "1,2", "--latency", "20ms", "--target-loss", "6.5", "--run-timeout", "90s",
            "--model", "t5-tiny", "--data", str(data), "--time-budget", "45",
            "--train-args=--source-column src --target-column tgt --batch-size 2")
    config = bench.config_from_args(bench_args(*argv))
    assert (config.latency_s, config.run_timeout_s, config.time_budget, config.seeds) == (0.02, 90.0, 45.0, (0, 3))
    assert config.bandwidths_bps == (1e8, 2.5e9) and config.data == str(data.resolve())
    assert config.train == {"run": {"val_every": 10}}  # the bench's default; the flags' go after it
    assert config.train_args == ("--val-every", "10", "--source-column", "src", "--target-column", "tgt",
                                 "--batch-size", "2")
    path = jobfile.write(config, tmp_path)
    assert path.name == "bench.toml" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    again = bench.config_from_args(_args("--config", str(path)))
    assert again == config and again.as_dict() == config.as_dict()
    assert jobfile.dumps(again) == jobfile.dumps(config)
    # The file holds every [bench] key (defaults spelled out) but those TOML cannot hold (None).
    written = jobfile.load(path)["bench"]
    assert set(written) == set(job_fields(BenchTable)) - {"preset", "faults"}
    assert written["bandwidths"] == ("100mbit", "2.5gbit") and written["time_budget"] == 45.0


def test_every_bench_key_is_a_flag_and_a_flag_not_given_sets_nothing() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    flags = parser._option_string_actions
    for key in job_fields(BenchTable):
        assert flags[flag_of(key)].dest == key, key
    assert flags["--seed"].dest == "seeds" and flags["--bench.steps"].dest == "steps"
    assert flags["--model"].dest == "model.name" and flags["--data"].dest == "data.path"
    assert all(v is None for k, v in vars(_args()).items() if k != "no_progress")


def test_a_preset_under_a_file_under_flags(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[bench]\npreset = "quality"\nseeds = [3, 4]\nsteps = 60\ntrain_args = ["--val-batches", "2"]\n\n'
                   '[data]\nmax_target_len = 24\n\n[schedule]\nbatch_size = 4\n')
    config = bench.config_from_args(bench_args("--config", str(job), "--seeds", "5", "--train-args=--grad-accum 2"))
    quality = PRESETS["quality"]
    assert config.preset == "quality" and config.seeds == (5,) and config.steps == 60  # flag > file > preset
    assert [str(m) for m in config.methods] == list(quality.bench.methods)  # the preset's, untouched
    assert config.train == {"data": {"max_source_len": 64, "max_target_len": 24},
                            "schedule": {"lr_schedule": "cosine", "warmup_steps": 20, "batch_size": 4},
                            "run": {"val_every": 20}}  # the bench's default, the preset's, the file's
    assert config.extra_train_args == ("--val-batches", "2", "--grad-accum", "2")  # the file's, then the flag's
    assert BenchConfig.from_tables(jobfile.loads(jobfile.dumps(config))) == config  # its bench.toml gives it back
    # --preset on the command line is the same layer as the file's preset = "...".
    flags = bench.config_from_args(bench_args("--preset", "quality", "--steps", "60", "--seeds", "5"))
    assert flags.train == {"data": {"max_source_len": 64, "max_target_len": 16},
                           "schedule": {"lr_schedule": "cosine", "warmup_steps": 20}, "run": {"val_every": 20}}
    assert (flags.steps, flags.seeds, flags.methods, flags.model) == (60, (5,), config.methods, quality.model)


@pytest.mark.parametrize(("text", "needle"), [
    ('[bench]\nstep = 3\n', "[bench] has no key 'step'; its keys are: preset, methods,"),
    ('[bnech]\nsteps = 3\n', "unknown table [bnech]; the tables of a bench job are: [bench], [model], [data]"),
    ('[data]\nmax_sourcelen = 3\n', "[data] has no key 'max_sourcelen'; its keys are: path, source_column"),
    ('[bench]\nsteps = "3"\n', "[bench] steps (--steps) must be int, got str '3'"),
    ('[bench]\nseeds = [0, "x"]\n', "[bench] seeds (--seeds) must be a list of int"),
    ('[bench]\nseeds = "0,x"\n', "[bench] seeds: --seeds: 'x' is not an integer"),
    ('[bench]\nft = "sometimes"\n', "--ft 'sometimes' ([bench] ft): accepted: off, on, both"),
    ('[bench]\ntime_budget = "soon"\n', "--time-budget 'soon': give seconds (e.g. 90 or 90s), 'auto'"),
    ('[schedule]\nsteps = 5\n', "[schedule] steps is set by the bench, run by run: give [bench] steps (--steps)"),
    ('[run]\nseed = 1\n', "give [bench] seeds (--seeds)"),
    ('[link]\nlatency_s = 0.1\n', "[link] is set by the bench, run by run: give [bench] bandwidths and latency_s"),
    ('[method]\nlr = 0.1\n', "[method] is set by the bench, run by run: give [bench] methods"),
    ('[schedule]\nbatch_size = 2.5\n', "[schedule] batch_size must be int, got float 2.5"),
    ('[bench\n', "not a valid TOML file"),
])  # fmt: skip
def test_a_bad_job_file_is_refused_naming_the_key_and_the_fix(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        bench.config_from_args(bench_args("--config", str(path)))
    assert str(e.value).startswith(f"{path}: ") and needle in str(e.value), str(e.value)


def test_bad_values_from_the_tables_are_named_before_anything_starts(tmp_path: Path) -> None:
    for tables, needle in (
        ({"bench": {"steps": 0}}, "steps=0: give at least 1 training step"),
        ({"bench": {"preset": "fastest"}}, "unknown preset 'fastest'; presets: quality, frontier"),
        ({"bench": {"emulation": "fast"}}, "--emulation 'fast' ([bench] emulation): accepted: auto, netns, shaped"),
        ({"model": {"name": "t5-huge"}}, "unknown model 't5-huge'"),
        ({"data": {"path": str(tmp_path / "none.jsonl")}}, "none.jsonl"),
        ({"data": {"max_source_len": "64"}}, "[data] max_source_len must be int, got str '64'"),
    ):
        with pytest.raises(ValueError) as e:
            BenchConfig.from_tables(tables)
        assert needle in str(e.value), (tables, str(e.value))
    with pytest.raises(FileNotFoundError, match=r"--config .*nope.toml: no such file .*OUT/bench.toml"):
        bench.config_from_args(bench_args("--config", str(tmp_path / "nope.toml")))


@pytest.mark.timeout(120)
def test_a_bench_keeps_its_job_and_runs_it_again_from_it(tmp_path, fake_trainer, monkeypatch, capsys) -> None:
    import lowband.report.render as render

    calls: list = []
    monkeypatch.setattr(runner, "launch_nodes", in_process_launcher(load_fake(fake_trainer), calls))
    monkeypatch.setattr(render, "write_plots", lambda results, out_dir: [])  # the plots are not this test's
    first, second = tmp_path / "first", tmp_path / "again"
    argv = ("--methods", "adamw", "flexdemo:topk=1", "--steps", "6", "--model", "t5-tiny", "--emulation", "shaped",
            "--no-progress", "--train-args=--batch-size 2")
    assert bench.main(bench_args(*argv, "--out", str(first))) == 0
    assert bench.main(bench_args("--config", str(first / "bench.toml"), "--out", str(second), "--no-progress")) == 0
    a, b = load_results(first), load_results(second)
    assert a["config"] == b["config"] and a["config"]["train_args"] == ["--val-every", "10", "--batch-size", "2"]
    assert [r.id for r in a["runs"]] == [r.id for r in b["runs"]] and len(calls) == 4
    assert (first / "bench.toml").read_text() == (second / "bench.toml").read_text()
    # A bad file is bad input: nothing starts, exit status 2, the problem named.
    bad = tmp_path / "bad.toml"
    bad.write_text("[bench]\nstepz = 3\n")
    assert bench.main(bench_args("--config", str(bad), "--out", str(tmp_path / "never"))) == 2
    assert "[bench] has no key 'stepz'" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_the_train_tables_as_flags_are_the_same_job_for_every_key() -> None:
    """What another entry is given and results.json records (train_flags) reads back as the tables."""
    import dataclasses
    import typing

    from lowband.bench.job import BENCH_SETS, TRAIN_TABLES, train_flags
    from lowband.train.args import train_overrides
    from lowband.train.config import sections
    from lowband.train.fields import field_types

    tables: dict = {}
    for table in TRAIN_TABLES:
        cls = sections()[table]
        fields, hints = {f.name: f for f in dataclasses.fields(cls)}, field_types(cls)
        for key in job_fields(cls):
            if (table, key) in BENCH_SETS or (table, key) in (("model", "name"), ("data", "path")):
                continue
            f = fields[key]
            base = next(a for a in (*typing.get_args(hints[key]), hints[key]) if a is not type(None))
            if f.metadata["choices"]:
                value = next(c for c in f.metadata["choices"] if c != f.default)
            elif base is bool:
                value = not f.default
            elif base is float:
                value = 0.25
            elif base is int:
                value = 3 if f.default != 3 else 4
            else:
                value = f"some-{key}"
            tables.setdefault(table, {})[key] = value
    assert set(tables) == set(TRAIN_TABLES) and sum(map(len, tables.values())) >= 25
    back = train_overrides(train_flags(tables))
    assert {t: back[t] for t in tables} == tables


def test_a_results_json_of_a_preset_written_before_presets_were_tables_still_reads_as_the_preset() -> None:
    """Then config.train_args held the bench's default flags, then the preset's as it spelled them."""
    from lowband.bench.presets import preset_differences

    quality = PRESETS["quality"]
    old = {"methods": list(quality.bench.methods), "bandwidths_bps": [1e8], "steps": 140, "seeds": [0, 1],
           "model": "t5-mini", "data": None, "preset": "quality",
           "train_args": ["--val-every", "10", "--max-source-len", "64", "--max-target-len", "16", "--val-every", "20",
                          "--schedule", "cosine", "--warmup-steps", "20"]}
    assert preset_differences(quality, old) == (["methods", "link", "steps", "seeds", "model", "data", "train args"], [])
    new = bench.config_from_args(bench_args("--preset", "quality")).as_dict()
    assert preset_differences(quality, new) == preset_differences(quality, old)
    other = preset_differences(quality, {**old, "train_args": [*old["train_args"], "--warmup-steps", "5"]})
    assert "train args" not in other[0] and other[1][0].startswith("train args --val-every 10 ")
