"""The fault-tolerance part of a bench report: faulted runs beside their twins, and what FT costs.

- **Faults** (``--faults``): each faulted run beside its fault-free twin (same method, seed and
  link, under fault tolerance): the final validation loss of both and the difference, set against
  the twin's seed spread where it ran at several seeds; steps dropped; for each kill the time until
  the survivors' next quorum without the node (detection and reconfiguration); for each start the
  step it healed to, the state it copied (MB) and the time the quorum with the transfer took.
- **Cost** (``--ft both``): seconds per step and bytes per step with fault tolerance on against off,
  measured side by side in the same bench.
- **What the exchange refused** (any run): per member of rank 0's exchange group, the messages
  that failed their check, the updates robust aggregation clipped or left out, the members evicted.
- ``faults.png``: validation loss against step for each faulted run and its twin, the faults marked,
  and the live nodes over the steps.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lowband.bench.quality import variants
from lowband.bench.record import RunRecord
from lowband.report.tables import markdown_table
from lowband.units import format_bandwidth

__all__ = ["ft_section", "fault_plot", "FAULT_PLOT_FILE"]

FAULT_PLOT_FILE = "faults.png"

Run = RunRecord


def _ft(run: Run) -> dict:
    return run.fault_tolerance or {}


def _is_ft(run: Run) -> bool:
    return bool(run.fault_tolerance)


def _twin_label(label: str) -> str:
    return label.removesuffix(" faults")


def _find(runs: Sequence[Run], *, label: str, seed: Any, bw: Any) -> Run | None:
    for r in runs:
        if r.label == label and r.seed == seed and r.bandwidth_bps == bw:
            return r
    return None


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def fault_events(run: Run) -> list[dict]:
    """Per planned event: what it did and what it cost, from the run's fault-tolerance record."""
    ft = _ft(run)
    nodes = ft.get("nodes") or {}
    steady = nodes.get(str(ft.get("steady_node", 0))) or {}
    membership = steady.get("membership") or []
    out = []
    for ev in ft.get("events") or []:
        if not ev.get("planned"):
            continue
        row = {"event": ev["planned"], "node": ev["node"], "action": ev["event"], "job_step": ev.get("job_step"),
               "t_s": ev.get("t_s")}
        if ev["event"] == "kill":
            # The steady node's first membership change to fewer nodes after the kill.
            after = [m for m in membership if m.get("unix_s", 0) >= ev["unix_s"] and m["replicas"] < m["was"]]
            if after:
                m = after[0]
                row["detect_s"] = m["unix_s"] - ev["unix_s"]
                row["quorum_s"] = m["quorum_s"]
                row["resumed_step"] = m["step"]
        elif ev["event"] == "start":
            node = nodes.get(str(ev["node"])) or {}
            heals = [h for h in ((node.get("end") or {}).get("healed") or []) if h.get("unix_s", 0) >= ev["unix_s"]]
            if heals:
                h = heals[0]
                row["healed_step"] = h.get("step")
                row["heal_mb"] = h.get("bytes", 0) / 1e6
                row["heal_quorum_s"] = h.get("quorum_s")
                row["join_s"] = h["unix_s"] - ev["unix_s"]  # start-up + waiting for a quorum + transfer
        elif ev["event"] == "intrude":
            row["refused"], row["why"], row["exit"] = ev.get("refused"), ev.get("why"), ev.get("exit")
        elif ev.get("removed"):  # a poisoner the gate removed from the quorum on the others' reports
            row["removed"] = ev["removed"]
        out.append(row)
    return out


def dropped_steps(run: Run) -> int:
    """Steps (outer steps for DiLoCo/NoLoCo) the steady node dropped because an exchange failed."""
    ft = _ft(run)
    steady = (ft.get("nodes") or {}).get(str(ft.get("steady_node", 0))) or {}
    return int((steady.get("end") or {}).get("dropped_steps") or 0)


