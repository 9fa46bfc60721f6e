"""The report's quality sections: time to target (measured and modelled), quality per byte, and
hiding or compressing the link against the plain variant.

Pure functions of the results dictionary, as the rest of the report (:mod:`lowband.report.render`,
which renders them into ``report.md``); the figures come from :mod:`lowband.bench.quality`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lowband.bench import quality
from lowband.bench.quality import REFERENCE
from lowband.bench.record import RunRecord
from lowband.report.plots import FRONTIER_PLOT_FILE, has_frontier
from lowband.report.tables import MISSING, markdown_table, mean_range, number_cell
from lowband.train.methods import METHODS, reference_method
from lowband.units import format_bandwidth

__all__ = [
    "MODELLED_COMPUTE_S",
    "frontier_rows",
    "frontier_section",
    "hiding_rows",
    "hiding_section",
    "modelled_rows",
    "quality_section",
    "time_to_target_rows",
    "why_not_reached_notes",
]

Run = RunRecord


def _reference(vs: Sequence[quality.Variant], v: quality.Variant, target_label: str | None) -> quality.Variant | None:
    """The AdamW variant that set the target, at ``v``'s link if it ran there."""
    refs = [u for u in vs if u.method == reference_method() and u.label == target_label and u.ok and not u.faulted]
    same_link = [u for u in refs if u.bandwidth_bps == v.bandwidth_bps]
    return (same_link or refs or [None])[0]


def _target_label(vs: Sequence[quality.Variant]) -> str | None:
    best, _ = quality.target_variants(vs)
    return best.label if best is not None else None


def _versus(v: quality.Variant, ref: quality.Variant | None) -> str:
    """The final-loss difference to ``ref`` (AdamW, or a plain twin), and whether it exceeds the seed spread."""
    if ref is None or ref is v or v.stat("val_loss") is None:
        return MISSING
    delta = v.stat("val_loss")[0] - ref.stat("val_loss")[0]
    beyond = quality.exceeds_spread(v, ref)
    word = "better" if delta < 0 else "worse"
    if beyond is None:
        return f"{delta:+.3f} ({word}; spread unknown (one seed))"
    return f"{delta:+.3f} ({word}, beyond the seed spread)" if beyond else f"{delta:+.3f} (within the seed spread)"


