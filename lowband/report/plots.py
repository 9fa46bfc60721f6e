"""PNG plots of a bench (matplotlib's Agg canvas, without pyplot: no display needed).

In the FlexDeMo paper's style, one line per variant (a method with its hyper-parameters; runs
that differ only in their seed are one variant: the line is their mean, the shaded band their
min-max):

- ``val_loss_vs_tokens.png`` (the paper's Fig. 3): validation loss against tokens trained on;
- ``val_loss_vs_time.png`` (Fig. 4): validation loss against training minutes (the training
  clock: start-up and validation excluded), one dash style per link;
- ``time_to_target_modelled.png``: MODELLED training time to the target against compute time
  per step (measured steps to target and bytes per step; see :mod:`lowband.bench.quality`);
- ``speedup_at_equal_loss_modelled.png``: MODELLED AdamW's time ÷ each variant's time to the
  same loss against compute time per step: at the target where the variant reached it, else at
  its own final loss (AdamW's steps to that loss), so that a variant that missed the target is
  still drawn;
- ``step_time_vs_bandwidth.png``: seconds per step against link bandwidth;
- ``frontier.png`` (quality per byte; written when at least two variants finished): final
  validation loss against bits sent per parameter per step (log axis; the link's exact byte count,
  :func:`~lowband.bench.quality.bits_per_param_per_step`), one point per variant at its seed mean
  with a min-max bar, the Pareto front as a step line, a method's points that differ in one
  hyper-parameter joined by a thin line, and the reference (AdamW) variant's seed band shaded.

The loss axes are zoomed to where the curves differ (the first fifth of training, where every
method falls fast from the same start, is above the top; a curve that ends far above the others,
by Tukey's fence over the final losses, leaves the axis and is named on the plot); the target is drawn as a horizontal
line and each variant's mean curve gets a marker where it first reaches it. Failed runs and runs
without validations are left out; a plot with nothing to show still gets written, saying so.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lowband.bench.methods import column_labels
from lowband.bench.quality import (
    REFERENCE,
    FrontierPoint,
    Variant,
    crossing,
    equal_loss_steps,
    frontier,
    knob_curves,
    modelled_comm_s,
    modelled_speedup_at_equal_loss,
    modelled_step_s,
    reference_runs,
    variants,
)
from lowband.bench.record import RunRecord
from lowband.report.faults import FAULT_PLOT_FILE, fault_plot
from lowband.train.methods import display_name
from lowband.units import format_bandwidth

__all__ = ["FRONTIER_PLOT_FILE", "PLOT_FILES", "has_frontier", "write_plots"]

PLOT_FILES = (
    "val_loss_vs_tokens.png", "val_loss_vs_time.png", "time_to_target_modelled.png",
    "speedup_at_equal_loss_modelled.png", "step_time_vs_bandwidth.png",
)  # fmt: skip
FRONTIER_PLOT_FILE = "frontier.png"
_DPI = 110
_LINESTYLES = ("-", "--", ":", "-.")
#: The share of training whose losses lie above the zoomed loss axis.
_ZOOM_FROM = 0.2


def _colours(labels: Sequence[str]) -> dict[str, Any]:
    import matplotlib  # heavy: only the plots need it

    names = list(dict.fromkeys(labels))
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _legend(ax: Any, entries: int, *, outside: bool = False) -> None:
    """The legend: inside the axes, or right of them when it is long (or ``outside``: points carry labels)."""
    if outside or entries > 8:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize=8)


def _figure(entries: int = 0, *, wide: bool = False) -> tuple[Any, Any]:
    """A figure on the Agg canvas, outside pyplot: no global backend switch, nothing to close."""
    from matplotlib.figure import Figure  # heavy: only the plots need it

    fig = Figure(figsize=(9.5 if wide or entries > 8 else 7.5, 4.8))
    return fig, fig.add_subplot()


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _mean_curve(v: Variant, x_key: str, scale: float) -> list[tuple[float, float, float, float]]:
    """(x, mean loss, min loss, max loss) per validation, over the variant's seeds (index-aligned)."""
    histories = [[p for p in r.val_history or [] if p.get("val_loss") is not None and p.get(x_key) is not None]
                 for r in v.ok]  # fmt: skip
    histories = [h for h in histories if h]
    if not histories:
        return []
    n = min(len(h) for h in histories)
    out = []
    for i in range(n):
        losses = [h[i]["val_loss"] for h in histories]
        x = statistics.fmean(h[i][x_key] for h in histories) / scale
        out.append((x, statistics.fmean(losses), min(losses), max(losses)))
    return out


