"""The recommendation at the top of ``report.md``: which variant to use for this model, data and link.

Two answers, each from figures the report already computes (:mod:`lowband.bench.quality`):

- **Soonest**: among the variants at a link whose every seed reached the target (the reference's
  final loss, :func:`quality.annotate_time_to_target`), the one with the lowest mean time to it
  (the training clock), if that is below the reference's own mean time to it. Its figures: its time,
  the reference's, and the reference's time ÷ its.
- **Fewest bytes within the spread**: among the points of the quality-per-byte frontier
  (:func:`quality.frontier`), the one sending the fewest bytes per step whose final loss is within
  the reference's seed spread or below it (their min–max ranges overlap, or it is lower beyond
  them), if it sends fewer bytes than the reference. Its figures: the reference's bytes ÷ its, and
  its loss beside the reference's.

A verdict needs a spread: the reference and the variant each need at least two successful seeds.
With one seed the recommendation gives no verdict and says to run ``--seeds 0,1``. When seeds
were run and no variant qualifies, it says "no variant beat the reference here".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lowband.bench import quality
from lowband.bench.quality import REFERENCE
from lowband.units import format_bandwidth

__all__ = ["NO_WINNER", "Recommendation", "recommend", "recommendation_lines", "recommendation_section"]

#: What the recommendation says when the measurement found nothing better than the reference.
NO_WINNER = "no variant beat the reference here"
#: The fix named when a verdict needs more seeds.
SEEDS_FIX = "run --seeds 0,1"


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The two answers, or why there is none (``no_verdict``). Pure data: the report words it."""

    reference: quality.Variant | None
    no_verdict: str | None = None
    soonest: tuple[tuple[float, quality.Variant | None, float | None, float | None], ...] = ()
    """Per link: (link, the soonest variant or None, its mean time to target, the reference's)."""
    fewest: tuple[quality.FrontierPoint, quality.FrontierPoint] | None = None
    """(the fewest-bytes variant within the spread, the reference), or None."""


def _seeds(v: quality.Variant) -> int:
    return len(v.ok)


def _time(v: quality.Variant) -> float | None:
    """Mean time to target when every successful seed reached it, else None."""
    if not v.ok or len(v.values("time_to_target_s")) != len(v.ok):
        return None
    return v.stat("time_to_target_s")[0]


def recommend(results: Mapping[str, Any]) -> Recommendation:
    """The recommendation from an annotated results dictionary (``runs`` with their ``*_to_target`` fields)."""
    runs = results["runs"]
    vs = quality.variants(runs)
    ref, _ = quality.target_variants(vs)
    if ref is None:
        return Recommendation(reference=None, no_verdict=f"no successful {REFERENCE} run, so no reference to beat: "
                                                         f"add {REFERENCE.lower()} to --methods")
    if _seeds(ref) < 2:
        return Recommendation(reference=ref, no_verdict=(
            f"one seed gives no verdict: {ref.label} ran one seed, so it has no seed spread, and a variant that "
            f"ends lower or sooner may only have had a luckier seed; {SEEDS_FIX} (two seeds or more) for one"))
    soonest = []
    for bw in dict.fromkeys(v.bandwidth_bps for v in vs):
        refs_here = [u for u in vs if u.label == ref.label and u.method == ref.method and u.bandwidth_bps == bw]
        ref_v = refs_here[0] if refs_here and _seeds(refs_here[0]) >= 2 else ref
        # As the time-to-target table: the reference's mean over its seeds that reached its own mean final loss.
        ref_stat = ref_v.stat("time_to_target_s")
        ref_t = ref_stat[0] if ref_stat is not None else None
        pool = [(t, v) for v in vs if v.bandwidth_bps == bw and v.method != ref.method and not v.faulted
                and _seeds(v) >= 2 and (t := _time(v)) is not None]
        best = min(pool, key=lambda p: p[0], default=None)
        if best is not None and ref_t is not None and best[0] < ref_t:
            soonest.append((bw, best[1], best[0], ref_t))
        else:
            soonest.append((bw, None, None, ref_t))
    points, reference, _ = quality.frontier(runs)
    ref_p = next((p for p in points if p.variant is reference), None)
    fewest = None
    if ref_p is not None:
        for p in points:  # sorted by bits: the first that qualifies sends the fewest
            v = p.variant
            if (p is ref_p or v.faulted or _seeds(v) < 2 or p.bits >= ref_p.bits
                    or v.method == ref_p.variant.method):
                continue
            beyond = quality.exceeds_spread(v, ref_p.variant)
            if beyond is False or (beyond and p.loss[0] < ref_p.loss[0]):
                fewest = (p, ref_p)
                break
    return Recommendation(reference=ref, soonest=tuple(soonest), fewest=fewest)


def _fewer(ratio: float) -> str:
    """``ref bytes ÷ these`` in words: "2,020× fewer"."""
    return f"{ratio:,.0f}× fewer" if ratio >= 10 else f"{ratio:.2f}× fewer"


def _loss(p: quality.FrontierPoint) -> str:
    mean, lo, hi = p.loss
    return f"{mean:.3f} [{lo:.3f}–{hi:.3f}]"


def recommendation_lines(results: Mapping[str, Any]) -> list[str]:
    """The recommendation as markdown bullet lines (no heading)."""
    rec = recommend(results)
    if rec.no_verdict is not None:
        return [f"- No verdict: {rec.no_verdict}."]
    ref = rec.reference
    n = _seeds(ref)
    several = len(rec.soonest) > 1
    out = []
    for bw, v, t, ref_t in rec.soonest:
        at = f" at {format_bandwidth(bw)}" if several else ""
        if v is None:
            why = ("" if ref_t is None else f" ({ref.label} took {ref_t:.0f} s of training to its final loss, mean "
                                            f"over {n} seeds)")
            out.append(f"- Soonest to {REFERENCE}'s loss{at}: {NO_WINNER}: no other variant reached the target "
                       f"sooner at every seed{why}.")
        else:
            out.append(f"- Soonest to {REFERENCE}'s loss{at}: **{v.label}**, {t:.0f} s of training (mean over "
                       f"{_seeds(v)} seeds) against {ref_t:.0f} s for {ref.label}: {ref_t / t:.2f}× sooner.")
    if rec.fewest is None:
        out.append(f"- Fewest bytes within {REFERENCE}'s seed spread: {NO_WINNER}: no variant that sends fewer "
                   f"bytes ended within or below {ref.label}'s final-loss spread at two or more seeds.")
    else:
        p, r = rec.fewest
        ratio = r.bits / p.bits if p.bits > 0 else float("inf")
        out.append(f"- Fewest bytes within {REFERENCE}'s seed spread: **{p.variant.label}**, {_fewer(ratio)} bytes "
                   f"per step than {r.variant.label} ({p.bits:.3g} against {r.bits:.3g} bits per parameter per step, "
                   f"counted by the link), final loss {_loss(p)} against {_loss(r)} ({_seeds(p.variant)} and "
                   f"{_seeds(r.variant)} seeds).")
    return out


def recommendation_section(results: Mapping[str, Any]) -> list[str]:
    """``report.md``'s first section: the recommendation with its figures ([] when nothing ran)."""
    if not results.get("runs"):
        return []
    return [
        "## Recommendation",
        "",
        f"For this model, data and link: the variant that reaches the reference's ({REFERENCE}'s) final loss "
        "soonest on the training clock, and the one that sends the fewest bytes while ending within the "
        "reference's seed spread (or below it). Both need two seeds or more, of the variant and of the "
        "reference; the tables below hold every figure.",
        "",
        *recommendation_lines(results),
        "",
    ]
