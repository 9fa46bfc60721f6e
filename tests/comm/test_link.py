"""lowband/comm/link.py: the link (shaping from arguments, refusals, a vanished peer) and its asynchronous handles (the shaped link's clock, exposed time), on 2 × 2 where needed."""

from __future__ import annotations

import time

import pytest
import torch

from lowband.comm.link import Link, LinkHandle
from lowband.distributed.topology import Topology
from lowband.testing.ranks import run_ranks


def _async_link(rank: int) -> dict:
    topo = Topology.from_env()
    out: dict = {}
    peer = [p for p in topo.replicate_group_ranks(rank) if p != rank]
    # Same results and the same byte records, blocking or not.
    recs = {}
    for mode in (False, True):
        link = Link(topo)
        x = torch.full((1000,), float(rank))
        ar = link.all_reduce(x, op="avg", async_op=mode)
        ag = link.all_gather(torch.full((7,), float(rank)), async_op=mode)
        ex = link.exchange(torch.full((5,), float(rank)), peer, async_op=mode)
        if mode:
            out["handles"] = all(isinstance(h, LinkHandle) for h in (ar, ag, ex)) and link.in_flight == 3
            ar, ag, ex = ar.wait(), ag.wait(), ex.wait()
            out["in_flight_after"] = link.in_flight
        out[f"values_{mode}"] = (ar[0].item(), ag[:, 0].tolist(), ex[0][0].item())
        traffic = link.end_step()
        recs[mode] = [(o.kind, o.payload_bytes, o.bytes_sent, o.inter_node_bytes_sent, o.node_inter_node_bytes_sent,
                       o.messages) for o in traffic.ops]
        out[f"exposed_{mode}"] = (traffic.exposed_comm_time_s, sum(o.exposed_s for o in traffic.ops),
                                  all(o.time_s > 0 for o in traffic.ops))
    out["records_equal"] = recs[False] == recs[True]

    # Shaped: 1 MB/s per node uplink, 20 ms per message. Two all-gathers of 40 kB per rank in
    # flight together: the node sends 80 kB each, 0.08 s apiece; they queue on the uplink.
    link = Link(topo, bandwidth_bps=8e6, latency_s=0.02)
    t0 = time.perf_counter()
    h1 = link.all_gather(torch.zeros(10_000), async_op=True)
    h2 = link.all_gather(torch.zeros(10_000), async_op=True)
    h2.wait()
    both = time.perf_counter() - t0
    h1.wait()
    out["queued"] = (both, h1.record.modelled_link_time_s, h2.record.modelled_link_time_s)
    link.end_step()
    # Overlap with "compute": start, compute 0.2 s, wait. The wait is what is exposed.
    h = link.all_gather(torch.zeros(10_000), async_op=True)
    time.sleep(0.2)
    h.wait()
    step = link.end_step()
    out["overlap"] = (h.record.time_s, h.record.exposed_s, step.exposed_comm_time_s, h.record.modelled_link_time_s)
    # An operation waited on in a later step: its bytes count in the step that started it, its wait
    # in the step that waited.
    h = link.all_gather(torch.zeros(10), async_op=True)
    first = link.end_step()
    h.wait()
    second = link.end_step()
    out["split"] = (len(first.ops), len(second.ops), second.exposed_comm_time_s > 0, h.wait() is h.wait())
    link.drain()
    # A real link (unshaped) with 0.2 s of latency: the latency runs from when the data arrived, so
    # an all-gather left in flight through 0.3 s of compute is not delayed again at its wait; a
    # blocking one waits the whole latency.
    delayed = Link(topo, latency_s=0.2)
    h = delayed.all_gather(torch.zeros(10), async_op=True)
    time.sleep(0.3)
    h.wait()
    hidden = delayed.end_step().exposed_comm_time_s
    delayed.all_gather(torch.zeros(10))
    out["latency"] = (hidden, delayed.end_step().exposed_comm_time_s)
    return out


