"""``results.json``: what a bench measured, in a stable, documented schema (version 4).

A bench's run directory holds::

    results.json                 this file's schema, below
    report.md                    the tables (lowband.report.render)
    *.png                        the plots (lowband.report.plots)
    runs/<run id>/               one directory per run: the trainer's metrics.jsonl and
                                 summary_rank<R>.json, and logs/node<i>.log

Schema, version 4 (version 3 named two time-to-quality keys after AdamW, ``adamw_steps_to_final``
and ``adamw_time_to_final_s``: now ``reference_...``, after the registry's reference method;
version 2 had version 3's keys, read without a check: version 3's run records are
:class:`~lowband.bench.record.RunRecord`, and a key that is not a field is refused; version 1 had
``val_history`` as ``[step, wall_s, val_loss]`` lists and one ``seed``). A file of another version
is refused with what to do: re-run the bench (there is no conversion). Sizes are in bytes, times in
seconds, rates in bit/s, memory in MB (10^6 bytes); a value that does not apply or was not measured
is ``null``. Every key is present in every record. New keys may be added within a version; a key is
never renamed or removed without raising ``schema_version``.

Top level::

    schema_version  4
    created         ISO 8601 local time with offset, when the bench started
    finished        ISO 8601, when it ended (null while running)
    interrupted     true when stopped by Ctrl-C / SIGTERM before every run was done
    command         the command line (list of strings), or null
    host            {"hostname", "platform", "python", "torch", "lowband", "cpu_count"}
    config          the bench configuration: {"methods" (specs as given), "bandwidths_bps",
                    "shards" (list or null), "steps", "model", "data", "emulation" (as asked:
                    auto|netns|shaped), "latency_s", "nodes", "ranks_per_node", "seeds" (list),
                    "target_loss" (as given, or null), "preset" (name or null), "run_timeout_s",
                    "entry", "train_args" (every run's lowband train flags besides the
                    bench's own: the job's train tables as flags, then [bench] train_args),
                    "ft", "faults", "time_budget" (seconds, "auto" or null:
                    lowband.bench.timebudget), "train" (the job's lowband train tables,
                    lowband.bench.job) and "tune" (both absent in an older results.json)}
    target_loss     the loss every run is timed to: AdamW's final validation loss in this
                    bench (its best variant, mean over seeds; a one-seed variant only when
                    no AdamW variant ran at several) or the --target-loss given; null
                    when there is neither (lowband.bench.quality)
    target_source   where target_loss came from, in words
    emulation       {"mode": "netns" | "shaped",
                     "reason": why this mode was used,
                     "nodes", "ranks_per_node",
                     "latency_s": per-message latency added in-process by the link (both modes),
                     "links": [{"bandwidth_bps",
                                "measured_throughput_bps": TCP goodput between the nodes'
                                    namespaces (lowband.cluster.measure_throughput); null in
                                    shaped mode,
                                "note": how the rate is enforced / why it was not measured}]}
    runs            list of run records (below), in the order they ran
    lr_sources      {spec: where its lr came from: given | preset default | method default | tuned here (...)}
    tuning          --tune only: one lr search per variant (lowband.bench.tune.LrSearch as a dict)

A run record is :class:`lowband.bench.record.RunRecord` (its fields are documented there): a JSON
object with one key per field, in field order; in memory ``results["runs"]`` is a list of
RunRecord objects (:func:`load_results` reads them, :func:`write_results` writes them).

The trainer's per-rank ``summary_rank<R>.json`` files (:class:`lowband.train.summary.RunSummary`,
one schema for the writer and this reader) are the source of every training field;
:func:`aggregate_run` turns them into a run record's training fields.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import platform
import socket
import statistics
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from lowband.bench.record import RunRecord
from lowband.comm.traffic import OpTally, merge_tallies
from lowband.train.methods import family_of
from lowband.train.summary import RunSummary, summary_path
from lowband.util import atomic_path

__all__ = [
    "RESULTS_FILE",
    "SCHEMA_VERSION",
    "RunRecord",
    "aggregate_run",
    "host_info",
    "load_results",
    "now_iso",
    "read_summaries",
    "write_results",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4
RESULTS_FILE = "results.json"
_MAX_ERROR_CHARS = 6000

def now_iso() -> str:
    """The local time as ISO 8601 with its UTC offset, to the second."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _lowband_version() -> str:
    # From the installed distribution, not `lowband.__version__`: the bench does not import the package's top.
    try:
        return importlib.metadata.version("lowband")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def host_info() -> dict[str, Any]:
    """Where the bench ran: host name, platform, Python, torch and lowband versions, CPU count."""
    import torch  # heavy: a command that does not train must not pay for it

    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "lowband": _lowband_version(),
        "cpu_count": os.cpu_count(),
    }


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _mean(values: Sequence[Any]) -> float | None:
    nums = [v for v in (_finite(x) for x in values) if v is not None]
    return statistics.fmean(nums) if nums else None


def read_summaries(run_dir: Path, world_size: int) -> list[RunSummary]:
    """Read ``summary_rank{R}.json`` for every rank, in rank order.

    Raises:
        ValueError: a summary is missing, unreadable, not a run summary of this version, or not
            ``status: ok`` (the message names the file).
    """
    summaries = []
    missing = []
    for rank in range(world_size):
        path = summary_path(run_dir, rank)
        if not path.is_file():
            missing.append(path.name)
            continue
        summary = RunSummary.read(path)
        if summary.status != "ok":
            raise ValueError(f"{path} reports status {summary.status!r}")
        summaries.append(summary)
    if missing:
        raise ValueError(
            f"the trainer exited successfully but wrote no {', '.join(missing)} in {run_dir} "
            f"(expected one summary per rank, {world_size} ranks)"
        )
    return summaries


