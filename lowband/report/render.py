"""Tables from ``results.json``: the console table, and ``report.md`` in the FlexDeMo paper's layouts.

- Table 1 (paper's Table 1): rows = link bandwidth, columns = methods, cells = seconds per step.
- Table 2 (paper's Table 2), one per bandwidth: rows = DeMo (shards = 1) and FlexDeMo
  (shards > 1), columns = Deto-Full, Top1, Top8, ...; cells = seconds per step.
- Quality per byte: each variant's final loss against the bits it sends per parameter per step,
  beside the reference (AdamW) variant's seed spread, with its Pareto front (and ``frontier.png``).
  This and the other quality sections (time to target, hiding the link) are in
  :mod:`lowband.report.quality`, the fault-tolerance section in :mod:`lowband.report.faults`,
  the table formatting they share in :mod:`lowband.report.tables`.
- The per-run table: step time with its compute / communication split, inter-node MB per step
  per node, final validation loss, peak memory per rank, status.

Everything here is a pure function of the results dictionary (its ``runs``:
:class:`~lowband.bench.record.RunRecord` objects), so ``lowband report RUN_DIR`` re-renders a
report from ``results.json`` alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lowband.bench.methods import SHARD_SWEEP, column_labels
from lowband.bench.presets import PRESETS, data_name, lrs_tuned_here, preset_differences, sequence_lengths
from lowband.bench.record import RunRecord, error_headline
from lowband.report.equal_time import equal_time_rows, equal_time_section
from lowband.report.faults import ft_section
from lowband.report.plots import FRONTIER_PLOT_FILE, write_plots
from lowband.report.quality import (
    frontier_rows,
    frontier_section,
    hiding_rows,
    hiding_section,
    modelled_rows,
    quality_section,
    time_to_target_rows,
    why_not_reached_notes,
)
from lowband.report.recommend import recommendation_section
from lowband.report.tables import MISSING, markdown_table, number_cell, text_table
from lowband.report.tuning import tuning_section, write_tune_plots
from lowband.train.methods import demo_method, display_name, family_of
from lowband.units import format_bandwidth

__all__ = [
    "REPORT_FILE",
    "column_labels",
    "console_summary",
    "error_headline",
    "frontier_rows",
    "hiding_rows",
    "markdown_table",
    "modelled_rows",
    "render_markdown",
    "run_rows",
    "table1",
    "table2",
    "text_table",
    "time_to_target_rows",
    "why_not_reached_notes",
    "write_report",
]

log = logging.getLogger(__name__)

REPORT_FILE = "report.md"
Run = RunRecord


# ------------------------------------------------------------------------------------- tables


def _step_cell(runs: Sequence[Run] | None) -> str:
    """Seconds per step of a cell's runs (its seeds): their mean; "failed" when none succeeded."""
    if not runs:
        return MISSING
    times = [float(r.step_time_s) for r in runs if r.status == "ok" and r.step_time_s is not None]
    if not times:
        return "failed"
    return format(sum(times) / len(times), ".3f")


