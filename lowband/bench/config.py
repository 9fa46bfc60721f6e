"""What a bench runs: the defaults of ``lowband bench``, the validated configuration, and the plan.

Everything a user can get wrong is checked in :func:`make_config`, before any process starts:
method specs, bandwidths, shard counts, the model name, the data file, steps, latency.
:func:`plan_runs` then expands the configuration into one :class:`RunPlan` per training run
(every method at every bandwidth; FlexDeMo-family methods at every ``--shards`` value).
"""

from __future__ import annotations

import logging
import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowband.bench.methods import (
    METHODS,
    SHARD_SWEEP,
    BenchMethod,
    canonical_method,
    method_label,
    parse_method_list,
    shown_params,
    train_hp_args,
)
from lowband.optim.outer import unmerged_tail_note
from lowband.train.methods import MethodConfig
from lowband.units import format_bandwidth, parse_bandwidth, parse_duration, parse_int_list, split_list

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
    "PRESETS",
    "QUALITY_PRESET",
    "Preset",
    "BenchConfig",
    "data_name",
    "lrs_tuned_here",
    "preset_differences",
    "sequence_lengths",
    "RunPlan",
    "make_config",
    "plan_runs",
]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------
# The default bench: what `lowband bench` runs with no arguments. One place to tune it. It must
# finish within 10 minutes on a 2-core machine, and the model must be large enough that AdamW's
# full gradient all-reduce makes it communication-bound on the default link.

#: Methods of the default bench: the FlexDeMo paper's Table 1 columns, then DiLoCo and NoLoCo (H = 10).
DEFAULT_METHODS: tuple[str, ...] = (
    "adamw", "deto-full", "demo", "flexdemo:topk=1", "flexdemo:topk=8", "diloco:H=10", "noloco:H=10",
)
#: Link rates of the default bench (one row of Table 1).
DEFAULT_BANDWIDTHS: tuple[str, ...] = ("100mbit",)
#: Model of every run (a name in lowband.train.models.MODEL_SIZES, or a local model directory).
DEFAULT_MODEL = "t5-mini"
#: Training steps of every run.
DEFAULT_STEPS = 40
#: Emulated nodes and ranks per node (the paper: 2 nodes × 2 GPUs).
DEFAULT_NODES = 2
DEFAULT_RANKS_PER_NODE = 2
#: Seed of model initialisation and data order, the same for every run.
DEFAULT_SEED = 0
#: Wall-clock limit of one run (all its nodes); a run that takes longer is recorded as failed.
DEFAULT_RUN_TIMEOUT_S = 600.0
#: `lowband train` arguments of every run, before the user's --train-args (which win).
DEFAULT_TRAIN_ARGS: tuple[str, ...] = ("--val-every", "10")
#: What each node runs: `python -m lowband train ...`. A module name or a path to a .py script.
DEFAULT_ENTRY = "lowband"
# ------------------------------------------------------------------------------------------------

