"""lowband/ft/node.py: Fault tolerance without processes: configuration errors, refusals, the state copied when a node heals."""

from __future__ import annotations

import pytest
import torch

from lowband.ft.node import (
    FaultToleranceConfig,
    ForeignJob,
    admit,
    committed_of,
    data_slot,
    load_local_state,
    local_state,
    member_of,
    quorum_step,
    replica_id,
)
from lowband.train.config import TrainConfig
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
    cfg = TrainConfig.from_tables({"method": {"name": method, **hp}, "schedule": {"steps": 20},
                                   "fault_tolerance": {"lighthouse": "http://127.0.0.1:1", "max_nodes": 2}})
    with pytest.raises(ValueError, match=needle):
        cfg.validate()


@pytest.mark.parametrize("method", ["flexdemo", "adamw", "muon", "deto-full", "diloco", "noloco", "sparseloco"])
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
    from lowband.ft.node import FaultTolerance

    ft = FaultTolerance.__new__(FaultTolerance)  # no Manager: only the membership check
    ft.cfg = FaultToleranceConfig(lighthouse="http://h:1", node=node, max_nodes=3)
    ft.replica_ids, ft.quorums = replica_ids, quorums
    return ft


def test_a_second_process_for_a_live_node_slot_is_refused_when_it_joins_and_the_live_one_goes_on():
    from lowband.ft.node import NodeSlotTaken

    ids = ["lowband_node0:aa", "lowband_node2:bb", "lowband_node2:cc", "lowband_node1:dd"]
    with pytest.raises(NodeSlotTaken, match=r"node slot 2 is already live .* --ft-node 2.*free slot \(0\.\.2"):
        _ft_with(ids, node=2, quorums=1)._check_slot()  # the newcomer (its first quorum) leaves
    _ft_with(ids, node=2, quorums=5)._check_slot()  # the live one (many quorums behind it) goes on
    _ft_with(ids, node=0, quorums=1)._check_slot()  # other slots are not concerned
    # node10 is not node1
    _ft_with(["lowband_node1:aa", "lowband_node10:bb"], node=1, quorums=1)._check_slot()


class _Quorums:
    """A stand-in for the Lighthouse: the members and newest step of each quorum a node asks for."""

    def __init__(self, results):
        self.results, self.asked = list(results), 0

    def start_step(self, ft, step):
        self.asked += 1
        ft.last_members, ft.quorum_heals, ft.quorum_max_step = self.results.pop(0)
        ft.quorums += 1


def _gathering(results, *, start_nodes=3, timeout_s=2.0, poll_s=0.001):
    from lowband.ft.node import FaultTolerance

    ft = FaultTolerance.__new__(FaultTolerance)  # no Manager: only the start rule
    ft.cfg = FaultToleranceConfig(lighthouse="http://h:1", node=0, max_nodes=3, start_nodes=start_nodes,
                                  quorum_timeout_s=timeout_s, start_poll_s=poll_s)
    ft.quorums, ft._pending = 0, None
    lighthouse = _Quorums(results)
    ft.start_step = lambda step: lighthouse.start_step(ft, step)
    ft.manager = type("M", (), {"current_step": lambda self: 0})()
    ft.start_step(0)  # the first quorum, as the trainer starts it
    return ft, lighthouse


def test_a_new_job_waits_for_its_nodes_and_a_node_joining_a_running_job_does_not(caplog):
    # Alone, then two, then all three: three quorums, then training.
    ft, lh = _gathering([(1, False, 0), (2, False, 0), (3, False, 0)])
    assert ft.gather(0) == 3 and lh.asked == 3
    # A node whose first quorum has someone ahead joins a running job at once (that quorum heals it).
    ft, lh = _gathering([(2, True, 7 << 32)])
    assert ft.gather(0) == 2 and lh.asked == 1
    # --ft-start-nodes 1: nobody waits.
    ft, lh = _gathering([(1, False, 0)], start_nodes=1)
    assert ft.gather(0) == 1 and lh.asked == 1
    # The others never come: it starts with what there is after the quorum timeout, and says so.
    # (Attempts are counted, not timed, so that every rank of the node stops at the same quorum.)
    ft, lh = _gathering([(1, False, 0)] * 4, timeout_s=0.004, poll_s=0.001)
    assert ft.gather(0) == 1 and lh.asked == 4
    assert "only 1 of 3 nodes started" in caplog.text


def test_start_nodes_must_fit_the_slots():
    with pytest.raises(ValueError, match=r"--ft-start-nodes must be in \[1, --ft-max-nodes = 3\], got 4"):
        FaultToleranceConfig(lighthouse="http://h:1", node=0, max_nodes=3, start_nodes=4)


