"""FlexDeMo (DeMo when S = 1): the optimizer and its parts (blocks of chunk rows, overlap, 2-D tiles, message screening)."""

from lowband.optim.flexdemo.optimizer import OVERLAP_APPLY, FlexDeMo

__all__ = ["FlexDeMo", "OVERLAP_APPLY"]
