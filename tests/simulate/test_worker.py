"""lowband/simulate/worker.py: the worker times both operations through the link (real gloo ranks)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def _worker_on_rank(rank: int) -> dict:
    from lowband.simulate.worker import measure

    return measure(size_bytes=4096, reps=2, group_size=2, seed=0, probes=3)


@pytest.mark.multiprocess
def test_worker_times_both_operations_through_the_link() -> None:
    """The worker's code on 4 forked gloo ranks (loopback, unshaped): structure and byte counts."""
    from lowband.testing.ranks import run_ranks

    records = run_ranks(_worker_on_rank, world_size=4, ranks_per_node=1, timeout_s=60)
    for r in records:
        assert r["all_reduce_bytes"] == 4096 and r["exchange_bytes"] == 8192  # NoLoCo sends φ and θ−φ
        assert len(r["all_reduce_s"]) == len(r["exchange_s"]) == len(r["exchange_receive_first_s"]) == 2
        assert all(t > 0 for t in r["all_reduce_s"] + r["exchange_s"])
        assert r["link_bytes_sent"] == {"all_reduce": 2 * 3 * 4096 // 4, "exchange": 8192}
        assert all(len(p) == 1 for p in r["exchange_peers"])
    # Pairs are symmetric: my peer's peer is me, in every repetition.
    for rep in range(2):
        peer_of = {r["rank"]: r["exchange_peers"][rep][0] for r in records}
        assert all(peer_of[peer_of[i]] == i for i in peer_of)