def _outliers(finals: Sequence[float]) -> set[int]:
    """Indices of final losses far above the others: above Tukey's fence Q3 + 1.5·IQR (4 or more curves)."""
    if len(finals) < 4:
        return set()
    q1, _, q3 = statistics.quantiles(finals, n=4, method="inclusive")
    fence = q3 + 1.5 * (q3 - q1)
    return {i for i, f in enumerate(finals) if f > fence}


def _zoom(ax: Any, curves: Sequence[list[tuple[float, float, float, float]]], target: float | None) -> tuple[bool, set[int]]:
    """Zoom the loss axis to where the curves differ: (zoomed?, indices of curves left above the axis).

    The axis spans the lowest loss (or the target) to the highest loss any curve has after the first
    fifth of training. Curves that end far above the others (Tukey's fence over the final losses, e.g.
    a learning rate far from the best) do not set the top: they leave the axis and are named on the plot.
    """
    usable = [i for i, c in enumerate(curves) if len(c) >= 3]
    if not usable:
        return False, set()
    high = {usable[j] for j in _outliers([curves[i][-1][1] for i in usable])}
    def at_zoom(c: list) -> float:
        return c[min(len(c) - 1, max(1, math.ceil(_ZOOM_FROM * (len(c) - 1))))][3]

    keep = [curves[i] for i in usable if i not in high]
    lows = [lo for c in keep for _, _, lo, _ in c]
    bottom, top = min(lows), max(at_zoom(c) for c in keep)
    if target is not None:
        bottom, top = min(bottom, target), max(top, target)
    span = max(top - bottom, 1e-3)
    ax.set_ylim(bottom - 0.05 * span, top + 0.05 * span)
    # Named on the plot only if it does leave the axis after the first fifth of training.
    return True, {i for i in high if at_zoom(curves[i]) > top + 0.05 * span}


def _loss_plot(
    vs: Sequence[Variant], *, x_key: str, scale: float, xlabel: str, title: str, target: float | None,
    path: Path, dash_by_link: bool,
) -> None:  # fmt: skip
    colours = _colours([v.group for v in vs])
    links = sorted({v.bandwidth_bps for v in vs})
    fig, ax = _figure(len(vs))
    curves, names, drawn = [], [], 0
    for v in vs:
        curve = _mean_curve(v, x_key, scale)
        if not curve:
            continue
        xs, mean, lo, hi = zip(*curve, strict=True)
        colour = colours[v.group]
        style = _LINESTYLES[links.index(v.bandwidth_bps) % len(_LINESTYLES)] if dash_by_link else "-"
        lrs = sorted({u.lr for u in vs if u.group == v.group and u.lr is not None})  # a failed run may have none
        if v.lr is not None and len(lrs) > 1:
            style = _LINESTYLES[lrs.index(v.lr) % len(_LINESTYLES)]
        seeds = len(v.ok)
        label = v.label + (f" @ {format_bandwidth(v.bandwidth_bps)}" if dash_by_link and len(links) > 1 else "")
        label += f" ({seeds} seeds)" if seeds > 1 else ""
        ax.plot(xs, mean, linestyle=style, color=colour, label=label, linewidth=1.6)
        if seeds > 1:
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.18, linewidth=0)
        if target is not None:
            hit = crossing([{"step": x, "val_loss": m} for x, m in zip(xs, mean, strict=True)], target)
            if hit is not None:
                ax.plot([hit.step], [target], marker="o", markersize=7, color=colour, markeredgecolor="black",
                        zorder=5)  # fmt: skip
        curves.append(curve)
        names.append(label)
        drawn += 1
    if target is not None and drawn:
        ax.axhline(target, color="black", linewidth=0.9, linestyle=(0, (4, 3)), label=f"target {target:.3f}")
    zoomed, high = _zoom(ax, curves, target)
    if high:
        note = "above the axis (final loss far above the others): " + ", ".join(names[i] for i in sorted(high))
        ax.text(0.99, 0.98, textwrap.fill(note, width=70), transform=ax.transAxes, ha="right", va="top",
                fontsize=7, color="dimgray")  # fmt: skip
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss" + (" (zoomed)" if zoomed else ""))
    ax.set_title(title + ("\nmean over seeds, band = min-max; ● = first reaches the target" if drawn else ""),
                 fontsize=10)  # fmt: skip
    ax.grid(True, alpha=0.3)
    if drawn:
        _legend(ax, drawn + (target is not None))
    else:
        _empty(ax, "no successful run with validations")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")


