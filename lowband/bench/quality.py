"""Time to quality: the target loss, when each run reached it, seed spread, best learning rates.

Everything here is a pure function of run records (:class:`~lowband.bench.record.RunRecord`, the
``runs`` of ``results.json``), so ``lowband report`` recomputes it from the file alone.

- **Target.** AdamW's final validation loss in the same bench (the FlexDeMo paper's metric:
  Figures 3-4 ask when each method reaches what AdamW ends at), or a loss the user gives
  (``--target-loss``). With several AdamW variants (an lr sweep), the best one's (lowest mean
  final loss over its seeds); with several seeds, the mean over them. A variant run at one seed
  (``nseeds=1``) is never the target when another ran at several.
- **Reaching it.** The first validation at or below the target; the step, tokens and training
  time there are linearly *interpolated* between that validation and the one before it (the
  report says so). Training time is the trainer's training clock: start-up and validation are
  left out.
- **Variants and seeds.** Runs that differ only in their seed form a *variant* (same method,
  hyper-parameters and link); their spread is min-max over the seeds. Variants of one method
  that differ only in ``lr`` form a *method group*, and the variant with the lowest mean final
  loss among those with the group's most seeds is the group's best lr (against variants with fewer
  seeds only when it is also below them, and the report says the comparison is across seed counts).
- **Significance.** A difference between two variants "exceeds the seed spread" when their
  min-max ranges over the seeds do not overlap; when either has a single seed the spread is
  unknown and the report says so instead of judging.
- **Hiding and compressing against the plain version.** A variant that overlaps its exchange
  (``overlap``, ``delay``) or sends its values in another format (``values``) is compared with
  the *plain* variant of the same bench: the same method, hyper-parameters, lr and link, with
  those settings at the method's defaults (blocking; fp32 outer messages for DiLoCo/NoLoCo, bf16
  values for FlexDeMo). Its loss is "within the seed spread" of the plain one or worse by a
  stated amount.
- **Quality per byte** (the frontier): each variant's final validation loss against the bits it
  sends per parameter per step (:func:`bits_per_param_per_step`: the link's exact byte count, not
  a model), its Pareto front, and the curves of one method swept over one knob
  (:func:`knob_curves`); the reference is the target's AdamW variant.
- **Modelled time** (labelled as such wherever it is shown): for a given compute time per step
  ``c``, a step costs ``c`` plus the run's *measured* bytes per step over the link rate plus the
  link latency for each of its inter-node operations per step (or ``max(c, comm)`` for variants
  that overlap communication with computation), and the time to target is that times the
  run's measured steps to target. It answers "what would this look like on a faster
  accelerator", which this CPU cannot show.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lowband.bench.methods import method_label
from lowband.bench.record import RunRecord
from lowband.train.methods import METHODS, display_name, reference_method

#: The reference method's name in reports and plots (the registry's one ``reference=True`` method).
REFERENCE: str = display_name(reference_method())

__all__ = [
    "Crossing",
    "FrontierPoint",
    "Variant",
    "annotate_time_to_target",
    "best_lr",
    "best_lr_labels",
    "bits_per_param_per_step",
    "break_even_compute_s",
    "choose_target",
    "reference_runs",
    "crossing",
    "equal_loss_steps",
    "exceeds_spread",
    "frontier",
    "knob_curves",
    "unjudged_lr_notes",
    "modelled_comm_s",
    "modelled_speedup_at_equal_loss",
    "modelled_step_s",
    "modelled_time_to_target_s",
    "overlaps",
    "pareto_front",
    "plain_variant",
    "target_variants",
    "variants",
]

Run = RunRecord


@dataclass(frozen=True, slots=True)
class Crossing:
    """Where a validation curve first reached the target (interpolated between validations)."""

    step: float
    tokens: float | None
    train_time_s: float | None


def _lerp(a: float | None, b: float | None, t: float) -> float | None:
    if a is None or b is None:
        return None
    return a + (b - a) * t


def crossing(history: Sequence[Mapping[str, Any]], target: float) -> Crossing | None:
    """The first point where ``history`` (validation points, in step order) reaches ``target``.

    Linear interpolation between the first validation at or below the target and the one
    before it; None when no validation reaches it.
    """
    prev = None
    for point in history:
        loss = point.get("val_loss")
        if loss is None or not math.isfinite(loss):
            prev = None
            continue
        if loss <= target:
            if prev is None or prev["val_loss"] <= target:
                return Crossing(float(point["step"]), point.get("tokens"), point.get("train_time_s"))
            t = (prev["val_loss"] - target) / (prev["val_loss"] - loss)
            return Crossing(
                float(_lerp(prev["step"], point["step"], t)),
                _lerp(prev.get("tokens"), point.get("tokens"), t),
                _lerp(prev.get("train_time_s"), point.get("train_time_s"), t),
            )
        prev = point
    return None


@dataclass(frozen=True, kw_only=True)
class Variant:
    """Runs that differ only in their seed: one method, its hyper-parameters, one link."""

    label: str
    method: str
    group: str  # the method group: the label without the lr
    lr: float | None
    bandwidth_bps: float
    runs: tuple[Run, ...]

    @property
    def ok(self) -> list[Run]:
        return [r for r in self.runs if r.status == "ok" and r.val_loss is not None]

    @property
    def faulted(self) -> bool:
        """Runs with nodes killed on purpose (``--faults``): never the reference others are timed to."""
        return any((r.fault_tolerance or {}).get("faults") for r in self.runs)

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.ok]

    def values(self, key: str) -> list[float]:
        """The run-record field ``key`` (a number, e.g. "val_loss") of the successful seeds that have it."""
        return [float(v) for v in (getattr(r, key) for r in self.ok) if v is not None]

    def stat(self, key: str) -> tuple[float, float, float] | None:
        """(mean, min, max) of ``key`` over the seeds that have it."""
        vals = self.values(key)
        if not vals:
            return None
        return statistics.fmean(vals), min(vals), max(vals)


def _lr_of(run: Run) -> float | None:
    hp = run.hyperparameters or {}
    lr = (run.params or {}).get("lr", hp.get("lr"))
    return float(lr) if lr is not None else None


def _group_label(run: Run) -> str:
    params = {k: v for k, v in (run.params or {}).items() if k != "lr"}
    return method_label(run.method, params)


def variants(runs: Sequence[Run]) -> list[Variant]:
    """Runs grouped into variants (same label, method and link), in the order they first ran."""
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        key = (r.label, r.method, r.shards, r.bandwidth_bps)
        groups.setdefault(key, []).append(r)
    out = []
    for (label, method, _shards, bw), rs in groups.items():
        out.append(Variant(label=label, method=method, group=_group_label(rs[0]), lr=_lr_of(rs[0]),
                           bandwidth_bps=bw, runs=tuple(rs)))  # fmt: skip
    return out


def _mean_final(v: Variant) -> float:
    s = v.stat("val_loss")
    return s[0] if s is not None else math.inf


def best_lr(vs: Sequence[Variant]) -> dict[str, bool]:
    """The best-lr variant of every method group run at more than one lr: ``{label: like_with_like}``.

    Only variants with the group's most seeds can win. ``like_with_like`` is True when the winner
    beat other lrs run at as many seeds, False when it was compared only with variants run at fewer
    seeds (a mean over several seeds against fewer): the report says so. A group whose lowest mean
    final loss belongs to a variant with fewer seeds than another has no winner.
    """
    best: dict[str, bool] = {}
    for members in _lr_groups(vs):
        most = max(len(m.ok) for m in members)
        top = [m for m in members if len(m.ok) == most]
        if len({m.lr for m in top}) > 1:
            best[min(top, key=_mean_final).label] = True
        elif min(members, key=_mean_final) in top:
            best[top[0].label] = False
    return best


def _lr_groups(vs: Sequence[Variant]) -> list[list[Variant]]:
    """Variants of one method group at one link, with a final loss, for groups run at several lrs."""
    by_group: dict[tuple, list[Variant]] = {}
    for v in vs:
        if math.isfinite(_mean_final(v)):
            by_group.setdefault((v.group, v.bandwidth_bps), []).append(v)
    return [m for m in by_group.values() if len({v.lr for v in m}) > 1]


def unjudged_lr_notes(vs: Sequence[Variant]) -> list[str]:
    """Why a method group run at several lrs has no best lr (:func:`best_lr`): one sentence each."""
    notes = []
    best = best_lr(vs)
    for members in _lr_groups(vs):
        if any(m.label in best for m in members):
            continue
        low = min(members, key=_mean_final)
        most = max(members, key=lambda m: len(m.ok))
        notes.append(f"{low.label} ({len(low.ok)} seed{'s' if len(low.ok) != 1 else ''}) ended below {most.label} "
                     f"(mean over {len(most.ok)} seeds): no lr of this method is marked best, since fewer seeds "
                     "are not weighed against a mean over more.")
    return list(dict.fromkeys(notes))


def best_lr_labels(vs: Sequence[Variant]) -> set[str]:
    """Labels of the best-lr variant of every method group that was run at more than one lr (:func:`best_lr`)."""
    return set(best_lr(vs))


def _n_seeds(label: str, vs: Sequence[Variant]) -> int:
    return len({r.seed for v in vs if v.label == label for r in v.ok})


def target_variants(vs: Sequence[Variant]) -> tuple[Variant | None, list[Variant]]:
    """The AdamW variant that sets the target, and the AdamW variants left out for having one seed.

    The lowest mean final loss among AdamW variants that ran without faults; a variant with one
    seed is never the target when one with several exists (a single seed against a mean).
    """
    refs = [v for v in vs if v.method == reference_method() and v.ok and not v.faulted]
    if not refs:
        return None, []
    several = [v for v in refs if _n_seeds(v.label, vs) > 1]
    pool = several or refs
    return min(pool, key=_mean_final), [v for v in refs if v not in pool]


def reference_runs(runs: Sequence[Run]) -> list[Run]:
    """The successful runs of the target's AdamW variant (:func:`target_variants`), at every link."""
    vs = variants(runs)
    best, _ = target_variants(vs)
    if best is None:
        return []
    return [r for v in vs if v.method == reference_method() and not v.faulted and v.label == best.label for r in v.ok]