def fault_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    runs = results["runs"]
    vs = {(v.label, v.bandwidth_bps): v for v in variants(runs)}
    headers = ["variant", "seed", "faults", "steps dropped", "kill → quorum without it (s)",
               "rejoin: healed at step, MB, transfer s", "intruder (no secret), poisoner", "final loss", "twin's final loss", "Δ", "twin's seed spread"]
    rows = []
    for r in runs:
        if not _ft(r).get("faults"):
            continue
        twin = _find(runs, label=_twin_label(r.label), seed=r.seed, bw=r.bandwidth_bps)
        evs = fault_events(r)
        kills = "; ".join(f"{e['event']}: {_fmt(e.get('detect_s'), '.2f')}" for e in evs if e["action"] == "kill")
        starts = "; ".join(f"{e['event']}: {e.get('healed_step', '–')}, {_fmt(e.get('heal_mb'), '.2f')}, "
                           f"{_fmt(e.get('heal_quorum_s'), '.2f')}" for e in evs if e["action"] == "start")
        intruders = "; ".join([f"{e['event']}: " + ("refused" if e.get("refused") else "NOT refused")
                               for e in evs if e["action"] == "intrude"]
                              + [f"{e['event']}: removed from the quorum (the others reported its bad messages)"
                                 for e in evs if e.get("removed")])
        loss, tloss = r.val_loss, (twin.val_loss if twin is not None else None)
        delta = loss - tloss if loss is not None and tloss is not None else None
        tv = vs.get((_twin_label(r.label), r.bandwidth_bps))
        spread = "one seed: unknown"
        if tv is not None and len(tv.ok) > 1:
            mean, lo, hi = tv.stat("val_loss")
            spread = f"{lo:.4f}–{hi:.4f}" + (" (within)" if loss is not None and lo <= loss <= hi else " (outside)")
        rows.append([r.label, str(r.seed), ", ".join(_ft(r)["faults"]),
                     str(dropped_steps(r)) if r.status == "ok" else "run failed", kills or "–", starts or "–",
                     intruders or "–", _fmt(loss, ".4f"), _fmt(tloss, ".4f"), _fmt(delta, "+.4f"), spread])
        for note in _ft(r).get("notes") or []:
            rows[-1][5] += f" ({note})"
    return headers, rows


def cost_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Fault tolerance on against off, per variant, seed and link (``--ft both``)."""
    runs = results["runs"]
    headers = ["variant", "seed", "link", "s/step off", "s/step on", "on/off", "MB/step/node off", "MB/step/node on",
               "on/off"]
    rows = []

    for r in runs:
        if not _is_ft(r) or _ft(r).get("faults") or not r.label.endswith(" FT"):
            continue
        off = _find(runs, label=r.label.removesuffix(" FT"), seed=r.seed, bw=r.bandwidth_bps)
        if off is None or off.status != "ok" or r.status != "ok":
            continue
        a, b = off.step_time_s, r.step_time_s
        ba, bb = off.inter_node_bytes_per_step, r.inter_node_bytes_per_step
        rows.append([off.label, str(r.seed), format_bandwidth(r.bandwidth_bps), _fmt(a, ".3f"),
                     _fmt(b, ".3f"), _fmt(b / a if a and b else None, ".3f"), _fmt(ba / 1e6 if ba else None, ".4f"),
                     _fmt(bb / 1e6 if bb else None, ".4f"), _fmt(bb / ba if ba and bb else None, ".3f")])
    return headers, rows


def _by_member(counts: Mapping[str, int] | None, of: int | None) -> str:
    """``{"1": 146}`` -> "member 1: 146 of 151"."""
    if not counts:
        return "–"
    return "; ".join(f"member {m}: {n}" + (f" of {of}" if of else "") for m, n in counts.items())


def screened_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Runs whose exchange refused or weakened anything: by member, how often, and the final loss."""
    headers = ["variant", "seed", "faults", "messages refused (failed their check)", "clipped to the median norm",
               "left out (aggregate=agree)", "evicted", "final loss"]
    rows = []
    for r in results["runs"]:
        s = r.screened or {}
        if not any(s.get(k) for k in ("bad_messages", "clipped", "left_out", "evicted")):
            continue
        of = s.get("aggregations")
        rows.append([r.label, str(r.seed), ", ".join(_ft(r).get("faults") or []) or "–",
                     _by_member(s.get("bad_messages"), None), _by_member(s.get("clipped"), of),
                     _by_member(s.get("left_out"), of),
                     ", ".join(f"member {m}" for m in s.get("evicted") or []) or "–", _fmt(r.val_loss, ".4f")])
    return headers, rows


