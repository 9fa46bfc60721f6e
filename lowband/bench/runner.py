"""Run a bench: every planned run on emulated nodes, one results record each.

For each bandwidth the runner builds the emulated link once and runs every method on it:

- ``netns`` (root, ``ip netns`` and ``tc`` tbf available): an
  :class:`~lowband.cluster.EmulatedNetwork` of one namespace per node joined by tbf-limited veth
  links; the link's TCP throughput is measured once (:func:`~lowband.cluster.measure_throughput`)
  and each run's interface byte counters are read before and after it;
- ``shaped`` (anywhere): all nodes on loopback, and every rank's link shapes its own traffic
  as the ``--link-bandwidth`` / ``--link-latency`` flags of its command say
  (:func:`~lowband.bench.jobs.shaping_args`).

Each run is ``python -m lowband train ...`` on every node through
:func:`~lowband.cluster.launch_nodes` (one torchrun per node). A run that crashes or times out is
recorded as failed with the tail of its node logs, and the next one starts. ``results.json`` is
rewritten before and after every run, so a crash of the bench itself keeps what was measured (the
run it was in is recorded as failed). On Ctrl-C or
SIGTERM the launcher stops every process and the network is torn down (``with`` block) before
the interrupt propagates; namespaces left by an earlier crash are removed at start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from lowband.bench.config import BenchConfig
from lowband.bench.faults import poison_of
from lowband.bench.jobs import run_command
from lowband.bench.plan import RunPlan, plan_runs
from lowband.bench.quality import annotate_time_to_target
from lowband.bench.record import RunRecord, error_headline
from lowband.bench.results import (
    SCHEMA_VERSION,
    aggregate_run,
    host_info,
    now_iso,
    read_summaries,
    truncate_error,
    write_results,
)
from lowband.bench.timebudget import budget_plan
from lowband.cluster import (
    EmulatedNetwork,
    cleanup_leftovers,
    launch_nodes,
    measure_throughput,
    netns_available,
)
from lowband.cluster.ftjob import FaultTolerantJob
from lowband.train.summary import RunSummary
from lowband.trust.secret import write_secret
from lowband.units import format_bandwidth

__all__ = ["check_out_dir", "choose_emulation", "default_out_dir", "prepare_out_dir", "run_bench"]

log = logging.getLogger(__name__)

#: Seconds of the TCP throughput probe per bandwidth (netns mode).
THROUGHPUT_PROBE_S = 1.5
NOT_MEASURED = "shaped in-process, not measured"
STOPPED_DURING_RUN = "the bench stopped before this run finished"
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM) during this run"


def default_out_dir(root: Path = Path("runs")) -> Path:
    """A new directory name ``runs/bench-YYYYmmdd-HHMMSS`` (with a suffix if it exists)."""
    base = root / time.strftime("bench-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_out_dir(out_dir: Path) -> Path:
    """ValueError unless ``out_dir`` can receive a new bench (absent, or a directory without one)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} exists and is not a directory; give a new directory")
    if (out_dir / "results.json").exists() or (out_dir / "runs").exists():
        raise ValueError(f"--out {out_dir} already holds a bench; give a new directory (or leave --out out)")
    return out_dir


def prepare_out_dir(out_dir: Path) -> Path:
    """Create ``out_dir`` after :func:`check_out_dir`."""
    out_dir = check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def choose_emulation(requested: str, *, prefix: str = "lb") -> tuple[str, str]:
    """Decide between ``netns`` and ``shaped``: returns (mode, reason).

    Raises:
        ValueError: ``netns`` was asked for but cannot be built here (the reason says why).
    """
    if requested == "shaped":
        return "shaped", "Chosen with --emulation shaped."
    ok, why = netns_available(prefix)
    if ok:
        return "netns", "Network namespaces with tbf are available (root)."
    if requested == "netns":
        raise ValueError(f"--emulation netns is not possible here: {why}")
    return "shaped", f"Network namespaces unavailable ({why}); shaping in-process instead."


