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
    from lowband.bench.config import make_config

    with pytest.raises(ValueError, match="adamw's gradients are all-reduced"):
        make_config(methods=["adamw", "diloco:H=5"], nodes=3, faults="node2:poison@10", steps=40)
