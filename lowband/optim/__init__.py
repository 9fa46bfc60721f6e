"""Optimizers: FlexDeMo (DeMo when S = 1), the full-sync baselines, DiLoCo and NoLoCo."""

from lowband.optim._common import NonFiniteGradientError
from lowband.optim.flexdemo import FlexDeMo
from lowband.optim.fullsync import AdamWFullSync, DetoFull, sync_gradients
from lowband.optim.local_sgd import DiLoCo, NoLoCo, noloco_groups, warmup_cosine

__all__ = ["AdamWFullSync", "DetoFull", "FlexDeMo", "NonFiniteGradientError", "sync_gradients"]
__all__ += ["DiLoCo", "NoLoCo", "noloco_groups", "warmup_cosine"]
