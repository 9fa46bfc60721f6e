"""Measure DiLoCo's all-reduce and NoLoCo's exchange on emulated links, and set the model beside it.

For each N in ``nodes``: N network namespaces with tbf-limited veths (:class:`EmulatedNetwork`),
one torchrun per namespace, one rank each, running :mod:`lowband.simulate.worker`. Where
namespaces cannot be built, every node runs on loopback and each rank's :class:`~lowband.comm.link.Link`
shapes its own traffic in-process; that mode only checks the plumbing (the link sleeps until
its own ring model's time has passed, so measured ≈ modelled by construction).

The model is then evaluated for the same N and bytes at σ = 0 with

- B = the tbf rate × 1448/1514, the TCP payload carried by one 1514-byte Ethernet frame (MTU
  1500, TCP timestamps): what the shaper lets through as goodput. Derived from the frame format,
  not fitted. A TCP probe (:func:`~lowband.cluster.measure_throughput`) is reported beside it;
- L = the median time of a one-float exchange between NoLoCo peers (network + gloo + Python).

Nothing is fitted to the timings being compared. Known small biases: the ACKs of the incoming
stream share each node's egress shaper with its outgoing data (≈ 2 % at one ACK per two frames),
and barrier exit skew (≈ L) adds to every timed operation.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowband.cluster import EmulatedNetwork, launch_nodes, measure_throughput, netns_available
from lowband.simulate.model import SyncModel, closed_form

__all__ = ["MeasureSpec", "choose_mode", "compare", "goodput_bps", "measure", "summarize"]

log = logging.getLogger(__name__)

#: TCP payload per Ethernet frame (MTU 1500 − 20 IP − 20 TCP − 12 timestamp option) and the frame
#: as tbf counts it on a veth (1500 + 14 header; no preamble or FCS).
TCP_PAYLOAD_PER_FRAME = 1448
FRAME_BYTES = 1514
NAMESPACE_PREFIX = "lbsim"


def goodput_bps(rate_bps: float) -> float:
    """TCP payload rate through a tbf of ``rate_bps``: rate × 1448/1514."""
    return rate_bps * TCP_PAYLOAD_PER_FRAME / FRAME_BYTES


@dataclass(frozen=True, kw_only=True)
class MeasureSpec:
    """What to measure.

    Args:
        nodes: replica counts N to measure (one emulated node, one rank each).
        bandwidth_bps: tbf rate of every node's link.
        size_bytes: all-reduce payload M (a multiple of 4); the exchange sends 2·M.
        reps: timed repetitions of each operation (the median is reported).
        group_size: NoLoCo's group size n.
        seed: seed of NoLoCo's groups.
        probes: latency probes of each kind.
        timeout_s: wall-clock limit of one N's launch.
    """

    nodes: tuple[int, ...]
    bandwidth_bps: float
    size_bytes: int
    reps: int = 3
    group_size: int = 2
    seed: int = 0
    probes: int = 20
    timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("give at least one node count to measure, e.g. --measure-nodes 4,8")
        for n in self.nodes:
            if not 2 <= n <= 64:
                raise ValueError(f"measured node counts must be in [2, 64] (one namespace and torchrun each), got {n}")
            if n < self.group_size:
                raise ValueError(f"cannot measure N={n} replicas with NoLoCo groups of n={self.group_size}: need N >= n")
        if self.size_bytes < 4 or self.size_bytes % 4:
            raise ValueError(f"--measure-size must be a positive multiple of 4 bytes (float32), got {self.size_bytes}")
        if not 8_000 <= self.bandwidth_bps:
            raise ValueError(f"--measure-bandwidth must be at least 8kbit, got {self.bandwidth_bps:g} bit/s")
        if self.reps < 1 or self.probes < 1:
            raise ValueError(f"--measure-reps must be >= 1, got {self.reps}")
        if not self.timeout_s > 0:
            raise ValueError(f"the measurement timeout must be > 0 s, got {self.timeout_s}")


def choose_mode() -> tuple[str, str]:
    """("netns", "") where emulated nodes can be built, else ("shaped", why not)."""

    ok, reason = netns_available(NAMESPACE_PREFIX)
    return ("netns", "") if ok else ("shaped", reason)


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]  # lowband/simulate/measure.py -> the folder that holds lowband/


def _measure_one(num_nodes: int, spec: MeasureSpec, *, mode: str, work_dir: Path) -> dict[str, Any]:


    out_json = work_dir / f"worker-N{num_nodes}.json"
    out_json.unlink(missing_ok=True)
    args = ["--size-bytes", str(spec.size_bytes), "--reps", str(spec.reps), "--group-size", str(spec.group_size),
            "--seed", str(spec.seed), "--probes", str(spec.probes), "--out", str(out_json)]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(_repo_root()), os.environ.get("PYTHONPATH", "")) if p)}
    if mode == "shaped":
        args += ["--link-bandwidth", f"{spec.bandwidth_bps:g}", "--link-latency", "0"]
    timing: dict[str, float] = {}
    probe: dict[str, float] = {}
    t0 = time.perf_counter()
    net_cm = EmulatedNetwork(num_nodes, spec.bandwidth_bps, prefix=NAMESPACE_PREFIX) if mode == "netns" else nullcontext()
    with net_cm as net:
        timing["network_setup_s"] = time.perf_counter() - t0
        if net is not None:
            t = time.perf_counter()
            try:
                measure_throughput(net, 0, 1, 1.0, details=probe)
            except (RuntimeError, OSError) as exc:
                log.warning("TCP throughput probe failed (reported, not used by the model): %s", exc)
                probe = {"error": str(exc)}  # type: ignore[dict-item]
            timing["throughput_probe_s"] = time.perf_counter() - t
        t = time.perf_counter()
        launched_at = time.time()
        result = launch_nodes(num_nodes=num_nodes, ranks_per_node=1, module="lowband.simulate.worker",
                              module_args=args, env=env, net=net, timeout_s=spec.timeout_s,
                              log_dir=work_dir / f"logs-N{num_nodes}")  # fmt: skip
        timing["launch_s"] = time.perf_counter() - t
        t = time.perf_counter()
    timing["network_teardown_s"] = time.perf_counter() - t
    timing["total_s"] = time.perf_counter() - t0
    result.raise_for_failure()
    worker = json.loads(out_json.read_text())
    stamps = [r.get("stamps") for r in worker["ranks"] if r.get("stamps")]
    if stamps:  # where the launch time went (wall clock, across ranks)
        timing["start_up_s"] = max(s["initialised"] for s in stamps) - launched_at
        timing["operations_s"] = max(s["measured"] for s in stamps) - max(s["initialised"] for s in stamps)
        timing["python_and_torch_import_s"] = statistics.median(s["torch_imported"] - launched_at for s in stamps)
    return {"num_nodes": num_nodes, "mode": mode, "timing": timing, "throughput_probe": probe,
            "ranks": worker["ranks"]}  # fmt: skip


def measure(spec: MeasureSpec, work_dir: Path, *, mode: str | None = None, reason: str = "") -> dict[str, Any]:
    """Measure every N of ``spec``; return the raw records (per rank, per repetition) and timings."""
    if mode is None:
        mode, reason = choose_mode()
    if mode == "shaped":
        log.warning("network namespaces unavailable (%s): measuring with in-process shaping on loopback", reason)
    work_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in spec.nodes:
        log.info("measuring N=%d on %s links", n, "emulated (netns + tbf)" if mode == "netns" else "loopback, shaped in-process")
        runs.append(_measure_one(n, spec, mode=mode, work_dir=work_dir))
        log.info("N=%d measured in %.1f s (%s)", n, runs[-1]["timing"]["total_s"],
                 ", ".join(f"{k} {v:.1f}" for k, v in runs[-1]["timing"].items()))  # fmt: skip
    return {"mode": mode, "reason": reason, "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
            "runs": runs}  # fmt: skip


def _per_rep(ranks: Sequence[dict[str, Any]], key: str, agg: str) -> list[float]:
    reps = len(ranks[0][key])
    out = []
    for i in range(reps):
        values = [r[key][i] for r in ranks]
        out.append(max(values) if agg == "max" else statistics.fmean(values))
    return out


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Measured figures of one N: medians over repetitions of the per-replica mean (and max) times."""
    ranks = run["ranks"]
    out: dict[str, Any] = {"num_nodes": run["num_nodes"],
                           "all_reduce_bytes": ranks[0]["all_reduce_bytes"],
                           "exchange_bytes": ranks[0]["exchange_bytes"]}  # fmt: skip
    for key in ("all_reduce_s", "exchange_s", "exchange_receive_first_s"):
        if not ranks[0].get(key):
            out[key] = None
            continue
        mean = _per_rep(ranks, key, "mean")
        out[key] = statistics.median(mean)
        out[key.removesuffix("_s") + "_reps_s"] = mean
        out[key.removesuffix("_s") + "_slowest_s"] = statistics.median(_per_rep(ranks, key, "max"))
    out["latency_s"] = statistics.median(r["tiny_exchange_median_s"] for r in ranks)
    out["tiny_all_reduce_s"] = statistics.median(r["tiny_all_reduce_median_s"] for r in ranks)
    out["tiny_all_reduce_bytes"] = ranks[0]["tiny_all_reduce_bytes"]
    return out


