"""lowband/comm/traffic.py: the ring model's byte counts and the step tally."""

from __future__ import annotations

import pytest

from lowband.comm.traffic import (
    OpRecord,
    OpTally,
    StepTraffic,
    exchange_inter_node_bytes,
    merge_tallies,
    ring_inter_node_bytes,
)
from lowband.distributed.topology import Topology


def _node_of(ranks_per_node: int):
    return lambda r: r // ranks_per_node


def test_ring_counts_only_hops_between_nodes():
    # DeMo on 2 nodes × 2 ranks: the replicate group is all four ranks, ring 0 → 1 → 2 → 3 → 0.
    ranks, node_of = [0, 1, 2, 3], _node_of(2)
    assert ring_inter_node_bytes(ranks, 0, node_of, 100, 1) == (0, 100, 100)  # sends to 1 (same node)
    assert ring_inter_node_bytes(ranks, 1, node_of, 100, 1) == (100, 0, 100)  # sends to 2 (node 1)
    # The replicate group of shard 0 on 2 nodes (ranks 0 and 2), S = 2 groups at once on the uplink.
    assert ring_inter_node_bytes([0, 2], 0, node_of, 100, 2) == (100, 100, 200)


def test_ring_of_one_node_crosses_nothing():
    assert ring_inter_node_bytes([0, 1, 2, 3], 2, _node_of(4), 100, 1) == (0, 0, 0)


def test_ring_counts_match_the_topology():
    t = Topology(num_nodes=3, ranks_per_node=2)
    ranks = t.replicate_group_ranks(1)
    assert ring_inter_node_bytes(ranks, 1, t.node_of, 7, t.shards) == (7, 7, 7 * t.shards)


def test_exchange_counts_peers_on_other_nodes():
    node_of = _node_of(2)
    assert exchange_inter_node_bytes([1, 2, 3], 0, node_of, 10, 1) == (20, 20)
    assert exchange_inter_node_bytes([1], 0, node_of, 10, 3) == (0, 0)
    assert exchange_inter_node_bytes([2], 0, node_of, 10, 3) == (10, 30)


def test_step_traffic_tallies_its_ops():
    def op(kind, sent, inter, group):
        return OpRecord(kind=kind, group_size=group, payload_bytes=sent, bytes_sent=sent, bytes_recv=sent,
                        inter_node_bytes_sent=inter, inter_node_bytes_recv=inter, node_inter_node_bytes_sent=2 * inter,
                        messages=1, time_s=0.5, modelled_link_time_s=0.0)

    step = StepTraffic(step=3, ops=[op("all_reduce", 10, 4, 2), op("all_reduce", 6, 0, 4), op("exchange", 5, 5, 2)])
    assert (step.bytes_sent, step.inter_node_bytes_sent, step.node_inter_node_bytes_sent) == (21, 9, 18)
    assert step.comm_time_s == pytest.approx(1.5)
    assert step.by_kind() == {"all_reduce": OpTally(count=2, bytes=16, inter_node_bytes=4, largest_group=4),
                              "exchange": OpTally(count=1, bytes=5, inter_node_bytes=5, largest_group=2)}
    d = step.as_dict()
    assert d["step"] == 3 and d["inter_node_bytes_recv"] == 9 and len(d["ops"]) == 3


def test_op_tallies_add_up_counts_and_bytes_and_keep_the_largest_group() -> None:
    a = OpTally(count=2, bytes=16, inter_node_bytes=4, largest_group=4)
    a.add(OpTally(count=1, bytes=5, inter_node_bytes=5, largest_group=2))
    assert a == OpTally(count=3, bytes=21, inter_node_bytes=9, largest_group=4)  # the group: a maximum, not a sum
    op = OpRecord(kind="exchange", group_size=8, payload_bytes=3, bytes_sent=3, bytes_recv=3, inter_node_bytes_sent=0,
                  inter_node_bytes_recv=0, node_inter_node_bytes_sent=0, messages=1, time_s=0.1, modelled_link_time_s=0.0)
    a.add_op(op)
    assert a == OpTally(count=4, bytes=24, inter_node_bytes=9, largest_group=8)
    into = {"all_reduce": OpTally(count=1, bytes=2, inter_node_bytes=2, largest_group=2)}
    more = {"all_reduce": OpTally(count=1, bytes=3, inter_node_bytes=0, largest_group=4), "exchange": a}
    assert merge_tallies(into, more) is into
    assert into == {"all_reduce": OpTally(count=2, bytes=5, inter_node_bytes=2, largest_group=4), "exchange": a}
    assert into["exchange"] is not a  # a copy: adding to the merged tally leaves the source alone
    assert OpTally.from_dict(a.to_dict()) == a and list(a.to_dict()) == ["count", "bytes", "inter_node_bytes",
                                                                         "largest_group"]
    with pytest.raises(ValueError, match="count"):
        OpTally.from_dict({"count": 1, "bytes": 2})
