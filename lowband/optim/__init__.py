"""Optimizers: FlexDeMo (DeMo when S = 1), the full-sync baselines, DiLoCo, NoLoCo and SparseLoCo."""

from lowband.optim._common import NonFiniteGradientError
from lowband.optim.diloco import DiLoCo
from lowband.optim.flexdemo import FlexDeMo
from lowband.optim.fullsync import AdamWFullSync, DetoFull, MuonFullSync, sync_gradients
from lowband.optim.noloco import NoLoCo
from lowband.optim.noloco_groups import noloco_groups
from lowband.optim.protocol import LowbandOptimizer, OptimizerStats
from lowband.optim.sparseloco import SparseLoCo

__all__ = ["AdamWFullSync", "DetoFull", "FlexDeMo", "MuonFullSync", "NonFiniteGradientError", "sync_gradients"]
__all__ += ["DiLoCo", "NoLoCo", "SparseLoCo", "noloco_groups", "LowbandOptimizer", "OptimizerStats"]
