"""Text tables and the plot of ``lowband simulate``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowband.simulate.model import SyncModel, SyncTimes, closed_form, default_replica_counts, sweep

__all__ = ["format_comparison", "format_model_table", "format_seconds", "sensitivity", "write_plot"]


def format_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 100:
        return f"{s:.0f}"
    if s >= 1:
        return f"{s:.3g}"
    return f"{s:.3f}"


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def format_model_table(rows: Sequence[SyncTimes]) -> str:
    """The modelled sweep: times in seconds and DiLoCo/NoLoCo ratios, one line per N."""
    head = (f"{'N':>6} | {'NoLoCo':>8} {'slowest':>8} | {'ring':>8} {'ring*':>8} {'tree':>8} {'tree*':>8} |"
            f" {'ring/NL':>7} {'ring*/NL':>8} {'tree/NL':>7} {'tree*/NL':>8}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.num_replicas:>6} | {format_seconds(r.pair_s):>8} {format_seconds(r.pair_slowest_s):>8} |"
            f" {format_seconds(r.ring_s):>8} {format_seconds(r.ring_no_barrier_s):>8}"
            f" {format_seconds(r.tree_s):>8} {format_seconds(r.tree_no_barrier_s):>8} |"
            f" {_ratio(r.ring_ratio):>7} {_ratio(r.ring_no_barrier_ratio):>8}"
            f" {_ratio(r.tree_ratio):>7} {_ratio(r.tree_no_barrier_ratio):>8}"
        )
    return "\n".join(lines)


def _fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:.3f} s" if unit == "s" else f"{value:.2f}×"


def format_comparison(comparisons: Sequence[dict[str, Any]]) -> str:
    """Measured beside modelled, one line per (N, quantity), with the relative error."""
    width = max(len(row["quantity"]) for c in comparisons for row in c["rows"])
    head = f"{'N':>3}  {'quantity':<{width}}  {'MEASURED':>10}  {'MODELLED':>10}  {'error':>8}"
    lines = [head, "-" * len(head)]
    for c in comparisons:
        for row in c["rows"]:
            err = "—" if row["error"] is None else f"{row['error'] * 100:+.1f} %"
            lines.append(
                f"{c['num_nodes']:>3}  {row['quantity']:<{width}}  {_fmt_value(row['measured'], row['unit']):>10}"
                f"  {_fmt_value(row['modelled'], row['unit']):>10}  {err:>8}"
            )
    return "\n".join(lines)


def write_plot(
    path: Path,
    rows: Sequence[SyncTimes],
    deterministic: Sequence[SyncTimes],
    *,
    title: str,
    measured: Sequence[dict[str, Any]] = (),
    measured_model: SyncModel | None = None,
    measured_title: str = "",
    claim_ratio: float = 10.0,
    headline_replicas: int = 256,
) -> Path:
    """Write the PNG: the modelled ratio against N (left) and, if given, measured vs modelled (right).

    Args:
        rows: the modelled sweep (σ as given). deterministic: the same N at σ = 0.
        measured: per N, a dict with "num_nodes", "ratio_link", "ratio_receive_first".
        measured_model: the σ = 0 model at the measurement's link, drawn as a line on the right.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only the plots need it
    from matplotlib.figure import Figure  # heavy: only the plots need it

    panels = 2 if measured else 1
    fig = Figure(figsize=(7.5 * panels, 5.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, panels, 1)
    ns = [r.num_replicas for r in rows]
    ax.plot(ns, [r.tree_ratio for r in rows], "o-", color="C0", label="tree all-reduce, round barrier (paper's model)")
    ax.plot(ns, [r.ring_ratio for r in rows], "s-", color="C1", label="ring all-reduce, step barrier")
    nb = [(r.num_replicas, r.tree_no_barrier_ratio) for r in rows]
    ax.plot(*zip(*nb, strict=True), "o--", color="C0", alpha=0.6, mfc="none", label="tree, no barrier")
    rb = [(r.num_replicas, r.ring_no_barrier_ratio) for r in rows if r.ring_no_barrier_ratio is not None]
    if rb:
        ax.plot(*zip(*rb, strict=True), "s--", color="C1", alpha=0.6, mfc="none", label="ring, no barrier")
    dn = [r.num_replicas for r in deterministic]
    ax.plot(dn, [r.tree_ratio for r in deterministic], ":", color="C0", label="tree, σ = 0")
    ax.plot(dn, [r.ring_ratio for r in deterministic], ":", color="C1", label="ring, σ = 0")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.plot([128, 512], [claim_ratio, claim_ratio], color="C3", lw=3, alpha=0.5,
            label=f"NoLoCo paper: ≈{claim_ratio:g}× for a few hundred replicas")  # fmt: skip
    ax.axvline(headline_replicas, color="C3", lw=0.8, ls="--", alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_ticks(ax, ns)
    head = next((r for r in rows if r.num_replicas == headline_replicas), None)
    if head is not None:
        ax.annotate(f"N={headline_replicas}: tree {head.tree_ratio:.1f}×, ring {head.ring_ratio:.1f}×",
                    (headline_replicas, head.tree_ratio), textcoords="offset points", xytext=(-150, 18),
                    fontsize=7, arrowprops={"arrowstyle": "->", "lw": 0.6})  # fmt: skip
    ax.set_xlabel("replicas N")
    ax.set_ylabel("DiLoCo all-reduce time / NoLoCo exchange time (MODELLED)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")

    if measured:
        bx = fig.add_subplot(1, 2, 2)
        top = max(16, max(m["num_nodes"] for m in measured) * 2)
        if measured_model is not None:
            mn = default_replica_counts(top)
            bx.plot(mn, [closed_form(n, measured_model).ring_ratio for n in mn], "-", color="C1",
                    label="MODELLED ring / exchange (σ = 0)")  # fmt: skip
        pts = [(m["num_nodes"], m["ratio_receive_first"]) for m in measured if m.get("ratio_receive_first")]
        if pts:
            bx.plot(*zip(*pts, strict=True), "o", color="C2", ms=8, label="MEASURED, exchange receives first")
        pts = [(m["num_nodes"], m["ratio_link"]) for m in measured if m.get("ratio_link")]
        if pts:
            bx.plot(*zip(*pts, strict=True), "x", color="C3", ms=9, mew=2, label="MEASURED, Link.exchange")
        bx.set_xscale("log", base=2)
        _plain_ticks(bx, default_replica_counts(top), log_y=False)
        bx.set_xlabel("replicas N")
        bx.set_ylabel("all-reduce time / exchange time")
        bx.set_title(measured_title, fontsize=9)
        bx.grid(True, which="both", alpha=0.3)
        bx.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _plain_ticks(ax: Any, ns: Sequence[int], *, log_y: bool = True) -> None:
    """Replica counts and ratios as plain numbers (2, 4, ..., 1024; 0.5, 1, 2, 5, 10) on log axes."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # heavy: only the plots need it

    powers = [n for n in ns if n & (n - 1) == 0]
    ax.xaxis.set_major_locator(FixedLocator(powers))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    if log_y:
        ax.yaxis.set_major_locator(FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def sensitivity(model: SyncModel, num_replicas: int, sigmas: Sequence[float]) -> list[dict[str, float | None]]:
    """Ratios at one N for several σ (the claim depends on the assumed spread)."""
    out = []
    for s in sigmas:
        (r,) = sweep([num_replicas], dataclasses.replace(model, sigma=s))
        out.append({"sigma": s, "tree_ratio": r.tree_ratio, "ring_ratio": r.ring_ratio,
                    "tree_no_barrier_ratio": r.tree_no_barrier_ratio,
                    "ring_no_barrier_ratio": r.ring_no_barrier_ratio})  # fmt: skip
    return out
