"""NoLoCo's sync step against DiLoCo's all-reduce: modelled for 2..1024 replicas, measured at small N."""

from lowband.simulate.measure import MeasureSpec
from lowband.simulate.model import MAX_REPLICAS, SyncModel, closed_form, default_replica_counts, sweep
from lowband.simulate.study import SimulateConfig, run

__all__ = ["MAX_REPLICAS", "MeasureSpec", "SimulateConfig", "SyncModel", "closed_form", "default_replica_counts",
           "run", "sweep"]
