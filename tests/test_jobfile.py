"""The job file: ``lowband train --config job.toml`` with flags on top, and the file a run writes."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from lowband.train import jobfile
from lowband.train.cli import add_arguments, config_from_args
from lowband.train.loop import TrainConfig
from lowband.train.methods import method_config


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _write(tmp_path, text: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_every_field_has_one_table_and_one_flag():
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "hp"]
    tabled = [f for body in jobfile.SECTIONS.values() for f in body]
    assert sorted(tabled) == sorted(fields)  # each field in exactly one table
    p = argparse.ArgumentParser()
    add_arguments(p)
    flagged = {a.dest for a in p._actions}
    assert set(fields) <= flagged, set(fields) - flagged


def test_no_flags_give_the_config_defaults_and_help_says_them():
    assert config_from_args(_parse()) == TrainConfig()
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = p.format_help()
    assert "--steps STEPS" in text and "(default 100)" in text
    assert "(default t5-mini)" in text


def test_a_written_file_reads_back_to_the_same_job(tmp_path):
    cfg = TrainConfig(method="noloco", hp={"H": 7, "max_grad_norm": None, "group_size": 3}, model="t5-tiny",
                      data="x.jsonl", max_examples=900, val_size=0.1, steps=321, batch_size=3, grad_accum=2,
                      precision="bf16", activation_checkpointing=True, seed=5, shards=1, schedule="cosine",
                      warmup_steps=4, min_lr_ratio=0.25, val_every=9, ckpt_every=50, ckpt_at_end=True,
                      link_bandwidth_bps=1e8, link_latency_s=0.05, ft_lighthouse="http://h:1", ft_node=2,
                      ft_max_nodes=4, ft_quorum="sync", ft_start_nodes=3, progress=False,
                      out="runs/elsewhere", resume="auto")
    text = jobfile.dumps(cfg)
    assert 'max_grad_norm = "none"' in text  # an optional hyper-parameter off, though its default is on
    back = TrainConfig(**jobfile.loads(text))
    for f in dataclasses.fields(TrainConfig):
        if f.name == "hp":
            assert method_config(back.method, back.hp) == method_config(cfg.method, cfg.hp)
        elif f.name in ("out", "resume"):  # a re-run must not write over the run it repeats
            assert getattr(back, f.name) == getattr(TrainConfig(), f.name)
        else:
            assert getattr(back, f.name) == getattr(cfg, f.name), f.name
    assert type(back.val_size) is float and type(back.link_latency_s) is float


def test_flags_win_over_the_file_and_the_file_over_the_defaults(tmp_path):
    path = _write(tmp_path, '[method]\nname = "diloco"\nH = 10\nouter_lr = 0.5\n[schedule]\nsteps = 300\n'
                            '[model]\nmodel = "t5-tiny"\n')
    cfg = config_from_args(_parse("--config", path))
    assert (cfg.method, cfg.steps, cfg.model, cfg.batch_size) == ("diloco", 300, "t5-tiny", TrainConfig.batch_size)
    assert method_config(cfg.method, cfg.hp).sync_every == 10
    # A flag given wins, even when it equals the default.
    cfg = config_from_args(_parse("--config", path, "--steps", "100", "--sync-every", "4", "--hp", '{"outer_lr": 0.9}'))
    assert cfg.steps == 100
    mc = method_config(cfg.method, cfg.hp)
    assert (mc.sync_every, mc.outer_lr) == (4, 0.9)


def test_another_method_on_the_command_line_drops_the_files_hyper_parameters(tmp_path, caplog):
    path = _write(tmp_path, '[method]\nname = "diloco"\nH = 10\n')
    with caplog.at_level(logging.WARNING):
        cfg = config_from_args(_parse("--config", path, "--method", "flexdemo", "--topk", "4"))
    assert cfg.method == "flexdemo" and cfg.hp == {"topk": 4}
    assert "the file's hyper-parameters (sync_every) are dropped" in caplog.text


@pytest.mark.parametrize("text, needle", [
    ("[moddel]\nmodel = 't5-tiny'\n", r"unknown table \[moddel\]; the tables are: \[method\], \[model\]"),
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
    from lowband.bench.config import make_config, plan_runs
    from lowband.bench.runner import _shaping_args
    from lowband.train.cli import parse_train_args

    config = make_config(methods="adamw,flexdemo:topk=4,diloco:H=5,noloco:H=2,n=2", bandwidths="100mbit,1gbit",
                         steps=30, model="t5-tiny", latency="50ms", seeds="0,1",
                         train_args="--batch-size 3 --sync-every 7 --warmup-steps 2")
    mode = "shaped" if shaped else "netns"
    for plan in plan_runs(config):
        cfg = plan.train_config(config, tmp_path, shaped=shaped)
        argv = plan.train_args(config, tmp_path)[1:] + _shaping_args(plan, mode)
        assert cfg == parse_train_args(argv), plan.id  # the same job as the flags would give
        assert (cfg.batch_size, cfg.warmup_steps, cfg.link_latency_s, cfg.seed) == (3, 2, 0.05, plan.seed)
        assert cfg.link_bandwidth_bps == (plan.bandwidth_bps if shaped else None)
        if cfg.method in ("diloco", "noloco"):
            assert method_config(cfg.method, cfg.hp).sync_every == 7  # the user's --train-args win over the spec
