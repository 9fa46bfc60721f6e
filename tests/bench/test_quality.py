"""Time to quality without training: target, interpolated crossings, seeds, best lr, presets, modelled times."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

import lowband.bench as bench
from lowband.bench import quality
from lowband.bench.config import PRESETS, make_config, plan_runs
from lowband.bench.record import RunRecord
from lowband.bench.report import modelled_rows, render_markdown, time_to_target_rows
from lowband.traffic import OpTally


def _history(losses, *, dt=2.0, tokens=1000, every=10):
    return [{"step": i * every, "epoch": 0, "tokens": i * tokens, "train_time_s": i * dt, "wall_s": i * dt + 5,
             "val_loss": v} for i, v in enumerate(losses)]  # fmt: skip


def _run(method, losses, *, seed=0, label=None, params=None, dt=2.0, bw=1e8, nbytes=1e6, compute=0.1, ops=1):
    params = dict(params or {})
    history = _history(losses, dt=dt)
    steps = history[-1]["step"]
    return RunRecord(
        id=f"{method}-{seed}", label=label or method, method=method, params=params, shards=2,
        hyperparameters={"lr": params.get("lr", 1e-3)}, seed=seed, status="ok", bandwidth_bps=bw,
        latency_s=0.05, nodes=2, ranks_per_node=2, replicas=2, steps=steps,
        val_loss=losses[-1], val_history=history, train_time_s=history[-1]["train_time_s"], step_time_s=compute + 0.5, compute_time_s=compute,
        inter_node_bytes_per_step=nbytes, link_ops={"all_gather": OpTally(count=4 * steps * ops)},
    )  # fmt: skip


def test_crossing_is_interpolated_between_validations() -> None:
    hist = _history([8.0, 6.0, 4.0])  # steps 0, 10, 20; times 0, 2, 4
    hit = quality.crossing(hist, 5.0)
    assert hit.step == pytest.approx(15.0) and hit.train_time_s == pytest.approx(3.0) and hit.tokens == 1500
    assert quality.crossing(hist, 6.0).step == 10.0  # exactly at a validation
    assert quality.crossing(hist, 3.9) is None
    # The first crossing counts, even if the loss rises again later.
    assert quality.crossing(_history([8.0, 5.0, 7.0, 4.0]), 6.0).step == pytest.approx(10 * 2 / 3)


def test_target_is_best_adamw_mean_over_seeds_and_runs_are_timed_to_it() -> None:
    runs = [
        _run("adamw", [8.0, 6.0, 5.0], seed=0, label="AdamW lr=0.001", params={"lr": 1e-3}),
        _run("adamw", [8.0, 6.0, 5.2], seed=1, label="AdamW lr=0.001", params={"lr": 1e-3}),
        _run("adamw", [8.0, 7.0, 6.0], seed=0, label="AdamW lr=0.0003", params={"lr": 3e-4}),
        _run("flexdemo", [8.0, 5.0, 4.0], seed=0, label="FlexDeMo Top1", dt=1.0),
        _run("flexdemo", [8.0, 5.5, 4.5], seed=1, label="FlexDeMo Top1", dt=1.0),
        _run("diloco", [8.0, 7.0, 6.5], label="DiLoCo H=10"),
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
    assert runs[5].adamw_steps_to_final == pytest.approx(7.5) and runs[5].adamw_time_to_final_s == pytest.approx(1.5)
    assert row["DiLoCo H=10"]["at its final loss: AdamW time ÷ this"] == "0.38×"
    # FlexDeMo ends below where either AdamW seed got: no AdamW time to compare with.
    assert row["FlexDeMo Top1"]["at its final loss: AdamW time ÷ this"] == "not every AdamW seed got this low (2/2 seeds)"
    assert runs[0].adamw_time_to_final_s is None  # AdamW's own runs are the reference
    one = quality.annotate_time_to_target({"runs": [_run("adamw", [8.0, 6.0, 5.0], label="AdamW"),
                                                    _run("deto-full", [8.0, 6.0, 4.5], label="Deto-Full")]})
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
    adamw = _run("adamw", [8, 6, 5], nbytes=8e6, compute=0.3)  # 64 Mbit per step at 100 Mbit/s: 0.64 s
    flex = _run("flexdemo", [8, 7, 6, 5.5, 5], nbytes=5e4, compute=0.3)
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


def test_seeds_multiply_the_runs_seed_major() -> None:
    config = make_config(methods="adamw,flexdemo", seeds="0,1,2", steps=5, model="t5-tiny")
    plans = plan_runs(config)
    assert [(p.method, p.seed) for p in plans] == [
        ("adamw", 0), ("flexdemo", 0), ("adamw", 1), ("flexdemo", 1), ("adamw", 2), ("flexdemo", 2)]
    assert len({p.id for p in plans}) == 6
    argv = plans[3].train_args(config, __import__("pathlib").Path("/x"))
    assert argv[argv.index("--seed") + 1] == "1"
    assert config.as_dict()["seeds"] == [0, 1, 2]
    for bad, words in (("0,x", "'x' is not an integer"), ("1,1", "names a seed twice")):
        with pytest.raises(ValueError, match=words):
            make_config(methods="adamw", seeds=bad, steps=5, model="t5-tiny")


def test_nseeds_runs_a_variant_at_the_first_seeds_only() -> None:
    config = make_config(methods=["adamw:lr=0.001,nseeds=1", "flexdemo"], seeds="0,1", steps=5, model="t5-tiny")
    plans = plan_runs(config)
    assert [(p.method, p.seed) for p in plans] == [("adamw", 0), ("flexdemo", 0), ("flexdemo", 1)]
    assert "nseeds" not in plans[0].params  # a bench key: it never reaches the trainer
    assert "--nseeds" not in " ".join(plans[0].train_args(config, __import__("pathlib").Path("/x")))
    with pytest.raises(ValueError, match="nseeds=3 exceeds the 2 seed"):
        make_config(methods="adamw:nseeds=3", seeds="0,1", steps=5, model="t5-tiny")
    with pytest.raises(ValueError, match="nseeds must be >= 1"):
        make_config(methods="adamw:nseeds=0", seeds="0,1", steps=5, model="t5-tiny")


def test_meaningless_benches_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as err:
        make_config(methods="diloco,noloco", steps=40, model="t5-tiny")  # registry H = 50 > 40 steps
    assert "no outer step ever happens" in str(err.value) and "diloco:H=" in str(err.value)
    make_config(methods="diloco:H=10", steps=40, model="t5-tiny")
    with pytest.raises(ValueError, match="positive validation loss"):
        make_config(methods="adamw", steps=5, model="t5-tiny", target_loss=-1.0)


def test_a_run_that_ends_between_outer_steps_is_warned_about_with_the_fix(caplog) -> None:
    from lowband.train.config import TrainConfig

    with caplog.at_level("WARNING"):
        make_config(methods="diloco:H=20,noloco:H=10", steps=150, model="t5-tiny")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1  # NoLoCo's H=10 divides 150
    assert "diloco:H=20" in warned[0] and "last 10 inner steps are never merged" in warned[0]
    assert "--steps 140 or 160" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        make_config(methods="diloco:H=20", steps=140, model="t5-tiny")
        TrainConfig.from_tables({"method": {"name": "diloco", "sync_every": 20}, "schedule": {"steps": 140}}).validate()
    assert not caplog.records
    with caplog.at_level("WARNING"):
        TrainConfig.from_tables({"method": {"name": "noloco", "sync_every": 20}, "schedule": {"steps": 50}}).validate()
    assert ["--steps 40 or 60" in r.getMessage() for r in caplog.records] == [True]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_preset_settings_and_the_users_options_win() -> None:
    preset = PRESETS["quality"]
    config = bench.config_from_args(_args("--preset", "quality"))
    assert config.preset == "quality" and config.steps == preset.settings["steps"]
    assert len(config.seeds) >= 2 and config.bandwidths_bps == (1e8,)
    assert [str(m) for m in config.methods] == list(preset.settings["methods"])
    assert {m.name for m in config.methods} >= {"adamw", "deto-full", "demo", "flexdemo", "diloco", "noloco"}
    config = bench.config_from_args(_args("--preset", "quality", "--steps", "60", "--seeds", "5",
                                          "--train-args=--val-every 7"))  # fmt: skip
    assert config.steps == 60 and config.seeds == (5,)
    assert config.train_args[-2:] == ("--val-every", "7")  # the user's train args come last and win


def test_a_variant_that_misses_the_target_is_explained_by_loss_and_time_per_step() -> None:
    from lowband.bench.report import why_not_reached_notes

    runs = [_run("adamw", [8.0, 6.0, 5.0], label="AdamW", compute=0.5),
            _run("flexdemo", [8.0, 6.5, 5.5], label="FlexDeMo Top1", dt=1.0, compute=0.6),
            _run("diloco", [8.0, 5.5, 4.5], label="DiLoCo H=10", dt=1.0)]
    for r, exposed in zip(runs, (0.7, 0.01, 0.0), strict=True):
        r.exposed_comm_time_s = exposed
    results = quality.annotate_time_to_target({"runs": runs})
    notes = why_not_reached_notes(results)
    assert len(notes) == 1  # DiLoCo reached the target; AdamW is the reference
    assert notes[0].startswith("FlexDeMo Top1 did not reach the target in 20 steps: it ends +0.500")
    assert "computes 0.600 s and waits 0.010 s on the link, against 0.500 s and 0.700 s for AdamW" in notes[0]
    assert "its loss per step is what it lacks" in notes[0]
    assert "FlexDeMo Top1 did not reach" in render_markdown(results)
    # Two seeds each, and the variant's range overlaps AdamW's: it misses the mean by seed noise.
    runs = [_run("adamw", [8.0, 6.0, 5.0], seed=0, label="AdamW"), _run("adamw", [8.0, 6.0, 5.4], seed=1, label="AdamW"),
            _run("flexdemo", [8.0, 6.0, 5.3], seed=0, label="Top8"), _run("flexdemo", [8.0, 6.2, 5.5], seed=1, label="Top8")]
    notes = why_not_reached_notes(quality.annotate_time_to_target({"runs": runs}))
    assert len(notes) == 1 and notes[0].startswith("Top8 did not reach the target in 20 steps: it ends +0.200")
    assert "within the seed spread, so it misses the target (a mean over seeds) by seed noise" in notes[0]
    assert "what it lacks" not in notes[0]


def test_group_size_and_data_columns_are_refused_before_any_process_starts(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"group size n=4 exceeds the 2 replicas.*use n <= 2"):
        make_config(methods="noloco:H=5,n=4", steps=10, model="t5-tiny")
    make_config(methods="noloco:H=5,n=4", steps=10, model="t5-tiny", nodes=4, ranks_per_node=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": "x", "b": "y"}\n')
    with pytest.raises(ValueError, match=r"no source column 'source' \(its first row has: a, b\).*--source-column"):
        make_config(methods="adamw", steps=5, model="t5-tiny", data=str(bad))
    make_config(methods="adamw", steps=5, model="t5-tiny", data=str(bad),
                train_args="--source-column a --target-column=b")
    csv_file = tmp_path / "pairs.csv"
    csv_file.write_text("source,summary\nx,y\n")
    with pytest.raises(ValueError, match="no target column 'target'"):
        make_config(methods="adamw", steps=5, model="t5-tiny", data=str(csv_file))


def test_overlapping_and_compressed_variants_are_set_beside_their_plain_twin() -> None:
    from lowband.bench.report import hiding_rows
    from lowband.train.methods import METHODS

    def local(label, losses, seed, nbytes, sync, **hiding):
        run = _run("diloco", losses, seed=seed, label=label, nbytes=nbytes, params={"lr": 3e-3, **hiding})
        run.hyperparameters = {**METHODS["diloco"].hyperparameters, "lr": 3e-3, "sync_every": 20, **hiding}
        run.sync_time_s = sync
        return run

    runs = [local("DiLoCo", [8, 6, 5.00], 0, 8e5, 0.7), local("DiLoCo", [8, 6, 5.10], 1, 8e5, 0.8),
            local("DiLoCo overlap", [8, 6, 5.05], 0, 8e5, 0.001, overlap=True),
            local("DiLoCo overlap", [8, 6, 5.08], 1, 8e5, 0.003, overlap=True),
            local("DiLoCo int8", [8, 6, 5.30], 0, 2e5, 0.5, values="int8", quant_block=128),
            local("DiLoCo int8", [8, 6, 5.40], 1, 2e5, 0.5, values="int8", quant_block=128)]
    # A compressed variant at another lr has no plain twin in this bench: it is left out.
    other_lr = local("DiLoCo int4 lr", [8, 6, 5.2], 0, 1e5, 0.4, values="int4")
    other_lr.hyperparameters["lr"] = 1e-2
    vs = quality.variants([*runs, other_lr])
    assert quality.plain_variant(vs[0], vs) is None  # the plain one itself
    assert quality.plain_variant(vs[1], vs) is vs[0] and quality.plain_variant(vs[2], vs) is vs[0]
    assert quality.plain_variant(vs[3], vs) is None
    headers, rows = hiding_rows({"runs": [*runs, other_lr]})
    row = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    assert set(row) == {"DiLoCo overlap", "DiLoCo int8"}
    assert row["DiLoCo overlap"]["Δ loss"] == "+0.015 (within the seed spread)"
    assert row["DiLoCo int8"]["Δ loss"] == "+0.300 (worse, beyond the seed spread)"
    assert row["DiLoCo overlap"]["exposed s per exchange (this / plain)"] == "0.002 / 0.750"
    assert row["DiLoCo int8"]["plain bytes ÷ this"] == "4.00×"
    assert "## Hiding and compressing the link" in render_markdown({"runs": runs, "config": {}, "host": {},
                                                                    "emulation": {}})  # fmt: skip


def test_loss_plots_leave_curves_that_end_far_above_the_others_off_the_zoomed_axis() -> None:
    from matplotlib.figure import Figure

    from lowband.bench.plots import _outliers, _zoom

    assert _outliers([6.75, 6.85, 6.90, 6.78, 6.97, 6.94, 7.69, 7.99]) == {6, 7}
    assert _outliers([6.8, 6.9, 7.0]) == set()  # too few curves to call one an outlier
    curve = [(float(i), 9.0 - i * 0.3, 9.0 - i * 0.3, 9.0 - i * 0.3) for i in range(10)]
    far = [(x, m + 1.5, lo + 1.5, hi + 1.5) for x, m, lo, hi in curve]
    ax = Figure().add_subplot()
    zoomed, high = _zoom(ax, [curve, curve, curve, far], target=6.5)
    assert zoomed and high == {3}
    bottom, top = ax.get_ylim()
    assert top < far[2][3] and top == pytest.approx(curve[2][3] + 0.05 * (curve[2][3] - 6.3))
    assert bottom == pytest.approx(6.3 - 0.05 * (curve[2][3] - 6.3))


def test_speedup_at_equal_loss_compares_at_the_target_or_else_at_the_runs_own_final_loss(tmp_path) -> None:
    adamw = [_run("adamw", [8, 6, 5], seed=s, nbytes=8e6, compute=0.3) for s in (0, 1)]  # target 5.0 at step 20
    flex = _run("flexdemo", [8, 7, 6, 5.5, 5], nbytes=5e4, compute=0.3)  # reaches 5.0 at step 40
    short = _run("flexdemo", [8, 7, 5.5], seed=2, label="FlexDeMo short", nbytes=5e4)  # ends at 5.5: AdamW's step 15
    low = _run("diloco", [8, 7, 4.0], label="DiLoCo", nbytes=5e4, params={"delay": 1})  # target at step 16.7
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
    missed_low = dataclasses.replace(short, steps_to_target=None, adamw_steps_to_final=None)
    assert quality.equal_loss_steps(missed_low, adamw) is None
    assert quality.modelled_speedup_at_equal_loss(missed_low, adamw, c) is None

    from lowband.bench.plots import PLOT_FILES, write_plots

    paths = write_plots(results, tmp_path)
    assert "speedup_at_equal_loss_modelled.png" in PLOT_FILES
    assert (tmp_path / "speedup_at_equal_loss_modelled.png") in paths
    assert (tmp_path / "speedup_at_equal_loss_modelled.png").stat().st_size > 1000


def test_a_one_seed_variant_is_neither_the_target_nor_a_spread_to_judge_against() -> None:
    # The quality preset's AdamW: lr 0.03 at two seeds, the paper's lr 0.001 at one (nseeds=1), which ends lower.
    runs = [_run("adamw", [8.0, 6.0, 5.0], seed=0, label="AdamW lr=0.03", params={"lr": 0.03}),
            _run("adamw", [8.0, 6.0, 5.2], seed=1, label="AdamW lr=0.03", params={"lr": 0.03}),
            _run("adamw", [8.0, 6.0, 4.8], seed=0, label="AdamW lr=0.001", params={"lr": 1e-3}),
            _run("flexdemo", [8.0, 6.0, 5.6], seed=0, label="FlexDeMo Top1 lr=0.03", params={"lr": 0.03}),
            _run("flexdemo", [8.0, 6.0, 5.7], seed=1, label="FlexDeMo Top1 lr=0.03", params={"lr": 0.03}),
            _run("flexdemo", [8.0, 6.0, 6.5], seed=0, label="FlexDeMo Top1 lr=0.001", params={"lr": 1e-3})]
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
    two = [*runs[:2], _run("adamw", [8.0, 6.0, 5.5], seed=0, label="AdamW lr=0.01", params={"lr": 0.01}),
           _run("adamw", [8.0, 6.0, 5.6], seed=1, label="AdamW lr=0.01", params={"lr": 0.01})]
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


def _config(*argv: str) -> dict:
    return bench.config_from_args(_args(*argv)).as_dict()


def _head(cfg: dict) -> str:
    """The report's set-up part: everything before the first section."""
    return render_markdown({"config": cfg, "host": {}, "emulation": {}, "runs": []}).split("No run was recorded")[0]


