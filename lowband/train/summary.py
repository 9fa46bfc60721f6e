"""The run summary: what one rank of ``lowband train`` reports, written as ``summary_rank{R}.json``.

:class:`RunSummary` is the schema, once: the trainer (:class:`lowband.train.loop.Trainer`) fills
and writes it; the bench (:mod:`lowband.bench.results`) reads it back with :meth:`RunSummary.read`
and builds its results records from the fields. Every field is always written; a file that lacks
one (or names one this version does not know) is refused with the names, not guessed around.

Times are seconds, sizes bytes, memory MiB; a median over no steps (a run shorter than the
warm-up) is null.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowband.comm.traffic import OpTally

__all__ = ["RunSummary", "summary_path"]


def summary_path(out: Path | str, rank: int) -> Path:
    """Where rank ``rank`` of a run in ``out`` writes its summary."""
    return Path(out) / f"summary_rank{rank}.json"


@dataclass(kw_only=True)
class RunSummary:
    """One rank's account of a training run.

    Attributes:
        rank, node: this rank and its node.
        method: the method (a key of :data:`lowband.train.methods.METHODS`).
        hp: every hyper-parameter of the method as used, by field name (its config).
        topk, chunk: FlexDeMo/DeMo's top-k and chunk; null for other methods.
        shards, nodes, ranks_per_node, replicas: the topology (replicas R = W / S).
        steps: the run's last step; start_step: where it began (a resume: the checkpoint's step).
        model, num_params, data: the model's name, its parameter count, the data's name.
        batch_size, grad_accum, precision, activation_checkpointing: as configured.
        memory: per-phase peaks (:meth:`lowband.train.memory.PhaseMemory.summary`).
        status: "ok" (a failed run writes no summary).
        step_time_s, compute_time_s, comm_time_s, exposed_comm_time_s: medians over the steps
            after the warm-up: the step, its compute part (step − exposed), the inter-node
            operations started in it (start to result), the time blocked in the link.
        sync_time_s: DiLoCo/NoLoCo: median exposed time of the steps that synchronise; else null.
        outer_steps: DiLoCo/NoLoCo: outer steps taken; else null.
        screened: what this rank's exchange refused or weakened over the run
            (:meth:`lowband.optim.protocol.OptimizerStats.screened`): per member of the exchange's
            group (its index there), the messages that failed their check, the updates robust
            aggregation clipped or left out, and the members evicted.
        inter_node_bytes_per_step: bytes this rank sent to other nodes per step (mean).
        node_inter_node_bytes_per_step: the same summed over this rank's node.
        link_ops: per operation kind, this rank's :class:`~lowband.comm.traffic.OpTally` over the run
            (written as ``{"count", "bytes", "inter_node_bytes", "largest_group"}``).
        peak_rss_mb: this rank's peak memory (CUDA: allocated; CPU: resident).
        val_loss: the final validation loss; val_history: every validation, {"step", "epoch",
            "tokens", "train_time_s", "wall_s", "val_loss"}.
        train_loss: the last step's training loss.
        train_time_s: the training clock (time in training steps); tokens: this rank's tokens.
        shaping: {"bandwidth_bps", "latency_s"} of the in-process link shaping, or null.
        wall_time_s: this process's time from the start of the run to its summary.
        config: the run's :class:`lowband.train.config.TrainConfig` as its tables (:meth:`~lowband.train.config.TrainConfig.tables`).
    """

    rank: int
    node: int
    method: str
    hp: dict[str, Any]
    topk: int | None
    chunk: int | None
    shards: int
    nodes: int
    ranks_per_node: int
    replicas: int
    steps: int
    start_step: int
    model: str
    num_params: int
    data: str
    batch_size: int
    grad_accum: int
    precision: str
    activation_checkpointing: bool
    memory: dict[str, Any]
    status: str
    step_time_s: float | None
    compute_time_s: float | None
    comm_time_s: float | None
    exposed_comm_time_s: float | None
    sync_time_s: float | None
    outer_steps: int | None
    screened: dict[str, Any]
    inter_node_bytes_per_step: float
    node_inter_node_bytes_per_step: float
    link_ops: dict[str, OpTally]
    peak_rss_mb: float
    val_loss: float
    val_history: list[dict[str, Any]]
    train_loss: float
    train_time_s: float
    tokens: int
    shaping: dict[str, float] | None
    wall_time_s: float
    config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # the OpTally values of link_ops become dicts too

    def write(self, out: Path | str) -> Path:
        """Write ``summary_rank{rank}.json`` in ``out``; return its path."""
        path = summary_path(out, self.rank)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "summary") -> RunSummary:
        """The summary in ``data``; a missing or unknown field is a ValueError naming ``source``."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(
                f"{source} does not match this lowband's run summary: "
                + "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                        f"unknown {', '.join(unknown)}" if unknown else "") if x)
                + ". Was it written by another lowband version? Re-run the training with this one."
            )
        try:
            link_ops = {kind: OpTally.from_dict(ops) for kind, ops in data["link_ops"].items()}
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: link_ops is not a tally per operation kind: {exc}") from exc
        return cls(**{**data, "link_ops": link_ops})

    @classmethod
    def read(cls, path: Path | str) -> RunSummary:
        """Read a ``summary_rank{R}.json``; unreadable, not an object or not a summary: ValueError."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        return cls.from_dict(data, source=str(path))