def _modelled_canvas(vs: Sequence[Variant]) -> tuple[dict[str, Any], Any, Any, Any]:
    """Colours by method group, the figure, its axes and the compute times (s/step) the curves are drawn at."""
    import numpy as np  # heavy: a command that does not train must not pay for it

    fig, ax = _figure(len(vs))
    return _colours([v.group for v in vs]), fig, ax, np.logspace(-3, 1, 60)


def _finish_modelled(fig: Any, ax: Any, path: Path, *, measured_compute: list[float], note: str | None,
                     note_y: float, ylabel: str, title: str, drawn: int, empty: str) -> None:
    """The two MODELLED plots' common frame: this machine's compute marked, log-log axes, a note, save."""
    if measured_compute:
        c = statistics.fmean(measured_compute)
        ax.axvline(c, color="gray", linewidth=0.8, linestyle=":")
        ax.text(c, 0.02, " this machine's compute", transform=ax.get_xaxis_transform(), fontsize=7, color="gray")
    if note and drawn:
        ax.text(0.01, note_y, textwrap.fill(note, width=90), transform=ax.transAxes, ha="left",
                va="top" if note_y > 0.5 else "bottom", fontsize=7, color="dimgray")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute time per step (s), MODELLED")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    if drawn:
        _legend(ax, drawn)
    else:
        _empty(ax, empty)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")


def _modelled_plot(vs: Sequence[Variant], target: float | None, path: Path) -> None:
    colours, fig, ax, compute = _modelled_canvas(vs)
    drawn = 0
    measured_compute = []
    missed = []
    for v in vs:
        steps = v.values("steps_to_target")
        comms = [c for c in (modelled_comm_s(r) for r in v.ok) if c is not None]
        if not steps or not comms:
            if v.ok:
                missed.append(v.label)
            continue
        s, m = statistics.fmean(steps), statistics.fmean(comms)
        times = s * modelled_step_s(v.ok[0], compute, m) / 60.0
        label = f"{v.label} @ {format_bandwidth(v.bandwidth_bps)}" + (f" ({len(steps)}/{len(v.ok)} seeds)"
                                                                       if len(steps) < len(v.ok) else "")  # fmt: skip
        ax.plot(compute, times, color=colours[v.group], label=label)
        measured_compute += v.values("compute_time_s")
        drawn += 1
    what = f"the target {target:.3f}" if target is not None else "a target"
    note = ("did not reach the target (no line; speedup_at_equal_loss_modelled.png and the report compare "
            "them at their own final loss): " + ", ".join(missed)) if missed else None
    _finish_modelled(fig, ax, path, measured_compute=measured_compute, note=note, note_y=0.80,
                     ylabel="training minutes to target, MODELLED",
                     title=f"MODELLED time to {what}: measured steps to target × (compute + measured bytes / link "
                           "rate + latency per op)",
                     drawn=drawn, empty="no run reached the target" if target is not None else f"no target (no {REFERENCE} run)")