def test_a_replica_id_carries_the_job_and_the_slot_and_torchft_still_reads_the_slot():
    rid = replica_id("0123abcd", 12)
    assert member_of(rid + ":5f0e-uuid") == ("0123abcd", 12)
    assert member_of("lowband_node3:uuid") == ("", 3)  # an id without a fingerprint
    assert member_of("someone-else:uuid") == ("", None)
    from torchft.manager import extract_trailing_digits  # what torchft makes of it
    assert extract_trailing_digits(rid) == 12


@pytest.mark.parametrize("ids, mine, behind, rounds, verdict", [
    (["lowband_a_node0", "lowband_a_node1"], "a", False, 0, "accept"),
    # one foreign node: the two of the job stay and ask again, the foreign one leaves
    (["lowband_a_node0", "lowband_a_node1", "lowband_b_node2"], "a", False, 0, "retry"),
    (["lowband_a_node0", "lowband_a_node1", "lowband_b_node2"], "b", False, 0, "leave"),
    (["lowband_a_node0", "lowband_a_node1", "lowband_b_node2"], "b", True, 0, "leave"),
    # one against one: the newcomer (behind) leaves, the running node stays
    (["lowband_a_node0", "lowband_b_node1"], "b", True, 0, "leave"),
    (["lowband_a_node0", "lowband_b_node1"], "a", False, 0, "retry"),
    # both at the newest step and still tied a round later: the smaller fingerprint stays
    (["lowband_a_node0", "lowband_b_node1"], "a", False, 1, "retry"),
    (["lowband_a_node0", "lowband_b_node1"], "b", False, 1, "leave"),
    # with patience (the nodes ask half the quorum timeout long): still retrying while patience lasts
    (["lowband_a_node0", "lowband_b_node1"], "b", False, (1, 5), "retry"),
    (["lowband_a_node0", "lowband_b_node1"], "b", False, (5, 5), "leave"),
    (["lowband_a_node0", "lowband_b_node1"], "b", True, (1, 5), "leave"),  # a newcomer still leaves at once
    # a minority of several jobs leaves, the largest stays
    (["lowband_a_node0", "lowband_c_node1", "lowband_b_node2", "lowband_b_node3"], "c", False, 0, "leave"),
    (["lowband_a_node0", "lowband_c_node1", "lowband_b_node2", "lowband_b_node3"], "b", True, 0, "retry"),
])
def test_every_member_judges_a_mixed_quorum_alike(ids, mine, behind, rounds, verdict):
    rounds, patience = rounds if isinstance(rounds, tuple) else (rounds, 1)
    assert admit([i + ":uuid" for i in ids], mine, behind=behind, rounds=rounds, patience=patience) == verdict


class _Result:
    def __init__(self, ids, *, heal=False, max_step=0):
        self.replica_ids, self.heal, self.max_step, self.replica_rank = ids, heal, max_step, 0


def _recorder(results, *, fp="a", timeout_s=1.0, secret=None, store="h:1", quorums=0, node=0):
    from lowband.ft.node import FaultTolerance
    from lowband.ft.quorum import QuorumRecorder

    ft = FaultTolerance.__new__(FaultTolerance)
    ft.cfg = FaultToleranceConfig(lighthouse="http://h:1", node=node, max_nodes=3, fingerprint=fp,
                                  quorum_timeout_s=timeout_s, start_poll_s=0.001, secret=secret)
    ft.replica_id, ft.quorums = replica_id(fp, node, secret=secret, store=store, manager=store) + ":u", quorums
    ft.had_peers = quorums > 0  # a node with quorums behind it here has had peers in them
    client = type("C", (), {})()
    asked = []
    client._quorum = lambda **kw: (asked.append(kw), results.pop(0))[1]
    return ft, QuorumRecorder(client, ft), asked


def test_a_quorum_with_a_node_of_another_job_forms_again_without_it_or_this_node_leaves(caplog):
    ids = [replica_id("a", 0) + ":u", replica_id("a", 1) + ":u"]
    foreign = ids + [replica_id("b", 2) + ":u"]
    # The job's node: the quorum with the foreign node is asked again; the next one is taken.
    ft, rec, asked = _recorder([_Result(foreign), _Result(ids)])
    assert rec._quorum(step=0).replica_ids == ids and len(asked) == 2 and ft.replica_ids == ids
    assert "node2 (b) of another job joined the quorum" in caplog.text
    # The foreign node: it leaves at once, saying why and what to do.
    ft, rec, asked = _recorder([_Result(foreign)], fp="b")
    with pytest.raises(ForeignJob, match=r"run another job.*node0 \(a\), node1 \(a\).*"
                                         r"fingerprint is b.*This node leaves; the running job goes on"):
        rec._quorum(step=0)
    # A foreign node that never leaves: the job's node gives up after the quorum timeout, naming it.
    ft, rec, asked = _recorder([_Result(foreign)] * 10, timeout_s=0.003)
    with pytest.raises(ForeignJob, match="did not leave within the quorum timeout"):
        rec._quorum(step=0)
    assert len(asked) == 4


