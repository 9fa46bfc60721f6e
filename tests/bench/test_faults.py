"""lowband/bench/faults.py: the fault plan syntax (steps and times) and its refusals."""

from __future__ import annotations

import pytest

from lowband.bench.faults import FaultEvent, parse_faults


def test_fault_plan_parses_steps_and_times():
    plan = parse_faults("node1:kill@30, node1:start@60,node2:kill@90s", nodes=3, steps=100)
    assert plan == (FaultEvent(node=1, action="kill", step=30), FaultEvent(node=1, action="start", step=60),
                    FaultEvent(node=2, action="kill", at_s=90.0))
    assert str(plan[2]) == "node2:kill@90s"
    assert parse_faults("node0:kill@1.5m", nodes=2)[0].at_s == 90.0


@pytest.mark.parametrize("text, needle", [
    ("node1:explode@3", "cannot read"),
    ("node3:kill@3", "names node 3, but the bench has nodes 0..2"),
    ("node1:start@3", "starts node 1, which is running"),
    ("node1:kill@3,node1:kill@5", "kills node 1, which is not running"),
    ("node0:kill@3,node1:kill@4,node2:kill@5", "would kill the last live node"),
    ("node1:kill@300", "runs have 100 steps"),
    ("node1:kill@30,node1:start@10", "list events in the order"),
    ("node1:kill@2.5", "a step is a whole number"),
    ("node1:poison@30s", "poisons from a step on"),
    ("node1:poison@3,node2:poison-flip@5", "a second poison event"),
    ("", "no event given"),
])
def test_bad_fault_plans_are_named(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_faults(text, nodes=3, steps=100)


def test_a_poison_event_is_carried_out_by_the_node_itself_through_lowband_train():
    from lowband.bench.faults import poison_of

    plan = parse_faults("node1:kill@10,node1:start@20,node2:poison-flip@30", nodes=3, steps=100)
    assert [e.poison for e in plan] == [None, None, "node2:flip@30"]
    assert poison_of(plan) == "node2:flip@30" and str(plan[2]) == "node2:poison-flip@30"
    assert poison_of(parse_faults("node0:poison@5", nodes=2)) == "node0:scale@5"
    assert poison_of(parse_faults("node0:kill@5", nodes=2)) is None


def test_a_poison_plan_is_refused_for_a_method_whose_gradients_are_all_reduced():
    from lowband.bench.config import BenchConfig

    with pytest.raises(ValueError, match="adamw's gradients are all-reduced"):
        BenchConfig.from_tables({"bench": {"methods": ["adamw", "diloco:H=5"], "nodes": 3, "faults": "node2:poison@10",
                                           "steps": 40}})


def test_an_intruder_takes_a_live_or_a_free_slot_and_changes_no_node():
    plan = parse_faults("node1:intrude@5,node2:kill@10,node2:intrude@15,node2:start@20,node2:intrude@40s",
                        nodes=3, steps=100)
    assert [(e.action, e.node) for e in plan] == [("intrude", 1), ("kill", 2), ("intrude", 2), ("start", 2),
                                                  ("intrude", 2)]
    assert all(e.poison is None for e in plan) and str(plan[0]) == "node1:intrude@5"
    with pytest.raises(ValueError, match="names node 3"):
        parse_faults("node3:intrude@5", nodes=3)


def test_an_intruder_is_checked_refused_by_its_exit_and_its_log(tmp_path):
    from lowband.bench.runner import _check_intruders

    (tmp_path / "intruder1.log").write_text("...\nRuntimeError: node 2 is refused by the job at http://x: no member "
                                            "proves its secret\n")
    (tmp_path / "intruder2.log").write_text("step 10 loss 5.2\n")
    events = [{"event": "kill", "node": 2},
              {"event": "intrude", "node": 2, "name": "intruder1", "exit": 1, "planned": "node2:intrude@5"},
              {"event": "intrude", "node": 1, "name": "intruder2", "exit": 0, "planned": "node1:intrude@9"},
              {"event": "intrude", "node": 1, "name": "intruder3", "exit": None, "planned": "node1:intrude@12"}]
    admitted = _check_intruders(events, tmp_path)
    assert events[1]["refused"] and events[1]["why"].startswith("node 2 is refused by the job")
    assert not events[2]["refused"] and not events[3]["refused"]
    assert len(admitted) == 2 and "node1:intrude@9 (exit 0)" in admitted[0]
    assert "still running when the job ended" in admitted[1]


def test_malformed_poison_events_map_to_lowband_train_and_index_needs_indices():
    from lowband.bench.config import BenchConfig
    from lowband.bench.faults import poison_of

    assert poison_of(parse_faults("node1:poison-nan@7", nodes=3)) == "node1:nan@7"
    assert poison_of(parse_faults("node1:poison-index@7", nodes=3)) == "node1:index@7"
    with pytest.raises(ValueError, match="diloco's are dense"):
        BenchConfig.from_tables({"bench": {"methods": ["sparseloco:H=5", "diloco:H=5"], "nodes": 3,
                                           "faults": "node2:poison-index@10", "steps": 40}})
    BenchConfig.from_tables({"bench": {"methods": ["sparseloco:H=5", "flexdemo"], "nodes": 3,
                                       "faults": "node2:poison-index@10", "steps": 40}})


def test_a_node_that_ends_outside_the_plan_is_named_first_with_how_it_ended(tmp_path):
    """An unplanned kill -9 of node 1 (tried by hand: the survivors trained on, the run was not counted, and the
    error's kept end was torchft's log lines, which never say the node was killed): the headline names it."""
    from lowband.bench.runner import unplanned_exit_error
    from lowband.report.render import error_headline

    (tmp_path / "node2.log").write_text("step 3\nRuntimeError: boom\n")
    error = unplanned_exit_error({1: -9, 2: 1}, {0: 0, 1: 0, 2: 0}, tmp_path)
    first = error.splitlines()[0]
    assert first.startswith("under fault tolerance, node(s) [1, 2] ended outside the fault plan: node 1 was killed "
                            "by SIGKILL (expected: exited 0); node 2 exited 1 (expected: exited 0); node(s) [0] "
                            "ended as planned.")
    assert "node 2, the end of its log:" in error and "RuntimeError: boom" in error
    assert "node 1, the end of its log" not in error  # a killed node's log says nothing of it
    killed_only = unplanned_exit_error({1: -9}, {0: 0, 1: 0, 2: -9}, tmp_path)
    assert error_headline(killed_only) == killed_only.splitlines()[0]  # what the console prints
    assert "node(s) [0, 2] ended as planned" in killed_only
