"""lowband/bench/quality.py: time to quality without training (target, interpolated crossings, best lr, modelled times, speedup at equal loss)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lowband.bench import quality
from lowband.bench.record import RunRecord
from lowband.report.render import modelled_rows, render_markdown, time_to_target_rows
from tests.bench.records import run_record, val_history


def test_crossing_is_interpolated_between_validations() -> None:
    hist = val_history([8.0, 6.0, 4.0])  # steps 0, 10, 20; times 0, 2, 4
    hit = quality.crossing(hist, 5.0)
    assert hit.step == pytest.approx(15.0) and hit.train_time_s == pytest.approx(3.0) and hit.tokens == 1500
    assert quality.crossing(hist, 6.0).step == 10.0  # exactly at a validation
    assert quality.crossing(hist, 3.9) is None
    # The first crossing counts, even if the loss rises again later.
    assert quality.crossing(val_history([8.0, 5.0, 7.0, 4.0]), 6.0).step == pytest.approx(10 * 2 / 3)


def test_target_is_best_adamw_mean_over_seeds_and_runs_are_timed_to_it() -> None:
    runs = [
        run_record("adamw", [8.0, 6.0, 5.0], seed=0, label="AdamW lr=0.001", params={"lr": 1e-3}),
        run_record("adamw", [8.0, 6.0, 5.2], seed=1, label="AdamW lr=0.001", params={"lr": 1e-3}),
        run_record("adamw", [8.0, 7.0, 6.0], seed=0, label="AdamW lr=0.0003", params={"lr": 3e-4}),
        run_record("flexdemo", [8.0, 5.0, 4.0], seed=0, label="FlexDeMo Top1", dt=1.0),
        run_record("flexdemo", [8.0, 5.5, 4.5], seed=1, label="FlexDeMo Top1", dt=1.0),
        run_record("diloco", [8.0, 7.0, 6.5], label="DiLoCo H=10"),
    ]
    results = quality.annotate_time_to_target({"runs": runs})
    assert results["target_loss"] == pytest.approx(5.1)
    assert "AdamW (lr 0.001)" in results["target_source"] and "2 seeds" in results["target_source"]
    adamw0, adamw1 = runs[0], runs[1]
    assert adamw0.time_to_target_s == pytest.approx(2 + 2 * 0.9) and adamw1.steps_to_target is None
    assert runs[3].steps_to_target == pytest.approx(10 * 2.9 / 3) and runs[5].time_to_target_s is None
    assert runs[5].best_val_loss == 6.5
    # Given explicitly, the target wins.
    assert quality.annotate_time_to_target({"runs": runs}, 7.5)["target_loss"] == 7.5
    assert runs[5].steps_to_target == pytest.approx(5.0)
    results = quality.annotate_time_to_target({"runs": runs})
    assert quality.choose_target([runs[5]])[0] is None

    vs = quality.variants(runs)
    assert [v.label for v in vs] == ["AdamW lr=0.001", "AdamW lr=0.0003", "FlexDeMo Top1", "DiLoCo H=10"]
    assert quality.best_lr_labels(vs) == {"AdamW lr=0.001"}
    assert vs[2].stat("val_loss") == pytest.approx((4.25, 4.0, 4.5))
    # FlexDeMo's range [4.0, 4.5] against AdamW's [5.0, 5.2]: beyond the spread; one seed each: unknown.
    assert quality.exceeds_spread(vs[2], vs[0]) is True
    assert quality.exceeds_spread(vs[3], vs[1]) is None

    headers, rows = time_to_target_rows(results)
    row = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    assert row["AdamW lr=0.001 ★ (across seed counts)"]["time to target (s)"].endswith("(1/2 seeds)")
    assert row["FlexDeMo Top1"]["vs AdamW"] == "-0.850 (better, beyond the seed spread)"
    assert row["DiLoCo H=10"]["time to target (s)"] == "not reached"
    # DiLoCo ends at 6.5: AdamW (both seeds) was there at step 7.5, after 1.5 s; DiLoCo trained 4 s.
    assert runs[5].reference_steps_to_final == pytest.approx(7.5) and runs[5].reference_time_to_final_s == pytest.approx(1.5)
    assert row["DiLoCo H=10"]["at its final loss: AdamW time ÷ this"] == "0.38×"
    # FlexDeMo ends below where either AdamW seed got: no AdamW time to compare with.
    assert row["FlexDeMo Top1"]["at its final loss: AdamW time ÷ this"] == "not every AdamW seed got this low (2/2 seeds)"
    assert runs[0].reference_time_to_final_s is None  # AdamW's own runs are the reference
    one = quality.annotate_time_to_target({"runs": [run_record("adamw", [8.0, 6.0, 5.0], label="AdamW"),
                                                    run_record("deto-full", [8.0, 6.0, 4.5], label="Deto-Full")]})
    headers1, rows1 = time_to_target_rows(one)
    assert dict(zip(headers1, rows1[1], strict=True))["at its final loss: AdamW time ÷ this"] == "AdamW never got this low"
    assert row["FlexDeMo Top1"]["final val loss"] == "4.250 [4.000–4.500]"
    flex_time = statistics_mean([runs[3].time_to_target_s, runs[4].time_to_target_s])
    assert row["FlexDeMo Top1"]["AdamW time ÷ this"] == f"{adamw0.time_to_target_s / flex_time:.2f}×"
    text = render_markdown({**results, "config": {}, "host": {}, "emulation": {}})
    assert "## Time to target" in text and "interpolated" in text and "Modelled, not measured" in text


def statistics_mean(xs):
    return sum(xs) / len(xs)


def test_modelled_time_and_break_even() -> None:
    adamw = run_record("adamw", [8, 6, 5], nbytes=8e6, compute=0.3)  # 64 Mbit per step at 100 Mbit/s: 0.64 s
    flex = run_record("flexdemo", [8, 7, 6, 5.5, 5], nbytes=5e4, compute=0.3)
    quality.annotate_time_to_target({"runs": [adamw, flex]})
    assert adamw.steps_to_target == 20 and flex.steps_to_target == 40
    m_a = 8e6 * 8 / 1e8 + 0.05 * 1
    assert quality.modelled_comm_s(adamw) == pytest.approx(m_a)
    assert quality.modelled_time_to_target_s(adamw, 0.1) == pytest.approx(20 * (0.1 + m_a))
    m_f = quality.modelled_comm_s(flex)
    c, side = quality.break_even_compute_s(flex, adamw)
    assert side == "below" and c == pytest.approx((20 * m_a - 40 * m_f) / 20)
    # At the break-even compute both take the same modelled time.
    assert quality.modelled_time_to_target_s(flex, c) == pytest.approx(quality.modelled_time_to_target_s(adamw, c))
    # Fewer steps and fewer bytes: sooner at every compute time.
    assert quality.break_even_compute_s(dataclasses.replace(adamw, steps_to_target=10, inter_node_bytes_per_step=1.0),
                                        adamw) == (math.inf, "below")
    # An overlapping variant costs max(compute, comm) per step.
    overlapped = dataclasses.replace(flex, params={"overlap": True})
    assert quality.modelled_time_to_target_s(overlapped, 1.0) == pytest.approx(40 * 1.0)
    # So does DiLoCo/NoLoCo with a delayed merge, whether written overlap=true or delay=τ.
    assert quality.overlaps(RunRecord(params={"delay": 2})) and not quality.overlaps(RunRecord(params={"delay": 0}))
    headers, rows = modelled_rows({"runs": [adamw, flex], "target_loss": 5.0})
    assert rows[1][0] == "flexdemo" and rows[1][-1] == f"sooner when compute < {c:.3g} s/step"


def test_speedup_at_equal_loss_compares_at_the_target_or_else_at_the_runs_own_final_loss(tmp_path) -> None:
    adamw = [run_record("adamw", [8, 6, 5], seed=s, nbytes=8e6, compute=0.3) for s in (0, 1)]  # target 5.0 at step 20
    flex = run_record("flexdemo", [8, 7, 6, 5.5, 5], nbytes=5e4, compute=0.3)  # reaches 5.0 at step 40
    short = run_record("flexdemo", [8, 7, 5.5], seed=2, label="FlexDeMo short", nbytes=5e4)  # ends at 5.5: AdamW's step 15
    low = run_record("diloco", [8, 7, 4.0], label="DiLoCo", nbytes=5e4, params={"delay": 1})  # target at step 16.7
    results = quality.annotate_time_to_target({"runs": [*adamw, flex, short, low]})
    assert results["target_loss"] == 5.0
    m_a, m_f = quality.modelled_comm_s(adamw[0]), quality.modelled_comm_s(flex)
    assert quality.equal_loss_steps(flex, adamw) == (40.0, 20.0, "target")
    c = 0.2
    assert quality.modelled_speedup_at_equal_loss(flex, adamw, c) == pytest.approx(20 * (c + m_a) / (40 * (c + m_f)))
    # Missed the target: all 20 of its steps against AdamW's 15 to its final loss 5.5.
    assert quality.equal_loss_steps(short, adamw) == (20.0, 15.0, "final")
    assert quality.modelled_speedup_at_equal_loss(short, adamw, c) == pytest.approx(15 * (c + m_a) / (20 * (c + m_f)))
    # An overlapping variant costs max(compute, comm) per step.
    assert low.steps_to_target is not None
    got = quality.modelled_speedup_at_equal_loss(low, adamw, 1.0)
    assert got == pytest.approx(20 * (1.0 + m_a) / (low.steps_to_target * max(1.0, m_f)))
    # No common loss (AdamW never got as low as this run's final loss and the run missed the target): None.
    missed_low = dataclasses.replace(short, steps_to_target=None, reference_steps_to_final=None)
    assert quality.equal_loss_steps(missed_low, adamw) is None
    assert quality.modelled_speedup_at_equal_loss(missed_low, adamw, c) is None

    from lowband.report.plots import PLOT_FILES, write_plots

    paths = write_plots(results, tmp_path)
    assert "speedup_at_equal_loss_modelled.png" in PLOT_FILES
    assert (tmp_path / "speedup_at_equal_loss_modelled.png") in paths
    assert (tmp_path / "speedup_at_equal_loss_modelled.png").stat().st_size > 1000


def test_a_one_seed_variant_is_neither_the_target_nor_a_spread_to_judge_against() -> None:
    # The quality preset's AdamW: lr 0.03 at two seeds, the paper's lr 0.001 at one (nseeds=1), which ends lower.
    runs = [run_record("adamw", [8.0, 6.0, 5.0], seed=0, label="AdamW lr=0.03", params={"lr": 0.03}),
            run_record("adamw", [8.0, 6.0, 5.2], seed=1, label="AdamW lr=0.03", params={"lr": 0.03}),
            run_record("adamw", [8.0, 6.0, 4.8], seed=0, label="AdamW lr=0.001", params={"lr": 1e-3}),
            run_record("flexdemo", [8.0, 6.0, 5.6], seed=0, label="FlexDeMo Top1 lr=0.03", params={"lr": 0.03}),
            run_record("flexdemo", [8.0, 6.0, 5.7], seed=1, label="FlexDeMo Top1 lr=0.03", params={"lr": 0.03}),
            run_record("flexdemo", [8.0, 6.0, 6.5], seed=0, label="FlexDeMo Top1 lr=0.001", params={"lr": 1e-3})]
    results = quality.annotate_time_to_target({"runs": runs})
    assert results["target_loss"] == pytest.approx(5.1)  # the two-seed mean, not the one seed's 4.8
    assert "lr 0.03" in results["target_source"] and "mean over 2 seeds" in results["target_source"]
    assert "AdamW lr=0.001 ended lower, at its one seed" in results["target_source"]
    vs = quality.variants(runs)
    # ★: AdamW's one-seed lr ended lower than the two-seed mean: no lr of AdamW is called best.
    # FlexDeMo's two-seed lr is below its one-seed one: best, but said to be across seed counts.
    assert quality.best_lr(vs) == {"FlexDeMo Top1 lr=0.03": False}
    # A one-seed variant on either side: no spread claim.
    assert quality.exceeds_spread(vs[1], vs[0]) is None and quality.exceeds_spread(vs[3], vs[1]) is None
    headers, rows = time_to_target_rows(results)
    row = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    assert set(row) == {"AdamW lr=0.03", "AdamW lr=0.001", "FlexDeMo Top1 lr=0.03 ★ (across seed counts)",
                        "FlexDeMo Top1 lr=0.001"}
    assert row["AdamW lr=0.001"]["vs AdamW"] == "-0.300 (better; spread unknown (one seed))"
    assert row["FlexDeMo Top1 lr=0.001"]["vs AdamW"] == "+1.400 (worse; spread unknown (one seed))"
    assert row["FlexDeMo Top1 lr=0.03 ★ (across seed counts)"]["vs AdamW"] == "+0.550 (worse, beyond the seed spread)"
    # Like with like: two lrs at two seeds each give a plain ★.
    two = [*runs[:2], run_record("adamw", [8.0, 6.0, 5.5], seed=0, label="AdamW lr=0.01", params={"lr": 0.01}),
           run_record("adamw", [8.0, 6.0, 5.6], seed=1, label="AdamW lr=0.01", params={"lr": 0.01})]
    assert quality.best_lr(quality.variants(two)) == {"AdamW lr=0.03": True}
    # The reference against a one-seed AdamW (the only one): every comparison says the spread is unknown.
    solo = quality.annotate_time_to_target({"runs": [runs[2], *runs[3:5]]})
    headers, rows = time_to_target_rows(solo)
    assert "spread unknown (one seed)" in dict(zip(headers, rows[1], strict=True))["vs AdamW"]
    text = render_markdown({**results, "config": {}, "host": {}, "emulation": {}})
    assert "beyond the seed spread" not in text.split("AdamW lr=0.001 |")[1].split("\n")[0]
    assert ("- AdamW lr=0.001 (1 seed) ended below AdamW lr=0.03 (mean over 2 seeds): no lr of this method is "
            "marked best") in text
    assert "FlexDeMo Top1 lr=0.001 (1 seed) ended below" not in text
