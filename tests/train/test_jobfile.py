"""lowband/train/jobfile.py: The job file: ``lowband train --config job.toml`` with flags on top, and the file a run writes."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from lowband.train import jobfile
from lowband.train.args import add_arguments, config_from_args
from lowband.train.config import DataConfig, RunConfig, ScheduleConfig, TrainConfig, replace
from lowband.train.methods import method_config


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _write(tmp_path, text: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_every_key_of_every_table_has_one_flag_and_each_table_is_a_typed_class():
    p = argparse.ArgumentParser()
    add_arguments(p)
    flagged = {a.dest for a in p._actions}
    for table, cls in jobfile.sections().items():
        assert dataclasses.is_dataclass(cls) and isinstance(getattr(TrainConfig(), table), cls), table
        for key in jobfile.job_fields(cls):
            assert f"{table}.{key}" in flagged, (table, key)
    # DataConfig's kind and seed are the trainer's to set (from the model and the run's seed), not keys
    assert "kind" not in jobfile.job_fields(DataConfig) and "seed" not in jobfile.job_fields(DataConfig)


def test_no_flags_give_the_config_defaults_and_help_says_them():
    assert config_from_args(_parse()) == TrainConfig()
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = p.format_help()
    assert "--steps STEPS, --schedule.steps STEPS" in text and "(default 100)" in text
    assert "(default t5-mini)" in text


def test_a_written_file_reads_back_to_the_same_job(tmp_path):
    cfg = TrainConfig.from_tables({
        "method": {"name": "noloco", "H": 7, "max_grad_norm": None, "group_size": 3},
        "model": {"name": "t5-tiny", "precision": "bf16", "activation_checkpointing": True, "shards": 1},
        "data": {"path": "x.jsonl", "max_examples": 900, "val_size": 0.1},
        "schedule": {"steps": 321, "batch_size": 3, "grad_accum": 2, "lr_schedule": "cosine", "warmup_steps": 4,
                     "min_lr_ratio": 0.25},
        "run": {"seed": 5, "val_every": 9, "progress": False, "out": "runs/elsewhere", "export_hf": "runs/hf"},
        "checkpoint": {"every": 50, "at_end": True, "resume": "auto"},
        "link": {"bandwidth_bps": 1e8, "latency_s": 0.05},
        "fault_tolerance": {"lighthouse": "http://h:1", "node": 2, "max_nodes": 4, "quorum": "sync", "start_nodes": 3},
    })  # fmt: skip
    text = jobfile.dumps(cfg)
    assert 'max_grad_norm = "none"' in text  # an optional hyper-parameter off, though its default is on
    back = TrainConfig.from_tables(jobfile.loads(text))
    # a re-run must not write over the run it repeats: out, resume and export_hf are left out
    assert (back.run.out, back.checkpoint.resume, back.run.export_hf) == (RunConfig.out, None, None)
    assert back == dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out=RunConfig.out, export_hf=None),
                                       checkpoint=dataclasses.replace(cfg.checkpoint, resume=None))
    assert type(back.data.val_size) is float and type(back.link.latency_s) is float


def test_flags_win_over_the_file_and_the_file_over_the_defaults(tmp_path):
    path = _write(tmp_path, '[method]\nname = "diloco"\nH = 10\nouter_lr = 0.5\n[schedule]\nsteps = 300\n'
                            '[model]\nname = "t5-tiny"\n')
    cfg = config_from_args(_parse("--config", path))
    assert (cfg.method.name, cfg.schedule.steps, cfg.model.name) == ("diloco", 300, "t5-tiny")
    assert cfg.schedule.batch_size == ScheduleConfig.batch_size
    assert (cfg.method.hp.sync_every, cfg.method.hp.outer_lr) == (10, 0.5)
    # A flag given wins, even when it equals the default; --table.key is the same flag.
    cfg = config_from_args(_parse("--config", path, "--schedule.steps", "100", "--sync-every", "4",
                                  "--hp", '{"outer_lr": 0.9}'))
    assert cfg.schedule.steps == 100
    assert (cfg.method.hp.sync_every, cfg.method.hp.outer_lr) == (4, 0.9)


def test_another_method_on_the_command_line_drops_the_files_hyper_parameters(tmp_path, caplog):
    path = _write(tmp_path, '[method]\nname = "diloco"\nH = 10\n')
    with caplog.at_level(logging.WARNING):
        cfg = config_from_args(_parse("--config", path, "--method", "flexdemo", "--topk", "4"))
    assert cfg.method.name == "flexdemo" and cfg.method.hp == method_config("flexdemo", {"topk": 4})
    assert "the file's hyper-parameters (sync_every) are dropped" in caplog.text


def test_tables_in_code_name_a_bad_key_and_a_bad_value():
    with pytest.raises(ValueError, match=r"\[schedule\] has no key step; its keys are: steps"):
        TrainConfig.from_tables({"schedule": {"step": 3}})
    with pytest.raises(ValueError, match=r"unknown table\(s\) moddel"):
        TrainConfig.from_tables({"moddel": {}})
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        TrainConfig.from_tables({"method": {"name": "diloco", "H": 0}})
    assert replace(TrainConfig(), schedule={"steps": 7}).schedule.steps == 7
    assert replace(TrainConfig.from_tables({"method": {"name": "diloco", "H": 3}}),
                   method={"name": "adamw"}).method.hp == method_config("adamw")


@pytest.mark.parametrize("text, needle", [
    ("[moddel]\nname = 't5-tiny'\n", r"unknown table \[moddel\]; the tables are: \[method\], \[model\]"),
    ("[schedule]\nstep = 3\n", r"\[schedule\] has no key 'step'; its keys are: steps, batch_size"),
    ("[schedule]\nsteps = '3'\n", r"\[schedule\] steps must be int, got str '3'"),
    ("[schedule]\nsteps = 3.5\n", r"\[schedule\] steps must be int, got float 3.5"),
    ("[model]\nactivation_checkpointing = 1\n", "must be bool, got int 1"),
    ("[link]\nlatency_s = true\n", "latency_s must be float, got bool"),
    ("[method]\nname = 'diloco'\nsync_evry = 3\n", r"\[method\] method 'diloco' has no hyper-parameter 'sync_evry'"),
    ("[method]\nname = 'diloco'\nH = 0\n", r"\[method\] sync_every must be >= 1"),
    ("[method]\nH = 3\n", r"gives hyper-parameters \(H\) but no name"),
    ("[schedule\nsteps = 3\n", "not a valid TOML file"),
    ("schedule = 3\n", "schedule must be a table"),
])
def test_a_bad_file_is_named_before_anything_runs(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=needle) as e:
        config_from_args(_parse("--config", path))
    assert path in str(e.value)  # the message says which file


def test_a_missing_file_says_what_a_job_file_is(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--config .*nope.toml: no such file .*OUT/config.toml"):
        config_from_args(_parse("--config", str(tmp_path / "nope.toml")))


@pytest.mark.parametrize("shaped", [True, False])
def test_the_bench_builds_each_runs_config_as_its_command_line_would_and_the_users_args_win(tmp_path, shaped):
    from lowband.bench.config import BenchConfig
    from lowband.bench.jobs import shaping_args as _shaping_args
    from lowband.bench.plan import plan_runs
    from lowband.train.args import parse_train_args

    config = BenchConfig.from_tables({
        "bench": {"methods": "diloco:H=5,noloco:H=2,n=2", "bandwidths": "100mbit,1gbit", "steps": 30,
                  "latency_s": "50ms", "seeds": "0,1", "train_args": "--batch-size 3 --sync-every 7 --warmup-steps 2"},
        "model": {"name": "t5-tiny"}})
    mode = "shaped" if shaped else "netns"
    for plan in plan_runs(config):
        cfg = plan.train_config(config, tmp_path, shaped=shaped)
        argv = plan.train_args(config, tmp_path)[1:] + _shaping_args(plan, mode)
        assert cfg == parse_train_args(argv), plan.id  # the same job as the flags would give
        assert (cfg.schedule.batch_size, cfg.schedule.warmup_steps, cfg.link.latency_s, cfg.run.seed) == (
            3, 2, 0.05, plan.seed)
        assert cfg.link.bandwidth_bps == (plan.bandwidth_bps if shaped else None)
        assert cfg.method.hp.sync_every == 7  # the user's --train-args win over the spec
    config = BenchConfig.from_tables({
        "bench": {"methods": "adamw,flexdemo:topk=4", "bandwidths": "100mbit", "steps": 30,
                  "train_args": "--batch-size 3 --weight-decay 0.01"},
        "model": {"name": "t5-tiny"}})
    for plan in plan_runs(config):
        cfg = plan.train_config(config, tmp_path, shaped=shaped)
        assert (cfg.method.hp.weight_decay, cfg.schedule.batch_size) == (0.01, 3)


def test_a_bench_hyper_parameter_that_some_methods_lack_is_refused_with_the_fix():
    from lowband.bench.config import BenchConfig

    with pytest.raises(ValueError, match=r"with method adamw: method 'adamw' has no hyper-parameter 'sync_every'.*"
                                         r"goes in their specs \(e.g. diloco:H=10\)"):
        BenchConfig.from_tables({"bench": {"methods": "diloco:H=5,adamw", "bandwidths": "100mbit", "steps": 30,
                                           "train_args": "--sync-every 7"}, "model": {"name": "t5-tiny"}})