def choose_target(runs: Sequence[Run], target_loss: float | None = None) -> tuple[float | None, str]:
    """The target loss and where it came from (a sentence for the report)."""
    if target_loss is not None:
        return float(target_loss), f"given with --target-loss {target_loss:g}"
    vs = variants(runs)
    best, left_out = target_variants(vs)
    if best is None:
        return None, (f"no target: the bench has no successful {REFERENCE} run (add {reference_method()}, or give "
                      "--target-loss)")
    # AdamW's loss does not depend on the link: its runs at every bandwidth are the same training.
    finals = [float(r.val_loss) for r in reference_runs(runs)]
    n = _n_seeds(best.label, vs)
    lr = f" (lr {best.lr:g})" if best.lr is not None else ""
    source = f"{REFERENCE}{lr} final validation loss, mean over {n} seed{'s' if n != 1 else ''}"
    lower = sorted({v.label for v in left_out if _mean_final(v) < statistics.fmean(finals)})
    if left_out:
        source += (f"; {REFERENCE} variants run at one seed are not the target when one ran at several"
                   + (f" ({', '.join(lower)} ended lower, at its one seed)" if lower else ""))
    return statistics.fmean(finals), source


def annotate_time_to_target(results: dict[str, Any], target_loss: float | None = None) -> dict[str, Any]:
    """Set ``target_loss``/``target_source`` and every run's ``*_to_target`` fields; returns ``results``.

    ``results["runs"]`` holds :class:`~lowband.bench.record.RunRecord` objects, updated in place.
    """
    runs: list[RunRecord] = results.get("runs") or []
    if target_loss is None:
        target_loss = (results.get("config") or {}).get("target_loss")
    target, source = choose_target(runs, target_loss)
    results["target_loss"] = target
    results["target_source"] = source
    for r in runs:
        hit = None
        if target is not None and r.status == "ok":
            hit = crossing(r.val_history or [], target)
        r.steps_to_target = hit.step if hit else None
        r.tokens_to_target = hit.tokens if hit else None
        r.time_to_target_s = hit.train_time_s if hit else None
        losses = [p["val_loss"] for p in r.val_history or [] if p.get("val_loss") is not None]
        r.best_val_loss = min(losses) if losses else None
    # Time to quality at the quality a run did reach: how long AdamW (the reference variant, at the
    # run's link, mean over its seeds) took to reach this run's final loss.
    refs = reference_runs(runs)
    for r in runs:
        r.reference_steps_to_final = r.reference_time_to_final_s = None
        same_link = [a for a in refs if a.bandwidth_bps == r.bandwidth_bps] or refs
        if r.status != "ok" or r.val_loss is None or not same_link or any(r is a for a in same_link):
            continue
        hits = [crossing(a.val_history or [], r.val_loss) for a in same_link]
        hits = [h for h in hits if h is not None]
        if len(hits) == len(same_link):
            r.reference_steps_to_final = statistics.fmean(h.step for h in hits)
            times = [h.train_time_s for h in hits if h.train_time_s is not None]
            r.reference_time_to_final_s = statistics.fmean(times) if len(times) == len(hits) else None
    return results


