"""``report.md``'s table at equal training time (``lowband bench --time-budget``): each variant's loss when its budget ran out."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lowband.bench import quality
from lowband.bench.quality import REFERENCE
from lowband.bench.record import RunRecord
from lowband.bench.timebudget import AUTO, STEP_CAP_FACTOR
from lowband.report.tables import markdown_table
from lowband.train.methods import reference_method
from lowband.units import format_bandwidth

__all__ = ["equal_time_rows", "equal_time_section"]


def _has_budget(runs: Sequence[RunRecord]) -> bool:
    return any(r.time_budget_s is not None for r in runs)


def _fmt(stat: tuple[float, float, float] | None, fmt: str, n: int) -> str:
    if stat is None:
        return "-"
    mean, lo, hi = stat
    return format(mean, fmt) if n < 2 else f"{format(mean, fmt)} [{format(lo, fmt)}–{format(hi, fmt)}]"


def equal_time_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per variant: training time, steps run, final loss (at equal time), and its time to the reference's loss."""
    vs = quality.variants(results["runs"])
    ref, _ = quality.target_variants(vs)
    headers = ["Run", "Link", "Seeds", "budget s", "training s", "steps run", "val loss at equal time",
               f"Δ vs {REFERENCE}", f"time to {REFERENCE}'s loss (s)", f"{REFERENCE} time ÷ this", "MB/step/node"]
    rows = []
    for v in vs:
        n = len(v.ok)
        if not n:
            rows.append([v.label, format_bandwidth(v.bandwidth_bps), f"0/{len(v.runs)}", *(["-"] * 7), "failed"])
            continue
        budgets = v.values("time_budget_s")
        budget = (f"{statistics.fmean(budgets):.1f}" if budgets else
                  "sets it" if v.method == reference_method() else "none (no reference time)")
        ref_here = next((u for u in vs if ref is not None and u.label == ref.label
                         and u.bandwidth_bps == v.bandwidth_bps and u.ok), ref)
        delta = "-"
        if ref_here is not None and ref_here is not v:
            d = v.stat("val_loss")[0] - ref_here.stat("val_loss")[0]
            beyond = quality.exceeds_spread(v, ref_here)
            delta = f"{d:+.3f}" + (" (one seed: spread unknown)" if beyond is None else
                                   " (beyond the seed spread)" if beyond else " (within the seed spread)")
        reached = v.values("time_to_target_s")
        to_target = "not reached" if not reached else _fmt(v.stat("time_to_target_s"), ".0f", len(reached)) + (
            f" ({len(reached)}/{n} seeds)" if len(reached) < n else "")
        ratio = "-"
        ref_t = ref_here.stat("time_to_target_s") if ref_here is not None else None
        if reached and ref_t is not None and ref_here is not v:
            ratio = f"{ref_t[0] / v.stat('time_to_target_s')[0]:.2f}×"
        mb = v.stat("inter_node_bytes_per_step")
        rows.append([v.label, format_bandwidth(v.bandwidth_bps), f"{n}/{len(v.runs)}", budget,
                     _fmt(v.stat("train_time_s"), ".1f", n), _fmt(v.stat("steps"), ".0f", n),
                     _fmt(v.stat("val_loss"), ".3f", n), delta, to_target, ratio,
                     "-" if mb is None else f"{mb[0] / 1e6:.3f}"])  # fmt: skip
    return headers, rows


def equal_time_section(results: Mapping[str, Any]) -> list[str]:
    """``report.md``'s first table when the bench ran under a time budget ([] otherwise)."""
    runs = results.get("runs") or []
    if not _has_budget(runs):
        return []
    cfg = results.get("config") or {}
    how = ("every other method trained for the reference's measured training time at its link and seed, "
           f"{REFERENCE} for its {cfg.get('steps')} steps" if cfg.get("time_budget") == AUTO
           else f"every method trained for {cfg.get('time_budget')} s of training clock")
    return [
        "## At equal training time",
        "",
        f"Does compression pay off on this link? Under `--time-budget {cfg.get('time_budget')}` {how} (training "
        "clock: start-up and validation excluded; a run stops at the first step past its budget, a local-step "
        f"method at the end of that outer window; at most {STEP_CAP_FACTOR} × {cfg.get('steps')} steps). Its "
        f"validation loss then is the loss at equal time; the time to {REFERENCE}'s final loss is interpolated "
        f"between validations. The lr schedule runs to the budget (its progress: the further of step / most steps "
        f"and clock / budget). All figures measured on this machine.",
        "",
        markdown_table(*equal_time_rows(results)),
        "",
    ]
