"""Optimizers: FlexDeMo (DeMo when S = 1), the full-sync baselines, DiLoCo and NoLoCo."""

from lowband.optim._common import NonFiniteGradientError
from lowband.optim.flexdemo import FlexDeMo
from lowband.optim.fullsync import AdamWFullSync, DetoFull, sync_gradients

__all__ = ["AdamWFullSync", "DetoFull", "FlexDeMo", "NonFiniteGradientError", "sync_gradients"]
