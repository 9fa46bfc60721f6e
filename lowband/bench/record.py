"""The bench's run record: one run of ``results.json``'s ``runs`` list, as a typed dataclass.

:class:`RunRecord` is the schema of a run record, once: the runner fills it
(:mod:`lowband.bench.runner`, :func:`lowband.bench.results.aggregate_run`), the quality annotations
set its ``*_to_target`` fields (:mod:`lowband.bench.quality`), and the report, the plots and the
fault-tolerance report read its attributes. In ``results.json`` a record is a JSON object with one
key per field, in the order of the fields below (:meth:`RunRecord.to_dict`);
:meth:`RunRecord.from_dict` reads one back and refuses keys it does not know.

Sizes are in bytes, times in seconds, rates in bit/s, memory in MB (10^6 bytes); a value that does
not apply or was not measured is ``None`` (``null``). Every field is always written.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lowband.comm.traffic import OpTally

__all__ = ["RunRecord", "error_headline"]


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """What the bench recorded of one run (a method at one link and seed). Every field defaults to None."""

    id: str | None = None
    """Unique name of the run, also its directory under ``runs/``."""
    label: str | None = None
    """Table label, e.g. "FlexDeMo Top8"."""
    method: str | None = None
    """adamw | deto-full | demo | flexdemo | diloco | noloco | ... (FlexDeMo with shards=1 is recorded as demo)."""
    spec: str | None = None
    """The method spec it came from, e.g. "flexdemo:topk=8"."""
    params: dict[str, Any] | None = None
    """Every hyper-parameter passed to the trainer, e.g. {"topk": 8, "chunk": 128, "shards": 2}."""
    hyperparameters: dict[str, Any] | None = None
    """All of the method's hyper-parameters as the trainer used them (its defaults included; from the
    trainer's summary, None if it did not say)."""
    batch_size: int | None = None
    """Examples per rank per step (from the trainer)."""
    topk: int | None = None
    """FlexDeMo/DeMo's top-k; None for other methods."""
    chunk: int | None = None
    """FlexDeMo/DeMo's DCT chunk; None for other methods."""
    shards: int | None = None
    """Ranks of a node sharding one model copy (S)."""
    nodes: int | None = None
    """Emulated nodes."""
    ranks_per_node: int | None = None
    """Ranks (processes) per node."""
    replicas: int | None = None
    """Model copies, R = W / S."""
    model: str | None = None
    """The model's name."""
    steps: int | None = None
    """Training steps of the run (the steps it ran: under a time budget, where the budget stopped it)."""
    time_budget_s: float | None = None
    """The training-clock budget it ran under (``--time-budget``), or None for a run of a set step count."""
    max_steps: int | None = None
    """Under a time budget: the most steps it could take (its ``schedule.steps``); else None."""
    seed: int | None = None
    """The run's seed: model init, data order, dropout."""
    data: str | None = None
    """The data set (as the bench was given it)."""
    num_params: int | None = None
    """Model parameters (from the trainer)."""
    bandwidth_bps: float | None = None
    """The link rate of the run."""
    latency_s: float | None = None
    """The per-message latency added in-process by the link."""
    emulation: str | None = None
    """"netns" | "shaped"."""
    status: str | None = None
    """"ok" | "failed"."""
    error: str | None = None
    """Why it failed: the launcher's account with the tail of each failing node's log, or what was
    missing from its output; None when ok."""
    wall_time_s: float | None = None
    """Wall time of the whole launch (start-up, training, validation, exit)."""
    step_time_s: float | None = None
    """Median seconds per training step (warm-up excluded), mean over ranks."""
    compute_time_s: float | None = None
    """Its compute part (forward, backward, optimizer math): step time minus the exposed communication,
    mean over ranks."""
    comm_time_s: float | None = None
    """Median seconds of the inter-node operations started in a step (start to result, the part hidden
    behind compute included), mean over ranks."""
    exposed_comm_time_s: float | None = None
    """Median seconds per step that a rank was blocked in the link (blocking calls, starts and waits of
    overlapped operations): the communication on the critical path; equals comm_time_s without
    overlap; mean over ranks."""
    sync_time_s: float | None = None
    """DiLoCo/NoLoCo: median exposed seconds of the steps that start or finish an outer synchronisation
    (the outer step's time on the critical path); else None."""
    outer_steps: int | None = None
    """DiLoCo/NoLoCo: outer steps taken; else None."""
    inter_node_bytes_per_step: float | None = None
    """Bytes a node sends to other nodes per step (the link's count: a model of the collective, ring
    order), summed over the node's ranks, mean over nodes."""
    inter_node_bytes_per_step_by_node: list[float] | None = None
    """The same, one entry per node."""
    measured_wire_bytes_per_step: float | None = None
    """netns mode only: the node's veth tx_bytes over the whole launch divided by the steps, mean over
    nodes. It INCLUDES set-up traffic (rendezvous, gloo connection set-up, validation, shutdown) and
    Ethernet/IP/TCP headers, so it exceeds inter_node_bytes_per_step, most for short runs; None in
    shaped mode."""
    measured_wire_bytes_per_step_by_node: list[float] | None = None
    """The same, one entry per node."""
    link_effective_bps: float | None = None
    """inter_node_bytes_per_step · 8 / comm_time_s: the rate the run's communication achieved (includes
    waiting for peers); None when not defined."""
    val_loss: float | None = None
    """Final validation loss (rank 0's model copy)."""
    best_val_loss: float | None = None
    """The lowest validation loss of the run."""
    train_time_s: float | None = None
    """The training clock at the end: time in training steps only (start-up, validation and
    checkpoints excluded), rank 0."""
    tokens: int | None = None
    """Non-padding tokens trained on, summed over all ranks."""
    steps_to_target: float | None = None
    """Where the validation loss first reached the bench's target_loss, linearly interpolated between
    the two validations around it; None when not reached (:mod:`lowband.bench.quality`)."""
    tokens_to_target: float | None = None
    """The same in tokens."""
    time_to_target_s: float | None = None
    """The same on the training clock."""
    reference_steps_to_final: float | None = None
    """The steps the target's AdamW variant (at this run's link, mean over its seeds) needed to reach
    this run's final validation loss; None for AdamW's own runs."""
    reference_time_to_final_s: float | None = None
    """The same in training time: time to quality at the quality this run reached."""
    train_loss: float | None = None
    """Final training loss (rank 0)."""
    peak_rss_mb: float | None = None
    """Peak memory of the largest rank."""
    peak_rss_mb_by_rank: list[float | None] | None = None
    """Peak memory of every rank."""
    link_ops: dict[str, OpTally] | None = None
    """Per operation kind ("all_reduce", "all_gather", "exchange", ...), its tally
    (:class:`~lowband.comm.traffic.OpTally`: count, bytes sent (ring model, intra-node hops included),
    inter_node_bytes, largest_group); count and bytes are totals over the run and over all ranks."""
    val_history: list[dict[str, Any]] | None = None
    """Rank 0's validations: [{"step", "epoch", "tokens" (summed over ranks), "train_time_s" (training
    clock), "wall_s" (since the loop started), "val_loss"}, ...]."""
    run_dir: str | None = None
    """The run's directory, relative to the bench directory."""
    logs: list[str] | None = None
    """Node log files, relative to the bench directory."""
    command: list[str] | None = None
    """The arguments after the entry module (["train", ...])."""
    fault_tolerance: dict[str, Any] | None = None
    """Runs under fault tolerance: the plan, what was done when, each node's membership changes,
    dropped steps and heals (:mod:`lowband.bench.runner`); else None."""
    screened: dict[str, Any] | None = None
    """What rank 0's exchange refused or weakened over the run, per member of its exchange group (its
    index there: node i without fault tolerance; under it, its place in the quorum): {"bad_messages",
    "clipped", "left_out": {member: count}, "evicted": [member, ...], "aggregations": how many times the
    robust rule decided} (the trainer's summary; clipped and left out are counted out of the aggregations)."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The record's keys, in the order they are written."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The record as ``results.json`` holds it: every key, in field order; link_ops as plain dicts."""
        out = {name: getattr(self, name) for name in self.field_names()}
        if self.link_ops is not None:
            out["link_ops"] = {kind: tally.to_dict() for kind, tally in self.link_ops.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "run record") -> RunRecord:
        """The record in ``data``. A key that is no field is a ValueError naming it and ``source``.

        A missing key is None (keys may be added within a schema version; :data:`SCHEMA_VERSION`
        in :mod:`lowband.bench.results` changes when one is renamed or removed).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"{source} is not a JSON object but {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{source} has keys that are not run-record fields: {', '.join(unknown)}")
        fields = dict(data)
        if fields.get("link_ops") is not None:
            try:
                fields["link_ops"] = {kind: OpTally.from_dict(ops) for kind, ops in fields["link_ops"].items()}
            except (AttributeError, TypeError, ValueError) as exc:
                raise ValueError(f"{source}: link_ops is not a tally per operation kind: {exc}") from exc
        return cls(**fields)


_ERROR_LINE = re.compile(r"Error|Exception|error:|Killed|timed out")


def error_headline(error: str | None) -> str:
    """One line of a run's error for the console: the last line that names an error, else the first."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    if not lines:
        return "no error recorded"
    named = [line for line in lines if _ERROR_LINE.search(line) and not line.startswith("torchrun:")]
    return named[-1] if named else lines[0]