def ft_section(results: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    headers, rows = fault_rows(results)
    if rows:
        out += ["## Faults: each faulted run beside its fault-free twin", "",
                "Both run under fault tolerance (one torchrun per node, torchft), on the same data, seed and link; "
                "the faulted one carries out the plan (kill: SIGKILL to every process of the node; start: the node "
                "rejoins and copies its state from a live peer over the network; poison: from its step on the node "
                "sends its updates times 1,000, poison-flip: sign-flipped, well-formed and finite, so that only "
                "robust aggregation bounds them (aggregate=clip|trimmed the scaled ones, aggregate=agree the flipped); poison-nan, poison-index: NaN values or "
                "out-of-range indices with a clean flag, which the message checks refuse (the members report the "
                "sender to the Lighthouse's gate, which removes it from the quorum once most of them did); intrude: a process with the job's command "
                "line but not its secret starts in the node's slot, and must be refused before any process group "
                "includes it: the run fails if it is not; every fault-tolerant run of the bench has a job secret "
                "of its own). *Steps dropped*: steps whose "
                "exchange failed and were applied nowhere (DiLoCo: outer steps). *kill → quorum without it*: "
                "from the kill to the survivors' next quorum without the node. *rejoin*: the step it healed to, the "
                "state it copied and how long the quorum with the transfer took (start-up of the restarted node "
                "not included). A difference in final loss is judged against the twin's seed spread, which needs "
                "the twin at several seeds (--seeds). The global batch shrinks while a node is dead (its slice "
                "of each step's batch is skipped).", "", markdown_table(headers, rows), ""]
    headers, rows = screened_rows(results)
    if rows:
        out += ["## What the exchange refused", "",
                "Rank 0's count over the run, per member of its exchange group (member i is node i without fault "
                "tolerance; under it, the member's place in the quorum). *Messages refused*: received messages that "
                "failed their check (size, index range, finite values, flag) and were left out of the step. "
                "*Clipped*: updates robust aggregation (clip, agree) scaled down to the members' median norm (with 3 members, one a step when their norms differ). *Left out*: "
                "updates aggregate=agree left out because they pointed against most of the others' (of the "
                "rule's decisions: one per step and bucket of parameters for FlexDeMo, per outer step for the others). *Evicted*: members whose "
                "messages failed their check 3 times in a row; nothing they sent after was used until the "
                "membership changed.", "", markdown_table(headers, rows), ""]
    headers, rows = cost_rows(results)
    if rows:
        out += ["## What fault tolerance costs when nothing fails", "",
                "The same runs with fault tolerance off and on (--ft both), side by side in this bench: the "
                "quorum (formed while the step computes for the methods that communicate every step, before the outer step "
                "for the local-step methods) and the commit vote after each exchange are what fault tolerance adds.",
                "", markdown_table(headers, rows), ""]
    return out


def _plot_delta(ax, run: Run, twin: Run | None, twin_variant) -> None:
    """The faulted run's validation loss minus its twin's at the steps both validated, and the band of the twin's
    final losses over its seeds, relative to this seed's (where more than one seed ran)."""
    ax.axhline(0.0, color="tab:blue", lw=1)
    ax.set_ylabel("Δ val loss vs twin", fontsize=8)
    if twin is None or not twin.val_history or not run.val_history:
        return
    theirs = {p["step"]: p["val_loss"] for p in twin.val_history}
    pts = [(p["step"], p["val_loss"] - theirs[p["step"]]) for p in run.val_history if p["step"] in theirs]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "--", marker=".", color="tab:orange", label="with faults − twin")
    if twin_variant is not None and len(twin_variant.ok) > 1 and twin.val_loss is not None:
        _, lo, hi = twin_variant.stat("val_loss")
        ax.axhspan(lo - twin.val_loss, hi - twin.val_loss, color="tab:blue", alpha=0.15,
                   label=f"twin's final loss over {len(twin_variant.ok)} seeds")
    ax.legend(fontsize=7, loc="upper left")


