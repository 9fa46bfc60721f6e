"""PNG plots of a bench (matplotlib's Agg canvas, without pyplot: no display needed).

- ``val_loss_vs_step.png``: validation loss against training step, one line per run;
- ``val_loss_vs_wall.png``: validation loss against wall time since training started;
- ``step_time_vs_bandwidth.png``: seconds per step against link bandwidth, one line per method
  (with a single bandwidth, one point per method).

Failed runs and runs without validations are left out; a plot with nothing to show still gets
written, saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lowband.bench.config import format_bandwidth
from lowband.bench.report import column_labels

__all__ = ["PLOT_FILES", "write_plots"]

PLOT_FILES = ("val_loss_vs_step.png", "val_loss_vs_wall.png", "step_time_vs_bandwidth.png")
_DPI = 110


_LINESTYLES = ("-", "--", ":", "-.")


def _series(runs: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(legend label, line style) per run: one colour per method column, one dash per bandwidth."""
    import matplotlib

    labels = column_labels(runs)
    methods = list(dict.fromkeys(labels))
    bandwidths = sorted({r["bandwidth_bps"] for r in runs})
    cmap = matplotlib.colormaps["tab10" if len(methods) <= 10 else "tab20"]
    out = []
    for label, run in zip(labels, runs, strict=True):
        style = {"color": cmap(methods.index(label) % cmap.N),
                 "linestyle": _LINESTYLES[bandwidths.index(run["bandwidth_bps"]) % len(_LINESTYLES)]}  # fmt: skip
        if len(bandwidths) > 1:
            label = f"{label} @ {format_bandwidth(run['bandwidth_bps'])}"
        out.append((label, style))
    return out


def _legend(ax: Any, entries: int) -> None:
    if entries > 8:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize=8)


def _figure(entries: int = 0) -> tuple[Any, Any]:
    """A figure on the Agg canvas, outside pyplot: no global backend switch, nothing to close.

    With many legend entries the figure is wider and the legend goes to the right of the axes.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5 if entries > 8 else 7, 4.5))
    return fig, fig.add_subplot()


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _loss_plot(runs: Sequence[Mapping[str, Any]], *, x_index: int, xlabel: str, title: str, path: Path) -> None:
    lines = []
    for run, (label, style) in zip(runs, _series(runs), strict=True):
        points = [(h[x_index], h[2]) for h in run.get("val_history") or [] if h[x_index] is not None and h[2] is not None]
        if run.get("status") == "ok" and points:
            lines.append((label, style, points))
    fig, ax = _figure(len(lines))
    for label, style, points in lines:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, label=label, **style)
    drawn = len(lines)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if drawn:
        _legend(ax, drawn)
    else:
        _empty(ax, "no successful run with validations")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")


def _step_time_plot(runs: Sequence[Mapping[str, Any]], path: Path) -> None:
    series: dict[str, list[tuple[float, float]]] = {}
    colours: dict[str, Any] = {}
    for run, label, (_, style) in zip(runs, column_labels(runs), _series(runs), strict=True):
        colours.setdefault(label, style["color"])
        if run.get("status") == "ok" and run.get("step_time_s") is not None:
            series.setdefault(label, []).append((run["bandwidth_bps"] / 1e6, float(run["step_time_s"])))
    fig, ax = _figure(len(series))
    for label, points in series.items():
        points.sort()
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=label, color=colours[label])
    bandwidths = sorted({r["bandwidth_bps"] / 1e6 for r in runs})
    if len(bandwidths) > 1:
        ax.set_xscale("log")
    if bandwidths:
        ax.set_xticks(bandwidths, [format_bandwidth(b * 1e6) for b in bandwidths])
        ax.set_xticks([], minor=True)
    ax.set_xlabel("link bandwidth")
    ax.set_ylabel("seconds per step (median)")
    ax.set_title("Step time against link bandwidth")
    ax.grid(True, alpha=0.3)
    if series:
        _legend(ax, len(series))
    else:
        _empty(ax, "no successful run")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")


def write_plots(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write the three PNGs of :data:`PLOT_FILES` into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    runs = list(results.get("runs") or [])
    paths = [out_dir / name for name in PLOT_FILES]
    _loss_plot(runs, x_index=0, xlabel="step", title="Validation loss per step", path=paths[0])
    _loss_plot(runs, x_index=1, xlabel="wall time since training started (s)",
               title="Validation loss against wall time", path=paths[1])  # fmt: skip
    _step_time_plot(runs, paths[2])
    return paths
