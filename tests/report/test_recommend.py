"""lowband/report/recommend.py: the recommendation at the top of report.md, on made-up records."""

from __future__ import annotations

from lowband.bench import quality
from lowband.report.recommend import NO_WINNER, recommend, recommendation_lines
from lowband.report.render import render_markdown
from tests.bench.records import run_record

# AdamW: 2 seeds ending 6.00 and 6.10 (target 6.05), 4 MB per step, 2 s of training between validations.
ADAMW = [[7.0, 6.6, 6.3, 6.00], [7.0, 6.6, 6.3, 6.10]]


def _results(*runs) -> dict:
    results = {"runs": list(runs), "config": {}}
    return quality.annotate_time_to_target(results)


def _adamw(seeds=(0, 1)):
    return [run_record("adamw", ADAMW[s], seed=s, label="AdamW", nbytes=4e6) for s in seeds]


def _with_params(runs, num_params=1_000_000):
    for r in runs:
        r.num_params = num_params
    return runs


def test_the_soonest_variant_is_named_with_its_time_and_ratio() -> None:
    fast = [run_record("flexdemo", losses, seed=s, label="FlexDeMo Top1", nbytes=1e5)
            for s, losses in enumerate([[7.0, 6.2, 6.0, 5.9], [7.0, 6.3, 6.02, 5.95]])]
    slow = [run_record("diloco", losses, seed=s, label="DiLoCo H=10", nbytes=4e5)
            for s, losses in enumerate([[7.0, 6.5, 6.04, 5.98], [7.0, 6.5, 6.03, 5.99]])]
    results = _results(*_with_params(_adamw() + fast + slow))
    rec = recommend(results)
    (bw, winner, t, ref_t), = rec.soonest
    assert winner.label == "FlexDeMo Top1"
    assert t < ref_t and abs(t - quality.variants(fast)[0].stat("time_to_target_s")[0]) < 1e-9
    line = next(x for x in recommendation_lines(results) if x.startswith("- Soonest"))
    assert "**FlexDeMo Top1**" in line and f"{t:.0f} s" in line and f"{ref_t:.0f} s" in line
    assert f"{ref_t / t:.2f}× sooner" in line
    report = render_markdown(results)
    assert report.index("## Recommendation") < report.index("## Time to target")


def test_the_fewest_bytes_within_the_spread_is_named_with_its_bytes_ratio_and_loss() -> None:
    # Top-1: 40x fewer bytes, ends 6.04/6.09 (overlaps AdamW's 6.00-6.10); Top-0.1: 400x fewer but far above.
    within = [run_record("flexdemo", [7.0, 6.7, 6.4, v], seed=s, label="FlexDeMo Top1", nbytes=1e5)
              for s, v in enumerate([6.04, 6.09])]
    beyond = [run_record("sparseloco", [7.0, 6.9, 6.8, v], seed=s, label="SparseLoCo", nbytes=1e4)
              for s, v in enumerate([6.60, 6.65])]
    results = _results(*_with_params(_adamw() + within + beyond))
    p, ref = recommend(results).fewest
    assert p.variant.label == "FlexDeMo Top1" and ref.variant.label == "AdamW"
    line = next(x for x in recommendation_lines(results) if x.startswith("- Fewest"))
    assert "**FlexDeMo Top1**" in line and "40× fewer" in line
    assert "6.065 [6.040–6.090]" in line and "6.050 [6.000–6.100]" in line
    assert "SparseLoCo" not in line


def test_no_variant_beat_the_reference_when_none_did() -> None:
    worse = [run_record("flexdemo", [7.0, 6.9, 6.8, v], seed=s, label="FlexDeMo Top1", nbytes=1e5)
             for s, v in enumerate([6.6, 6.7])]
    results = _results(*_with_params(_adamw() + worse))
    rec = recommend(results)
    assert rec.no_verdict is None and rec.fewest is None and rec.soonest[0][1] is None
    lines = recommendation_lines(results)
    assert len(lines) == 2 and all(NO_WINNER in x for x in lines)


def test_one_seed_gives_no_verdict_and_says_why() -> None:
    fast = [run_record("flexdemo", [7.0, 6.0, 5.9, 5.8], seed=0, label="FlexDeMo Top1", nbytes=1e5)]
    results = _results(*_with_params(_adamw(seeds=(0,)) + fast))
    rec = recommend(results)
    assert rec.no_verdict is not None and rec.fewest is None and not rec.soonest
    (line,) = recommendation_lines(results)
    assert "one seed gives no verdict" in line and "--seeds 0,1" in line
    assert "FlexDeMo Top1" not in line and NO_WINNER not in line


def test_a_variant_with_one_seed_is_not_named_even_when_the_reference_has_two() -> None:
    lucky = [run_record("flexdemo", [7.0, 6.0, 5.9, 5.8], seed=0, label="FlexDeMo Top1", nbytes=1e5)]
    results = _results(*_with_params(_adamw() + lucky))
    assert all(NO_WINNER in x for x in recommendation_lines(results))