def table1(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Table 1 layout: rows = bandwidth, columns = methods, cells = seconds per step (mean over seeds)."""
    runs = results["runs"]
    labels = column_labels(runs)
    columns = list(dict.fromkeys(labels))
    cells: dict[tuple[float, str], list[Run]] = {}
    for run, label in zip(runs, labels, strict=True):
        cells.setdefault((run.bandwidth_bps, label), []).append(run)
    rows = []
    for bw in sorted({r.bandwidth_bps for r in runs}):
        rows.append([format_bandwidth(bw), *(_step_cell(cells.get((bw, c))) for c in columns)])
    return ["Link", *columns], rows


def _table2_column(run: Run) -> tuple[tuple, str]:
    """(sort key, column name) of a FlexDeMo-family run in Table 2."""
    label = run.label
    if family_of(run.method) == "demo":
        name = label.removeprefix(display_name(run.method)).strip()
        return (1, run.topk or 0, run.chunk or 0, name), name
    return (0, 0, 0, label), label


def table2(results: Mapping[str, Any]) -> list[tuple[float, list[str], list[list[str]]]]:
    """Table 2 layout, one table per bandwidth with FlexDeMo-family runs.

    Returns:
        ``[(bandwidth_bps, headers, rows), ...]``; rows = shard counts (``DeMo`` for 1,
        ``FlexDeMo`` above), columns = Deto-Full, Top1, Top8, ...
    """
    family = [r for r in results["runs"] if r.method in SHARD_SWEEP]
    tables = []
    for bw in sorted({r.bandwidth_bps for r in family}):
        runs = [r for r in family if r.bandwidth_bps == bw]
        columns = sorted({_table2_column(r) for r in runs})
        names = [name for _, name in columns]
        cells: dict[tuple, list[Run]] = {}
        for r in runs:
            cells.setdefault((r.shards, _table2_column(r)[1]), []).append(r)
        rows = []
        for s in sorted({r.shards for r in runs}):
            rows.append([display_name(demo_method(s)), str(s), *(_step_cell(cells.get((s, n))) for n in names)])
        tables.append((bw, ["", "Shards", *names], rows))
    return tables


def run_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The per-run table: split step time, bytes, loss, memory and status."""
    runs = results["runs"]
    wire = any(r.measured_wire_bytes_per_step is not None for r in runs)
    sync = any(r.sync_time_s is not None for r in runs)
    headers = ["Run", "Seed", "Method", "TopK", "Shards", "Link", "s/step", "compute s", "comm s", "exposed comm s"]
    headers += ["sync s"] if sync else []
    headers += ["MB/step/node"] + (["wire MB/step/node"] if wire else [])
    headers += ["val loss", "peak MB/rank", "run s", "status"]
    rows = []
    for r, label in zip(runs, column_labels(runs), strict=True):
        row = [
            label,
            MISSING if r.seed is None else str(r.seed),
            r.method,
            MISSING if r.topk is None else str(r.topk),
            MISSING if r.shards is None else str(r.shards),
            format_bandwidth(r.bandwidth_bps),
            number_cell(r.step_time_s, ".3f"),
            number_cell(r.compute_time_s, ".3f"),
            number_cell(r.comm_time_s, ".3f"),
            number_cell(r.exposed_comm_time_s, ".3f"),
        ]
        row += [number_cell(r.sync_time_s, ".3f")] if sync else []
        row += [number_cell(r.inter_node_bytes_per_step, ".3f", 1e6)]
        row += [number_cell(r.measured_wire_bytes_per_step, ".3f", 1e6)] if wire else []
        row += [number_cell(r.val_loss, ".4f"), number_cell(r.peak_rss_mb, ".0f"), number_cell(r.wall_time_s, ".0f"),
                r.status or MISSING]  # fmt: skip
        rows.append(row)
    return headers, rows


def _link_ops_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for r, label in zip(results["runs"], column_labels(results["runs"]), strict=True):
        for kind, ops in (r.link_ops or {}).items():
            rows.append([
                label, format_bandwidth(r.bandwidth_bps), kind, str(ops.count),
                number_cell(ops.bytes, ".3f", 1e6), number_cell(ops.inter_node_bytes, ".3f", 1e6), str(ops.largest_group),
            ])  # fmt: skip
    return ["Run", "Link", "Operation", "Count", "MB sent", "MB inter-node", "Largest group"], rows


# ------------------------------------------------------------------------------------- text


def emulation_lines(results: Mapping[str, Any]) -> list[str]:
    """How the links were emulated and what was measured, one line per fact."""
    emu = results.get("emulation") or {}
    mode = emu.get("mode", "?")
    nodes, per_node = emu.get("nodes"), emu.get("ranks_per_node")
    if mode == "netns":
        how = "netns: one network namespace per node, veth links limited by tbf"
    else:
        how = "shaped: traffic shaped in-process by each rank's link (lowband train --link-bandwidth)"
    lines = [f"Emulation: {how}; {nodes} nodes × {per_node} ranks. {emu.get('reason', '')}".rstrip()]
    latency = emu.get("latency_s") or 0.0
    if latency:
        lines.append(f"In-process latency: {latency * 1e3:g} ms per message.")
    for link in emu.get("links") or []:
        measured = link.get("measured_throughput_bps")
        what = (
            f"measured {measured / 1e6:.1f} Mbit/s TCP throughput between the nodes"
            if measured is not None
            else link.get("note") or "not measured"
        )
        lines.append(f"Link {format_bandwidth(link['bandwidth_bps'])}: {what}.")
    return lines


def console_summary(results: Mapping[str, Any]) -> str:
    """What ``lowband bench`` prints at the end: emulation, the per-run table, failures."""
    headers, rows = run_rows(results)
    parts = [*emulation_lines(results), "", text_table(headers, rows)]
    if any(r.time_budget_s is not None for r in results["runs"]):
        parts += ["", f"At equal training time (--time-budget {(results.get('config') or {}).get('time_budget')}):",
                  text_table(*equal_time_rows(results))]  # fmt: skip
    if results.get("target_loss") is not None:
        parts += ["", f"Time to target {results['target_loss']:.4f} ({results.get('target_source')}; "
                      "interpolated between validations; training clock):",
                  text_table(*time_to_target_rows(results))]  # fmt: skip
    failed = [r for r in results["runs"] if r.status != "ok"]
    for r in failed:
        parts.append(f"{r.id} failed: {error_headline(r.error)} (details in report.md)")
    if results.get("interrupted"):
        parts.append("Interrupted: not every run was done.")
    return "\n".join(parts)


def setup_line(cfg: Mapping[str, Any]) -> str:
    """What ran, from the bench's configuration: model, data, sequence lengths, steps, seeds, nodes, links."""
    model = cfg.get("model")
    seeds = cfg.get("seeds") or []
    links = ", ".join(format_bandwidth(b) for b in cfg.get("bandwidths_bps") or [])
    nodes = f"{cfg.get('nodes')} nodes × {cfg.get('ranks_per_node')} ranks" if cfg.get("nodes") else None
    parts = [f"Model {model} on {data_name(cfg.get('data'))}",
             sequence_lengths(model, cfg.get("train_args") or ()) if model else None,
             f"{cfg.get('steps')} steps", f"seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds))}",
             nodes, f"link {links}" if links else None]  # fmt: skip
    return ", ".join(p for p in parts if p) + "."


def preset_lines(cfg: Mapping[str, Any]) -> list[str]:
    """The preset a bench started from: which settings are its and which were given instead, and what holds here.

    Its description is printed only when no setting was overridden; facts of its own model and data
    only when they ran; a caveat when its learning rates were tuned on another model or data.
    """
    preset = PRESETS.get(cfg.get("preset") or "")
    if preset is None:
        return []
    kept, changed = preset_differences(preset, dict(cfg))
    if not changed:
        text = f"Preset `{preset.name}`, as it is: {preset.why}"
    else:
        text = (f"Preset `{preset.name}`; from the preset: {', '.join(kept) or 'nothing'}; overridden on the "
                f"command line: {'; '.join(changed)}.")
    own_data = lrs_tuned_here(preset, cfg) and (sequence_lengths(cfg.get("model") or "", cfg.get("train_args") or ())
                                                == sequence_lengths(preset.model, preset.train_args))
    if preset.facts and own_data:
        text += f" {preset.facts}"
    out = [text, ""]
    methods_kept = list(cfg.get("methods") or []) == list(preset.bench.methods)
    if preset.lrs_tuned_on and methods_kept and not lrs_tuned_here(preset, cfg):
        out += [f"**Learning rates not tuned here.** The preset's lrs were tuned on {preset.lrs_tuned_on}, not on "
                f"this run's {cfg.get('model')} on {data_name(cfg.get('data'))}: no method is known to run at its "
                "best lr here, and a method that trails may only have the wrong lr. To tune them, give each method "
                "at several lrs, e.g. `--methods adamw:lr=0.001 adamw:lr=0.003 adamw:lr=0.01 ...` (the report marks "
                "each method's best lr with ★), or add `--tune`: a short lr search per method on this data first.", ""]
    return out


def render_markdown(results: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    """``report.md``: set-up, Table 1, Table 2, the per-run table, link operations, failures, plots."""
    cfg = results.get("config") or {}
    host = results.get("host") or {}
    runs = results["runs"]
    out = [f"# lowband bench, {results.get('created', '')}", ""]
    out.append(
        f"{setup_line(cfg)} "
        f"Host {host.get('hostname')} ({host.get('cpu_count')} CPUs), Python {host.get('python')}, "
        f"torch {host.get('torch')}, lowband {host.get('lowband')}."
    )
    out += ["", *emulation_lines(results), ""]
    out += [*preset_lines(cfg)]
    if results.get("interrupted"):
        out += ["**Interrupted**: the bench was stopped before every run was done.", ""]
    if not runs:
        out += ["No run was recorded.", ""]
        return "\n".join(out)
    out += recommendation_section(results)
    out += equal_time_section(results)  # --time-budget: the first table

    # The frontier heads its own section, the lr searches theirs.
    top = [p for p in plots if Path(p).name != FRONTIER_PLOT_FILE and not Path(p).name.startswith("tune-")]
    if top:
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in top] + [""]
    out += quality_section(results)
    out += frontier_section(results, [Path(p).name for p in plots])
    out += hiding_section(results)
    out += ft_section(results)
    out += tuning_section(results, [Path(p).name for p in plots])  # where each lr came from; --tune's searches
    out += ["## Table 1: seconds per step by link bandwidth", "",
            "Median seconds per training step (warm-up excluded), as in the FlexDeMo paper's Table 1.", ""]  # fmt: skip
    out += [markdown_table(*table1(results)), ""]
    for bw, headers, rows in table2(results):
        out += [f"## Table 2: seconds per step by shard count at {format_bandwidth(bw)}", "",
                "DeMo is FlexDeMo with shards = 1 (no sharding inside a node), as in the paper's Table 2.", "",
                markdown_table(headers, rows), ""]  # fmt: skip
    out += ["## Runs", "",
            "s/step = compute s + exposed comm s: exposed communication is the time a step waited on the "
            "link (comm s is all the link's time, hidden behind computation or not). run s: wall time of the whole run, start-up and "
            "validation included. MB/step/node: bytes a node sends to other nodes per "
            "step, counted by the link (MB = 10^6 bytes)."]  # fmt: skip
    if any(r.measured_wire_bytes_per_step is not None for r in runs):
        out[-1] += (
            " wire MB/step/node: the node's interface counter over the whole launch divided by the steps; "
            "it includes set-up traffic (rendezvous, connection set-up, validation) and packet headers."
        )
    out += ["", markdown_table(*run_rows(results)), ""]
    headers, rows = _link_ops_rows(results)
    if rows:
        out += ["## Link operations", "", "Totals over the run and over all ranks.", "", markdown_table(headers, rows), ""]
    failed = [r for r in runs if r.status != "ok"]
    if failed:
        out += ["## Failed runs", ""]
        for r in failed:
            out += [f"### {r.id}", "", "```", (r.error or "no error recorded").rstrip(), "```", ""]
    return "\n".join(out)


def write_report(
    out_dir: Path,
    results: Mapping[str, Any],
    *,
    plot_writer: Callable[[Mapping[str, Any], Path], list[Path]] | None = None,
) -> Path:
    """Write the plots and ``report.md`` into ``out_dir``; returns the report's path.

    A plot that cannot be drawn is logged and left out; the report is written regardless.
    """
    out_dir = Path(out_dir)
    plot_writer = plot_writer or write_plots
    try:
        plots = [*plot_writer(results, out_dir), *write_tune_plots(results, out_dir)]
    except Exception:  # noqa: BLE001 - a broken plot must not lose the tables
        log.exception("writing the plots failed; report.md is written without them")
        plots = []
    path = out_dir / REPORT_FILE
    path.write_text(render_markdown(results, [p.name for p in plots]))
    return path