def time_to_target_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per variant (runs that differ only in their seed): loss, time to target, speed-up."""
    vs = quality.variants(results["runs"])
    best = quality.best_lr(vs)
    target_label = _target_label(vs)
    headers = ["Run", "Link", "Seeds", "final val loss", f"vs {REFERENCE}", "best val loss", "steps to target",
               "tokens to target (M)", "time to target (s)", f"{REFERENCE} time ÷ this",
               f"at its final loss: {REFERENCE} time ÷ this", "s/step", "MB/step/node"]  # fmt: skip
    rows = []
    for v in vs:
        n = len(v.ok)
        reached = v.values("time_to_target_s")
        ref = _reference(vs, v, target_label)
        if not v.ok:
            to_target = steps = tokens = speedup = "failed" if v.runs else MISSING
        elif not reached:
            to_target = steps = tokens = "not reached"
            speedup = MISSING
        else:
            note = f" ({len(reached)}/{n} seeds)" if len(reached) < n else ""
            to_target = mean_range(v.stat("time_to_target_s"), ".0f", len(reached)) + note
            steps = mean_range(v.stat("steps_to_target"), ".0f", len(reached)) + note
            tokens = mean_range(v.stat("tokens_to_target"), ".2f", len(reached), 1e6)
            ref_time = ref.stat("time_to_target_s") if ref is not None else None
            speedup = MISSING if ref_time is None else f"{ref_time[0] / v.stat('time_to_target_s')[0]:.2f}×"
        at_final = MISSING
        ref_final, own = v.stat("reference_time_to_final_s"), v.stat("train_time_s")
        if ref_final is not None and own is not None and len(v.values("reference_time_to_final_s")) == n:
            at_final = f"{ref_final[0] / own[0]:.2f}×"
        elif v.ok and v.method != reference_method():
            missing = n - len(v.values("reference_time_to_final_s"))
            # reference_time_to_final_s needs every AdamW seed to have reached this run's final loss.
            if not n:
                at_final = MISSING
            elif ref is not None and len(ref.ok) == 1:
                at_final = f"{REFERENCE} never got this low" + (f" ({missing}/{n} seeds)" if n > 1 else "")
            else:
                at_final = f"not every {REFERENCE} seed got this low ({missing}/{n} seeds)"
        rows.append([
            v.label + ("" if v.label not in best else " ★" if best[v.label] else " ★ (across seed counts)"),
            format_bandwidth(v.bandwidth_bps), f"{n}/{len(v.runs)}",
            mean_range(v.stat("val_loss"), ".3f", n), _versus(v, ref),
            mean_range(v.stat("best_val_loss"), ".3f", n), steps, tokens, to_target, speedup, at_final,
            number_cell(v.stat("step_time_s")[0] if v.stat("step_time_s") else None, ".3f"),
            number_cell(v.stat("inter_node_bytes_per_step")[0] if v.stat("inter_node_bytes_per_step") else None, ".3f", 1e6),
        ])  # fmt: skip
    return headers, rows


#: Compute times per step at which the modelled table is evaluated, besides this machine's.
MODELLED_COMPUTE_S: tuple[float, ...] = (0.1, 0.01)


def modelled_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """MODELLED time to target at given compute times per step, and the break-even against AdamW."""
    vs = quality.variants(results["runs"])
    target_label = _target_label(vs)
    headers = ["Run", "Link", "modelled comm s/step", "this machine: compute s/step",
               *(f"time to target at {c:g} s compute" for c in MODELLED_COMPUTE_S), f"vs {REFERENCE}"]  # fmt: skip
    rows = []
    for v in vs:
        reached = [r for r in v.ok if r.steps_to_target is not None or r.reference_steps_to_final is not None]
        if not reached:
            continue
        compute = v.stat("compute_time_s")
        comm = statistics.fmean(c for c in (quality.modelled_comm_s(r) for r in reached) if c is not None)

        def at(c: float, reached: list[Run] = reached) -> str:
            t = [quality.modelled_time_to_target_s(r, c) for r in reached]
            t = [x for x in t if x is not None]
            return f"{statistics.fmean(t):.0f} s" if t else "not reached"

        ref = _reference(vs, v, target_label)
        versus = MISSING
        if ref is not None and ref is not v:
            refs = [r for r in ref.ok if r.steps_to_target is not None]
            if refs:
                be = quality.break_even_compute_s(reached[0], refs[0])
                if be is not None:
                    c, side = be
                    if math.isinf(c):
                        versus = "sooner at every compute time"
                    elif c == 0.0:
                        versus = "later at every compute time"
                    else:
                        versus = f"sooner when compute {'<' if side == 'below' else '>'} {c:.3g} s/step"
        rows.append([v.label, format_bandwidth(v.bandwidth_bps), f"{comm:.3f}",
                     number_cell(compute[0] if compute else None, ".3f"),
                     *(at(c) for c in MODELLED_COMPUTE_S), versus])  # fmt: skip
    return headers, rows


def _exposed_per_exchange(v: quality.Variant) -> tuple[float, float, float] | None:
    """Seconds an exchange kept the step waiting: per step (exposed comm), or per outer step (DiLoCo/NoLoCo)."""
    return v.stat("sync_time_s") or v.stat("exposed_comm_time_s")


def _pair(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None, fmt: str,
          scale: float = 1.0) -> str:  # fmt: skip
    return f"{number_cell(a[0] if a else None, fmt, scale)} / {number_cell(b[0] if b else None, fmt, scale)}"


def hiding_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each overlapping or compressed variant against its plain (blocking, default format) twin."""
    vs = quality.variants(results["runs"])
    headers = ["Run", "against", "Link", "Seeds", "final val loss", "plain's", "Δ loss",
               "train s (this / plain)", "exposed s per exchange (this / plain)",
               "MB/step/node (this / plain)", "plain bytes ÷ this"]  # fmt: skip
    rows = []
    for v in vs:
        base = quality.plain_variant(v, vs)
        if base is None:
            continue
        n = len(v.ok)
        verdict = _versus(v, base)
        mine, theirs = v.stat("inter_node_bytes_per_step"), base.stat("inter_node_bytes_per_step")
        ratio = f"{theirs[0] / mine[0]:.2f}×" if mine and theirs and mine[0] > 0 else MISSING
        rows.append([
            v.label, base.label, format_bandwidth(v.bandwidth_bps), f"{n}/{len(v.runs)}",
            mean_range(v.stat("val_loss"), ".3f", n), mean_range(base.stat("val_loss"), ".3f", len(base.ok)),
            verdict, _pair(v.stat("train_time_s"), base.stat("train_time_s"), ".1f"),
            _pair(_exposed_per_exchange(v), _exposed_per_exchange(base), ".3f"),
            _pair(mine, theirs, ".3f", 1e6), ratio,
        ])  # fmt: skip
    return headers, rows


