"""What a bench runs: the validated configuration of ``lowband bench``, built from the job's tables.

:meth:`BenchConfig.from_tables` takes the job's typed tables (:mod:`lowband.bench.job`: ``[bench]``
and lowband train's ``[model]``, ``[data]``, ...), puts them over a preset's
(:mod:`lowband.bench.presets`) and the defaults (:mod:`lowband.bench.defaults`), and checks
everything a user can get wrong before any process starts: method specs, bandwidths, shard counts,
the model, the data file, steps, latency, the train settings against every method.
:func:`lowband.bench.plan.plan_runs` then expands the configuration into one
:class:`~lowband.bench.plan.RunPlan` per training run; :meth:`BenchConfig.tables` is the complete
job again, which the run directory keeps as ``bench.toml`` (:mod:`lowband.bench.jobfile`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowband.bench.defaults import DEFAULT_ENTRY, DEFAULT_TRAIN, FT_MODES
from lowband.bench.faults import format_faults, parse_faults
from lowband.bench.job import TABLES, BenchTable, check_tables, merge, run_tables, train_flags
from lowband.bench.methods import METHODS, BenchMethod, parse_method_list
from lowband.bench.presets import PRESETS
from lowband.bench.timebudget import (
    check_time_budget,
    default_time_budget,
    parse_time_budget,
    reference_first,
)
from lowband.distributed.compile import check_compile
from lowband.distributed.topology import Topology
from lowband.ft.node import require_torchft
from lowband.optim.outer.schedule import unmerged_tail_note
from lowband.train.args import train_overrides
from lowband.train.config import TrainConfig
from lowband.train.data import check_data_file
from lowband.train.models import MODEL_SIZES, resolve_model
from lowband.units import parse_bandwidth, parse_duration, parse_int_list, split_list

__all__ = ["FT_MODES", "INDEXED", "PRESETS", "BenchConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """A validated bench configuration (build it with :meth:`from_tables`).

    Args:
        methods: the method specs, in the order given.
        bandwidths_bps: link rates, one Table 1 row each.
        shards: shard counts for FlexDeMo-family methods (Table 2's rows), or None for each
            method's own (DeMo 1, the others ranks per node).
        steps: training steps of every run.
        model: model name or local model directory (absolute path).
        data: data file (absolute path), or None for the embedded default corpus.
        emulation: ``auto``, ``netns`` or ``shaped``.
        latency_s: per-message latency added in-process by the link (both emulation modes).
        nodes: emulated nodes.
        ranks_per_node: ranks (processes) per node.
        seeds: the seeds every method runs at (model init, data order, dropout); several give
            the seed spread.
        target_loss: the loss to time every run to (None: AdamW's final validation loss).
        preset: the preset this configuration started from, or None.
        run_timeout_s: wall-clock limit of one run.
        entry: module (``python -m ENTRY train ...``) or ``.py`` script each node runs.
        train: lowband train's tables every run gets on top of lowband train's defaults (the bench's
            defaults, the preset's and the user's; without the model and data, which are above).
        extra_train_args: ``[bench] train_args``: ``lowband train`` flags every run gets after ``train``.
        time_budget: training-clock seconds of every run, ``"auto"`` (the reference's measured
            training time; :mod:`lowband.bench.timebudget`), or None: ``steps`` steps each.
        tune: search each method variant's lr first (:mod:`lowband.bench.tune`).
    """

    methods: tuple[BenchMethod, ...]
    bandwidths_bps: tuple[float, ...]
    shards: tuple[int, ...] | None
    steps: int
    model: str
    data: str | None
    emulation: str
    latency_s: float
    nodes: int
    ranks_per_node: int
    seeds: tuple[int, ...]
    run_timeout_s: float
    entry: str
    train: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    extra_train_args: tuple[str, ...] = ()
    target_loss: float | None = None
    preset: str | None = None
    ft: str = "off"
    faults: tuple = ()  # lowband.bench.faults.FaultEvent
    time_budget: float | str | None = None
    tune: bool = False

    @property
    def seed(self) -> int:
        """The first seed (single-seed benches)."""
        return self.seeds[0]

    @property
    def train_args(self) -> tuple[str, ...]:
        """Every run's ``lowband train`` flags besides the bench's own: :attr:`train` as flags, then
        :attr:`extra_train_args` (which win)."""
        return (*train_flags(self.train), *self.extra_train_args)

    @classmethod
    def from_tables(cls, tables: Mapping[str, Mapping[str, Any]], *, where: str = "") -> BenchConfig:
        """The bench a job's tables describe (``{"bench": {"methods": "adamw,flexdemo", "steps": 30},
        "model": {"name": "t5-tiny"}}``), over its preset's tables and the defaults; keys not given keep
        those. Lists may be given as comma-separated text, as on the command line.

        Raises:
            ValueError: naming the bad table, key or value and what is accepted (``where``: the file).
        """
        user = check_tables(tables, where=where)
        preset = user.get("bench", {}).get("preset")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        layers = [DEFAULT_TRAIN, PRESETS[preset].tables() if preset is not None else {}, user]
        merged = merge(*layers)
        bench = BenchTable(**merged.get("bench", {}))
        return _build(bench, merged)

    def tables(self) -> dict[str, dict[str, Any]]:
        """The complete job (every ``[bench]`` key, defaults included; the train tables the runs get):
        :meth:`from_tables` of it is this configuration again. A None, which TOML cannot hold, is left out."""
        bench = {
            "preset": self.preset, "methods": [str(m) for m in self.methods],
            "bandwidths": [_bandwidth_text(b) for b in self.bandwidths_bps],
            "shards": list(self.shards) if self.shards is not None else None, "steps": self.steps,
            "seeds": list(self.seeds), "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
            "emulation": self.emulation, "latency_s": self.latency_s, "target_loss": self.target_loss,
            "run_timeout_s": self.run_timeout_s, "time_budget": "off" if self.time_budget is None else self.time_budget,
            "ft": self.ft, "faults": format_faults(self.faults) if self.faults else None, "tune": self.tune,
            "entry": self.entry, "train_args": list(self.extra_train_args),
        }  # fmt: skip
        out = merge({"bench": bench, "model": {"name": self.model}, "data": {"path": self.data}}, self.train)
        out = {t: {k: v for k, v in out[t].items() if v is not None} for t in TABLES if t in out}
        return {t: body for t, body in out.items() if body}

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form, as stored under ``config`` in results.json."""
        return {
            "methods": [str(m) for m in self.methods],
            "bandwidths_bps": list(self.bandwidths_bps),
            "shards": list(self.shards) if self.shards is not None else None,
            "steps": self.steps,
            "model": self.model,
            "data": self.data,
            "emulation": self.emulation,
            "latency_s": self.latency_s,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "seeds": list(self.seeds),
            "target_loss": self.target_loss,
            "preset": self.preset,
            "run_timeout_s": self.run_timeout_s,
            "entry": self.entry,
            "train_args": list(self.train_args),
            "ft": self.ft,
            "faults": [str(e) for e in self.faults],
            "time_budget": self.time_budget,
            "train": {t: dict(body) for t, body in self.train.items()},
            "tune": self.tune,
        }