def test_the_report_describes_the_data_and_model_that_ran_not_the_presets(tmp_path) -> None:
    data = tmp_path / "my_texts.txt"
    data.write_text("one text\nanother text\n")
    head = _head(_config("--preset", "quality", "--data", str(data), "--model", "gpt-mini"))
    assert "Model gpt-mini on `my_texts.txt`, 128 tokens per text, 140 steps, seeds 0, 1" in head
    assert "from the preset: methods, link, steps, seeds, train args" in head
    assert "overridden on the command line: model gpt-mini (preset: t5-mini); data `my_texts.txt` " \
           "(preset: the embedded corpus)" in head
    # Nothing that holds only for the embedded data and t5-mini, and no "best lr" claim.
    for embedded_only in ("6.84", "unigram", "Wikipedia pairs (64/16 tokens), 140", "at its best lr from"):
        assert embedded_only not in head
    # The preset as it is: its description and the embedded data's facts.
    head = _head(_config("--preset", "quality"))
    assert "Model t5-mini on the embedded corpus, 64 source / 16 target tokens, 140 steps" in head
    assert "Preset `quality`, as it is:" in head and "unigram cross-entropy is 6.84 nats" in head
    # Other settings overridden, same data and model: the overrides are named, the data's facts still hold.
    head = _head(_config("--preset", "quality", "--steps", "60", "--train-args=--val-every 7"))
    assert "overridden on the command line: steps 60 (preset: 140); train args --val-every 7 added" in head
    assert "6.84 nats" in head and "as it is" not in head
    # Other target lengths: the unigram figure of 16 target tokens no longer holds.
    assert "6.84" not in _head(_config("--preset", "quality", "--train-args=--max-target-len 32"))
    # No preset: no preset text at all.
    head = _head(_config("--steps", "5", "--model", "t5-tiny", "--methods", "adamw"))
    assert "Preset" not in head and "Model t5-tiny on the embedded corpus, 128 source / 32 target tokens" in head


def test_the_lr_caveat_appears_exactly_when_data_or_model_differ_from_the_tuning_ones(tmp_path) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"source": "a b", "target": "a"}\n')
    caveat = "The preset's lrs were tuned on t5-mini on the embedded Wikipedia pairs"
    for argv, expected in ((("--preset", "quality"), False),
                           (("--preset", "quality", "--steps", "60", "--seeds", "3"), False),
                           (("--preset", "quality", "--data", str(data)), True),
                           (("--preset", "quality", "--model", "t5-tiny"), True),
                           (("--preset", "quality", "--model", "gpt-mini", "--data", str(data.with_suffix(".txt"))), True)):
        if argv[-1].endswith(".txt"):
            data.with_suffix(".txt").write_text("a b\n")
        head = _head(_config(*argv))
        assert (caveat in head) is expected, argv
        if expected:
            assert "not on this run's" in head and "adamw:lr=0.001 adamw:lr=0.003" in head
    # Methods of the user's own (their own lrs): the preset's tuning says nothing about them.
    assert caveat not in _head(_config("--preset", "quality", "--model", "t5-tiny", "--methods", "adamw:lr=0.01"))
