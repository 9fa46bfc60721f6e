"""What ``lowband simulate`` does: NoLoCo's sync step against DiLoCo's all-reduce, modelled, and measured at small N.

The NoLoCo paper estimates its synchronisation step to be about ten times faster than DiLoCo's
all-reduce "for a few hundred accelerators training over the internet". That figure is a model,
not a measurement. This command evaluates such a model for N = 2, 4, ..., 1024 replicas (and any
N given), prints a table, writes a plot of the ratio against N, and checks the model against
times measured on this machine's emulated links at N = 4 and 8.

Model (everything here is MODELLED; σ = 0 gives the closed forms exactly)::

    M        model bytes = parameters × bytes per parameter (DiLoCo all-reduces M)
    B, L     each replica's link: rate in bit/s (full duplex), latency per message in s
    t(b)   = (L + 8·b/B) · X      one message of b bytes
    X      = exp(σ·Z − σ²/2), Z ~ N(0, 1), independent per message: log-normal with mean 1
    E_k    = E[max of k factors X]   (Monte Carlo, fixed seed; = 1 at σ = 0)

    NoLoCo, groups of n (pairs by default), one round, no barrier over all replicas:
        every member sends φ and θ−φ, 2M bytes, to each of its n−1 peers at once (one uplink);
        a member is done when the 2(n−1) messages it sends or receives have all arrived:
        member  = (L + 8·2M·(n−1)/B) · max of its 2(n−1) factors
        pair    = mean over replicas of member           σ = 0, n = 2:  L + 16·M/B
        slowest = the slowest group (reported; nobody waits for it)
    DiLoCo, ring all-reduce (reduce-scatter + all-gather), the brief's bulk-synchronous model:
        2(N−1) steps; in each, N messages of M/N bytes at once; a step waits for its slowest:
        ring    = 2(N−1) · (L + 8·M/(N·B)) · E_N          σ = 0:  2(N−1)·(L + 8·M/(N·B))
    DiLoCo, tree all-reduce (binomial-tree reduce, then broadcast: the paper's "2·t·log2 N"):
        2·⌈log2 N⌉ rounds of M bytes; reduce round r carries c_r = ⌈(N − 2^(r−1)) / 2^r⌉ messages
        (N/2^r for a power of two), the broadcast the same backwards; a round waits for its slowest:
        tree    = 2 · (L + 8·M/B) · Σ_r E_{c_r}            σ = 0:  2·⌈log2 N⌉·(L + 8·M/B)
    Without barriers (ring*, tree*; Monte Carlo over the data flow): a message starts as soon as
        its sender has the data and its link end is free; mean over replicas of when each has the
        result. Real collectives (gloo, NCCL) have no step barrier, so these are likely closer to
        reality; at σ = 0 they equal the barrier forms.
    ratio   = DiLoCo time / NoLoCo pair time

Assumptions: every replica has a link of its own (no shared core bottleneck); message times are
independent (no persistently slow replica: one would slow every all-reduce but only its own
NoLoCo group); no overlap with compute; no compression. σ = 0.5 by default: the mean message time
is the deterministic one and the spread only adds waiting; at σ = 0.5 the 95th percentile of a
message is 2.0× its mean and the expected slowest of 256 is 3.7×. What σ describes a given
network is an input, not a finding: the output shows the headline at several σ.

Measurement (``--measure``, the default): see :mod:`lowband.simulate.measure`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from lowband.simulate import measure as ms
from lowband.simulate.measure import MeasureSpec
from lowband.simulate.model import SyncModel, closed_form, sweep
from lowband.simulate.report import (
    format_comparison,
    format_model_table,
    format_seconds,
    sensitivity,
    write_plot,
)
from lowband.units import (
    format_bytes,
    format_count,
    format_rate,
)

__all__ = ["DEFAULT_OUT", "SimulateConfig", "run"]

log = logging.getLogger(__name__)

HEADLINE_REPLICAS = 256
PAPER_CLAIM_RATIO = 10.0
SENSITIVITY_SIGMAS = (0.0, 0.25, 0.5, 1.0)
ERROR_TARGET = 0.25
DEFAULT_OUT = Path("runs/simulate")

@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    model: SyncModel
    parameters: float
    bytes_per_param: float
    replica_counts: list[int]
    out_dir: Path
    measure: MeasureSpec | None


def _model_section(cfg: SimulateConfig) -> tuple[str, dict[str, Any], list, list]:

    m = cfg.model
    rows = sweep(cfg.replica_counts, m)
    deterministic = [closed_form(n, m) for n in cfg.replica_counts]
    (head,) = [r for r in rows if r.num_replicas == HEADLINE_REPLICAS] or sweep([HEADLINE_REPLICAS], m)
    head0 = closed_form(HEADLINE_REPLICAS, m)
    sens = sensitivity(m, HEADLINE_REPLICAS, SENSITIVITY_SIGMAS)
    peers = m.group_size - 1
    lines = [
        "MODELLED sync-step times (a model, not a measurement)",
        f"  model    {format_count(cfg.parameters)} parameters × {cfg.bytes_per_param:g} B = M = {format_bytes(m.model_bytes)}: DiLoCo "
        f"all-reduces M; NoLoCo sends φ and θ−φ, 2M = {format_bytes(2 * m.model_bytes)}, to each of its "
        f"{peers} peer{'s' if peers != 1 else ''} (groups of n = {m.group_size})",
        f"  link     {format_rate(m.bandwidth_bps)} per replica, latency {m.latency_s * 1e3:g} ms per message; "
        f"each message time × a log-normal factor with mean 1, σ = {m.sigma:g}",
        f"  method   Monte Carlo, {m.samples} samples, seed {m.seed}" + (" (σ = 0: closed forms)" if m.sigma == 0 else ""),
        "",
        format_model_table(rows),
        "",
        "  NoLoCo  = group exchange, mean time per replica (no barrier over all replicas); slowest = the slowest group",
        "  ring    = ring all-reduce, 2(N−1) steps of M/N, each step waits for the slowest of its N messages",
        "  tree    = tree reduce + broadcast, 2·⌈log2 N⌉ rounds of M, each round waits for its slowest (the paper's model)",
        "  *       = without step/round barrier (each message waits only for its data and link; as real collectives)",
        "  X/NL    = DiLoCo time / NoLoCo time; times in seconds",
        "",
        f"HEADLINE (MODELLED) at N = {HEADLINE_REPLICAS}: DiLoCo / NoLoCo = {head.tree_ratio:.1f}× with the tree all-reduce "
        f"(the paper's model; the paper says ≈{PAPER_CLAIM_RATIO:g}× for a few hundred replicas), {head.ring_ratio:.1f}× with the ring;",
        f"  without barriers {head.tree_no_barrier_ratio:.1f}× (tree) and "
        f"{head.ring_no_barrier_ratio:.1f}× (ring); with no spread (σ = 0) {head0.tree_ratio:.1f}× (tree) and {head0.ring_ratio:.1f}× (ring).",
        f"  NoLoCo {format_seconds(head.pair_s)} s per replica vs DiLoCo {format_seconds(head.tree_s)} s (tree), "
        f"{format_seconds(head.ring_s)} s (ring).",
        "  σ sensitivity at N = 256 (tree / ring / tree* / ring*): "
        + "; ".join(f"σ={s['sigma']:g}: {s['tree_ratio']:.1f} / {s['ring_ratio']:.1f} / {s['tree_no_barrier_ratio']:.1f}"
                    f" / {s['ring_no_barrier_ratio']:.1f}" for s in sens),  # fmt: skip
    ]
    data = {
        "inputs": {"parameters": cfg.parameters, "bytes_per_param": cfg.bytes_per_param,
                   **dataclasses.asdict(m), "replica_counts": cfg.replica_counts},
        "rows": [r.as_dict() for r in rows],
        "rows_sigma0": [r.as_dict() for r in deterministic],
        "headline": {"num_replicas": HEADLINE_REPLICAS, **head.as_dict(), "sigma0": head0.as_dict(),
                     "paper_claim_ratio": PAPER_CLAIM_RATIO},
        "sensitivity": sens,
    }  # fmt: skip
    return "\n".join(lines), data, rows, deterministic


def _measure_section(cfg: SimulateConfig) -> tuple[str, dict[str, Any], list[dict[str, Any]], SyncModel | None, str]:

    spec = cfg.measure
    assert spec is not None
    mode, reason = ms.choose_mode()
    where = (f"{'/'.join(str(n) for n in spec.nodes)} emulated nodes (network namespaces, tbf {format_rate(spec.bandwidth_bps)} "
             "per node), one rank each") if mode == "netns" else (
             f"loopback with IN-PROCESS SHAPING at {format_rate(spec.bandwidth_bps)} (network namespaces unavailable: {reason})")  # fmt: skip
    # A rough guess for the progress line: starting torchrun and torch in every node dominates.
    guess_s = sum(10 + 5.5 * n for n in spec.nodes)
    print(f"\nmeasuring on {where}: N = {', '.join(map(str, spec.nodes))} (about {guess_s:.0f} s on 2 cores, "
          "mostly torchrun start-up) ...", file=sys.stderr, flush=True)  # fmt: skip
    raw = ms.measure(spec, cfg.out_dir / "measure", mode=mode, reason=reason)
    summaries = [ms.summarize(run) for run in raw["runs"]]
    comparisons = [ms.compare(s, bandwidth_bps=spec.bandwidth_bps, mode=mode, group_size=spec.group_size)
                   for s in summaries]  # fmt: skip
    latency_ms = ", ".join(f"N={c['num_nodes']}: {c['latency_s'] * 1e3:.2f} ms" for c in comparisons)
    lines = [
        f"MEASURED on this machine vs MODELLED: {where}",
        f"  payload  M = {format_bytes(spec.size_bytes)} all-reduced (DiLoCo); NoLoCo exchanges 2M = "
        f"{format_bytes(2 * spec.size_bytes)} with a peer from a seeded permutation; "
        f"median of {spec.reps} repetitions of the mean over replicas",
        "  model    σ = 0, ring all-reduce (gloo's algorithm for CPU tensors), "
        + (f"B = {format_rate(comparisons[0]['bandwidth_bps'])} (the tbf rate × 1448/1514: TCP payload per Ethernet frame), "
           if mode == "netns" else f"B = {format_rate(comparisons[0]['bandwidth_bps'])} (the in-process shaping rate), ")
        + f"L = measured one-float exchange time ({latency_ms}); nothing fitted to the timings below",
        "",
        format_comparison(comparisons),
        "",
    ]  # fmt: skip
    for run in raw["runs"]:
        probe = run.get("throughput_probe") or {}
        t = run["timing"]
        probe_txt = (f"TCP probe node 0 -> 1 {format_rate(probe['steady_bps'])} (reported only); "
                     if "steady_bps" in probe else "")  # fmt: skip
        split = (f": start-up to process group {t['start_up_s']:.0f} s, timed operations {t['operations_s']:.0f} s"
                 if "start_up_s" in t else "")  # fmt: skip
        lines.append(f"  N={run['num_nodes']}: {probe_txt}took {t['total_s']:.0f} s (network set-up "
                     f"{t['network_setup_s']:.1f} s, torchrun {t['launch_s']:.0f} s{split})")  # fmt: skip
    bad = [(c["num_nodes"], r) for c in comparisons for r in c["rows"]
           if r["error"] is not None and abs(r["error"]) > ERROR_TARGET]  # fmt: skip
    main_bad = [(n, r) for n, r in bad if not r["quantity"].startswith("latency term")]
    lines.append(f"  target |error| <= {ERROR_TARGET:.0%}: " + ("met by every main row" if not main_bad else
                 "NOT met by: " + "; ".join(f"N={n} {r['quantity']} ({r['error']:+.0%})" for n, r in main_bad)))  # fmt: skip
    if any(r["quantity"].startswith("NoLoCo exchange of 2M (Link") for _, r in main_bad):
        lines += [
            "  why Link.exchange is slow: gloo sends a message only after the receiver announced its posted receive, and",
            "  that announcement queues behind any data already queued to the same peer. Link.exchange posts its send",
            "  before its receive, so when one side's data goes first the other side's send waits for all of it: the two",
            "  directions run one after the other (up to 2× the time). Posting receives first (row 'receives posted first')",
            "  gives what the link allows. The fix belongs in lowband/comm/link.py (irecv before isend); the model is unchanged.",
        ]  # fmt: skip
    if any(r["quantity"].startswith("latency term") for _, r in bad):
        lines.append("  latency term: a tiny gloo all-reduce costs more per ring step than one point-to-point message here "
                     "(2N segments, a receive announcement per segment, N processes on 2 cores); at the payload above "
                     "it is a few % of the time.")  # fmt: skip
    if mode == "shaped":
        lines.append("  NOTE: in-process shaping makes every operation last at least the link's own ring-model time: "
                     "agreement here is by construction, NOT evidence for the model.")  # fmt: skip
    plot_points = []
    for s in summaries:
        plot_points.append({
            "num_nodes": s["num_nodes"],
            "ratio_link": s["all_reduce_s"] / s["exchange_s"] if s["exchange_s"] else None,
            "ratio_receive_first": (s["all_reduce_s"] / s["exchange_receive_first_s"]
                                    if s["exchange_receive_first_s"] else None),
        })  # fmt: skip
    pm = SyncModel(model_bytes=spec.size_bytes, bandwidth_bps=comparisons[0]["bandwidth_bps"],
                   latency_s=comparisons[0]["latency_s"], sigma=0.0, group_size=spec.group_size)  # fmt: skip
    title = (f"MEASURED on {'emulated links (netns, tbf)' if mode == 'netns' else 'loopback, in-process shaping'} at "
             f"{format_rate(spec.bandwidth_bps)}, M = {format_bytes(spec.size_bytes)}; line: model, σ = 0")  # fmt: skip
    data = {"mode": mode, "reason": reason, "raw": raw, "summaries": summaries, "comparisons": comparisons,
            "error_target": ERROR_TARGET}  # fmt: skip
    return "\n".join(lines), data, plot_points, pm, title


def run(cfg: SimulateConfig, *, command: list[str] | None = None) -> dict[str, Any]:
    """Model, optionally measure, print, and write simulate.json and simulate.png; return the JSON."""

    t0 = time.perf_counter()
    text, model_data, rows, deterministic = _model_section(cfg)
    print("lowband simulate: NoLoCo's sync step against DiLoCo's all-reduce\n")
    print(text, flush=True)
    result: dict[str, Any] = {"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "model": model_data, "measurement": None}  # fmt: skip
    points: list[dict[str, Any]] = []
    pm, mtitle = None, ""
    error: str | None = None
    if cfg.measure is not None:
        try:
            mtext, mdata, points, pm, mtitle = _measure_section(cfg)
            print("\n" + mtext, flush=True)
            result["measurement"] = mdata
        except (RuntimeError, OSError) as exc:
            error = f"the measurement failed: {exc}"
            result["measurement"] = {"error": error}
            print(f"\nMEASUREMENT FAILED (the model above stands): {exc}", flush=True)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    m = cfg.model
    png = write_plot(
        cfg.out_dir / "simulate.png", rows, deterministic,
        title=(f"MODELLED: {format_count(cfg.parameters)} params × {cfg.bytes_per_param:g} B = {format_bytes(m.model_bytes)}, "
               f"{format_rate(m.bandwidth_bps)}, L = {m.latency_s * 1e3:g} ms, σ = {m.sigma:g}, n = {m.group_size}"),
        measured=points, measured_model=pm, measured_title=mtitle,
        claim_ratio=PAPER_CLAIM_RATIO, headline_replicas=HEADLINE_REPLICAS,
    )  # fmt: skip
    result["files"] = {"plot": str(png), "json": str(cfg.out_dir / "simulate.json")}
    result["error"] = error
    result["elapsed_s"] = time.perf_counter() - t0
    (cfg.out_dir / "simulate.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {png} and {cfg.out_dir / 'simulate.json'}")
    return result