def fault_plot(results: Mapping[str, Any], path: Path) -> Path | None:
    """``faults.png``: per faulted run, loss against step beside its twin, faults marked, live nodes below."""
    runs = results["runs"]
    faulted = [r for r in runs if _ft(r).get("faults") and r.status == "ok"]
    if not faulted:
        return None
    from matplotlib.figure import Figure  # heavy: only the plots need it

    n = min(len(faulted), 6)
    vs = {(v.label, v.bandwidth_bps): v for v in variants(runs)}
    fig = Figure(figsize=(6.5 * min(n, 3), 8.0 * ((n + 2) // 3)))
    grid = fig.add_gridspec(3 * ((n + 2) // 3), min(n, 3), height_ratios=[3, 1.6, 1] * ((n + 2) // 3))
    for i, r in enumerate(faulted[:n]):
        row, col = 3 * (i // 3), i % 3
        ax = fig.add_subplot(grid[row, col])
        axd = fig.add_subplot(grid[row + 1, col], sharex=ax)
        axn = fig.add_subplot(grid[row + 2, col], sharex=ax)
        twin = _find(runs, label=_twin_label(r.label), seed=r.seed, bw=r.bandwidth_bps)
        for run, style, name in ((twin, "-", "fault-free twin"), (r, "--", "with faults")):
            if run is None or not run.val_history:
                continue
            pts = [(p["step"], p["val_loss"]) for p in run.val_history]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=name)
        _plot_delta(axd, r, twin, vs.get((_twin_label(r.label), r.bandwidth_bps)))
        for e in fault_events(r):
            if e.get("job_step") is None:
                continue
            colour = {"kill": "tab:red", "start": "tab:green", "intrude": "tab:brown"}.get(e["action"],
                                                                                           "tab:purple")  # poison
            for a in (ax, axd, axn):
                a.axvline(e["job_step"], color=colour, alpha=0.6, lw=1)
            ax.annotate(e["event"] + (": removed" if e.get("removed") else ""), (e["job_step"], 1.0),
                        xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7,
                        color=colour)
        ax.set_title(f"{r.label} (seed {r.seed})", fontsize=9)
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
        ft = _ft(r)
        steady = (ft.get("nodes") or {}).get(str(ft.get("steady_node", 0))) or {}
        reps = steady.get("replicas_by_step") or []
        if reps:
            axn.step([p[0] for p in reps], [p[1] for p in reps], where="post", color="tab:blue")
            drops = [p[0] for p in reps if p[2]]
            axn.plot(drops, [0.5] * len(drops), "x", color="tab:red", label="dropped step")
            if drops:
                axn.legend(fontsize=7, loc="lower right")
        axn.set_ylim(0, int(r.nodes or 3) + 0.5)
        axn.set_ylabel("live nodes")
        axn.set_xlabel("step")

    fig.suptitle(textwrap.fill("Faults: validation loss beside the fault-free twin (kills red, starts green, "
                               "intruders brown, poison purple); the difference to the twin at each validation "
                               "(zoomed), with the twin's seed spread where several seeds ran; live nodes below, "
                               "dropped steps x", 60 * min(n, 3)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