def _equal_loss_plot(vs: Sequence[Variant], runs: Sequence[RunRecord], path: Path) -> None:
    import numpy as np  # heavy: a command that does not train must not pay for it

    refs = reference_runs(runs)
    colours, fig, ax, compute = _modelled_canvas(vs)
    drawn = 0
    measured_compute = []
    never = []
    groups_drawn: list[str] = []
    for v in vs:
        if not v.ok or any(r is a for r in v.ok for a in refs):
            continue
        curves, where = [], set()
        for r in v.ok:
            same_link = [a for a in refs if a.bandwidth_bps == r.bandwidth_bps] or refs
            ratio = modelled_speedup_at_equal_loss(r, same_link, compute)
            if ratio is not None:
                curves.append(ratio)
                where.add(equal_loss_steps(r, same_link)[2])  # cheap: a few attribute reads
        if not curves:
            never.append(v.label)
            continue
        at = {"target": "at the target", "final": "at its final loss"}
        label = (f"{v.label} @ {format_bandwidth(v.bandwidth_bps)}, " + " / ".join(at[w] for w in sorted(where, reverse=True))
                 + (f" ({len(curves)}/{len(v.ok)} seeds)" if len(curves) < len(v.ok) else ""))  # fmt: skip
        # Variants of one method (e.g. two lrs) share its colour; the line style tells them apart.
        style = _LINESTYLES[sum(1 for g in groups_drawn if g == v.group) % len(_LINESTYLES)]
        groups_drawn.append(v.group)
        ax.plot(compute, np.mean(curves, axis=0), color=colours[v.group], linestyle=style, label=label)
        measured_compute += v.values("compute_time_s")
        drawn += 1
    if drawn:  # on empty axes the label would stretch the log scale's limits
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.text(compute[0], 1.0, f" {REFERENCE}", va="bottom", fontsize=7)
    _finish_modelled(fig, ax, path, measured_compute=measured_compute,
                     note=(f"{REFERENCE} never got as low as (no line): " + ", ".join(never)) if never else None,
                     note_y=0.02,
                     ylabel=f"{REFERENCE}'s time ÷ this variant's, same loss, MODELLED\n(above 1: sooner than {REFERENCE})",
                     title=f"MODELLED time to equal loss against {REFERENCE}:\nmeasured steps to that loss × (compute + "
                           "measured bytes / link rate + latency per op)",
                     drawn=drawn, empty=f"nothing to compare with {REFERENCE}" if refs else f"no {REFERENCE} run to compare with")


def _step_time_plot(runs: Sequence[RunRecord], path: Path) -> None:
    labels = column_labels(runs)
    colours = _colours(labels)
    series: dict[str, dict[float, list[float]]] = {}
    for run, label in zip(runs, labels, strict=True):
        if run.status == "ok" and run.step_time_s is not None:
            series.setdefault(label, {}).setdefault(run.bandwidth_bps / 1e6, []).append(float(run.step_time_s))
    fig, ax = _figure(len(series))
    for label, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [statistics.fmean(points[x]) for x in xs], marker="o", label=label, color=colours[label])
    bandwidths = sorted({r.bandwidth_bps / 1e6 for r in runs})
    if len(bandwidths) > 1:
        ax.set_xscale("log")
    if bandwidths:
        ax.set_xticks(bandwidths, [format_bandwidth(b * 1e6) for b in bandwidths])
        ax.set_xticks([], minor=True)
    ax.set_xlabel("link bandwidth")
    ax.set_ylabel("seconds per step (median; mean over seeds)")
    ax.set_title("Step time against link bandwidth")
    ax.grid(True, alpha=0.3)
    if series:
        _legend(ax, len(series))
    else:
        _empty(ax, "no successful run")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")


def has_frontier(runs: Sequence[RunRecord]) -> bool:
    """True when at least two variants finished a run: then there is a frontier to draw and tabulate."""
    points, _, left_out = frontier(runs)
    return len(points) + sum(1 for v in left_out if v.ok) >= 2


def _frontier_point(ax: Any, p: FrontierPoint, colour: Any) -> None:
    """A variant at its seed mean with its min-max bar (hollow: one seed, no bar; ×: faulted), labelled."""
    mean, lo, hi = p.loss
    one_seed = len(p.variant.ok) < 2
    ax.errorbar([p.bits], [mean], yerr=None if one_seed else [[mean - lo], [hi - mean]],
                fmt="x" if p.variant.faulted else "o", color=colour, markerfacecolor="white" if one_seed else colour,
                markersize=6, capsize=3, elinewidth=1.2, zorder=4)  # fmt: skip
    ax.annotate(p.variant.label, (p.bits, mean), xytext=(5, 4), textcoords="offset points", fontsize=7)