def _remove_leftovers(prefix: str) -> None:
    """Remove namespaces (and processes inside them) left by an earlier bench that crashed."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return
    try:
        removed = cleanup_leftovers(prefix)
    except (RuntimeError, OSError) as exc:
        log.warning("could not look for namespaces left by an earlier run: %s", exc)
        return
    if removed:
        log.warning("removed network namespaces left by an earlier crash: %s", ", ".join(removed))


# torchrun's agent reports a failed worker with a long traceback of its own after the worker's
# output; what the worker printed (the actual error) comes before the first such line.
_AGENT_REPORT = re.compile(r"^[EW]\d{4} .*torch/distributed/elastic/.*failed \(exitcode")
_AGENT_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*$|^\s*exitcode\s*:\s*(-?\d+)")
_EXCERPT_LINES = 40


def log_excerpt(path: Path, *, max_lines: int = _EXCERPT_LINES) -> str:
    """The end of what a node's workers printed, without torchrun's own failure report.

    torchrun appends a ChildFailedError traceback and a summary block after its workers' output;
    this keeps the workers' last ``max_lines`` lines and condenses the summary to
    ``torchrun: rank R exitcode C`` lines.
    """
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(log unreadable: {exc})"
    worker = lines
    for i, line in enumerate(lines):
        if _AGENT_REPORT.match(line):
            worker = lines[:i]
            break
    summary, rank = [], None
    for line in lines[len(worker):]:
        m = _AGENT_FAILURE.match(line)
        if m and m.group(1) is not None:
            rank = m.group(1)
        elif m and rank is not None:
            summary.append(f"torchrun: rank {rank} exitcode {m.group(2)}")
            rank = None
    return "\n".join([*worker[-max_lines:], *dict.fromkeys(summary)])


def failure_text(launch: Any) -> str:
    """Why a launch failed, node by node, with the end of each failing node's worker output."""
    parts = []
    if getattr(launch, "timed_out", False):
        parts.append(f"the run timed out after {launch.wall_time_s:.0f} s (raise --run-timeout if it is slow)")
    killed = getattr(launch, "killed", None) or [False] * len(launch.returncodes)
    for i, rc in enumerate(launch.returncodes):
        if rc == 0:
            continue
        why = "stopped by the launcher" if killed[i] else f"exit status {rc}"
        excerpt = log_excerpt(launch.log_paths[i]).strip() or "(no output)"
        parts.append(f"node {i}: {why}; log {launch.log_paths[i]}; last lines:\n{excerpt}")
    return "\n".join(parts) if parts else launch.failure_message()


def _entry_kwargs(entry: str) -> dict[str, Any]:
    if entry.endswith(".py"):
        return {"script": Path(entry).resolve()}
    return {"module": entry}


def _new_record(plan: RunPlan, config: BenchConfig, *, out_dir: Path, mode: str) -> RunRecord:
    """The run's record before it runs: failed, until :func:`_run_one` says otherwise."""
    run_dir = out_dir / "runs" / plan.id
    return RunRecord(
        id=plan.id, label=plan.label, method=plan.method, spec=plan.spec, params=dict(plan.params),
        topk=plan.topk, chunk=plan.chunk, shards=plan.shards, nodes=plan.nodes, ranks_per_node=plan.ranks_per_node,
        replicas=plan.world_size // plan.shards, model=config.model, steps=plan.steps or config.steps, seed=plan.seed,
        time_budget_s=plan.time_budget_s, max_steps=plan.steps if plan.time_budget_s is not None else None,
        data=config.data, bandwidth_bps=plan.bandwidth_bps,
        latency_s=plan.latency_s, emulation=mode, status="failed",
        run_dir=str(run_dir.relative_to(out_dir)),
        logs=[str((run_dir / "logs" / f"node{i}.log").relative_to(out_dir)) for i in range(plan.nodes)],
        command=run_command(plan, config, run_dir, mode),
        error=STOPPED_DURING_RUN,
    )  # fmt: skip


