"""The plan of a bench: one :class:`RunPlan` per training run, and each run's job file.

:func:`plan_runs` expands a validated configuration (:class:`~lowband.bench.config.BenchConfig`)
into its runs (every method at every bandwidth and seed; FlexDeMo-family methods at every
``--shards`` value). :func:`run_command` turns one plan into what its nodes run: the run's complete
``TrainConfig`` (:meth:`RunPlan.train_config`) written to ``RUN_DIR/config.toml``
(:mod:`lowband.train.jobfile`), or ``lowband train`` arguments for another entry than lowband's own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowband.bench.config import BenchConfig
from lowband.bench.defaults import DEFAULT_ENTRY, DEFAULT_SEED
from lowband.bench.methods import (
    METHODS,
    SHARD_SWEEP,
    canonical_method,
    method_label,
    shown_params,
    train_hp_args,
)
from lowband.train.methods import MethodConfig
from lowband.units import format_bandwidth

__all__ = ["RunPlan", "plan_runs", "run_command", "shaping_args"]


def _bandwidth_slug(bandwidth_bps: float) -> str:
    return format_bandwidth(bandwidth_bps).replace("/s", "").replace(" ", "").lower()


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """One training run of the bench: a method with its hyper-parameters at one bandwidth.

    ``hp`` is the method's typed config (the spec's; the trainer gets it as it is, with the user's
    ``--train-args`` on top); ``shown`` the hyper-parameters its label and record name (the spec's
    and the method's run-defining ones, FlexDeMo's topk and chunk).
    """

    index: int
    id: str
    method: str
    spec: str
    label: str
    hp: MethodConfig
    shown: tuple[str, ...] = ()
    shards: int
    bandwidth_bps: float
    latency_s: float
    nodes: int
    ranks_per_node: int
    seed: int = DEFAULT_SEED
    ft: bool = False  # under fault tolerance (one torchrun per node, torchft)
    faults: tuple = ()  # the fault plan this run carries out (its twin runs without)
    steps: int | None = None  # the run's (most) steps, when not the bench's (a time budget's cap)
    time_budget_s: float | None = None  # training-clock budget (lowband.bench.timebudget.budget_plan)

    @property
    def params(self) -> dict[str, Any]:
        """What the run's record names (``RunRecord.params``): the ``shown`` hyper-parameters and shards."""
        return {**{k: getattr(self.hp, k) for k in self.shown}, "shards": self.shards}

    @property
    def topk(self) -> int | None:
        return getattr(self.hp, "topk", None)

    @property
    def chunk(self) -> int | None:
        return getattr(self.hp, "chunk", None)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def train_config(self, config: BenchConfig, out_dir: Path, *, shaped: bool):
        """The run's TrainConfig: the bench's settings and this run's, then ``config.train_args`` (the
        user's, which win), then the link (bandwidth when shaped in-process, latency always)."""
        import dataclasses

        from lowband.train.cli import train_overrides
        from lowband.train.config import RunMethod, TrainConfig
        from lowband.train.methods import canonical_names

        tables: dict[str, dict[str, Any]] = {
            "model": {"name": config.model, "shards": self.shards},
            "schedule": {"steps": self.steps or config.steps,
                         **({"time_budget_s": self.time_budget_s} if self.time_budget_s is not None else {})},
            "run": {"seed": self.seed, "out": str(out_dir)}, "data": {"path": config.data},
        }
        for table, body in train_overrides(config.train_args).items():
            tables.setdefault(table, {}).update(body)
        user_hp = canonical_names(self.method, {k: v for k, v in tables.pop("method").items() if k != "name"})
        tables["link"] = {**tables.get("link", {}), "latency_s": self.latency_s}
        if shaped:
            tables["link"]["bandwidth_bps"] = self.bandwidth_bps
        method = RunMethod(name=self.method, hp=dataclasses.replace(self.hp, **user_hp))
        return dataclasses.replace(TrainConfig.from_tables(tables), method=method)

    def train_args(self, config: BenchConfig, out_dir: Path) -> list[str]:
        """Arguments after the entry module: ``train --method M ... --out OUT_DIR``."""
        argv = ["train", "--method", self.method, *train_hp_args(self.params)]
        argv += ["--model", config.model, "--steps", str(self.steps or config.steps), "--seed", str(self.seed)]
        if self.time_budget_s is not None:
            argv += ["--time-budget", f"{self.time_budget_s:.3f}"]
        if config.data is not None:
            argv += ["--data", config.data]
        argv += ["--out", str(out_dir), *config.train_args]
        return argv


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def plan_runs(config: BenchConfig) -> list[RunPlan]:
    """Every run of the bench, grouped by bandwidth (one emulated network each), duplicates removed.

    A FlexDeMo-family method (deto-full, demo, flexdemo) runs at every ``config.shards`` value
    unless its spec sets ``shards``; FlexDeMo at shards=1 is recorded as DeMo and DeMo at
    shards>1 as FlexDeMo, so ``demo`` and ``flexdemo:topk=1`` with ``--shards 1,2`` give two runs,
    not four.
    """
    plans: list[RunPlan] = []
    seen: set[tuple] = set()
    # Seed-major within a bandwidth: an interrupted bench still holds every method at the first seeds.
    runs = ((bw, seed, spec) for bw in config.bandwidths_bps for seed in config.seeds for spec in config.methods)
    for bw, seed, spec in runs:
        if seed not in config.seeds[:spec.nseeds or len(config.seeds)]:
            continue
        if spec.shards is not None:
            shard_values: Sequence[int] = [spec.shards]
        elif config.shards is not None and spec.name in SHARD_SWEEP:
            shard_values = config.shards
        elif METHODS[spec.name].shards_per_node == 1:
            shard_values = [1]
        else:
            shard_values = [config.ranks_per_node]
        for s in shard_values:
            name = canonical_method(spec.name, s)
            shown = shown_params(spec.hp, spec.given)
            key = (name, spec.hp, s, bw, seed)
            if key in seen:
                continue
            seen.add(key)
            base = method_label(name, shown)
            variants = [(False, ())] if config.ft in ("off", "both") and not config.faults else []
            if config.ft == "both" and config.faults:
                variants.append((False, ()))
            if config.ft != "off" or config.faults:
                variants.append((True, ()))  # the fault-free twin of a faulted run, or FT's cost
            if config.faults:
                variants.append((True, config.faults))
            for ft, faults in variants:
                label = base + (" FT" if ft else "") + (" faults" if faults else "")
                index = len(plans)
                run_id = f"{index:02d}-{_slug(label)}-s{s}-{_bandwidth_slug(bw)}-seed{seed}"
                plans.append(
                    RunPlan(
                        index=index, id=run_id, method=name, spec=str(spec), label=label, hp=spec.hp,
                        shown=tuple(shown), shards=s,
                        bandwidth_bps=bw, latency_s=config.latency_s, nodes=config.nodes,
                        ranks_per_node=config.ranks_per_node, seed=seed, ft=ft, faults=faults,
                    )  # fmt: skip
                )
    return plans


