"""Named benches (``lowband bench --preset NAME``) and how a run of one differs from the preset.

A :class:`Preset` is a layer of the job's typed tables (:mod:`lowband.bench.job`: its ``[bench]``
table and lowband train's tables it sets), with the reasons for them; the report
(:mod:`lowband.report.render`) says which of a run's settings came from its preset
(:func:`preset_differences`) and whether its learning rates were tuned on what ran
(:func:`lrs_tuned_here`). What the presets measured, and how their settings were chosen, is in
docs/presets.md.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowband.bench.defaults import DEFAULT_TRAIN
from lowband.bench.job import BenchTable, check_tables, merge, run_tables, train_flags
from lowband.train.args import parse_train_args, train_overrides
from lowband.train.models import MODEL_SIZES
from lowband.units import format_bandwidth, parse_bandwidth

__all__ = [
    "FRONTIER_PRESET",
    "PRESETS",
    "QUALITY_PRESET",
    "Preset",
    "data_name",
    "lrs_tuned_here",
    "preset_differences",
    "sequence_lengths",
]


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named bench: a layer of the job's tables (:mod:`lowband.bench.job`) under the user's, with the
    reasons for them (the user's file and flags win).

    Args:
        name: ``--preset NAME``.
        description: one line for ``--help``.
        bench: its ``[bench]`` table (every key: a preset is a whole bench).
        train: lowband train's tables it sets on top of the bench's defaults (``model``, ``data``,
            ``schedule``, ``checkpoint``, ``run``), checked as a job file's are.
        why: why these settings, for the report; printed only for a run of the preset as it is
            (no setting of it overridden), since it describes those settings.
        facts: what holds only on the preset's own model, data and sequence lengths (e.g. a loss
            figure of that data); printed only when those are what ran.
        lrs_tuned_on: the model and data the preset's learning rates were chosen on; the report
            warns when a run of the preset's methods used another model or data.
    """

    name: str
    description: str
    bench: BenchTable
    train: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    why: str = ""
    facts: str = ""
    lrs_tuned_on: str = ""

    def __post_init__(self) -> None:
        if "bench" in self.train:
            raise ValueError(f"preset {self.name}: its [bench] table is `bench=BenchTable(...)`, not in `train`")
        object.__setattr__(self, "train", check_tables(self.train, where=f"preset {self.name}: "))

    def tables(self) -> dict[str, dict[str, Any]]:
        """The preset as a layer of a job's tables: its ``[bench]`` (naming itself) and train tables."""
        return merge({"bench": {**self.bench.table(), "preset": self.name}}, self.train)

    @property
    def model(self) -> str:
        """The model its runs train (``[model] name``, else the bench's default)."""
        return merge(DEFAULT_TRAIN, self.train)["model"]["name"]

    @property
    def data(self) -> str | None:
        """Its data file (``[data] path``), None for the embedded corpus."""
        return self.train.get("data", {}).get("path")

    @property
    def train_args(self) -> tuple[str, ...]:
        """Its runs' ``lowband train`` flags, as results.json's ``config.train_args`` has them
        (:attr:`lowband.bench.config.BenchConfig.train_args`)."""
        return tuple(train_flags(run_tables(merge(DEFAULT_TRAIN, self.train))))


# The quality preset: does each method train as well as AdamW, and how much sooner on a 100 Mbit/s
# link (the FlexDeMo paper's Figures 3-4)? Why each setting is what it is: docs/presets.md.
QUALITY_PRESET = Preset(
    name="quality",
    description="every method at its best lr on the embedded corpus (and the paper's shared 1e-3) at 2 seeds, "
                "timed to AdamW's final loss",
    bench=BenchTable(
        methods=("adamw:lr=0.03", "adamw:lr=0.001,nseeds=1", "deto-full:lr=0.01", "demo:lr=0.03",
                 "flexdemo:topk=1,lr=0.03", "flexdemo:topk=1,lr=0.001,nseeds=1", "flexdemo:topk=8,lr=0.03",
                 "flexdemo:topk=1,values=sign,lr=0.01", "diloco:H=20,lr=0.003", "noloco:H=20,lr=0.01"),
        bandwidths=("100mbit",),
        steps=140,  # a multiple of H = 20: DiLoCo's and NoLoCo's last inner steps are merged
        seeds=(0, 1),
    ),
    train={"model": {"name": "t5-mini"},
           "data": {"max_source_len": 64, "max_target_len": 16},
           "schedule": {"lr_schedule": "cosine", "warmup_steps": 20},
           "run": {"val_every": 20}},
    why="t5-mini on the embedded Wikipedia pairs (64/16 tokens), 140 steps of a global batch of 32 with "
        "warm-up and cosine decay, 2 seeds, 2 nodes × 2 ranks at 100 Mbit/s; every method at its best lr "
        "from a 200-step sweep, AdamW and FlexDeMo Top-1 also at the paper's shared 1e-3 (first seed only).",
    facts="The loss axis matters from about 7.5 down: the targets' unigram cross-entropy is 6.84 nats "
          "(t5-mini's tokenizer on the embedded Wikipedia pairs, 16 target tokens).",
    lrs_tuned_on="t5-mini on the embedded Wikipedia pairs (64/16 tokens; a 200-step sweep at seed 0, "
                 "docs/time-to-quality.md)",
)