def _frontier_plot(runs: Sequence[RunRecord], path: Path) -> None:
    points, reference, left_out = frontier(runs)
    drawable = [p for p in points if p.bits > 0]  # a log axis has no place for a variant that sent nothing
    colours = _colours([p.variant.method for p in drawable])
    fig, ax = _figure(len(colours) + 3, wide=True)  # the legend goes right of the labelled points
    for method, colour in colours.items():  # the legend's marker for a method, whatever its first point is
        ax.plot([], [], "o", color=colour, label=display_name(method))
    for p in drawable:
        _frontier_point(ax, p, colours[p.variant.method])
    for i, (_, curve) in enumerate(knob_curves(drawable)):
        ax.plot([p.bits for p in curve], [p.loss[0] for p in curve], color=colours[curve[0].variant.method],
                linewidth=0.8, alpha=0.6, label=None if i else "one method, one knob swept")  # fmt: skip
    front = [p for p in drawable if p.on_front]
    if front:
        xs, ys = [p.bits for p in front], [p.loss[0] for p in front]
        # On to the right edge (the x axis ends at 4 × the most bits): with more bits, the front is no lower.
        ax.step([*xs, 4 * drawable[-1].bits], [*ys, ys[-1]], where="post", color="black", linewidth=1.0,
                linestyle="--", zorder=3)  # fmt: skip
        ax.scatter(xs, ys, s=130, facecolors="none", edgecolors="black", linewidths=0.9, zorder=5,
                   label="Pareto front (fewer bits, lower loss)")  # fmt: skip
    ref = next((p for p in points if p.variant is reference), None)
    lows, highs = [p.loss[1] for p in drawable], [p.loss[2] for p in drawable]
    if ref is not None:
        mean, lo, hi = ref.loss
        n = len(ref.variant.ok)
        if n > 1:
            ax.axhspan(lo, hi, color="gray", alpha=0.18, linewidth=0,
                       label=f"{ref.variant.label}: seed band (min-max, {n} seeds)")  # fmt: skip
        ax.axhline(mean, color="gray", linewidth=0.8, label=None if n > 1 else f"{ref.variant.label} (one seed: no band)")
        lows, highs = [*lows, lo], [*highs, hi]
    missing = [v.label for v in left_out if v.ok] + [p.variant.label for p in points if p.bits <= 0]
    if missing:
        ax.text(0.01, 0.02, textwrap.fill("not drawn (no byte count, or nothing sent between nodes): "
                                          + ", ".join(missing), width=90),
                transform=ax.transAxes, fontsize=7, color="dimgray", va="bottom")  # fmt: skip
    if drawable:
        ax.set_xscale("log")
        ax.set_xlim(drawable[0].bits / 2, drawable[-1].bits * 4)  # room for the labels right of the points
        span = max(max(highs) - min(lows), 1e-3)
        ax.set_ylim(min(lows) - 0.08 * span, max(highs) + 0.12 * span)
        _legend(ax, len(colours) + 3, outside=True)
    else:
        _empty(ax, "no variant with a byte count")
    ax.set_xlabel("bits sent per parameter per step (log): 8 × bytes a node sends to other nodes per step "
                  "÷ parameters,\ncounted by the link", fontsize=8)  # fmt: skip
    ax.set_ylabel("final validation loss (zoomed)")
    ax.set_title("Quality per byte: final validation loss against bits sent\n"
                 "mean over seeds, bar = min-max; hollow = one seed", fontsize=10)  # fmt: skip
    ax.grid(True, alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")


def write_plots(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write the PNGs of :data:`PLOT_FILES` into ``out_dir``, and ``frontier.png`` and ``faults.png`` where
    there is something to draw; returns their paths."""
    out_dir = Path(out_dir)
    runs: list[RunRecord] = list(results.get("runs") or [])
    target = results.get("target_loss")
    vs = variants(runs)
    paths = [out_dir / name for name in PLOT_FILES]
    # The loss against tokens does not depend on the link: one curve per variant, at the first link.
    first_link = {}
    for v in vs:
        first_link.setdefault((v.label, v.method), v)
    _loss_plot(list(first_link.values()), x_key="tokens", scale=1e6, xlabel="tokens trained on (millions)",
               title="Validation loss against tokens (FlexDeMo paper, Fig. 3)", target=target, path=paths[0],
               dash_by_link=False)  # fmt: skip
    _loss_plot(vs, x_key="train_time_s", scale=60.0, xlabel="training minutes (start-up and validation excluded)",
               title="Validation loss against training time (FlexDeMo paper, Fig. 4)", target=target,
               path=paths[1], dash_by_link=True)  # fmt: skip
    _modelled_plot(vs, target, paths[2])
    _equal_loss_plot(vs, runs, paths[3])
    _step_time_plot(runs, paths[4])

    if has_frontier(runs):
        _frontier_plot(runs, out_dir / FRONTIER_PLOT_FILE)
        paths.append(out_dir / FRONTIER_PLOT_FILE)
    faults = fault_plot(results, out_dir / FAULT_PLOT_FILE)
    return paths + ([faults] if faults is not None else [])
