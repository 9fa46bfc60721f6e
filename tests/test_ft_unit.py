"""Fault tolerance without processes: configuration errors, refusals, the state copied when a node heals."""

from __future__ import annotations

import pytest
import torch

from lowband.ft import (
    FaultToleranceConfig,
    committed_of,
    data_slot,
    load_local_state,
    local_state,
    quorum_step,
)
from lowband.train.loop import TrainConfig
from lowband.train.methods import method_config


@pytest.mark.parametrize("kwargs, needle", [
    (dict(lighthouse="127.0.0.1:29510", node=0, max_nodes=2), "http://HOST:PORT"),
    (dict(lighthouse="http://h:1", node=2, max_nodes=2), r"--ft-node must be in \[0, 2\)"),
    (dict(lighthouse="http://h:1", node=0, max_nodes=0), "--ft-max-nodes must be >= 1"),
    (dict(lighthouse="http://h:1", node=0, max_nodes=2, timeout_s=0), "must be > 0"),
])
def test_bad_fault_tolerance_configuration_is_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        FaultToleranceConfig(**kwargs)


@pytest.mark.parametrize("method, hp, needle", [
    ("flexdemo", {"overlap": True}, "overlap=true does not run under fault tolerance"),
    ("diloco", {"overlap": True, "sync_every": 10}, "overlapped outer step"),
    ("noloco", {"overlap": True, "sync_every": 10}, "overlapped outer step"),
])
def test_methods_that_cannot_run_under_fault_tolerance_refuse_before_any_process(method, hp, needle):
    cfg = TrainConfig(method=method, hp=hp, ft_lighthouse="http://127.0.0.1:1", ft_max_nodes=2, steps=20)
    with pytest.raises(ValueError, match=needle):
        cfg.validate()


@pytest.mark.parametrize("method", ["flexdemo", "adamw", "deto-full", "diloco", "noloco"])
def test_methods_that_run_under_fault_tolerance_pass_the_check(method):
    method_config(method, {}).check_fault_tolerance()  # raises if refused


def test_data_slots_split_each_global_batch_by_node_whoever_is_alive():
    cfg = FaultToleranceConfig(lighthouse="http://h:1", node=2, max_nodes=3)
    assert data_slot(cfg, local_rank=1, ranks_per_node=2) == (5, 6)
    slots = {data_slot(FaultToleranceConfig(lighthouse="http://h:1", node=n, max_nodes=3), local_rank=r,
                       ranks_per_node=2)[0] for n in range(3) for r in range(2)}
    assert slots == set(range(6))  # disjoint and complete


def test_state_copied_from_a_peer_loads_in_place_and_keeps_references():
    mine = {"w": torch.zeros(3), "opt": {"step": torch.tensor(0.0), "m": [torch.zeros(2)]}, "lr": 0.1}
    w_ref, m_ref = mine["w"], mine["opt"]["m"][0]
    peer = local_state({"w": torch.arange(3.0), "opt": {"step": torch.tensor(7.0), "m": [torch.ones(2)]},
                        "lr": 0.05})
    out = load_local_state(mine, peer)
    assert out["w"] is w_ref and torch.equal(w_ref, torch.arange(3.0))
    assert m_ref is out["opt"]["m"][0] and torch.equal(m_ref, torch.ones(2))
    assert float(out["opt"]["step"]) == 7.0 and out["lr"] == 0.05
    peer["w"] += 1  # a copy: the peer's later changes do not reach this node
    assert torch.equal(w_ref, torch.arange(3.0))


@pytest.mark.parametrize("peer, needle", [
    ({"w": torch.zeros(4)}, r"shape \(3,\) here but \(4,\) on the peer"),
    ({"v": torch.zeros(3)}, r"differs between this node and the peer in \['v', 'w'\]"),
])
def test_state_of_another_model_is_refused_by_name(peer, needle):
    with pytest.raises(ValueError, match=needle):
        load_local_state({"w": torch.zeros(3)}, peer)


def test_the_quorum_orders_nodes_by_training_step_then_by_committed_steps():
    # A node that started late (step 0) is behind nodes at their first outer step that have not
    # committed yet either: it heals forward instead of joining them at another step.
    assert quorum_step(0, 0) < quorum_step(4, 0)
    # At the same training step, a node that dropped a step the others committed is behind.
    assert quorum_step(9, 1) < quorum_step(9, 2)
    # The training step comes first, and a commit (torchft adds 1) stays inside its step.
    assert quorum_step(9, 7) < quorum_step(14, 0) and quorum_step(9, 7) + 1 == quorum_step(9, 8)
    assert committed_of(quorum_step(123_456, 41)) == 41 and committed_of(quorum_step(123_456, 41) + 1) == 42
    with pytest.raises(ValueError, match="must be >= 0"):
        quorum_step(3, -1)


def _ft_with(replica_ids, *, node, quorums):
    from lowband.ft import FaultTolerance

    ft = FaultTolerance.__new__(FaultTolerance)  # no Manager: only the membership check
    ft.cfg = FaultToleranceConfig(lighthouse="http://h:1", node=node, max_nodes=3)
    ft.replica_ids, ft.quorums = replica_ids, quorums
    return ft


def test_a_second_process_for_a_live_node_slot_is_refused_when_it_joins_and_the_live_one_goes_on():
    from lowband.ft import NodeSlotTaken

    ids = ["lowband_node0:aa", "lowband_node2:bb", "lowband_node2:cc", "lowband_node1:dd"]
    with pytest.raises(NodeSlotTaken, match=r"node slot 2 is already live .* --ft-node 2.*free slot \(0\.\.2"):
        _ft_with(ids, node=2, quorums=1)._check_slot()  # the newcomer (its first quorum) leaves
    _ft_with(ids, node=2, quorums=5)._check_slot()  # the live one (many quorums behind it) goes on
    _ft_with(ids, node=0, quorums=1)._check_slot()  # other slots are not concerned
    # node10 is not node1
    _ft_with(["lowband_node1:aa", "lowband_node10:bb"], node=1, quorums=1)._check_slot()