def shaping_args(plan: RunPlan, mode: str) -> list[str]:
    """The shaping flags of a run's ``lowband train`` command: named on it, never taken from the environment.

    Shaped mode: every rank's link shapes to the bandwidth. Both modes: tbf has no delay, so the
    link adds the per-message latency in-process.
    """
    args = ["--link-bandwidth", f"{plan.bandwidth_bps:.0f}"] if mode == "shaped" else []
    return [*args, "--link-latency", f"{plan.latency_s:g}"]


def run_command(plan: RunPlan, config: BenchConfig, run_dir: Path, mode: str) -> list[str]:
    """``train --config RUN_DIR/config.toml --out RUN_DIR``: the run's complete configuration
    (:meth:`RunPlan.train_config`) goes to its ranks in the file, which also re-runs the row. Another
    entry than lowband's own gets ``lowband train`` arguments (it may take flags of its own)."""
    from lowband.train import jobfile

    if config.entry != DEFAULT_ENTRY:
        return plan.train_args(config, run_dir.resolve()) + shaping_args(plan, mode)
    cfg = plan.train_config(config, run_dir.resolve(), shaped=mode == "shaped")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.resolve() / "config.toml"
    path.write_text(jobfile.dumps(cfg))
    resume = cfg.checkpoint.resume
    return ["train", "--config", str(path), "--out", cfg.run.out, *(["--resume", resume] if resume else [])]
