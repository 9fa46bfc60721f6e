"""Topology arithmetic and the link's shaping, on real gloo processes where needed."""

from __future__ import annotations

import pytest
import torch

from lowband.link import Link
from lowband.testing import run_ranks
from lowband.topology import Topology


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


def _shaped(rank: int) -> dict:
    topo = Topology.from_env()
    link = Link(topo, bandwidth_bps=8e6, latency_s=0.05)  # 1 MB/s per node uplink
    x = torch.ones(25_000)  # 100 kB per rank
    link.all_reduce(x, op="avg")
    ar = link.current.ops[-1]
    y = link.all_gather(torch.full((10_000,), float(rank)))  # 40 kB per rank
    ag = link.current.ops[-1]
    peer = topo.replicate_group_ranks(rank)
    recv = link.exchange(torch.full((5,), float(rank)), [p for p in peer if p != rank])
    ex = link.current.ops[-1]
    # A real rate limit (no bandwidth shaping) with latency: the delay is added on top.
    delayed = Link(topo, latency_s=0.05)
    delayed.all_gather(torch.zeros(4))
    lat = delayed.current.ops[-1]
    return {"lat": (lat.modelled_link_time_s, lat.time_s),
            "ar": (ar.node_inter_node_bytes_sent, ar.modelled_link_time_s, ar.time_s, x[0].item()),
            "ag": (ag.node_inter_node_bytes_sent, ag.modelled_link_time_s, ag.time_s, y[:, 0].tolist()),
            "ex": (ex.group_size, ex.inter_node_bytes_sent, recv[0][0].item())}


@pytest.mark.multiprocess
def test_shaping_makes_operations_take_the_link_time():
    results = run_ranks(_shaped, world_size=4, ranks_per_node=2, timeout_s=60)
    for rank, r in enumerate(results):
        node_bytes, modelled, took, value = r["ar"]
        # R = 2: each rank sends 2·(R−1)/R·100 kB = 100 kB; the node's two ranks share the uplink.
        assert node_bytes == 200_000
        assert modelled == pytest.approx(200_000 * 8 / 8e6 + 0.05 * 2)
        assert took >= modelled and value == 1.0
        node_bytes, modelled, took, gathered = r["ag"]
        assert node_bytes == 80_000 and modelled == pytest.approx(0.08 + 0.05) and took >= modelled
        assert gathered == [float(p) for p in [rank % 2, rank % 2 + 2]]
        modelled, took = r["lat"]
        assert modelled == pytest.approx(0.05) and took >= 0.05
        group, inter, peer_value = r["ex"]
        assert group == 2 and inter == 20 and peer_value == float((rank + 2) % 4)


def test_link_rejects_bad_settings():
    t = Topology(num_nodes=1, ranks_per_node=1)
    for kwargs in (dict(bandwidth_bps=0), dict(latency_s=-1), dict(timeout_s=0)):
        with pytest.raises(ValueError):
            Link(t, **kwargs)


def _vanishing_peer(rank: int) -> str:
    from lowband.link import PeerLostError

    topo = Topology.from_env()
    link = Link(topo)
    if rank == 3:
        return "left"  # leaves the job: its process exits and its connections close
    if rank != 1:
        return "unaffected"  # ranks 0 and 2 form the other replicate group
    try:
        link.all_gather(torch.ones(1000))
    except PeerLostError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_a_vanished_peer_is_a_clear_error_naming_the_group():
    results = run_ranks(_vanishing_peer, world_size=4, ranks_per_node=2, timeout_s=120)
    msg = results[1]
    assert "all_gather over ranks [1, 3] failed" in msg and "node(s) [1]" in msg and "--resume auto" in msg


def test_shaping_comes_from_arguments_never_from_the_environment(monkeypatch):
    from lowband.cli import build_parser
    from lowband.train.cli import config_from_args

    monkeypatch.setenv("LOWBAND_BANDWIDTH_BPS", "1e6")  # what an old bench exported: ignored
    monkeypatch.setenv("LOWBAND_LATENCY_S", "1")
    link = Link(Topology(num_nodes=1, ranks_per_node=1))
    assert not link.shaping and link.bandwidth_bps is None and link.latency_s == 0.0
    cfg = config_from_args(build_parser("train").parse_args(["train", "--link-bandwidth", "100mbit",
                                                              "--link-latency", "20ms"]))
    assert cfg.link.bandwidth_bps == 1e8 and cfg.link.latency_s == pytest.approx(0.02)
    cfg = config_from_args(build_parser("train").parse_args(["train"]))
    assert cfg.link.bandwidth_bps is None and cfg.link.latency_s == 0.0
