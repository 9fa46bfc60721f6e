"""Named benches (``lowband bench --preset NAME``) and how a run of one differs from the preset.

A :class:`Preset` is a set of :func:`~lowband.bench.config.make_config` arguments with the reasons
for them; the report (:mod:`lowband.report.render`) says which of a run's settings came from its
preset (:func:`preset_differences`) and whether its learning rates were tuned on what ran
(:func:`lrs_tuned_here`).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowband.bench.defaults import DEFAULT_TRAIN_ARGS
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
#   then costs ~0.06 s instead of ~0.6 s, so 18 runs of 300 steps fit in the budget. Time to
#   quality is the quality preset's question (100 Mbit/s); here the modelled plots give it.
# - The variants span the bytes axis: AdamW (32 bits per parameter and step), DiLoCo H=10 fp32
#   (3.2), FlexDeMo Top-8 (1.5), Top-1 (0.19), NoLoCo H=10 (6.4; with 2 replicas its group is
#   both), and SparseLoCo H=10 with 2-bit values: Top-4 of 128 on the DCT (~0.032: 1,011x fewer
#   bytes than AdamW, just past the 1,000x goal: the most bytes a variant may send and still
#   meet it, so the first to try where Top-2 falls short), Top-2 on the flat chunks and on their DCT
#   (~0.016: ~2,000x), and Top-1 on the DCT (~0.008: ~4,000x, the stretch).
# - Learning rates: the reference and SparseLoCo were swept at these settings (300 steps, seed 0;
#   docs/time-to-quality.md, "The frontier preset"): AdamW 1e-2 (6.563 against 6.599 at 3e-2, the
#   quality preset's 200-step best), SparseLoCo 3e-2 (of 3e-3, 1e-2, 3e-2, 1e-1, on the flat
#   chunks; the DCT variants use it too). FlexDeMo, DiLoCo and NoLoCo at the quality preset's
#   (its 200-step sweep; DiLoCo and NoLoCo were swept at H = 20, not 10); SparseLoCo's Top-4 takes
#   Top-2's (added 2026-12-05, not swept). Two seeds: 18 runs, about 45 minutes on 2 cores.
# - SparseLoCo Top-1 on the DCT with Muon as its inner optimizer (inner=muon, MuLoCo; added 2026-12-05):
#   the stretch's bytes (~4,000x) with the inner steps that ended 0.30 below AdamW there on these settings
#   (docs/time-to-quality.md, "Muon as SparseLoCo's inner optimizer"); its lr is the AdamW inner steps' (Moonlight's
#   lr matching), not swept. 20 runs, about 50 minutes.
FRONTIER_PRESET = Preset(
    name="frontier",
    description="quality per byte: AdamW, FlexDeMo, DiLoCo, NoLoCo and SparseLoCo (with AdamW or Muon inner steps) "
                "from 32 down to ~0.008 bits per parameter per step, 300 steps (30 outer steps at H=10), 2 seeds",
    settings=dict(
        methods=("adamw:lr=0.01", "diloco:H=10,lr=0.003", "noloco:H=10,lr=0.01", "flexdemo:topk=8,lr=0.03",
                 "flexdemo:topk=1,lr=0.03", "sparseloco:H=10,topk=4,lr=0.03,transform=dct",
                 "sparseloco:H=10,lr=0.03", "sparseloco:H=10,lr=0.03,transform=dct",
                 "sparseloco:H=10,topk=1,lr=0.03,transform=dct",
                 "sparseloco:H=10,topk=1,lr=0.03,transform=dct,inner=muon"),
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
        "preset's 200-step sweep; SparseLoCo with Muon's inner steps at AdamW's inner lr (Moonlight's lr "
        "matching, not swept).",
    facts="The loss axis matters from about 7.5 down: the targets' unigram cross-entropy is 6.84 nats "
          "(t5-mini's tokenizer on the embedded Wikipedia pairs, 16 target tokens).",
    lrs_tuned_on="t5-mini on the embedded Wikipedia pairs (64/16 tokens; docs/time-to-quality.md)",
)
PRESETS: dict[str, Preset] = {p.name: p for p in (QUALITY_PRESET, FRONTIER_PRESET)}


def sequence_lengths(model: str, train_args: Sequence[str]) -> str:
    """The tokens per example a run of ``model`` with these ``lowband train`` arguments uses, in words."""
    from lowband.train.args import parse_train_args
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