# ----------------------------------------------------------------------------- what a healing node loads
def test_a_heal_is_refused_when_its_step_layout_or_job_is_not_this_nodes():
    from lowband.ft.node import check_heal, quorum_step

    good = quorum_step(40, 38)
    state = {"user": {"default": {"fingerprint": "fp"}}, "torchft": {"step": good, "batches_committed": 76}}
    check_heal(good, None, fingerprint="fp", steps=100)
    check_heal(good, state, fingerprint="fp", steps=100)
    for step, st, needle in (
            (quorum_step(10 ** 6, 0), None, r"step 1000000 with 0 committed, outside the job's \[0, 100\]"),
            (quorum_step(40, 101), None, "outside the job's"), (-1, None, "not a step"),
            (good, {"user": {}}, "not laid out as torchft's"),
            (good, {**state, "torchft": {"step": good + 1, "batches_committed": 0}}, "not the quorum's step"),
            (good, {**state, "torchft": {"step": good, "batches_committed": -5}}, "count of batches"),
            (good, {**state, "user": {"default": {"fingerprint": "other"}}}, "another job")):
        with pytest.raises(ValueError, match=needle):
            check_heal(step, st, fingerprint="fp", steps=100)


def _trainer_state(step=5):
    return {"fingerprint": "fp", "trainer": {"step": step, "train_time_s": 1.5, "tokens": 640},
            "scheduler": {"last_epoch": step, "base_lrs": [0.1], "_last_lr": [0.1], "_step_count": step + 1},
            "params": {"a.weight": torch.zeros(2, 3), "b": torch.zeros(3)}, "buffers": {"mask": torch.zeros(2)},
            "optimizer": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 3)},
                                     1: {"delta": torch.zeros(1, 3)}},
                           "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "foreach": None}]}]}


@pytest.mark.parametrize("change, needle", [
    (lambda s: s["trainer"].update(step=101), r"step 101 is outside the job's \[0, 100\]"),
    (lambda s: s["trainer"].update(step=-1), "outside the job's"),
    (lambda s: s["trainer"].update(train_time_s=float("nan")), "train_time_s = nan is not a finite"),
    (lambda s: s["trainer"].update(tokens="many"), "tokens"),
    (lambda s: s["params"].pop("b"), r"params differ from this node's in \['b'\]"),
    (lambda s: s["params"].update(c=torch.zeros(1)), r"params differ .*'c'"),
    (lambda s: s["buffers"].update(mask=[0.0, 1.0]), "buffers.mask is not a tensor"),
    (lambda s: s["optimizer"].append(s["optimizer"][0]), "2 optimizers"),
    (lambda s: s["optimizer"][0]["groups"].append({}), "2 parameter groups"),
    (lambda s: s["optimizer"][0]["groups"][0].update(lr="0.1"), "group 0 has other settings"),
    (lambda s: s["optimizer"][0]["groups"][0].pop("betas"), "group 0 has other settings"),
    (lambda s: s["optimizer"][0]["state"].update({7: {}}), "parameter 7, which this node does not have"),
    (lambda s: s["optimizer"][0]["state"][0].update(exp_avg=torch.zeros(5)), r"shape \(5,\), neither"),
    (lambda s: s["scheduler"].update(last_epoch=10 ** 9), "schedule is at step"),
    (lambda s: s["scheduler"].pop("base_lrs"), "schedule has other settings"),
    (lambda s: s.update(optimizer={}), "no optimizer of the kind"),
])
def test_a_peer_state_the_trainer_must_not_load_is_refused_before_anything_loads(change, needle):
    from lowband.ft.state import check_peer_state

    own, peer = _trainer_state(0), _trainer_state(5)
    own["optimizer"][0]["state"] = {}  # a node that has not stepped has no optimizer state yet
    shapes = [[(2, 3), (3,)]]
    check_peer_state(peer, own, steps=100, param_shapes=shapes)
    change(peer)
    with pytest.raises(ValueError, match=needle):
        check_peer_state(peer, own, steps=100, param_shapes=shapes)