def _bandwidth_text(bps: float) -> str | float:
    """A rate as a job file writes it: ``"100mbit"`` where that reads back exactly, else bit/s."""
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        text = f"{bps / factor:g}{unit}"
        if bps >= factor and parse_bandwidth(text) == bps:
            return text
    return bps


def _check_model(model: str) -> None:

    try:
        resolve_model(model)  # a named size, a local model directory, or a hub id in the local cache
    except FileNotFoundError as e:
        raise ValueError(str(e)) from e


def _check_data(data: str, model: str) -> None:

    try:
        extensions = check_data_file(data).extensions
    except FileNotFoundError as e:
        raise ValueError(str(e)) from e
    size = MODEL_SIZES.get(model)
    if ".txt" in extensions and size is not None and size.kind == "seq2seq":
        raise ValueError(
            f"{data} is plain text (one text per line) and suits a causal model, but {model} is seq2seq; "
            f"use a causal model ({', '.join(n for n, s in MODEL_SIZES.items() if s.kind == 'causal')}) "
            "or a .jsonl/.csv file with source and target columns"
        )


def _check_group_sizes(specs: Sequence[BenchMethod], *, nodes: int, ranks_per_node: int,
                       shards: Sequence[int] | None) -> None:
    """NoLoCo's group size n must not exceed the replicas R = nodes × ranks per node / shards."""
    for spec in specs:
        if not METHODS[spec.name].gossip:
            continue
        n = spec.hp.group_size
        for s in [spec.shards] if spec.shards is not None else (shards or [ranks_per_node]):
            replicas = nodes * ranks_per_node // s
            if replicas > 1 and n > replicas:
                raise ValueError(f"{spec}: NoLoCo's group size n={n} exceeds the {replicas} replicas of {nodes} "
                                 f"node(s) × {ranks_per_node} rank(s) at {s} shard(s); use n <= {replicas} "
                                 f"or more --nodes")