@pytest.mark.multiprocess
def test_async_link_same_bytes_own_clock_and_exposed_time():
    results = run_ranks(_async_link, world_size=4, ranks_per_node=2, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["handles"] and r["in_flight_after"] == 0
        assert r["values_False"] == r["values_True"]
        assert r["values_True"][1] == [float(rank % 2), float(rank % 2 + 2)]
        assert r["records_equal"]
        for mode in (False, True):
            step_exposed, ops_exposed, timed = r[f"exposed_{mode}"]
            assert step_exposed == pytest.approx(ops_exposed) and step_exposed > 0 and timed
        both, m1, m2 = r["queued"]
        assert m1 == pytest.approx(0.08 + 0.02, rel=0.05)
        # The second queues behind the first's bytes: its result comes 2 transfers + a latency after
        # the first started, at the earliest (on the clock: independent of how fast the ranks run).
        assert both >= 2 * 0.08 + 0.02 and m2 >= 0.08 + 0.02 - 1e-6
        took, exposed, step_exposed, modelled = r["overlap"]
        assert took >= modelled and took >= 0.2
        assert exposed == pytest.approx(step_exposed) and exposed < took - 0.19  # the compute was not exposed
        assert r["split"] == (1, 0, True, True)
        hidden, blocking = r["latency"]
        assert blocking >= 0.2 and hidden < 0.1, r["latency"]


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
    from lowband.comm.link import PeerLostError

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
    from lowband.train.args import config_from_args

    monkeypatch.setenv("LOWBAND_BANDWIDTH_BPS", "1e6")  # what an old bench exported: ignored
    monkeypatch.setenv("LOWBAND_LATENCY_S", "1")
    link = Link(Topology(num_nodes=1, ranks_per_node=1))
    assert not link.shaping and link.bandwidth_bps is None and link.latency_s == 0.0
    cfg = config_from_args(build_parser("train").parse_args(["train", "--link-bandwidth", "100mbit",
                                                              "--link-latency", "20ms"]))
    assert cfg.link.bandwidth_bps == 1e8 and cfg.link.latency_s == pytest.approx(0.02)
    cfg = config_from_args(build_parser("train").parse_args(["train"]))
    assert cfg.link.bandwidth_bps is None and cfg.link.latency_s == 0.0


class _SumPG:
    """torchft's process group for one all-reduce: adds the other members' buffers (values, then their count)."""

    def __init__(self, others: list[list[float]]):
        self.others = others

    def allreduce(self, tensors, opts):
        for o in self.others:
            tensors[0].add_(torch.tensor(o, dtype=tensors[0].dtype))

        class _Work:
            def wait(self, timeout=None):
                return True
        return _Work()


class _FT:
    """lowband.ft.node.FaultTolerance as the link sees it: torchft counts every member of the quorum as a
    participant, a node whose heal was refused included (it sends zeros)."""

    def __init__(self, others, *, participating=True, members=3):
        self.pg, self.participating, self.members = _SumPG(others), participating, members
        self.participants, self.errored, self.member_rank = members, False, 0


def test_a_mean_under_fault_tolerance_divides_by_the_members_whose_values_count_not_by_torchfts_count():
    topo = Topology(num_nodes=1, ranks_per_node=1)
    link = Link(topo, ft=_FT([[3.0, 3.0, 1.0], [5.0, 5.0, 1.0]]))  # all three count: (1 + 3 + 5) / 3
    assert link.all_reduce(torch.ones(2), op="avg").tolist() == [3.0, 3.0] and link.counted == 3
    assert link.end_step().ops[0].payload_bytes == 3 * 4  # the count travels: one element more
    refused = Link(topo, ft=_FT([[3.0, 3.0, 1.0], [0.0, 0.0, 0.0]]))  # a member whose heal was refused sent zeros
    assert refused.all_reduce(torch.ones(2), op="avg").tolist() == [2.0, 2.0] and refused.counted == 2  # not 4/3
    healer = Link(topo, ft=_FT([[3.0, 3.0, 1.0], [5.0, 5.0, 1.0]], participating=False))  # its own values stale
    assert healer.all_reduce(torch.full((2,), 100.0), op="avg").tolist() == [4.0, 4.0] and healer.counted == 2
    forged = Link(topo, ft=_FT([[3.0, 3.0, 0.5], [5.0, 5.0, 1.0]]))  # a count no whole number of members gives
    assert torch.isnan(forged.all_reduce(torch.ones(2), op="avg")).all()
    assert Link(topo, ft=_FT([[3.0, 3.0], [5.0, 5.0]])).all_reduce(torch.ones(2), op="sum").tolist() == [9, 9]  # as is


def test_tagged_messages_open_as_sent_and_a_message_in_a_members_place_is_left_out_uncounted():
    """lowband.comm.tags: with the job's secret each gathered or exchanged message carries a tag over its sender's
    place and the quorum; one that fails (garbage, another member's message, another quorum's) is someone else's on
    the wire: zeros marked not counted (flag 2), and the count says so."""
    from lowband.comm.tags import TAG_BYTES, MessageTags

    tags = MessageTags(b"k" * 32)
    for like in (torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.arange(5, dtype=torch.uint8),
                 torch.linspace(0, 1, 4, dtype=torch.bfloat16)):
        rows = [like + i for i in range(3)]
        sealed = torch.stack([tags.seal(r, sender=i, context=7) for i, r in enumerate(rows)])
        assert sealed.dtype == torch.uint8 and sealed.shape[1] == like.numel() * like.element_size() + TAG_BYTES
        opened, forged = tags.open(sealed, senders=[0, 1, 2], context=7, like=like)
        assert forged == [] and all(torch.equal(opened[i], rows[i]) for i in range(3))
        bad = sealed.clone()
        bad[0, 0] ^= 1  # one bit on the wire
        bad[1] = tags.seal(rows[2], sender=2, context=7)  # member 2's genuine message in member 1's place
        bad[2] = tags.seal(rows[2], sender=2, context=6)  # a message of another quorum
        opened, forged = tags.open(bad, senders=[0, 1, 2], context=7, like=like)
        assert forged == [0, 1, 2]
        assert all(opened[i].reshape(-1)[-1].item() == 2 and not opened[i].reshape(-1)[:-1].any() for i in range(3))
    assert MessageTags(b"o" * 32).open(sealed, senders=[0, 1, 2], context=7, like=like)[1] == [0, 1, 2]  # another job
    # a quorum id lasts as long as its members: the step is bound too, so an earlier step's message sent again fails
    earlier = torch.stack([tags.seal(r, sender=i, context=(7, 100)) for i, r in enumerate(rows)])
    assert tags.open(earlier, senders=[0, 1, 2], context=(7, 100), like=like)[1] == []
    assert tags.open(earlier, senders=[0, 1, 2], context=(7, 101), like=like)[1] == [0, 1, 2]


class _GatherPG:
    """torchft's process group for one all-gather: the other members' rows as given (sealed or not)."""

    def __init__(self, rows):
        self.rows = rows

    def allgather(self, outputs, inputs, opts):
        outputs[0][0].copy_(inputs[0])
        for out, row in zip(outputs[0][1:], self.rows, strict=True):
            out.copy_(row)

        class _Work:
            def wait(self, timeout=None):
                return True
        return _Work()


def test_a_link_with_the_jobs_secret_tags_what_it_gathers_and_leaves_a_forged_row_out():
    from types import SimpleNamespace

    from lowband.comm.tags import MessageTags

    secret = b"s" * 32
    tags = MessageTags(secret)
    ft = _FT([])
    ft.cfg, ft.manager = SimpleNamespace(secret=secret, max_nodes=3), SimpleNamespace(_quorum_id=4)
    ft.quorum_max_step = 9  # the quorum's step: bound into the tag with its id
    mine = torch.tensor([1.0, 2.0, 0.0])
    genuine = tags.seal(torch.tensor([3.0, 4.0, 0.0]), sender=1, context=(4, 9))
    garbage = torch.randint(0, 255, genuine.shape, dtype=torch.uint8)
    ft.pg = _GatherPG([genuine, garbage])
    link = Link(Topology(num_nodes=1, ranks_per_node=1), ft=ft)
    out = link.all_gather(mine)
    assert out.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 0.0], [0.0, 0.0, 2.0]] and link.tags.forged == 1
    assert link.end_step().ops[0].payload_bytes == 12 + 16  # the tag travels with the message
    ft.cfg.secret = None  # without a secret nothing is tagged
    ft.pg = _GatherPG([torch.tensor([3.0, 4.0, 0.0]), torch.tensor([5.0, 6.0, 0.0])])
    plain = Link(Topology(num_nodes=1, ranks_per_node=1), ft=ft)
    assert plain.tags is None and plain.all_gather(mine)[2].tolist() == [5.0, 6.0, 0.0]
