"""The asynchronous link (handles, the shaped link's clock, exposed time) and overlapped optimizers, on 2 × 2."""

from __future__ import annotations

import time

import pytest
import torch

from lowband.link import Link, LinkHandle
from lowband.testing import run_ranks
from lowband.topology import Topology


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
    return out


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
        # The second waits for the first's bytes: 2 transfers + its latency after its own start.
        assert m2 >= 2 * 0.08 + 0.02 - 0.01 and both >= m2 - 0.01
        took, exposed, step_exposed, modelled = r["overlap"]
        assert took >= modelled and took >= 0.2
        assert exposed == pytest.approx(step_exposed) and exposed < took - 0.19  # the compute was not exposed
        assert r["split"] == (1, 0, True, True)
