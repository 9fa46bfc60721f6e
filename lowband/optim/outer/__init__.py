"""The outer-step family: many local steps, then an outer step (DiLoCo, NoLoCo, SparseLoCo)."""

from lowband.optim.outer.base import (
    DROP,
    InnerOptimizer,
    OuterFlight,
    OuterStepOptimizer,
    check_unit_interval,
)
from lowband.optim.outer.diloco import DILOCO_INNER_DEFAULTS, DiLoCo
from lowband.optim.outer.groups import noloco_group_size, noloco_groups
from lowband.optim.outer.noloco import NOLOCO_INNER_DEFAULTS, NoLoCo
from lowband.optim.outer.schedule import check_delay, unmerged_tail_note
from lowband.optim.outer.sparseloco import (
    SPARSELOCO_INNER_DEFAULTS,
    SPARSELOCO_TRANSFORMS,
    SparseLoCo,
    sparseloco_message_nbytes,
)

__all__ = ["DILOCO_INNER_DEFAULTS", "DROP", "DiLoCo", "InnerOptimizer", "NOLOCO_INNER_DEFAULTS", "NoLoCo", "OuterFlight", "OuterStepOptimizer", "SPARSELOCO_INNER_DEFAULTS", "SPARSELOCO_TRANSFORMS", "SparseLoCo", "check_delay", "check_unit_interval", "noloco_group_size", "noloco_groups", "sparseloco_message_nbytes", "unmerged_tail_note"]