def _check_data_columns(data: str, model: str, cfg) -> None:
    """A seq2seq model's .jsonl/.csv/.tsv must have the source and target columns, checked on its first row."""


    size = MODEL_SIZES.get(model)
    path = Path(data)
    ext = path.suffix.lower()
    if size is None or ext not in (".jsonl", ".csv", ".tsv") or not path.is_file():  # globs: the run checks
        return
    if size.kind == "seq2seq":
        wanted = {"source": cfg.data.source_column, "target": cfg.data.target_column}
        fix = "--train-args='--source-column NAME --target-column NAME'"
    else:
        wanted = {"text": cfg.data.text_column}
        fix = "--train-args='--text-column NAME'"
    try:
        with path.open(encoding="utf-8") as f:
            if ext == ".jsonl":
                first = next((line for line in f if line.strip()), None)
                if first is None:
                    raise ValueError(f"{data} holds no example; give a file with one JSON object per line")
                row = json.loads(first)
                columns = list(row) if isinstance(row, dict) else []
            else:
                columns = next(csv.reader(f, delimiter="\t" if ext == ".tsv" else ","), [])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {data}: {e}; give a readable UTF-8 {ext} file") from None
    for role, column in wanted.items():
        if column not in columns:
            raise ValueError(f"{data} has no {role} column {column!r} (its first row has: "
                             f"{', '.join(map(str, columns)) or 'none'}); name it with {fix}")


def _parse_seeds(seeds: int | str | Sequence[int | str]) -> tuple[int, ...]:
    values = parse_int_list(seeds, what="--seeds", example="0,1,2")
    if len(set(values)) != len(values):
        raise ValueError(f"--seeds {','.join(map(str, values))} names a seed twice; give each seed once")
    return tuple(values)


def _check_meaningful(specs: Sequence[BenchMethod], steps: int) -> None:
    """Refuse a configuration whose runs could not show what they claim (no outer step at all)."""
    for spec in specs:
        if hasattr(spec.hp, "sync_every"):
            h = spec.hp.sync_every
            if h > steps:
                raise ValueError(
                    f"{spec}: H={h} inner steps per outer step with --steps {steps} means no outer step "
                    f"ever happens (0 bytes sent, plain local AdamW); give {spec.name}:H=N with N <= {steps} "
                    f"(e.g. {spec.name}:H={max(1, steps // 4)}) or raise --steps above {h}"
                )
            note = unmerged_tail_note(steps, h)
            if note is not None:
                log.warning("%s: %s", spec, note)


