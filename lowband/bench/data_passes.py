"""The bench's data-size guard: before its first run, say when the runs read their data more than once.

Every run of a bench reads the same data with the same steps and global batch, so one figure holds
for all: ``steps × global batch (× grad accumulation) / training examples`` passes (epochs), the
training examples counted as the runs count them (packed causal text: blocks of ``--max-len``
tokens; loading them here tokenises once, into the disk cache the runs then read).
"""

from __future__ import annotations

from pathlib import Path

from lowband.bench.config import BenchConfig
from lowband.bench.defaults import DEFAULT_ENTRY
from lowband.bench.plan import plan_runs
from lowband.bench.presets import data_name
from lowband.train.data import load_data, passes_note, training_examples
from lowband.train.pretrained import data_config_for

__all__ = ["data_passes_note"]


def data_passes_note(config: BenchConfig) -> str | None:
    """The passes the bench's runs make over their training data, in words, when more than one; else None.

    A bench with another entry than lowband's trainer (``--entry``) reads data of its own: None.

    Raises:
        ValueError: the data cannot be loaded (the runs could not either).
    """

    plans = plan_runs(config)
    if config.entry != DEFAULT_ENTRY or not plans:
        return None
    plan = plans[0]  # the same data, split, steps and batch for every run
    cfg = plan.train_config(config, Path("."), shaped=True)
    data_cfg = data_config_for(cfg.model.name, cfg.data)  # as the runs load it: a pretrained model's own tokenizer
    packed = data_cfg.kind == "causal" and data_cfg.packing == "blocks"
    data = load_data(data_cfg) if packed else training_examples(data_cfg)
    return passes_note(data, steps=cfg.schedule.steps, world_size=plan.world_size, batch_size=cfg.schedule.batch_size,
                       grad_accum=cfg.schedule.grad_accum, name=data_name(config.data))
