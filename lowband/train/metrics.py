"""``metrics.jsonl`` on rank 0: one record per training step and per validation, also sent to the run's
trackers (``--report-to``: TensorBoard, W&B; :mod:`lowband.train.trackers`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from lowband.train.trackers import Tracker

__all__ = ["MetricsFile"]


class MetricsFile:
    """metrics.jsonl (and the trackers) on rank 0.

    Args:
        out: the run directory.
        enabled: False on every rank but 0 (nothing is written).
        append: go on with an earlier life's file (a resume, a node that rejoins).
        trackers: opened by :func:`lowband.train.trackers.open_trackers`; closed with this file.
    """

    def __init__(self, out: Path, *, enabled: bool, append: bool, trackers: Sequence[Tracker] = ()) -> None:
        self.enabled = enabled
        self.file = open(out / "metrics.jsonl", "a" if append else "w") if enabled else None  # noqa: SIM115
        self.trackers = list(trackers) if enabled else []

    def write(self, record: dict) -> None:
        """One record (``type``, ``step`` and its numbers) to the file, and its numbers to each tracker as
        ``<type>/<key>`` at its step."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.log_scalars({f"{record['type']}/{k}": v for k, v in record.items()
                          if k not in ("type", "step") and isinstance(v, int | float)}, record["step"])

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """Numbers for the trackers only (the progress lines'), by tag, at ``step``."""
        for tracker in self.trackers:
            tracker.log(scalars, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        for tracker in self.trackers:
            tracker.close()