def compare(summary: dict[str, Any], *, bandwidth_bps: float, mode: str, group_size: int) -> dict[str, Any]:
    """The σ = 0 model for the measured N and bytes, beside the measured figures.

    Returns {"bandwidth_bps", "latency_s", "rows": [{"quantity", "measured_s", "modelled_s", "error"}]}
    where error = measured / modelled − 1 (None when either is missing).
    """
    n = summary["num_nodes"]
    model_bw = goodput_bps(bandwidth_bps) if mode == "netns" else bandwidth_bps
    latency = summary["latency_s"]
    m = SyncModel(model_bytes=summary["all_reduce_bytes"], bandwidth_bps=model_bw, latency_s=latency,
                  sigma=0.0, group_size=group_size)  # fmt: skip
    cf = closed_form(n, m)
    tiny = SyncModel(model_bytes=summary["tiny_all_reduce_bytes"], bandwidth_bps=model_bw, latency_s=latency,
                     sigma=0.0, group_size=group_size)  # fmt: skip

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    rows = [
        ("all-reduce of M (gloo ring, via Link)", summary["all_reduce_s"], cf.ring_s, "s"),
        ("NoLoCo exchange of 2M (Link.exchange)", summary["exchange_s"], cf.pair_s, "s"),
        ("NoLoCo exchange, receives posted first", summary["exchange_receive_first_s"], cf.pair_s, "s"),
        ("ratio all-reduce / Link.exchange", ratio(summary["all_reduce_s"], summary["exchange_s"]), cf.ring_ratio, "x"),
        ("ratio all-reduce / receive-first exchange",
         ratio(summary["all_reduce_s"], summary["exchange_receive_first_s"]), cf.ring_ratio, "x"),
        (f"latency term: all-reduce of {summary['tiny_all_reduce_bytes']} B",
         summary["tiny_all_reduce_s"], closed_form(n, tiny).ring_s, "s"),
    ]  # fmt: skip
    return {
        "num_nodes": n,
        "bandwidth_bps": model_bw,
        "latency_s": latency,
        "rows": [{"quantity": q, "measured": meas, "modelled": mod, "unit": unit,
                  "error": None if meas is None or not mod else meas / mod - 1.0}
                 for q, meas, mod, unit in rows],
    }  # fmt: skip