def _build(bench: BenchTable, tables: Mapping[str, Mapping[str, Any]]) -> BenchConfig:
    """Check everything a job's merged tables give and build its :class:`BenchConfig`.

    Raises:
        ValueError: naming the bad value and listing what is accepted.
    """

    model = tables["model"]["name"]
    data = tables.get("data", {}).get("path")
    nodes, ranks_per_node, steps = bench.nodes, bench.ranks_per_node, bench.steps
    if nodes < 2:
        raise ValueError(f"nodes={nodes}: a bench needs at least 2 nodes to have a link between them")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node}: give at least 1 rank per node")
    if steps < 1:
        raise ValueError(f"steps={steps}: give at least 1 training step")
    run_timeout_s = parse_duration(bench.run_timeout_s, what="--run-timeout")
    if not run_timeout_s > 0:
        raise ValueError(f"run timeout {run_timeout_s} s: give a positive number of seconds")
    specs = tuple(parse_method_list(bench.methods))
    bw_items = split_list([str(b) for b in bench.bandwidths])
    if not bw_items:
        raise ValueError("no bandwidth given; e.g. --bandwidth 100mbit,500mbit,1gbit")
    bandwidths_bps = tuple(dict.fromkeys(parse_bandwidth(b) for b in bw_items))
    shard_values: tuple[int, ...] | None = None
    if bench.shards is not None:
        shard_values = tuple(dict.fromkeys(parse_int_list(bench.shards, what="--shards", example="1,2")))
    divisors = [d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0]
    for s in [*(shard_values or ()), *(spec.shards for spec in specs if spec.shards is not None)]:
        try:
            Topology(num_nodes=nodes, ranks_per_node=ranks_per_node, shards=s)
        except ValueError as exc:
            raise ValueError(f"shards={s}: {exc} (accepted: {', '.join(map(str, divisors))})") from None
    _check_model(model)
    if data is not None:
        _check_data(data, model)
        data = str(Path(data).expanduser().resolve())  # the nodes may not share this working directory
    if Path(model).expanduser().is_dir():
        model = str(Path(model).expanduser().resolve())
    latency_s = parse_duration(bench.latency_s)
    seed_values = _parse_seeds(bench.seeds)
    for spec in specs:
        if (spec.nseeds or 1) > len(seed_values):
            raise ValueError(f"{spec}: nseeds={spec.nseeds} exceeds the {len(seed_values)} seed(s) of the bench "
                             f"(--seeds {','.join(map(str, seed_values))}); lower nseeds or add seeds")
    target_loss = bench.target_loss
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise ValueError(f"--target-loss {target_loss}: give a positive validation loss, e.g. --target-loss 6.5")
    _check_meaningful(specs, steps)
    entry = bench.entry
    if entry.endswith(".py") and not Path(entry).is_file():
        raise ValueError(f"entry script {entry} does not exist; give a module name or an existing .py file")
    _check_group_sizes(specs, nodes=nodes, ranks_per_node=ranks_per_node, shards=shard_values)
    train = run_tables(tables)
    if entry == DEFAULT_ENTRY:  # lowband's own flags, checked now (another entry may take flags of its own)
        _check_train_settings(specs, train, bench.train_args, data=data, model=model)
    budget = bench.time_budget
    if budget is None:  # not given: auto for a plain bench that holds the reference (timebudget's rule)
        budget = default_time_budget(bench.methods, preset=bench.preset, ft=bench.ft, faults=bench.faults)
    budget = parse_time_budget(budget)
    check_time_budget(budget, specs, ft=bench.ft, faults=bench.faults or ())
    specs = reference_first(specs, budget)  # under "auto" the reference runs first: it sets the budget
    fault_events = _check_fault_tolerance(specs, ft=bench.ft, faults=bench.faults, nodes=nodes, steps=steps,
                                          entry=entry, ranks_per_node=ranks_per_node)
    return BenchConfig(
        methods=specs,
        bandwidths_bps=bandwidths_bps,
        shards=shard_values,
        steps=steps,
        model=model,
        data=data,
        emulation=bench.emulation,
        latency_s=latency_s,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        seeds=seed_values,
        target_loss=target_loss,
        preset=bench.preset,
        run_timeout_s=run_timeout_s,
        entry=entry,
        train=train,
        extra_train_args=bench.train_args,
        ft=bench.ft,
        faults=fault_events,
        time_budget=budget,
        tune=bench.tune,
    )


