"""The quality-per-byte frontier (lowband/bench/quality.py: frontier, pareto_front, knob_curves; its plot in
plots.py and its section in report.py), without training: bits per parameter per step, the Pareto front, verdicts,
curves, plot, report."""

from __future__ import annotations

import pytest

from lowband.bench import quality
from lowband.bench.record import RunRecord
from lowband.report.plots import FRONTIER_PLOT_FILE, write_plots
from lowband.report.render import frontier_rows, write_report
from lowband.train.methods import display_name, reference_method

PARAMS = 1_000_000
REF = reference_method()
#: AdamW's fp32 all-reduce between two nodes: 4 bytes per parameter per step.
FULL = 4.0 * PARAMS


def _run(method, label, loss, *, seed=0, nbytes=FULL, hp=None, status="ok", bw=1e8, ft=None):
    hp = {"lr": 1e-3, **(hp or {})}
    return RunRecord(
        id=f"{label}-{seed}-{bw:g}", label=label, method=method, params=dict(hp), hyperparameters=hp, seed=seed,
        shards=2, status=status, bandwidth_bps=bw, num_params=PARAMS, steps=20,
        val_loss=loss if status == "ok" else None, inter_node_bytes_per_step=nbytes, fault_tolerance=ft,
        val_history=[{"step": 0, "val_loss": 9.0, "tokens": 0, "train_time_s": 0.0},
                     {"step": 10, "val_loss": (loss or 9.0) + 1, "tokens": 100, "train_time_s": 5.0},
                     {"step": 20, "val_loss": loss, "tokens": 200, "train_time_s": 10.0}] if status == "ok" else None,
    )  # fmt: skip


def _seeds(method, label, losses, **kw):
    return [_run(method, label, loss, seed=i, **kw) for i, loss in enumerate(losses)]


def _bench() -> list[RunRecord]:
    ref = display_name(REF)
    return [
        *_seeds(REF, f"{ref} lr=0.001", [3.00, 3.10, 3.20]),
        _run(REF, f"{ref} lr=0.003", 2.90, hp={"lr": 3e-3}),  # one seed, lower: never the reference
        *_seeds("flexdemo", "FlexDeMo Top1", [3.05, 3.15, 3.25], nbytes=FULL / 2000, hp={"topk": 1, "chunk": 128}),
        *_seeds("flexdemo", "FlexDeMo Top4", [2.70, 2.75, 2.80], nbytes=FULL / 500, hp={"topk": 4, "chunk": 128}),
        *_seeds("flexdemo", "FlexDeMo Top16", [3.50, 3.60], nbytes=FULL / 125, hp={"topk": 16, "chunk": 128}),
        # lr differs from Top1 (same bytes: no curve), and lr and topk from Top4 (two knobs: no curve).
        *_seeds("flexdemo", "FlexDeMo Top1 lr=0.01", [3.3, 3.4], nbytes=FULL / 2000,
                hp={"topk": 1, "chunk": 128, "lr": 1e-2}),
        # Under fault tolerance, with faults: fewest bytes, lowest loss, yet never on the front.
        *_seeds("flexdemo", "FlexDeMo Top2 FT faults", [2.0, 2.1], nbytes=FULL / 10_000,
                hp={"topk": 2, "chunk": 128}, ft={"faults": ["node1:kill@5"]}),
        _run("diloco", "DiLoCo H=10", 4.0, nbytes=None, hp={"sync_every": 10}),  # no byte count
        _run("diloco", "DiLoCo H=20", None, status="failed", hp={"sync_every": 20}),
    ]  # fmt: skip


def _by_label(points):
    return {p.variant.label: p for p in points}


def test_bits_per_parameter_per_step_are_the_links_bytes_per_node_times_8_over_the_parameters() -> None:
    assert quality.bits_per_param_per_step(_run(REF, "a", 3.0)) == pytest.approx(32.0)
    assert quality.bits_per_param_per_step(_run(REF, "a", 3.0, nbytes=1000)) == pytest.approx(8e3 / PARAMS)
    assert quality.bits_per_param_per_step(_run(REF, "a", 3.0, nbytes=None)) is None
    no_params = _run(REF, "a", 3.0)
    no_params.num_params = None
    assert quality.bits_per_param_per_step(no_params) is None


def test_the_pareto_front_keeps_the_undominated_points_and_both_of_a_tie() -> None:
    points = [(1.0, 3.0), (2.0, 2.0), (2.0, 2.5), (3.0, 2.0), (1.0, 3.0), (0.5, 4.0), (0.5, 4.5)]
    # (2, 2.5): same bits, higher loss; (3, 2): more bits, same loss; (0.5, 4.5): same bits, higher loss.
    assert quality.pareto_front(points) == {0, 1, 4, 5}
    assert quality.pareto_front([(1.0, 1.0)]) == {0}
    assert quality.pareto_front([]) == set()