#: Hyper-parameters that change how a method uses the link, not what it computes per step (overlap_apply:
#: what FlexDeMo steps with while its exchange is hidden, so a variant of overlap=true).
HIDING_KEYS = ("overlap", "overlap_apply", "delay", "values")


def _is_plain(run: Run) -> bool:
    """True when ``run``'s hiding settings are its method's defaults (blocking, default wire format)."""
    hp = run.hyperparameters or {}
    spec = METHODS.get(run.method)
    if spec is None:
        return True
    defaults = spec.hyperparameters
    return all(hp.get(k, defaults[k]) == defaults[k] for k in HIDING_KEYS if k in defaults)


def _rest(run: Run) -> dict[str, Any]:
    # quant_block only shapes a quantised format; NoLoCo's gossip seed follows the run's seed.
    skip = {*HIDING_KEYS, "quant_block", "seed"}
    return {k: v for k, v in (run.hyperparameters or {}).items() if k not in skip}


def plain_variant(v: Variant, vs: Sequence[Variant]) -> Variant | None:
    """The plain (blocking, default wire format) variant that ``v`` hides or compresses, if the bench ran it.

    None for a plain variant itself and when the bench has no plain twin (same method, link,
    shards and every other hyper-parameter, the lr included).
    """
    if not v.ok or _is_plain(v.ok[0]):
        return None
    for u in vs:
        if (u is not v and u.ok and u.method == v.method and u.bandwidth_bps == v.bandwidth_bps
                and u.ok[0].shards == v.ok[0].shards and _is_plain(u.ok[0])
                and _rest(u.ok[0]) == _rest(v.ok[0])):
            return u
    return None


