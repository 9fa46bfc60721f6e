"""What a bench runs: the validated configuration of ``lowband bench``.

Everything a user can get wrong is checked in :func:`make_config`, before any process starts:
method specs, bandwidths, shard counts, the model name, the data file, steps, latency.
:func:`lowband.bench.plan.plan_runs` then expands the configuration into one
:class:`~lowband.bench.plan.RunPlan` per training run. The defaults live in
:mod:`lowband.bench.defaults`, the named benches in :mod:`lowband.bench.presets`; both are
re-exported here.
"""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowband.bench.defaults import (
    DEFAULT_BANDWIDTHS,
    DEFAULT_ENTRY,
    DEFAULT_METHODS,
    DEFAULT_MODEL,
    DEFAULT_NODES,
    DEFAULT_RANKS_PER_NODE,
    DEFAULT_RUN_TIMEOUT_S,
    DEFAULT_SEED,
    DEFAULT_STEPS,
    DEFAULT_TRAIN_ARGS,
    EMULATION_MODES,
)
from lowband.bench.methods import METHODS, BenchMethod, parse_method_list
from lowband.bench.presets import (
    FRONTIER_PRESET,
    PRESETS,
    QUALITY_PRESET,
    Preset,
    data_name,
    lrs_tuned_here,
    preset_differences,
    sequence_lengths,
)
from lowband.bench.timebudget import check_time_budget, parse_time_budget, reference_first
from lowband.optim.outer.schedule import unmerged_tail_note
from lowband.units import parse_bandwidth, parse_duration, parse_int_list, split_list

__all__ = [
    "DEFAULT_BANDWIDTHS",
    "DEFAULT_ENTRY",
    "DEFAULT_METHODS",
    "DEFAULT_MODEL",
    "DEFAULT_NODES",
    "DEFAULT_RANKS_PER_NODE",
    "DEFAULT_RUN_TIMEOUT_S",
    "DEFAULT_SEED",
    "DEFAULT_STEPS",
    "DEFAULT_TRAIN_ARGS",
    "EMULATION_MODES",
    "FRONTIER_PRESET",
    "FT_MODES",
    "PRESETS",
    "QUALITY_PRESET",
    "Preset",
    "BenchConfig",
    "data_name",
    "lrs_tuned_here",
    "preset_differences",
    "sequence_lengths",
    "make_config",
]

log = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """A validated bench configuration (build it with :func:`make_config`).

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
        train_args: extra ``lowband train`` arguments for every run.
        time_budget: training-clock seconds of every run, ``"auto"`` (the reference's measured
            training time; :mod:`lowband.bench.timebudget`), or None: ``steps`` steps each.
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
    train_args: tuple[str, ...] = ()
    target_loss: float | None = None
    preset: str | None = None
    ft: str = "off"
    faults: tuple = ()  # lowband.bench.faults.FaultEvent
    time_budget: float | str | None = None

    @property
    def seed(self) -> int:
        """The first seed (single-seed benches)."""
        return self.seeds[0]

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
        }


def _check_model(model: str) -> None:
    from lowband.train.models import MODEL_SIZES

    if model in MODEL_SIZES:
        return
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return
    if path.is_dir():
        raise ValueError(
            f"model directory {model} has no config.json; known model sizes: {', '.join(MODEL_SIZES)}"
        )
    raise ValueError(
        f"unknown model {model!r}; known sizes: {', '.join(MODEL_SIZES)} "
        "(or a local model directory holding a config.json)"
    )


def _check_data(data: str, model: str) -> None:
    from lowband.train.data import check_data_file
    from lowband.train.models import MODEL_SIZES

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
    import csv
    import json

    from lowband.train.models import MODEL_SIZES

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


def make_config(
    *,
    methods: str | Sequence[str] = DEFAULT_METHODS,
    bandwidths: str | Sequence[str] = DEFAULT_BANDWIDTHS,
    shards: str | Sequence[str] | None = None,
    steps: int = DEFAULT_STEPS,
    model: str = DEFAULT_MODEL,
    data: str | None = None,
    emulation: str = "auto",
    latency: str | float = 0.0,
    nodes: int = DEFAULT_NODES,
    ranks_per_node: int = DEFAULT_RANKS_PER_NODE,
    seeds: int | str | Sequence[int | str] = (DEFAULT_SEED,),
    target_loss: float | None = None,
    preset: str | None = None,
    run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
    entry: str = DEFAULT_ENTRY,
    train_args: str | Sequence[str] = (),
    ft: str = "off",
    faults: str | None = None,
    time_budget: float | str | None = None,
) -> BenchConfig:
    """Check everything a user gave and build a :class:`BenchConfig`.

    Lists may be given as comma-separated strings (as on the command line) or as sequences.

    Raises:
        ValueError: naming the bad value and listing what is accepted.
    """
    from lowband.distributed.topology import Topology

    if emulation not in EMULATION_MODES:
        raise ValueError(f"unknown emulation {emulation!r}; accepted: {', '.join(EMULATION_MODES)}")
    if nodes < 2:
        raise ValueError(f"nodes={nodes}: a bench needs at least 2 nodes to have a link between them")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node}: give at least 1 rank per node")
    if steps < 1:
        raise ValueError(f"steps={steps}: give at least 1 training step")
    if not run_timeout_s > 0:
        raise ValueError(f"run timeout {run_timeout_s} s: give a positive number of seconds")
    specs = tuple(parse_method_list(methods))
    bw_items = split_list(bandwidths)
    if not bw_items:
        raise ValueError("no bandwidth given; e.g. --bandwidth 100mbit,500mbit,1gbit")
    bandwidths_bps = tuple(dict.fromkeys(parse_bandwidth(b) for b in bw_items))
    shard_values: tuple[int, ...] | None = None
    if shards is not None:
        shard_values = tuple(dict.fromkeys(parse_int_list(shards, what="--shards", example="1,2")))
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
    latency_s = parse_duration(latency)
    seed_values = _parse_seeds(seeds)
    for spec in specs:
        if (spec.nseeds or 1) > len(seed_values):
            raise ValueError(f"{spec}: nseeds={spec.nseeds} exceeds the {len(seed_values)} seed(s) of the bench "
                             f"(--seeds {','.join(map(str, seed_values))}); lower nseeds or add seeds")
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise ValueError(f"--target-loss {target_loss}: give a positive validation loss, e.g. --target-loss 6.5")
    _check_meaningful(specs, steps)
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    # The bench's own defaults first: the user's arguments come later and win.
    entry_args = DEFAULT_TRAIN_ARGS + (
        tuple(shlex.split(train_args)) if isinstance(train_args, str) else tuple(train_args))
    if entry.endswith(".py") and not Path(entry).is_file():
        raise ValueError(f"entry script {entry} does not exist; give a module name or an existing .py file")
    _check_group_sizes(specs, nodes=nodes, ranks_per_node=ranks_per_node, shards=shard_values)
    if entry == DEFAULT_ENTRY:  # lowband's own flags, checked now (another entry may take flags of its own)
        from lowband.train.args import train_overrides
        from lowband.train.config import TrainConfig

        user = shlex.join(entry_args[len(DEFAULT_TRAIN_ARGS):])
        try:
            given = train_overrides(entry_args)
        except ValueError as e:
            raise ValueError(f"--train-args {user!r}: {e}") from None
        user_hp = {k: v for k, v in given.get("method", {}).items() if k != "name"}
        for spec in specs:  # the user's hyper-parameters go to every method: each must have them
            try:
                train_config = TrainConfig.from_tables(
                    {**given, "method": {"name": spec.name, **spec.given_values(), **user_hp}})
            except ValueError as e:
                raise ValueError(f"--train-args {user!r} with method {spec}: {e}. A hyper-parameter that only some "
                                 f"methods have goes in their specs (e.g. diloco:H=10), not in --train-args") from None
        if data is not None:
            _check_data_columns(data, model, train_config)
    budget = parse_time_budget(time_budget)
    check_time_budget(budget, specs, ft=ft, faults=faults or ())
    specs = reference_first(specs, budget)  # under "auto" the reference runs first: it sets the budget
    fault_events = _check_fault_tolerance(specs, ft=ft, faults=faults, nodes=nodes, steps=steps, entry=entry,
                                          ranks_per_node=ranks_per_node)
    return BenchConfig(
        methods=specs,
        bandwidths_bps=bandwidths_bps,
        shards=shard_values,
        steps=steps,
        model=model,
        data=data,
        emulation=emulation,
        latency_s=latency_s,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        seeds=seed_values,
        target_loss=target_loss,
        preset=preset,
        run_timeout_s=run_timeout_s,
        entry=entry,
        train_args=entry_args,
        ft=ft,
        faults=fault_events,
        time_budget=budget,
    )


FT_MODES = ("off", "on", "both")


#: The methods whose messages carry indices (top-k of chunks): what --faults poison-index needs.
INDEXED = ("flexdemo", "demo", "sparseloco")


def _check_fault_tolerance(specs: Sequence[BenchMethod], *, ft: str, faults: str | None, nodes: int, steps: int,
                           entry: str, ranks_per_node: int) -> tuple:
    """Check ``--ft`` and ``--faults`` before anything starts; return the parsed fault plan."""
    from lowband.bench.faults import parse_faults

    if ft not in FT_MODES:
        raise ValueError(f"--ft {ft!r}: accepted: {', '.join(FT_MODES)} (both: every method with and without "
                         "fault tolerance, side by side)")
    events = parse_faults(faults, nodes=nodes, steps=steps) if faults is not None else ()
    if ft == "off" and not events:
        return ()
    from lowband.ft.node import require_torchft

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