# The frontier preset: which variant keeps AdamW's quality at the fewest bits per parameter and step,
# at a horizon where the local-step methods have taken enough outer steps to be judged. Why each
# setting and learning rate is what it is: docs/presets.md.
FRONTIER_PRESET = Preset(
    name="frontier",
    description="quality per byte: AdamW, FlexDeMo, DiLoCo, NoLoCo and SparseLoCo (with AdamW or Muon inner steps) "
                "from 32 down to ~0.008 bits per parameter per step, 300 steps (30 outer steps at H=10), 2 seeds",
    bench=BenchTable(
        methods=("adamw:lr=0.01", "diloco:H=10,lr=0.003", "noloco:H=10,lr=0.01", "flexdemo:topk=8,lr=0.03",
                 "flexdemo:topk=1,lr=0.03", "sparseloco:H=10,topk=4,lr=0.03,transform=dct",
                 "sparseloco:H=10,lr=0.03", "sparseloco:H=10,lr=0.03,transform=dct",
                 "sparseloco:H=10,topk=1,lr=0.03,transform=dct",
                 "sparseloco:H=10,topk=1,lr=0.03,transform=dct,inner=muon"),
        bandwidths=("1gbit",),
        steps=300,  # one pass over the training pairs; a multiple of H = 10
        seeds=(0, 1),
    ),
    train={"model": {"name": "t5-mini"},
           "data": {"max_source_len": 64, "max_target_len": 16},
           "schedule": {"lr_schedule": "cosine", "warmup_steps": 20},
           "run": {"val_every": 30}},
    why="t5-mini on the embedded Wikipedia pairs (64/16 tokens), 300 steps of a global batch of 32 (one pass "
        "over the data) with warm-up and cosine decay, 2 seeds, 2 nodes × 2 ranks at 1 Gbit/s (bytes and loss "
        "do not depend on the link); the local-step methods at H = 10, 30 outer steps each; AdamW's and "
        "SparseLoCo's learning rates from a 300-step sweep at these settings, the others' from the quality "
        "preset's 200-step sweep; SparseLoCo with Muon's inner steps at AdamW's inner lr (Moonlight's lr "
        "matching, not swept).",
    facts="The loss axis matters from about 7.5 down: the targets' unigram cross-entropy is 6.84 nats "
          "(t5-mini's tokenizer on the embedded Wikipedia pairs, 16 target tokens).",
    lrs_tuned_on="t5-mini on the embedded Wikipedia pairs (64/16 tokens; docs/time-to-quality.md)",
)
PRESETS: dict[str, Preset] = {p.name: p for p in (QUALITY_PRESET, FRONTIER_PRESET)}


def sequence_lengths(model: str, train_args: Sequence[str]) -> str:
    """The tokens per example a run of ``model`` with these ``lowband train`` arguments uses, in words."""

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


def preset_differences(preset: Preset, config: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Which settings of a run (``config``: :meth:`BenchConfig.as_dict`) came from ``preset`` and which did not.

    Returns ``(kept, changed)``: names of the settings as the preset has them, and one phrase per
    setting given otherwise, with the preset's value (``"model gpt-mini (preset: t5-mini)"``). The data
    is a setting: a preset without one runs on the embedded corpus.
    """
    bench = preset.bench
    kept: list[str] = []
    changed: list[str] = []

    def check(name: str, ours: Any, theirs: Any, show=str) -> None:
        if ours == theirs:
            kept.append(name)
        else:
            changed.append(f"{name} {show(ours)} (preset: {show(theirs)})")

    check("methods", list(config.get("methods") or []), list(bench.methods), show=" ".join)
    check("link", list(config.get("bandwidths_bps") or []), [parse_bandwidth(b) for b in bench.bandwidths],
          show=lambda bws: ", ".join(format_bandwidth(b) for b in bws))
    check("steps", config.get("steps"), bench.steps)
    check("seeds", [int(x) for x in config.get("seeds") or []], [int(x) for x in bench.seeds],
          show=lambda xs: ",".join(map(str, xs)))
    check("model", config.get("model"), preset.model)
    check("data", config.get("data"), preset.data, show=data_name)
    ours, theirs = tuple(config.get("train_args") or ()), preset.train_args
    if ours == theirs or _same_train_settings(ours, theirs):
        kept.append("train args")
    elif ours[:len(theirs)] == theirs:
        kept.append("train args")
        changed.append(f"train args {shlex.join(ours[len(theirs):])} added after the preset's")
    else:
        changed.append(f"train args {shlex.join(ours)} (preset: {shlex.join(theirs)})")
    return kept, changed


def _same_train_settings(ours: Sequence[str], theirs: Sequence[str]) -> bool:
    """Whether two lists of ``lowband train`` flags set the same (a results.json written before the presets
    were tables holds the preset's flags in another order, with the bench's default before them)."""
    try:
        return train_overrides(ours, known_only=True) == train_overrides(theirs, known_only=True)
    except ValueError:
        return False


def lrs_tuned_here(preset: Preset, config: Mapping[str, Any]) -> bool:
    """True when a run of ``preset`` used the model and data its learning rates were chosen on."""
    return config.get("model") == preset.model and config.get("data") == preset.data