def _check_train_settings(specs: Sequence[BenchMethod], train: Mapping[str, Mapping[str, Any]],
                          extra: Sequence[str], *, data: str | None, model: str) -> None:
    """The train tables and ``[bench] train_args`` with every method, as lowband train will read them: a
    hyper-parameter there goes to every method, so each must have it."""
    user = shlex.join(extra)
    try:
        given = merge(train, train_overrides(extra))
    except ValueError as e:
        raise ValueError(f"--train-args {user!r}: {e}") from None
    if given.get("run", {}).get("export_hf"):
        raise ValueError(f"--train-args {user!r}: --export-hf would have every run of the bench export to one "
                         "directory; give --train-args=--ckpt-at-end instead and export the runs you want "
                         "afterwards: lowband export BENCH_OUT/runs/<id> --out DIR")
    user_hp = {k: v for k, v in given.pop("method", {}).items() if k != "name"}
    train_config = None
    for spec in specs:
        try:
            train_config = TrainConfig.from_tables(
                {**given, "model": {**given.get("model", {}), "name": model},
                 "method": {"name": spec.name, **spec.given_values(), **user_hp}})
        except ValueError as e:
            raise ValueError(f"--train-args {user!r} with method {spec}: {e}. A hyper-parameter that only some "
                             f"methods have goes in their specs (e.g. diloco:H=10), not in --train-args") from None
    if train_config is not None and train_config.model.compile:
        check_compile("inductor")  # every run would fail at its start: said once, before any starts
    if data is not None and train_config is not None:
        _check_data_columns(data, model, train_config)


#: The methods whose messages carry indices (top-k of chunks): what --faults poison-index needs.
INDEXED = ("flexdemo", "demo", "sparseloco")


def _check_fault_tolerance(specs: Sequence[BenchMethod], *, ft: str, faults: str | None, nodes: int, steps: int,
                           entry: str, ranks_per_node: int) -> tuple:
    """Check ``--ft`` and ``--faults`` before anything starts; return the parsed fault plan."""
    events = parse_faults(faults, nodes=nodes, steps=steps) if faults is not None else ()
    if ft == "off" and not events:
        return ()

    require_torchft()
    if entry != DEFAULT_ENTRY:
        raise ValueError(f"--ft/--faults run `python -m lowband.cli train` on every node; --entry {entry} is not "
                         "supported with them")
    for spec in specs:
        try:
            spec.hp.check_fault_tolerance()
        except ValueError as exc:
            raise ValueError(f"{spec}: {exc}") from None
        if any(e.poison for e in events) and METHODS[spec.name].family == "full":
            raise ValueError(f"{spec}: --faults poison needs a method that sends an update of its own; {spec.name}'s "
                             "gradients are all-reduced (nothing in a sum names its sender). Leave it out of "
                             "--methods, or use flexdemo, demo, diloco, noloco or sparseloco")
        if any(e.action == "poison-index" for e in events) and spec.name not in INDEXED:
            raise ValueError(f"{spec}: --faults poison-index needs a method whose messages carry indices "
                             f"({', '.join(INDEXED)}); {spec.name}'s are dense. Leave it out of --methods, or use "
                             "poison-nan")
        one_copy_per_node = spec.shards in (None, ranks_per_node) and METHODS[spec.name].shards_per_node != 1
        if not one_copy_per_node and ranks_per_node > 1:
            raise ValueError(f"{spec}: under fault tolerance every node holds one model copy sharded over all its "
                             f"ranks; this runs {ranks_per_node} copies per node. Use --ranks-per-node 1 for DeMo "
                             "(or shards=ranks per node)")
    return events