def why_not_reached_notes(results: Mapping[str, Any]) -> list[str]:
    """For each variant that missed the target: its loss per step against its time per step, measured.

    Two things decide time to target: the loss a method gets per step, and the time a step
    takes (compute, and the communication it waits on). The note says which one kept the
    variant from the target, with this machine's figures, so a reader sees why.
    """
    vs = quality.variants(results["runs"])
    ref = next((u for u in vs if u.label == _target_label(vs) and u.ok), None)
    if ref is None or ref.stat("compute_time_s") is None:
        return []
    rc, re_ = ref.stat("compute_time_s")[0], ref.stat("exposed_comm_time_s") or ref.stat("comm_time_s")
    notes = []
    for v in vs:
        if v is ref or not v.ok or v.values("time_to_target_s") or v.stat("compute_time_s") is None:
            continue
        c = v.stat("compute_time_s")[0]
        e = (v.stat("exposed_comm_time_s") or v.stat("comm_time_s") or (0.0,))[0]
        delta = v.stat("val_loss")[0] - ref.stat("val_loss")[0]
        steps = int(statistics.fmean(float(r.steps or 0) for r in v.ok))
        if quality.exceeds_spread(v, ref) is False:
            why = ("within the seed spread, so it misses the target (a mean over seeds) by seed noise, not by its "
                   "loss per step")
        else:
            why = "so its loss per step is what it lacks"
        text = (f"{v.label} did not reach the target in {steps} steps: it ends {delta:+.3f} from {ref.label}'s "
                f"final loss, {why}. Per step it computes {c:.3f} s and waits "
                f"{e:.3f} s on the link, against {rc:.3f} s and {re_[0] if re_ else 0.0:.3f} s for {ref.label}")
        ref_final, own = v.stat("reference_time_to_final_s"), v.stat("train_time_s")
        if ref_final is not None and own is not None:
            text += (f"; {ref.label} needed {ref_final[0]:.0f} s of training to get to the loss this run ends at, "
                     f"this run {own[0]:.0f} s ({ref_final[0] / own[0]:.2f}×)")
        notes.append(text + ".")
    return notes


def _noloco_notes(results: Mapping[str, Any]) -> list[str]:
    notes = []
    for r in results["runs"]:
        spec = METHODS.get(r.method)
        if spec is None or not spec.gossip or r.replicas is None or r.hyperparameters is None:
            continue
        hp = r.hyperparameters
        n = int(hp["group_size"] if "group_size" in hp else hp["n"])  # "n": results written before the typed configs
        if r.replicas < 2 * n:
            notes.append(f"{r.label}: with {r.replicas} replicas and groups of n = {n}, NoLoCo's only group "
                         "is every replica: it is DiLoCo with heavy-ball momentum (α, β) and no gossip. Compare "
                         "NoLoCo with DiLoCo at 4 or more replicas (--nodes 4 --ranks-per-node 1) for the "
                         "paper's setting.")  # fmt: skip
    return list(dict.fromkeys(notes))