def _merge_link_ops(summaries: Sequence[RunSummary]) -> dict[str, OpTally]:
    merged: dict[str, OpTally] = {}
    for s in summaries:
        merge_tallies(merged, s.link_ops)
    return dict(sorted(merged.items()))


_POINT_KEYS = ("step", "epoch", "tokens", "train_time_s", "wall_s", "val_loss")
#: Run-record fields copied from rank 0's summary as they are.
_FROM_RANK0 = ("steps", "outer_steps", "screened", "shards", "replicas", "num_params", "model", "batch_size", "train_time_s")
#: Run-record fields that are the mean over the ranks' summaries.
_MEAN_OVER_RANKS = ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_time_s", "sync_time_s")


def aggregate_run(
    record: RunRecord,
    summaries: Sequence[RunSummary],
    *,
    wire_bytes_by_node: Sequence[int] | None = None,
) -> RunRecord:
    """Fill a run record's training fields from the per-rank summaries (in rank order).

    Args:
        record: a record with ``method``, ``nodes`` and ``ranks_per_node`` set; updated in place and
            returned.
        summaries: one :class:`~lowband.train.summary.RunSummary` per rank, rank 0 first.
        wire_bytes_by_node: netns mode: bytes each node's interface sent during the launch.
    """
    nodes, per_node = int(record.nodes), int(record.ranks_per_node)
    if len(summaries) != nodes * per_node:
        raise ValueError(f"expected {nodes * per_node} rank summaries ({nodes} nodes × {per_node}), got {len(summaries)}")
    first = summaries[0]
    by_node = [0.0] * nodes
    for rank, s in enumerate(summaries):
        if not 0 <= s.node < nodes:
            raise ValueError(f"summary of rank {rank} names node {s.node}, but there are {nodes} nodes")
        by_node[s.node] += float(_finite(s.inter_node_bytes_per_step) or 0.0)
    record.inter_node_bytes_per_step_by_node = by_node
    record.inter_node_bytes_per_step = statistics.fmean(by_node)
    for key in _MEAN_OVER_RANKS:
        setattr(record, key, _mean([getattr(s, key) for s in summaries]))
    for key in _FROM_RANK0:
        setattr(record, key, getattr(first, key))
    record.hyperparameters = dict(first.hp)
    demo = family_of(record.method) == "demo"
    record.topk, record.chunk = (first.topk, first.chunk) if demo else (None, None)
    record.val_loss = _finite(first.val_loss)
    record.train_loss = _finite(first.train_loss)
    rss = [_finite(s.peak_rss_mb) for s in summaries]
    record.peak_rss_mb_by_rank = rss
    record.peak_rss_mb = max((r for r in rss if r is not None), default=None)
    record.link_ops = _merge_link_ops(summaries)
    history = [{k: h[k] for k in _POINT_KEYS} for h in first.val_history]
    # Tokens: every rank trained on its own slice of the global batch; sum them over the ranks.
    per_rank = [s.val_history for s in summaries]
    if all(len(h) == len(history) for h in per_rank):
        for i, point in enumerate(history):
            point["tokens"] = sum(h[i]["tokens"] for h in per_rank)
    record.val_history = history
    record.tokens = sum(s.tokens for s in summaries)
    if wire_bytes_by_node is not None and first.steps > 0:
        wire = [b / first.steps for b in wire_bytes_by_node]
        record.measured_wire_bytes_per_step_by_node = wire
        record.measured_wire_bytes_per_step = statistics.fmean(wire)
    comm = record.comm_time_s
    if comm and comm > 0 and record.inter_node_bytes_per_step:
        record.link_effective_bps = record.inter_node_bytes_per_step * 8.0 / comm
    record.status = "ok"
    record.error = None
    return record


def truncate_error(text: str) -> str:
    """Keep the end of a long error (the tail of the logs is where the cause is)."""
    if len(text) <= _MAX_ERROR_CHARS:
        return text
    return "[...]\n" + text[-_MAX_ERROR_CHARS:]


def _strict_json(value: Any) -> Any:
    """NaN and infinities (a diverged loss) become null: results.json is strict JSON; run records become dicts."""
    if isinstance(value, RunRecord):
        value = value.to_dict()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    return value


def write_results(out_dir: Path, results: Mapping[str, Any]) -> Path:
    """Write ``results.json`` atomically (a crash never leaves half a file); NaN becomes null."""
    path = Path(out_dir) / RESULTS_FILE
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_strict_json(results), indent=2, allow_nan=False) + "\n")
    return path


def load_results(path: Path) -> dict[str, Any]:
    """Read a bench's ``results.json`` (or the directory holding it) and check its schema version.

    Returns the top level as a dict whose ``runs`` are :class:`~lowband.bench.record.RunRecord` objects.

    Raises:
        ValueError: no such file, not JSON, a schema version other than :data:`SCHEMA_VERSION` (the
            message says to re-run the bench: there is no conversion), or a run that is not a run
            record of this version (the message names the run and the keys).
    """
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise ValueError(f"{path} not found: give a bench run directory (one holding {RESULTS_FILE})")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    version = results.get("schema_version") if isinstance(results, dict) else None
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema_version {version!r}, but this lowband reads only schema_version {SCHEMA_VERSION}: "
            "it was written by another lowband version, and there is no conversion. Re-run the bench with this "
            "lowband (lowband bench ... --out NEW_DIR) to get results it can report on."
        )
    if not isinstance(results.get("runs"), list):
        raise ValueError(f"{path} has no list of runs")
    results["runs"] = [
        RunRecord.from_dict(run, source=f"{path}: run {i} ({run.get('id') if isinstance(run, dict) else '?'})")
        for i, run in enumerate(results["runs"])
    ]
    return results
