"""Each run's job: what the nodes of one planned run (:class:`~lowband.bench.plan.RunPlan`) are given.

The last stage of a bench configuration's way: the command line and the job file
(:mod:`lowband.bench.args`) -> :meth:`~lowband.bench.config.BenchConfig.from_tables` ->
:func:`~lowband.bench.plan.plan_runs` -> the runner
(:mod:`lowband.bench.runner`), which asks here, run by run, for the command of its nodes
(:func:`run_command`): the run's complete ``TrainConfig`` (:func:`train_config`) written to
``RUN_DIR/config.toml`` (:mod:`lowband.train.jobfile`), or, for another entry than lowband's own,
``lowband train`` arguments (:func:`train_args`). A plan is read, never imported: this module does
not import the plan's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lowband.bench.config import BenchConfig
from lowband.bench.defaults import DEFAULT_ENTRY
from lowband.bench.methods import train_hp_args
from lowband.train import jobfile
from lowband.train.args import train_overrides
from lowband.train.config import RunMethod, TrainConfig
from lowband.train.methods import canonical_names

__all__ = ["run_command", "shaping_args", "train_args", "train_config"]


def train_config(plan, config: BenchConfig, out_dir: Path, *, shaped: bool):
    """The run's TrainConfig: the bench's settings and this run's, then the job's train tables
    (``config.train``), then ``config.extra_train_args`` (which win), then the link (bandwidth when
    shaped in-process, latency always)."""


    tables: dict[str, dict[str, Any]] = {
        "model": {"name": config.model, "shards": plan.shards},
        "schedule": {"steps": plan.steps or config.steps,  # a time budget's cap (lowband.bench.timebudget)
                     **({"time_budget_s": plan.time_budget_s} if plan.time_budget_s is not None else {})},
        "run": {"seed": plan.seed, "out": str(out_dir)}, "data": {"path": config.data},
    }
    for table, body in [*config.train.items(), *train_overrides(config.extra_train_args).items()]:
        tables.setdefault(table, {}).update(body)
    user_hp = canonical_names(plan.method, {k: v for k, v in tables.pop("method", {}).items() if k != "name"})
    tables["link"] = {**tables.get("link", {}), "latency_s": plan.latency_s}
    if shaped:
        tables["link"]["bandwidth_bps"] = plan.bandwidth_bps
    method = RunMethod(name=plan.method, hp=dataclasses.replace(plan.hp, **user_hp))
    return dataclasses.replace(TrainConfig.from_tables(tables), method=method)


def train_args(plan, config: BenchConfig, out_dir: Path) -> list[str]:
    """Arguments after the entry module: ``train --method M ... --out OUT_DIR``."""
    argv = ["train", "--method", plan.method, *train_hp_args(plan.params)]
    argv += ["--model", config.model, "--steps", str(plan.steps or config.steps), "--seed", str(plan.seed)]
    if plan.time_budget_s is not None:
        argv += ["--time-budget", f"{plan.time_budget_s:.3f}"]
    if config.data is not None:
        argv += ["--data", config.data]
    argv += ["--out", str(out_dir), *config.train_args]
    return argv


def shaping_args(plan, mode: str) -> list[str]:
    """The shaping flags of a run's ``lowband train`` command: named on it, never taken from the environment.

    Shaped mode: every rank's link shapes to the bandwidth. Both modes: tbf has no delay, so the
    link adds the per-message latency in-process.
    """
    args = ["--link-bandwidth", f"{plan.bandwidth_bps:.0f}"] if mode == "shaped" else []
    return [*args, "--link-latency", f"{plan.latency_s:g}"]


def run_command(plan, config: BenchConfig, run_dir: Path, mode: str) -> list[str]:
    """``train --config RUN_DIR/config.toml --out RUN_DIR``: the run's complete configuration
    (:func:`train_config`) goes to its ranks in the file, which also re-runs the row. Another
    entry than lowband's own gets ``lowband train`` arguments (it may take flags of its own)."""

    if config.entry != DEFAULT_ENTRY:
        return train_args(plan, config, run_dir.resolve()) + shaping_args(plan, mode)
    cfg = train_config(plan, config, run_dir.resolve(), shaped=mode == "shaped")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.resolve() / "config.toml"
    path.write_text(jobfile.dumps(cfg))
    resume = cfg.checkpoint.resume
    return ["train", "--config", str(path), "--out", cfg.run.out, *(["--resume", resume] if resume else [])]
