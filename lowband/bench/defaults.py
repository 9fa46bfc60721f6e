"""The defaults of ``lowband bench``: what it runs with no arguments. One place to tune them.

The default bench must finish within 10 minutes on a 2-core machine, and its model must be large
enough that AdamW's full gradient all-reduce makes it communication-bound on the default link. It
runs at equal training time (``--time-budget auto``, :mod:`lowband.bench.timebudget`); what it
measured is in docs/presets.md.
The job's tables (:mod:`lowband.bench.job`), the presets (:mod:`lowband.bench.presets`), the
configuration (:mod:`lowband.bench.config`) and the plan (:mod:`lowband.bench.plan`) read them from here.
"""

from __future__ import annotations

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
    "DEFAULT_TRAIN",
    "EMULATION_MODES",
    "FT_MODES",
]

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
#: `lowband train`'s tables as every run gets them, before a preset's and the user's (which win): the
#: bench's model, and a validation every 10 steps (the curves need points; lowband train's default is per epoch).
DEFAULT_TRAIN: dict[str, dict[str, object]] = {"model": {"name": DEFAULT_MODEL}, "run": {"val_every": 10}}
#: What each node runs: `python -m lowband train ...`. A module name or a path to a .py script.
DEFAULT_ENTRY = "lowband"
# ------------------------------------------------------------------------------------------------

EMULATION_MODES: tuple[str, ...] = ("auto", "netns", "shaped")
#: --ft: off, on, or both (every method with and without fault tolerance, side by side).
FT_MODES: tuple[str, ...] = ("off", "on", "both")