def exceeds_spread(a: Variant, b: Variant, key: str = "val_loss") -> bool | None:
    """True when the min-max ranges of ``key`` over the seeds do not overlap; None when either has one seed.

    A single seed has no spread to judge against, so no claim is made about it either way.
    """
    sa, sb = a.stat(key), b.stat(key)
    if sa is None or sb is None or len(a.values(key)) < 2 or len(b.values(key)) < 2:
        return None
    return sa[2] < sb[1] or sb[2] < sa[1]


def overlaps(run: Run) -> bool:
    """True for a variant that overlaps communication with compute (``overlap=true``, or DiLoCo/NoLoCo ``delay`` > 0)."""
    params = run.params or {}
    return str(params.get("overlap", "false")).lower() in ("true", "1") or float(params.get("delay") or 0) > 0


def modelled_comm_s(run: Run) -> float | None:
    """Modelled seconds of communication per step: measured bytes over the link rate, plus latency per op."""
    nbytes = run.inter_node_bytes_per_step
    bw = run.bandwidth_bps
    steps = run.steps or 0
    if nbytes is None or not bw or steps <= 0:
        return None
    ranks = max(int(run.nodes or 1) * int(run.ranks_per_node or 1), 1)
    # link_ops counts every rank's operations over the run: per rank and step.
    ops = sum(o.count for o in (run.link_ops or {}).values()) / ranks / steps
    return float(nbytes) * 8.0 / float(bw) + float(run.latency_s or 0.0) * ops