def _run_one(
    plan: RunPlan,
    config: BenchConfig,
    record: RunRecord,
    *,
    out_dir: Path,
    mode: str,
    net: EmulatedNetwork | None,
    launcher: Callable[..., Any],
) -> RunRecord:
    """Launch one run on every node and fill its record (from :func:`_new_record`) from its output."""
    if plan.ft:
        return _run_ft(plan, config, record, out_dir=out_dir, net=net)
    run_dir = out_dir / "runs" / plan.id
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = record.command
    env: dict[str, str] = {}
    tx_before = [net.tx_bytes(i) for i in range(plan.nodes)] if net is not None else None
    try:
        launch = launcher(
            num_nodes=plan.nodes, ranks_per_node=plan.ranks_per_node, module_args=argv, env=env, net=net,
            timeout_s=config.run_timeout_s, log_dir=run_dir / "logs", **_entry_kwargs(config.entry),
        )  # fmt: skip
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - one run's failure must not stop the bench
        log.exception("run %s could not be launched", plan.id)
        record.error = f"the launch failed: {type(exc).__name__}: {exc}"
        return record
    record.wall_time_s = launch.wall_time_s
    if not launch.ok:
        record.error = truncate_error(failure_text(launch))
        return record
    wire = None
    if net is not None and tx_before is not None:
        wire = [net.tx_bytes(i) - before for i, before in enumerate(tx_before)]
    try:
        summaries = read_summaries(run_dir, plan.world_size)
        aggregate_run(record, summaries, wire_bytes_by_node=wire)
    except (ValueError, KeyError, TypeError) as exc:
        record.status = "failed"
        record.error = f"the run's output is unusable: {exc}"
    return record