EMULATION_MODES: tuple[str, ...] = ("auto", "netns", "shaped")


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named bench: the :func:`make_config` arguments it sets (the user's own arguments win).

    Args:
        name: ``--preset NAME``.
        description: one line for ``--help``.
        settings: :func:`make_config` keyword arguments.
        why: why these settings, for the report; printed only for a run of the preset as it is
            (no setting of it overridden), since it describes those settings.
        facts: what holds only on the preset's own model, data and sequence lengths (e.g. a loss
            figure of that data); printed only when those are what ran.
        lrs_tuned_on: the model and data the preset's learning rates were chosen on; the report
            warns when a run of the preset's methods used another model or data.
    """

    name: str
    description: str
    settings: dict[str, Any]
    why: str = ""
    facts: str = ""
    lrs_tuned_on: str = ""


# ------------------------------------------------------------------------------------------------
# The quality preset: does each method train as well as AdamW, and how much sooner does it get
# there on a 100 Mbit/s link (the FlexDeMo paper's Figures 3-4)? It must finish on 2 cores in
# about 45 minutes, and be long enough that the losses leave the unigram stage.
#
# - Model and data: t5-mini (1.97M parameters at vocab 8192) on the embedded Wikipedia pairs, so
#   AdamW's gradient all-reduce (7.9 MB per node and step) takes longer at 100 Mbit/s than a step's
#   compute on 2 cores: communication-bound, as t5-small on GPUs is in the paper.
#   64/16 tokens instead of the default 128/32: the one-line descriptions rarely exceed 16 tokens
#   and their subject sits in the first sentence; it halves compute, so more steps fit.
# - 140 steps of a global batch of 32 (under half an epoch), warm-up 20 then cosine to 0.1x. The
#   budget sets the length (18 runs, each with its start-up, validation and shutdown; 160 steps
#   overran it), so 140 it is: a multiple of H = 20, so DiLoCo's and NoLoCo's last inner steps are
#   merged by an outer step. At the sweep's 200 steps AdamW reaches 6.67 against the targets'
#   unigram cross-entropy of 6.84 nats; at 140 AdamW and FlexDeMo Top-8 end about 0.05 below it
#   (6.78, 6.79), the others above it and still falling. Validation every 20 steps (8 points per
#   curve).
# - Every method at its best lr from the sweep in docs/time-to-quality.md (200 steps, seed 0, lr
#   from 1e-3 up to where the loss turned up again, or to 3e-2/1e-1), and AdamW and FlexDeMo Top-1
#   also at the paper's shared lr 1e-3, at the first seed only (nseeds=1: a reference, not a
#   claim). Two seeds for the spread.
# - DiLoCo and NoLoCo at their papers' outer settings (DiLoCo: outer lr 0.7, Nesterov 0.9; NoLoCo:
#   alpha 0.5, beta 0.7) with H scaled to the run: H = 20, 7 outer steps in 140 (the NoLoCo
#   paper's H = 50 in a far longer run). With 2 replicas NoLoCo's group is everyone (the report says so).
QUALITY_PRESET = Preset(
    name="quality",
    description="every method at its best lr on the embedded corpus (and the paper's shared 1e-3) at 2 seeds, "
                "timed to AdamW's final loss",
    settings=dict(
        methods=("adamw:lr=0.03", "adamw:lr=0.001,nseeds=1", "deto-full:lr=0.01", "demo:lr=0.03",
                 "flexdemo:topk=1,lr=0.03", "flexdemo:topk=1,lr=0.001,nseeds=1", "flexdemo:topk=8,lr=0.03",
                 "flexdemo:topk=1,values=sign,lr=0.01", "diloco:H=20,lr=0.003", "noloco:H=20,lr=0.01"),
        bandwidths=("100mbit",),
        steps=140,
        seeds=(0, 1),
        model="t5-mini",
        train_args=("--max-source-len", "64", "--max-target-len", "16", "--val-every", "20",
                    "--schedule", "cosine", "--warmup-steps", "20"),
    ),
    why="t5-mini on the embedded Wikipedia pairs (64/16 tokens), 140 steps of a global batch of 32 with "
        "warm-up and cosine decay, 2 seeds, 2 nodes × 2 ranks at 100 Mbit/s; every method at its best lr "
        "from a 200-step sweep, AdamW and FlexDeMo Top-1 also at the paper's shared 1e-3 (first seed only).",
    facts="The loss axis matters from about 7.5 down: the targets' unigram cross-entropy is 6.84 nats "
          "(t5-mini's tokenizer on the embedded Wikipedia pairs, 16 target tokens).",
    lrs_tuned_on="t5-mini on the embedded Wikipedia pairs (64/16 tokens; a 200-step sweep at seed 0, "
                 "docs/time-to-quality.md)",
)

# ------------------------------------------------------------------------------------------------
# The frontier preset: which variant keeps AdamW's quality at the fewest bits per parameter and
# step, judged at a horizon where the local-step methods have taken enough outer steps to be
# judged (the quality preset's 140 steps are 7 outer steps at H = 20). It must finish on 2 cores
# in about 45 minutes.
#
# - Model, data and lengths as the quality preset (t5-mini on the embedded Wikipedia pairs,
#   64/16 tokens): its learning rates carry over, and its unigram cross-entropy (6.84 nats) is
#   the stage to get well past.
# - 300 steps of a global batch of 32: 9,600 pairs, one pass over the ~9,800 training pairs (no
#   pair seen twice, so a lower loss is not memorisation). H = 10 for the local-step methods, so
#   each takes 30 outer steps, and 300 is a multiple of 10 (the last inner steps are merged).
#   Validation every 30 steps (one point per 3 outer steps; 10 points per curve).
# - 1 Gbit/s: bytes and loss do not depend on the link, and AdamW's 7.9 MB all-reduce per step
#   then costs ~0.06 s instead of ~0.6 s, so 16 runs of 300 steps fit in the budget. Time to
#   quality is the quality preset's question (100 Mbit/s); here the modelled plots give it.
# - The variants span the bytes axis: AdamW (32 bits per parameter and step), DiLoCo H=10 fp32
#   (3.2), FlexDeMo Top-8 (1.5), Top-1 (0.19), NoLoCo H=10 (6.4; with 2 replicas its group is
#   both), and SparseLoCo H=10 at Top-2 of 128 with 2-bit values, on the flat chunks and on their
#   DCT (~0.016: ~2,000x fewer bytes than AdamW, the goal), and at Top-1 with the DCT (~0.008:
#   ~4,000x, the stretch).
# - Learning rates: the reference and SparseLoCo were swept at these settings (300 steps, seed 0;
#   docs/time-to-quality.md, "The frontier preset"): AdamW 1e-2 (6.563 against 6.599 at 3e-2, the
#   quality preset's 200-step best), SparseLoCo 3e-2 (of 3e-3, 1e-2, 3e-2, 1e-1, on the flat
#   chunks; the DCT variants use it too). FlexDeMo, DiLoCo and NoLoCo at the quality preset's
#   (its 200-step sweep; DiLoCo and NoLoCo were swept at H = 20, not 10). Two seeds: 16 runs,
#   about 40 minutes on 2 cores.
FRONTIER_PRESET = Preset(
    name="frontier",
    description="quality per byte: AdamW, FlexDeMo, DiLoCo, NoLoCo and SparseLoCo from 32 down to ~0.008 bits "
                "per parameter per step, 300 steps (30 outer steps at H=10), 2 seeds",
    settings=dict(
        methods=("adamw:lr=0.01", "diloco:H=10,lr=0.003", "noloco:H=10,lr=0.01", "flexdemo:topk=8,lr=0.03",
                 "flexdemo:topk=1,lr=0.03", "sparseloco:H=10,lr=0.03", "sparseloco:H=10,lr=0.03,transform=dct",
                 "sparseloco:H=10,topk=1,lr=0.03,transform=dct"),
        bandwidths=("1gbit",),
        steps=300,
        seeds=(0, 1),
        model="t5-mini",
        train_args=("--max-source-len", "64", "--max-target-len", "16", "--val-every", "30",
                    "--schedule", "cosine", "--warmup-steps", "20"),
    ),
    why="t5-mini on the embedded Wikipedia pairs (64/16 tokens), 300 steps of a global batch of 32 (one pass "
        "over the data) with warm-up and cosine decay, 2 seeds, 2 nodes × 2 ranks at 1 Gbit/s (bytes and loss "
        "do not depend on the link); the local-step methods at H = 10, 30 outer steps each; AdamW's and "
        "SparseLoCo's learning rates from a 300-step sweep at these settings, the others' from the quality "
        "preset's 200-step sweep.",
    facts="The loss axis matters from about 7.5 down: the targets' unigram cross-entropy is 6.84 nats "
          "(t5-mini's tokenizer on the embedded Wikipedia pairs, 16 target tokens).",
    lrs_tuned_on="t5-mini on the embedded Wikipedia pairs (64/16 tokens; docs/time-to-quality.md)",
)
PRESETS: dict[str, Preset] = {p.name: p for p in (QUALITY_PRESET, FRONTIER_PRESET)}


def sequence_lengths(model: str, train_args: Sequence[str]) -> str:
    """The tokens per example a run of ``model`` with these ``lowband train`` arguments uses, in words."""
    from lowband.train.cli import parse_train_args
    from lowband.train.models import MODEL_SIZES

    data = parse_train_args(train_args, known_only=True).data
    causal = f"{data.max_len} tokens per text" if data.packing == "lines" else f"blocks of {data.max_len} packed tokens"
    seq2seq = f"{data.max_source_len} source / {data.max_target_len} target tokens"
    size = MODEL_SIZES.get(model)
    if size is None:
        return f"{seq2seq} if seq2seq, {causal} if causal"
    return seq2seq if size.kind == "seq2seq" else causal


def data_name(data: str | None) -> str:
    """The data of a bench in words: its file name, or the embedded corpus."""
    return "the embedded corpus" if data is None else f"`{Path(data).name}`"


def preset_differences(preset: Preset, config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Which settings of a run (``config``: :meth:`BenchConfig.as_dict`) came from ``preset`` and which did not.

    Returns ``(kept, changed)``: names of the settings as the preset has them, and one phrase per
    setting given otherwise on the command line, with the preset's value (``"model gpt-mini (preset:
    t5-mini)"``). The data is a setting: a preset without one runs on the embedded corpus.
    """
    settings = preset.settings
    kept: list[str] = []
    changed: list[str] = []

    def check(name: str, ours: Any, theirs: Any, show=str) -> None:
        if ours == theirs:
            kept.append(name)
        else:
            changed.append(f"{name} {show(ours)} (preset: {show(theirs)})")

    if "methods" in settings:
        check("methods", list(config.get("methods") or []), list(settings["methods"]), show=" ".join)
    if "bandwidths" in settings:
        check("link", list(config.get("bandwidths_bps") or []), [parse_bandwidth(b) for b in settings["bandwidths"]],
              show=lambda bws: ", ".join(format_bandwidth(b) for b in bws))
    if "steps" in settings:
        check("steps", config.get("steps"), settings["steps"])
    if "seeds" in settings:
        check("seeds", [int(x) for x in config.get("seeds") or []], [int(x) for x in settings["seeds"]],
              show=lambda xs: ",".join(map(str, xs)))
    if "model" in settings:
        check("model", config.get("model"), settings["model"])
    check("data", config.get("data"), settings.get("data"), show=data_name)
    ours, theirs = tuple(config.get("train_args") or ()), DEFAULT_TRAIN_ARGS + tuple(settings.get("train_args", ()))
    if ours == theirs:
        kept.append("train args")
    elif ours[:len(theirs)] == theirs:
        kept.append("train args")
        changed.append(f"train args {shlex.join(ours[len(theirs):])} added after the preset's")
    else:
        changed.append(f"train args {shlex.join(ours)} (preset: {shlex.join(theirs)})")
    return kept, changed