def modelled_time_to_target_s(run: Run, compute_s: float) -> float | None:
    """MODELLED training time to the target at ``compute_s`` seconds of compute per step."""
    comm = modelled_comm_s(run)
    if comm is None or run.steps_to_target is None:
        return None
    return float(run.steps_to_target) * float(modelled_step_s(run, compute_s, comm))


def modelled_step_s(run: Run, compute_s: Any, comm_s: float) -> Any:
    """MODELLED seconds per step: compute and communication, overlapped or one after the other.

    ``compute_s`` may be a number or a numpy array (a curve over compute times).
    """
    import numpy as np  # heavy: a command that does not train must not pay for it

    return np.maximum(compute_s, comm_s) if overlaps(run) else compute_s + comm_s


def equal_loss_steps(run: Run, references: Sequence[Run]) -> tuple[float, float, str] | None:
    """``(run's steps, AdamW's mean steps, where)`` to one loss that both reached; None if there is none.

    At the target when ``run`` and every reference run (AdamW at the run's link, its seeds)
    reached it (``where = "target"``); otherwise at the run's own final loss, all its steps against
    AdamW's mean steps to that loss (``"final"``, from :func:`annotate_time_to_target`). None when
    AdamW never got as low as the run.
    """
    ref_steps = [a.steps_to_target for a in references]
    if run.steps_to_target is not None and references and None not in ref_steps:
        return float(run.steps_to_target), statistics.fmean(ref_steps), "target"
    if run.reference_steps_to_final is not None and run.steps:
        return float(run.steps), float(run.reference_steps_to_final), "final"
    return None


def modelled_speedup_at_equal_loss(run: Run, references: Sequence[Run], compute_s: Any) -> Any:
    """MODELLED AdamW's training time ÷ ``run``'s to the same loss (:func:`equal_loss_steps`) at ``compute_s``.

    Each side: its steps × (compute + its modelled communication per step, overlapped where the
    variant overlaps); AdamW's communication is the mean over ``references``. Above 1: ``run`` is
    sooner. None when there is no common loss or no byte count.
    """
    pair = equal_loss_steps(run, references)
    comm = modelled_comm_s(run)
    ref_comms = [modelled_comm_s(a) for a in references]
    if pair is None or comm is None or not ref_comms or None in ref_comms:
        return None
    steps, ref_steps, _ = pair
    ref_comm = statistics.fmean(ref_comms)
    return ref_steps * modelled_step_s(references[0], compute_s, ref_comm) / (steps * modelled_step_s(run, compute_s, comm))


def break_even_compute_s(run: Run, reference: Run) -> tuple[float, str] | None:
    """MODELLED compute time per step at which ``run`` and ``reference`` reach the target together.

    Solves ``s_run·(c + m_run) = s_ref·(c + m_ref)`` for ``c`` (blocking steps; ``s`` steps to
    target, ``m`` modelled communication per step). A run that did not reach the target is compared
    at the loss it did reach: all its steps against AdamW's steps to that loss. Returns ``(c, side)``: ``run`` is sooner for
    compute times ``"below"`` or ``"above"`` ``c``; ``(inf, "below")`` means at every compute time,
    ``(0.0, "below")`` at none. None when either did not reach the target.
    """
    pair = equal_loss_steps(run, [reference]) if reference.steps_to_target is not None else None
    m1, m2 = modelled_comm_s(run), modelled_comm_s(reference)
    if pair is None or None in (m1, m2):
        return None
    s1, s2, _ = pair
    if s1 == s2:
        return (math.inf, "below") if m1 <= m2 else (0.0, "below")
    c = (s2 * m2 - s1 * m1) / (s1 - s2)
    if s1 > s2:  # more steps: sooner only while communication dominates, below c
        return max(c, 0.0), "below"
    return (math.inf, "below") if c <= 0 else (c, "above")