def hiding_section(results: Mapping[str, Any]) -> list[str]:
    """The report's table of overlapping and compressed variants against their plain twins (none: [])."""
    headers, rows = hiding_rows(results)
    if not rows:
        return []
    return [
        "## Hiding and compressing the link, against the plain version",
        "",
        "Each variant that overlaps its exchange with computation (`overlap`, `delay`) or sends its values in "
        "another format (`values`) beside the *plain* variant of this bench: the same method, hyper-parameters, "
        "lr, seeds and link, blocking and in the method's default format. Exposed s per exchange: the median "
        "time a step waited on the link (per step; for DiLoCo/NoLoCo, per outer step). Δ loss: this variant's "
        "mean final loss minus the plain one's.",
        "",
        markdown_table(headers, rows),
        "",
    ]  # fmt: skip


def quality_section(results: Mapping[str, Any]) -> list[str]:
    """``report.md``'s time-to-target section: the target, the table, the modelled table, notes."""
    target = results.get("target_loss")
    out = ["## Time to target", ""]
    if target is None:
        out += [f"{results.get('target_source') or 'No target.'}", ""]
        return out
    out += [
        f"Target validation loss **{target:.4f}**: {results.get('target_source')}. A run reaches it at the first "
        "validation at or below it; step, tokens and time there are linearly *interpolated* between that "
        "validation and the one before. Time is the training clock (start-up and validation excluded), "
        "measured on this machine. Cells with several seeds give the mean and [min–max] over them; a "
        "difference *exceeds the seed spread* when the two min–max ranges do not overlap; against a variant "
        "with one seed the spread is unknown and no such claim is made. ★ = the best lr of a method run at "
        "several (lowest mean final loss), among its variants with the most seeds; \"across seed counts\": "
        "the other lrs ran at fewer seeds, so a mean is set against fewer seeds. \"At its final loss\": the training time "
        f"{REFERENCE} "
        "needed to reach the loss this run ends at, divided by this run's training time (above 1×: this run "
        "reached its quality sooner).",
        "",
        markdown_table(*time_to_target_rows(results)),
        "",
    ]  # fmt: skip
    headers, rows = modelled_rows(results)
    if rows:
        out += [
            "### Modelled, not measured: time to target at other compute speeds",
            "",
            "This CPU computes a step far slower than a GPU, which hides what the link costs. MODELLED: time to "
            "target = measured steps to target × (compute per step + measured bytes per step / link rate + "
            "latency × link operations per step); overlapping variants take max(compute, communication). "
            f"The vs-{REFERENCE} column solves for the compute time per step at which the run and {REFERENCE} reach the target "
            "together; a run that did not reach the target is compared at the loss it did reach (all its steps "
            f"against {REFERENCE}'s steps to that loss).",
            "",
            markdown_table(headers, rows),
            "",
        ]  # fmt: skip
    notes = quality.unjudged_lr_notes(quality.variants(results["runs"])) + why_not_reached_notes(results)
    notes += _noloco_notes(results)
    if notes:
        out += [f"- {n}" for n in notes] + [""]
    return out


def _fewer(ratio: float) -> str:
    """A bytes ratio as read in the goal: "1/1,250" for 1,250 times fewer, "2.5" for more."""
    if ratio >= 1 or ratio == 0:
        return f"{ratio:.3g}"
    return f"1/{1 / ratio:,.0f}" if ratio <= 0.01 else f"1/{1 / ratio:.3g}"


