"""Checkpoints: DCP save, load and reshard, and the signed manifest a resumed run checks."""

from lowband.checkpoint.dcp import (
    latest_checkpoint,
    load_checkpoint,
    replica_sources,
    save_checkpoint,
    topology_record,
)
from lowband.checkpoint.signatures import (
    MANIFEST,
    CheckpointRefused,
    SafePlanner,
    SafeReader,
    read_metadata,
    verify_manifest,
    write_manifest,
)

__all__ = ["CheckpointRefused", "MANIFEST", "SafePlanner", "SafeReader", "latest_checkpoint", "load_checkpoint", "read_metadata", "replica_sources", "save_checkpoint", "topology_record", "verify_manifest", "write_manifest"]
