"""The plan of a bench: one :class:`RunPlan` per training run.

:func:`plan_runs` expands a validated configuration (:class:`~lowband.bench.config.BenchConfig`)
into its runs (every method at every bandwidth and seed; FlexDeMo-family methods at every
``--shards`` value); the runner (:mod:`lowband.bench.runner`) runs them, and what a run's nodes are
given (its ``TrainConfig`` in ``RUN_DIR/config.toml``) is :mod:`lowband.bench.jobs`'.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowband.bench import jobs
from lowband.bench.config import BenchConfig
from lowband.bench.defaults import DEFAULT_SEED
from lowband.bench.methods import (
    METHODS,
    SHARD_SWEEP,
    canonical_method,
    method_label,
    shown_params,
)
from lowband.train.methods import MethodConfig
from lowband.units import format_bandwidth

__all__ = ["RunPlan", "plan_runs"]


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
        """The run's TrainConfig (:func:`lowband.bench.jobs.train_config`)."""
        return jobs.train_config(self, config, out_dir, shaped=shaped)

    def train_args(self, config: BenchConfig, out_dir: Path) -> list[str]:
        """``lowband train`` arguments of the run (:func:`lowband.bench.jobs.train_args`)."""
        return jobs.train_args(self, config, out_dir)


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