def _exit_text(code: int | None) -> str:
    """A node's exit code in words: "exited 0", "exited 1", "was killed by SIGKILL"."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited {code}"


def unplanned_exit_error(bad: dict[int, int | None], expected: dict[int, int], logs: Path) -> str:
    """A fault-tolerant run's error when node(s) ``bad`` ended outside the fault plan: a headline that names each
    node and how it ended, first and whole (a long error keeps only its end, and a killed node's log ends in
    torchft's own lines, which do not say that it was killed), then the end of each log that says more."""
    ended = "; ".join(f"node {n} {_exit_text(c)} (expected: {_exit_text(expected[n])})" for n, c in sorted(bad.items()))
    others = [n for n in sorted(expected) if n not in bad]
    headline = (f"under fault tolerance, node(s) {sorted(bad)} ended outside the fault plan: {ended}; node(s) "
                f"{others} ended as planned. The run's figures would not be the plan's, so it is not counted; the "
                f"nodes' logs are under {logs}")
    tails = "\n".join(f"node {n}, the end of its log:\n{log_excerpt(logs / f'node{n}.log')}"
                      for n in sorted(bad) if (bad[n] or 0) >= 0)  # a killed node's log says nothing of it
    return headline + ("\n" + truncate_error(tails) if tails else "")


def _steady_node(plan: RunPlan) -> int:
    """A node the fault plan never kills, nor makes poison if it can (its record is the run's; its progress
    moves the bar)."""
    killed = {e.node for e in plan.faults if e.action == "kill"}
    poisoner = {e.node for e in plan.faults if e.poison is not None}
    honest = [n for n in range(plan.nodes) if n not in killed and n not in poisoner]
    return honest[0] if honest else next(n for n in range(plan.nodes) if n not in killed)


def _run_ft(plan: RunPlan, config: BenchConfig, record: RunRecord, *, out_dir: Path,
            net: EmulatedNetwork | None) -> RunRecord:
    """A run under fault tolerance: one torchrun per node and a Lighthouse, with the plan's faults carried out.

    Node i writes ``run_dir/node{i}``; the run's record is aggregated over the nodes alive at the end
    (node by node, as if they were the job's only nodes) plus a ``fault_tolerance`` entry: the plan,
    what was done when, each node's membership changes, dropped steps and heals.
    """

    run_dir = out_dir / "runs" / plan.id
    run_dir.mkdir(parents=True, exist_ok=True)
    args = list(record.command[1:])  # after "train"
    i = args.index("--out")
    del args[i:i + 2]
    poison = poison_of(plan.faults)
    if poison is not None:  # a fault of malice: lowband train --poison, carried out by the node itself
        args += ["--poison", poison]
    tx_before = [net.tx_bytes(n) for n in range(plan.nodes)] if net is not None else None
    t0 = time.monotonic()
    try:
        # The job's secret (lowband.trust.secret): every node proves it before it joins a quorum, as across the
        # internet; it lives in a private directory outside the bench's output and goes when the run ends.
        keydir = tempfile.TemporaryDirectory(prefix="lowband-secret-")
        with keydir, FaultTolerantJob(train_args=args, nodes=plan.nodes, ranks_per_node=plan.ranks_per_node,
                                      out=run_dir, net=net, log_dir=run_dir / "logs",
                                      secret_file=write_secret(Path(keydir.name) / "job.secret")) as job:
            codes = job.run_plan([e for e in plan.faults if e.poison is None], timeout_s=config.run_timeout_s)
            events = [{**e, "t_s": e["unix_s"] - job.t0} for e in job.events]
            events += [{"node": e.node, "event": e.action, "planned": str(e), "job_step": e.step, "unix_s": job.t0,
                        "t_s": None} for e in plan.faults if e.poison is not None]
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - one run's failure must not stop the bench
        log.exception("run %s could not be launched", plan.id)
        record.error = f"the launch failed: {type(exc).__name__}: {exc}"
        return record
    record.wall_time_s = time.monotonic() - t0
    last = {e.node: e.action for e in plan.faults if e.action in ("kill", "start")}
    expected = {n: (-9 if last.get(n) == "kill" else 0) for n in range(plan.nodes)}
    for ev in events:  # a poisoner whose bad messages the others reported leaves when the gate removes it
        if ev["event"].startswith("poison") and codes.get(ev["node"]) not in (0, None):
            why = _log_line(run_dir / "logs" / f"node{ev['node']}.log", REMOVED, 400)
            if why is not None:
                ev["removed"] = why
                expected[ev["node"]] = codes[ev["node"]]
    bad = {n: c for n, c in codes.items() if c != expected[n]}
    if bad:
        record.error = unplanned_exit_error(bad, expected, run_dir / "logs")
        return record
    admitted = _check_intruders(events, run_dir / "logs")
    if admitted:
        record.error = truncate_error("an intruder was not refused (the job's command line without its secret):\n"
                                      + "\n".join(admitted))
        return record
    notes = []
    alive = [n for n in range(plan.nodes) if expected[n] == 0 and codes.get(n) == 0]
    for n in [n for n in alive if last.get(n) == "start"]:
        # A node restarted after the others had finished trains alone from scratch: not part of the job.
        started = max(e["unix_s"] for e in events if e["node"] == n and e["event"] == "start")
        ft_path = run_dir / f"node{n}" / "ft_rank0.json"
        healed = json.loads(ft_path.read_text()).get("healed", []) if ft_path.exists() else []
        if not any(h.get("unix_s", 0) >= started for h in healed):
            alive.remove(n)
            notes.append(f"node {n} was started again but never joined the job (the others had finished or it "
                         "found no live peer): left out of the run's figures")
    alive.sort(key=lambda n: n != _steady_node(plan))  # the steady node first: its rank 0 is the run's rank 0
    try:
        summaries = []
        for k, n in enumerate(alive):
            for r in range(plan.ranks_per_node):
                s = RunSummary.read(run_dir / f"node{n}" / f"summary_rank{r}.json")
                s.rank, s.node = k * plan.ranks_per_node + r, k
                summaries.append(s)
        wire = None
        if net is not None and tx_before is not None:
            wire = [net.tx_bytes(n) - tx_before[n] for n in alive]
        record.nodes = len(alive)
        aggregate_run(record, summaries, wire_bytes_by_node=wire)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        record.status = "failed"
        record.error = f"the run's output is unusable: {exc}"
    finally:
        record.nodes = plan.nodes
    record.fault_tolerance = {**_ft_record(plan, run_dir, events), "notes": notes}
    return record


#: What a node refused by the job's nodes prints (lowband.ft.node): the line the report quotes for an intruder.
REFUSED = "is refused by the job"
#: What a member that the Lighthouse's gate removed from the job prints (lowband.ft.node.gate_refusal).
REMOVED = "is removed from the job"


def _log_line(path: Path, marker: str, limit: int) -> str | None:
    """The first line of the log ``path`` that holds ``marker``, from its "node " on (the error without the
    program's prefix), at most ``limit`` characters; None when there is none."""
    text = path.read_text(errors="replace") if path.exists() else ""
    line = next((line.strip() for line in text.splitlines() if marker in line), None)
    if line is None:
        return None
    return (line[line.index("node "):] if "node " in line else line)[:limit]


def _check_intruders(events: list[dict], log_dir: Path) -> list[str]:
    """Mark each ``intrude`` event ``refused`` (it exited non-zero with the refusal in its log) and give it the
    refusal's first line; return what to say for each intruder that was not refused."""
    admitted = []
    for ev in events:
        if ev["event"] != "intrude":
            continue
        path = log_dir / f"{ev['name']}.log"
        ev["why"] = _log_line(path, REFUSED, 300)
        ev["refused"] = ev.get("exit") not in (0, None) and ev["why"] is not None
        if not ev["refused"]:
            code = "still running when the job ended" if ev.get("exit") is None else f"exit {ev['exit']}"
            admitted.append(f"{ev.get('planned', ev['name'])} ({code}); log {path}:\n{log_excerpt(path)}")
    return admitted


def _ft_record(plan: RunPlan, run_dir: Path, events: list[dict]) -> dict[str, Any]:
    """What fault tolerance did in a run: the plan, the events, and each node's membership, drops and heals."""
    nodes: dict[str, Any] = {}
    for n in range(plan.nodes):
        node_dir = run_dir / f"node{n}"
        membership, replicas = [], []
        path = node_dir / "metrics.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("type") == "membership":
                    membership.append(rec)
                elif rec.get("type") == "train" and "replicas" in rec:
                    replicas.append([rec["step"], rec["replicas"], bool(rec.get("dropped"))])
        ft_path = node_dir / "ft_rank0.json"
        ft = json.loads(ft_path.read_text()) if ft_path.exists() else None
        nodes[str(n)] = {"membership": membership, "replicas_by_step": replicas, "end": ft}
    return {"faults": [str(e) for e in plan.faults], "events": events, "steady_node": _steady_node(plan),
            "nodes": nodes}


def _link_info(bandwidth_bps: float, net: EmulatedNetwork | None) -> dict[str, Any]:
    if net is None:
        return {"bandwidth_bps": bandwidth_bps, "measured_throughput_bps": None, "note": NOT_MEASURED}
    try:
        measured = measure_throughput(net, 0, 1, THROUGHPUT_PROBE_S)
        note = f"veth + tbf at {format_bandwidth(bandwidth_bps)}; TCP payload rate from node 0 to node 1"
    except (RuntimeError, OSError, ValueError) as exc:
        log.warning("measuring the link at %s failed: %s", format_bandwidth(bandwidth_bps), exc)
        measured, note = None, f"measurement failed: {exc}"
    return {"bandwidth_bps": bandwidth_bps, "measured_throughput_bps": measured, "note": note}


def run_bench(
    config: BenchConfig,
    out_dir: Path,
    *,
    mode: str | None = None,
    reason: str = "",
    command: list[str] | None = None,
    progress: bool = True,
    launcher: Callable[..., Any] | None = None,
    on_run: Callable[[RunRecord], None] | None = None,
    plans: list[RunPlan] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every planned run of ``config``; write and return the results (see lowband.bench.results).

    Args:
        config: a validated configuration (:meth:`lowband.bench.config.BenchConfig.from_tables`).
        out_dir: the bench directory (created by :func:`prepare_out_dir`).
        mode: ``netns`` or ``shaped``; None decides with :func:`choose_emulation`.
        reason: why ``mode`` was chosen (recorded).
        command: the command line, recorded in results.json.
        progress: show a tqdm progress bar on stderr.
        launcher: a stand-in for :func:`lowband.cluster.launch_nodes` (same signature); None for it.
        on_run: called with each finished run record.
        plans: ``config``'s runs as :func:`~lowband.bench.plan.plan_runs` gives them (None: planned here).
        extra: more top-level keys of results.json (``--tune``: ``tuning``, ``lr_sources``).

    Ctrl-C / SIGTERM: processes and namespaces are cleaned up, results.json is written with
    ``interrupted: true``, and the interrupt propagates.
    """
    if mode is None:
        mode, reason = choose_emulation(config.emulation)
    launcher = launch_nodes if launcher is None else launcher
    plans = plan_runs(config) if plans is None else plans
    latency = config.latency_s  # added in-process by the link in both modes (tbf has no delay)
    results: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "created": now_iso(),
        "finished": None,
        "interrupted": False,
        "command": command,
        "host": host_info(),
        "config": config.as_dict(),
        "emulation": {"mode": mode, "reason": reason, "nodes": config.nodes,
                      "ranks_per_node": config.ranks_per_node, "latency_s": latency, "links": []},  # fmt: skip
        "runs": [],
        **(extra or {}),
    }
    _remove_leftovers("lb")
    write_results(out_dir, results)
    bar = None
    if progress:
        from tqdm import tqdm  # only when a progress bar is shown

        # Steps of every run, so the estimate of the time left covers the whole bench.
        bar = tqdm(total=len(plans) * config.steps, unit="step", desc="bench", dynamic_ncols=True)
    try:
        for bw in dict.fromkeys(p.bandwidth_bps for p in plans):
            group = [p for p in plans if p.bandwidth_bps == bw]
            with ExitStack() as stack:
                net: EmulatedNetwork | None = None
                if mode == "netns":
                    try:
                        net = stack.enter_context(EmulatedNetwork(config.nodes, bw))
                    except (RuntimeError, OSError) as exc:
                        # A network that cannot be built fails its runs; other bandwidths still run.
                        log.error("could not build the emulated network at %s: %s", format_bandwidth(bw), exc)
                        for plan in group:
                            record = _new_record(plan, config, out_dir=out_dir, mode=mode)
                            record.error = f"could not build the emulated network: {exc}"
                            results["runs"].append(record)
                            if bar is not None:
                                bar.update(config.steps)
                        write_results(out_dir, results)
                        continue
                results["emulation"]["links"].append(_link_info(bw, net))
                write_results(out_dir, results)
                for plan in group:
                    plan = budget_plan(plan, config, results["runs"])  # --time-budget: its steps and budget
                    if bar is not None:
                        bar.set_description(f"run {plan.index + 1}/{len(plans)} {plan.label} seed {plan.seed}")
                    record = _new_record(plan, config, out_dir=out_dir, mode=mode)
                    results["runs"].append(record)
                    write_results(out_dir, results)
                    done_before = plan.index * config.steps
                    try:
                        metrics = out_dir / "runs" / plan.id / (
                            f"node{_steady_node(plan)}/metrics.jsonl" if plan.ft else "metrics.jsonl")
                        with _StepProgress(bar, metrics, done_before, steps=config.steps,
                                           budget_s=plan.time_budget_s):
                            _run_one(plan, config, record, out_dir=out_dir, mode=mode, net=net, launcher=launcher)
                    except (KeyboardInterrupt, SystemExit):
                        record.error = INTERRUPTED
                        raise
                    annotate_time_to_target(results)
                    write_results(out_dir, results)
                    if record.status == "ok":
                        log.info("run %s: %.3f s/step", plan.id, record.step_time_s or float("nan"))
                    else:
                        log.warning("run %s failed: %s", plan.id, error_headline(record.error))
                    if on_run is not None:
                        on_run(record)
                    if bar is not None:
                        bar.n = done_before + config.steps
                        bar.refresh()
    except (KeyboardInterrupt, SystemExit):
        results["interrupted"] = True
        raise
    finally:
        if bar is not None:
            bar.close()
        results["finished"] = now_iso()
        annotate_time_to_target(results)
        write_results(out_dir, results)
    return results


class _StepProgress:
    """While a run trains, move the bench's step bar from rank 0's ``metrics.jsonl`` (every 2 s)."""

    def __init__(self, bar: Any, metrics: Path, done_before: int, *, steps: int, budget_s: float | None = None,
                 interval_s: float = 2.0) -> None:  # fmt: skip
        self.bar, self.metrics, self.done_before, self.interval_s = bar, metrics, done_before, interval_s
        # A run's share of the bar is ``steps``; under a time budget it moves with the training clock.
        self.steps, self.budget_s = steps, budget_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _last_step(self) -> int | None:
        try:
            with open(self.metrics, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("type") == "train":
                if self.budget_s:
                    return int(self.steps * min(1.0, float(rec.get("train_time_s", 0.0)) / self.budget_s))
                return min(int(rec["step"]), self.steps)
        return None

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            step = self._last_step()
            if step is not None and self.done_before + step > self.bar.n:
                self.bar.n = self.done_before + step
                self.bar.refresh()

    def __enter__(self) -> _StepProgress:
        if self.bar is not None:
            self._thread = threading.Thread(target=self._poll, name="bench-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
