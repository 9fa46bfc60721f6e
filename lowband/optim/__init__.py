"""Optimizers: FlexDeMo (DeMo when S = 1), the full-sync baselines, DiLoCo, NoLoCo and SparseLoCo."""

from lowband.optim._common import NonFiniteGradientError
from lowband.optim.flexdemo.optimizer import FlexDeMo
from lowband.optim.fullsync import AdamWFullSync, DetoFull, MuonFullSync, sync_gradients
from lowband.optim.outer.diloco import DiLoCo
from lowband.optim.outer.groups import noloco_groups
from lowband.optim.outer.noloco import NoLoCo
from lowband.optim.outer.sparseloco import SparseLoCo
from lowband.optim.protocol import LowbandOptimizer, OptimizerStats

__all__ = ["AdamWFullSync", "DetoFull", "FlexDeMo", "MuonFullSync", "NonFiniteGradientError", "sync_gradients"]
__all__ += ["DiLoCo", "NoLoCo", "SparseLoCo", "noloco_groups", "LowbandOptimizer", "OptimizerStats"]