def _frontier_verdict(p: quality.FrontierPoint, ref: quality.FrontierPoint) -> str:
    """Within the reference's seed spread, or above/below it by the difference of the means; no claim on one seed."""
    if p is ref:
        return "reference"
    if len(p.variant.ok) < 2:
        return "one seed: no spread claim"
    if len(ref.variant.ok) < 2:
        return "the reference ran one seed: no spread claim"
    delta = p.loss[0] - ref.loss[0]
    if not quality.exceeds_spread(p.variant, ref.variant):
        return "within the reference's spread"
    return f"{'above' if delta > 0 else 'below'} by {abs(delta):.3f} (beyond the spread)"


def frontier_rows(results: Mapping[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Quality per byte: ``(the line naming the reference, headers, one row per variant sorted by bits)``."""
    points, reference, left_out = quality.frontier(results["runs"])
    ref = next((p for p in points if p.variant is reference), None)
    name = REFERENCE
    headers = ["Run", "Seeds", "bits/param/step", f"bytes ÷ {name}'s", "final val loss",
               f"Δ vs {name}", "verdict", "Pareto front"]  # fmt: skip
    rows = []
    for p in points:
        v = p.variant
        n = len(v.ok)
        if ref is None:
            ratio = delta = verdict = MISSING
        else:
            ref_bytes = ref.variant.stat("inter_node_bytes_per_step")[0]
            ratio = _fewer(v.stat("inter_node_bytes_per_step")[0] / ref_bytes) if ref_bytes else MISSING
            delta, verdict = f"{p.loss[0] - ref.loss[0]:+.3f}", _frontier_verdict(p, ref)
        front = "yes" if p.on_front else "no (faulted)" if v.faulted else "no"
        rows.append([v.label, f"{n}/{len(v.runs)}", f"{p.bits:.3g}", ratio, mean_range(p.loss, ".3f", n), delta,
                     verdict, front])  # fmt: skip
    for v in left_out:
        why = "no byte count" if v.ok else "failed"
        rows.append([v.label, f"{len(v.ok)}/{len(v.runs)}", MISSING, MISSING,
                     mean_range(v.stat("val_loss"), ".3f", len(v.ok)), MISSING, why, MISSING])  # fmt: skip
    if ref is None:
        line = f"No {name} variant finished: no reference band, bytes ratio or verdict."
    else:
        n = len(ref.variant.ok)
        _, lo, hi = ref.loss
        line = (f"Reference: **{ref.variant.label}**, the variant the target comes from, {n} seed{'s' if n != 1 else ''}: "
                f"final loss {mean_range(ref.loss, '.3f', n)}"
                + (f", a spread of {hi - lo:.3f}." if n > 1 else "; with one seed it has no spread, and no "
                   "variant is called within or beyond it."))  # fmt: skip
    return line, headers, rows


def frontier_section(results: Mapping[str, Any], plots: Sequence[str] = ()) -> list[str]:
    """``report.md``'s quality-per-byte section: the plot, the reference, the table (fewer than two variants: [])."""
    if not has_frontier(results["runs"]):
        return []
    line, headers, rows = frontier_rows(results)
    out = ["## Quality per byte", ""]
    if FRONTIER_PLOT_FILE in plots:
        out += [f"![frontier]({FRONTIER_PLOT_FILE})", ""]
    out += [
        "Each variant's final validation loss (mean and [min–max] over its seeds) against the bits it sends "
        "per parameter per step: 8 × the bytes a node sends to other nodes per step (the MB/step/node of the "
        "tables below: counted exactly by the link, not modelled) ÷ the model's parameters. One point per "
        "variant, at the first link it ran at. A variant is *within the reference's spread* when the two "
        "min–max ranges overlap; a variant or reference with one seed has no spread, and no such claim is "
        "made. The Pareto front: the variants no other variant beats on both bits and loss (mean); faulted "
        "variants are never on it. In the plot a thin line joins a method's variants that differ in one "
        "hyper-parameter that changes the bytes (e.g. `--methods flexdemo:topk=1 flexdemo:topk=4 "
        "flexdemo:topk=16`): the method's own curve.",
        "",
        line,
        "",
        markdown_table(headers, rows),
        "",
    ]  # fmt: skip
    return out
