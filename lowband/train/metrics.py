"""``metrics.jsonl`` (and TensorBoard scalars) on rank 0: one record per training step and per validation."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["MetricsFile"]


class MetricsFile:
    """metrics.jsonl (and TensorBoard) on rank 0."""

    def __init__(self, out: Path, *, enabled: bool, tensorboard: bool, append: bool) -> None:
        self.enabled = enabled
        self.file = open(out / "metrics.jsonl", "a" if append else "w") if enabled else None  # noqa: SIM115
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError as e:
                raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from e

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k not in ("type", "step") and isinstance(v, int | float):
                    self.tb.add_scalar(f"{record['type']}/{k}", v, record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
