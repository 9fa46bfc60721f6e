"""lowband/report/faults.py: the report's fault-tolerance rows, a faulted run beside its fault-free twin, ft on beside off."""

from __future__ import annotations

import pytest

from lowband.bench.record import RunRecord
from lowband.report.faults import cost_rows, fault_events, fault_rows, ft_section, screened_rows


def _run(label, *, faults=None, loss, seed=0, step_time=0.1, bytes_=1e5, ft=None):
    return RunRecord(label=label, method="flexdemo", shards=2, seed=seed, bandwidth_bps=1e8, status="ok",
                     val_loss=loss, step_time_s=step_time, inter_node_bytes_per_step=bytes_, nodes=3,
                     val_history=[{"step": 0, "val_loss": 9.0}, {"step": 50, "val_loss": loss}],
                     fault_tolerance=ft if ft is not None else ({"faults": faults} if faults else None))


def _faulted_ft():
    t_kill, t_start = 1000.0, 1020.0
    return {
        "faults": ["node2:kill@10", "node1:intrude@15", "node2:start@20"], "steady_node": 0,
        "events": [
            {"event": "start", "node": 0, "unix_s": 990.0},
            {"event": "kill", "node": 2, "unix_s": t_kill, "planned": "node2:kill@10", "job_step": 10, "t_s": 10.0},
            {"event": "intrude", "node": 1, "name": "intruder1", "unix_s": t_kill + 5, "planned": "node1:intrude@15",
             "job_step": 15, "t_s": 15.0, "exit": 1, "refused": True, "why": "node 1 is refused by the job at ..."},
            {"event": "start", "node": 2, "unix_s": t_start, "planned": "node2:start@20", "job_step": 20, "t_s": 30.0},
        ],
        "nodes": {
            "0": {"membership": [{"step": 11, "replicas": 2, "was": 3, "quorum_s": 1.1, "unix_s": t_kill + 1.3}],
                  "replicas_by_step": [[10, 3, False], [11, 3, True], [12, 2, False]],
                  "end": {"dropped_steps": 1, "healed": []}},
            "2": {"membership": [], "replicas_by_step": [],
                  "end": {"dropped_steps": 0,
                          "healed": [{"step": 35, "unix_s": t_start + 15.0, "bytes": 2_500_000, "quorum_s": 0.2}]}},
        },
    }


def test_fault_report_rows_set_a_faulted_run_beside_its_twin():
    runs = [_run("FlexDeMo Top1 FT", loss=7.00, ft={"faults": []}),
            _run("FlexDeMo Top1 FT faults", loss=7.05, ft=_faulted_ft())]
    results = {"runs": runs}
    evs = fault_events(runs[1])
    assert evs[0]["detect_s"] == pytest.approx(1.3) and evs[0]["resumed_step"] == 11
    assert evs[1]["refused"] is True and evs[1]["exit"] == 1
    assert evs[2]["healed_step"] == 35 and evs[2]["heal_mb"] == pytest.approx(2.5)
    headers, rows = fault_rows(results)
    (row,) = rows
    assert row[3] == "1"  # steps dropped
    assert "node2:kill@10: 1.30" in row[4] and "node2:start@20: 35, 2.50, 0.20" in row[5]
    assert row[6] == "node1:intrude@15: refused"
    assert row[7:10] == ["7.0500", "7.0000", "+0.0500"]
    assert row[10] == "one seed: unknown"  # no claim about a spread that was not measured
    assert any("## Faults" in line for line in ft_section(results))


def test_a_poisoner_the_gate_removed_is_named_in_the_faults_row():
    ft = _faulted_ft()
    ft["faults"].append("node1:poison-index@30")
    ft["events"].append({"event": "poison-index", "node": 1, "planned": "node1:poison-index@30", "job_step": 30,
                         "unix_s": 990.0, "t_s": None,
                         "removed": "node 1 is removed from the job at http://x: ... nodes 0, 2 ... reported"})
    runs = [_run("FlexDeMo Top1 FT", loss=7.00, ft={"faults": []}),
            _run("FlexDeMo Top1 FT faults", loss=7.05, ft=ft)]
    assert fault_events(runs[1])[-1]["removed"].startswith("node 1 is removed from the job")
    (row,) = fault_rows({"runs": runs})[1]
    assert row[6] == ("node1:intrude@15: refused; "
                      "node1:poison-index@30: removed from the quorum (the others reported its bad messages)")
    ft["events"][-1].pop("removed")  # a poisoner that was not removed (a flip under agree, or 2 nodes): not named
    (row,) = fault_rows({"runs": runs})[1]
    assert row[6] == "node1:intrude@15: refused"


def test_cost_rows_compare_ft_on_with_off_side_by_side():
    runs = [_run("AdamW", loss=7.0, step_time=0.20, bytes_=2e6),
            _run("AdamW FT", loss=7.0, step_time=0.21, bytes_=2e6, ft={"faults": []})]
    headers, rows = cost_rows({"runs": runs})
    assert rows == [["AdamW", "0", "100 Mbit/s", "0.200", "0.210", "1.050", "2.0000", "2.0000", "1.000"]]


def test_what_the_exchange_refused_is_reported_by_member_for_any_run():
    """A run whose exchange refused messages, clipped or left out updates, or evicted a member gets a row (fault
    tolerance or not); a run whose exchange used everything gets none."""
    clean = _run("DeMo Top2", loss=5.57)
    clean.screened = {"bad_messages": {}, "clipped": {}, "left_out": {}, "evicted": [], "aggregations": 0}
    agree = _run("DeMo Top2 aggregate=agree", loss=5.66, seed=1)
    agree.screened = {"bad_messages": {}, "clipped": {"0": 2}, "left_out": {"1": 146}, "evicted": [],
                      "aggregations": 151}
    refused = _run("SparseLoCo", loss=6.1, ft=_faulted_ft())
    refused.screened = {"bad_messages": {"2": 4}, "clipped": {}, "left_out": {}, "evicted": [2], "aggregations": 0}
    headers, rows = screened_rows({"runs": [clean, agree, refused]})
    assert rows == [
        ["DeMo Top2 aggregate=agree", "1", "–", "–", "member 0: 2 of 151", "member 1: 146 of 151", "–", "5.6600"],
        ["SparseLoCo", "0", "node2:kill@10, node1:intrude@15, node2:start@20", "member 2: 4", "–", "–", "member 2",
         "6.1000"],
    ]
    assert "## What the exchange refused" in "\n".join(ft_section({"runs": [clean, agree]}))
    assert not any("What the exchange refused" in line for line in ft_section({"runs": [clean]}))


def test_the_fault_plot_draws_each_faulted_run_its_difference_to_the_twin_and_the_twins_seed_spread(tmp_path):
    from lowband.report.faults import fault_plot

    runs = [_run("FlexDeMo Top1 FT", loss=7.00, ft={"faults": []}),
            _run("FlexDeMo Top1 FT", loss=7.02, seed=1, ft={"faults": []}),
            _run("FlexDeMo Top1 FT faults", loss=7.05, ft=_faulted_ft())]
    path = fault_plot({"runs": runs}, tmp_path / "faults.png")
    assert path.stat().st_size > 10_000
    assert fault_plot({"runs": runs[:2]}, tmp_path / "none.png") is None  # no faulted run: no plot