def bits_per_param_per_step(run: Run) -> float | None:
    """8 × the bytes a node sends to other nodes per step ÷ the model's parameters; None if either is unknown.

    The bytes are ``inter_node_bytes_per_step``: counted exactly by the link (not modelled), summed
    over the node's ranks, mean over nodes: the "MB/step/node" of the report's tables, so a ratio of
    two variants' bits is the ratio of their bytes. Per node rather than per rank, because a node's
    link is what is slow, and a sharded node's ranks each send a part of one model copy.
    AdamW's fp32 all-reduce costs about 32 (two nodes) to 64 (many) bits per parameter per step.
    """
    if run.inter_node_bytes_per_step is None or not run.num_params:
        return None
    return 8.0 * float(run.inter_node_bytes_per_step) / float(run.num_params)


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """One variant on the quality-per-byte plot: its bits per parameter per step and final loss over its seeds."""

    variant: Variant
    bits: float  # mean over the seeds (the link counts the same bytes at every seed)
    loss: tuple[float, float, float]  # final validation loss: mean, min, max over the seeds
    on_front: bool


def pareto_front(points: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the ``(bits, loss)`` points that no other point dominates (as few bits and as low a loss,
    one of them strictly). Equal points do not dominate each other: both are on the front."""
    return {i for i, (bits, loss) in enumerate(points)
            if not any(b <= bits and v <= loss and (b, v) != (bits, loss) for b, v in points)}  # fmt: skip


def frontier(runs: Sequence[Run]) -> tuple[list[FrontierPoint], Variant | None, list[Variant]]:
    """The quality-per-byte frontier: ``(points sorted by bits, the reference variant, variants not drawn)``.

    One point per variant at the first link it ran at (neither its bytes nor its loss depend on the
    link). The reference is the variant the target comes from (:func:`target_variants`). Faulted
    variants are drawn but never on the front: their bytes and loss are those of a run with nodes
    down, not the method's trade-off. Not drawn: variants without a successful run or a byte count.
    """
    first: dict[tuple, Variant] = {}
    for v in variants(runs):
        first.setdefault((v.label, v.method, v.runs[0].shards), v)
    vs = list(first.values())
    reference, _ = target_variants(vs)
    drawn, left_out = [], []
    for v in vs:
        bits = [b for b in (bits_per_param_per_step(r) for r in v.ok) if b is not None]
        if bits and len(bits) == len(v.ok):
            drawn.append((v, statistics.fmean(bits), v.stat("val_loss")))
        else:
            left_out.append(v)
    healthy = [i for i, (v, _, _) in enumerate(drawn) if not v.faulted]
    front = {healthy[j] for j in pareto_front([(drawn[i][1], drawn[i][2][0]) for i in healthy])}
    points = [FrontierPoint(v, bits, loss, i in front) for i, (v, bits, loss) in enumerate(drawn)]
    return sorted(points, key=lambda p: p.bits), reference, left_out


def _hyperparameters(v: Variant) -> dict[str, Any]:
    """Every hyper-parameter of a variant as the trainer used them; NoLoCo's gossip seed, which follows the
    run's seed, left out."""
    run = v.ok[0]
    return {k: val for k, val in (run.hyperparameters or run.params or {}).items() if k != "seed"}


def knob_curves(points: Sequence[FrontierPoint]) -> list[tuple[str, list[FrontierPoint]]]:
    """A method's own curves: ``(knob, points sorted by bits)`` for each set of points of one method that
    differ in one hyper-parameter only (e.g. ``flexdemo:topk=1,flexdemo:topk=4,flexdemo:topk=16``).

    The points of a curve also share their shards and fault tolerance. A knob that leaves the bytes
    unchanged (``lr``, ``overlap``) traces no curve: its points stand on one vertical, and are not joined.
    """
    curves = []
    hps = [_hyperparameters(p.variant) for p in points]
    for knob in dict.fromkeys(k for hp in hps for k in hp):
        groups: dict[tuple, list[FrontierPoint]] = {}
        for p, hp in zip(points, hps, strict=True):
            if knob in hp:
                run = p.variant.ok[0]
                rest = sorted((k, repr(v)) for k, v in hp.items() if k != knob)
                same = (p.variant.method, run.shards, bool(run.fault_tolerance), p.variant.faulted, repr(rest))
                groups.setdefault(same, []).append(p)
        for members in groups.values():
            if len({p.bits for p in members}) > 1:
                curves.append((knob, sorted(members, key=lambda p: p.bits)))
    return curves