def test_the_frontier_has_one_point_per_variant_at_its_first_link_sorted_by_bits() -> None:
    runs = _bench() + _seeds(REF, f"{display_name(REF)} lr=0.001", [3.0, 3.1, 3.2], bw=1e7)  # a second link
    points, reference, left_out = quality.frontier(runs)
    assert reference.label == f"{display_name(REF)} lr=0.001" and len(reference.ok) == 3
    assert [p.bits for p in points] == sorted(p.bits for p in points)
    assert len([p for p in points if p.variant.label == reference.label]) == 1
    assert {v.label for v in left_out} == {"DiLoCo H=10", "DiLoCo H=20"}
    by = _by_label(points)
    assert by["FlexDeMo Top1"].bits == pytest.approx(32.0 / 2000)
    assert by["FlexDeMo Top4"].loss == pytest.approx((2.75, 2.70, 2.80))
    front = {p.variant.label for p in points if p.on_front}
    # Top1 lr=0.01: as many bits as Top1, higher loss; Top16 and both AdamW: more bits than Top4 and a higher
    # loss. The faulted variant has fewer bits and a lower loss than all, yet is never on the front.
    assert front == {"FlexDeMo Top1", "FlexDeMo Top4"}


def test_verdicts_judge_only_against_a_spread_and_never_a_single_seed() -> None:
    _, headers, rows = frontier_rows({"runs": _bench()})
    table = {row[0]: dict(zip(headers, row, strict=True)) for row in rows}
    name = display_name(REF)
    assert table[f"{name} lr=0.001"]["verdict"] == "reference"
    assert table["FlexDeMo Top1"]["verdict"] == "within the reference's spread"
    assert table["FlexDeMo Top1"][f"bytes ÷ {name}'s"] == "1/2,000"
    assert table["FlexDeMo Top4"][f"bytes ÷ {name}'s"] == "1/500"
    assert table["FlexDeMo Top16"]["verdict"] == "above by 0.450 (beyond the spread)"
    assert table["FlexDeMo Top16"][f"Δ vs {name}"] == "+0.450"
    assert table["FlexDeMo Top4"]["verdict"] == "below by 0.350 (beyond the spread)"
    assert table["FlexDeMo Top1 lr=0.01"]["verdict"] == "above by 0.250 (beyond the spread)"
    assert table[f"{name} lr=0.003"]["verdict"] == "one seed: no spread claim"
    assert table["FlexDeMo Top2 FT faults"]["Pareto front"] == "no (faulted)"
    assert table["DiLoCo H=20"]["verdict"] == "failed" and table["DiLoCo H=10"]["verdict"] == "no byte count"
    # Sorted by bits, the variants without a byte count last.
    assert [row[0] for row in rows][:2] == ["FlexDeMo Top2 FT faults", "FlexDeMo Top1"]
    assert [row[0] for row in rows][-2:] == ["DiLoCo H=10", "DiLoCo H=20"]

    # A reference with one seed: no variant is within or beyond it, whatever its own seeds.
    alone = [_run(REF, name, 3.0), *_seeds("flexdemo", "FlexDeMo Top1", [3.0, 3.1], nbytes=FULL / 2000)]
    line, headers, rows = frontier_rows({"runs": alone})
    verdicts = [dict(zip(headers, row, strict=True))["verdict"] for row in rows]
    assert verdicts == ["the reference ran one seed: no spread claim", "reference"]
    assert "no spread" in line and "spread of" not in line


def test_a_methods_curve_joins_only_variants_that_differ_in_one_knob_that_changes_the_bytes() -> None:
    points, _, _ = quality.frontier(_bench())
    curves = [(knob, [p.variant.label for p in members]) for knob, members in quality.knob_curves(points)]
    assert curves == [("topk", ["FlexDeMo Top1", "FlexDeMo Top4", "FlexDeMo Top16"])]
    # Two lrs of AdamW send the same bytes: no curve; nor do runs that differ in shards besides.
    sharded = _run("flexdemo", "FlexDeMo Top8", 3.0, nbytes=FULL / 250, hp={"topk": 8, "chunk": 128})
    sharded.shards = 4
    points, _, _ = quality.frontier([*_bench(), sharded])
    assert [len(m) for _, m in quality.knob_curves(points)] == [3]


def test_the_plot_is_written_and_the_table_heads_its_section_of_the_report(tmp_path) -> None:
    # (A finished run without a byte count is left out here: the modelled table needs one.)
    runs = [r for r in _bench() if r.status != "ok" or r.inter_node_bytes_per_step is not None]
    results = quality.annotate_time_to_target({"runs": runs})
    report = write_report(tmp_path, results).read_text()
    png = tmp_path / FRONTIER_PLOT_FILE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    section = report[report.index("## Quality per byte"):]
    assert section.index(f"![frontier]({FRONTIER_PLOT_FILE})") < section.index("| Run |")
    assert report.count(f"({FRONTIER_PLOT_FILE})") == 1  # not among the plots at the top as well
    assert f"Reference: **{display_name(REF)} lr=0.001**" in section and "3 seeds" in section
    assert "| FlexDeMo Top1 | 3/3 | 0.016 | 1/2,000 |" in section

    # One variant with a finished run: nothing to set it against, no plot, no section.
    lone = tmp_path / "lone"
    lone.mkdir()
    results = quality.annotate_time_to_target({"runs": _seeds(REF, display_name(REF), [3.0, 3.1]) + [
        _run("diloco", "DiLoCo H=20", None, status="failed")]})  # fmt: skip
    assert FRONTIER_PLOT_FILE not in [p.name for p in write_plots(results, lone)]
    assert "Quality per byte" not in write_report(lone, results).read_text()