def lrs_tuned_here(preset: Preset, config: dict[str, Any]) -> bool:
    """True when a run of ``preset`` used the model and data its learning rates were chosen on."""
    return config.get("model") == preset.settings.get("model") and config.get("data") == preset.settings.get("data")


def _bandwidth_slug(bandwidth_bps: float) -> str:
    return format_bandwidth(bandwidth_bps).replace("/s", "").replace(" ", "").lower()


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
        ext = check_data_file(data).suffix.lower()
    except FileNotFoundError as e:
        raise ValueError(str(e)) from e
    size = MODEL_SIZES.get(model)
    if ext == ".txt" and size is not None and size.kind == "seq2seq":
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
    if size is None or ext not in (".jsonl", ".csv", ".tsv"):
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
) -> BenchConfig:
    """Check everything a user gave and build a :class:`BenchConfig`.

    Lists may be given as comma-separated strings (as on the command line) or as sequences.

    Raises:
        ValueError: naming the bad value and listing what is accepted.
    """
    from lowband.topology import Topology

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
        from lowband.train.cli import train_overrides
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
    )


FT_MODES = ("off", "on", "both")


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
    from lowband.ft import require_torchft

    require_torchft()
    if entry != DEFAULT_ENTRY:
        raise ValueError(f"--ft/--faults run `python -m lowband.cli train` on every node; --entry {entry} is not "
                         "supported with them")
    for spec in specs:
        try:
            spec.hp.check_fault_tolerance()
        except ValueError as exc:
            raise ValueError(f"{spec}: {exc}") from None
        one_copy_per_node = spec.shards in (None, ranks_per_node) and METHODS[spec.name].shards_per_node != 1
        if not one_copy_per_node and ranks_per_node > 1:
            raise ValueError(f"{spec}: under fault tolerance every node holds one model copy sharded over all its "
                             f"ranks; this runs {ranks_per_node} copies per node. Use --ranks-per-node 1 for DeMo "
                             "(or shards=ranks per node)")
    return events


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
            "model": {"name": config.model, "shards": self.shards}, "schedule": {"steps": config.steps},
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
        argv += ["--model", config.model, "--steps", str(config.steps), "--seed", str(self.seed)]
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
