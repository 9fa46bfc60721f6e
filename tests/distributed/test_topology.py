"""lowband/distributed/topology.py: topology arithmetic, and a topology that does not match the launch (on real gloo processes)."""

from __future__ import annotations

import pytest

from lowband.distributed.topology import Topology
from lowband.testing.ranks import run_ranks


def test_topology_layout():
    t = Topology(num_nodes=2, ranks_per_node=2)
    assert (t.world_size, t.replicas, t.shards) == (4, 2, 2)
    assert t.replicate_group_ranks(1) == [1, 3] and t.shard_group_ranks(3) == [2, 3]
    assert [t.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    d = Topology(num_nodes=2, ranks_per_node=2, shards=1)
    assert d.replicas == 4 and d.replicate_group_ranks(2) == [0, 1, 2, 3]


def test_topology_errors_name_both_numbers(monkeypatch):
    with pytest.raises(ValueError, match=r"shards=3 must divide ranks_per_node=4"):
        Topology(num_nodes=2, ranks_per_node=4, shards=3)
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"world size 6 does not factor into nodes of LOCAL_WORLD_SIZE=4"):
        Topology.from_env()
    with pytest.raises(ValueError):
        Topology(num_nodes=0, ranks_per_node=1)


def _launch_mismatch(rank: int) -> str:
    try:
        Topology(num_nodes=3, ranks_per_node=2).mesh()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_topology_that_does_not_match_the_launch():
    msgs = run_ranks(_launch_mismatch, world_size=2, ranks_per_node=2, timeout_s=60)
    assert all("6 ranks" in m and "world size 2" in m for m in msgs)
