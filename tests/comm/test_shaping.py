"""lowband/comm/shaping.py: the uplink clock queues operations behind each other."""

from __future__ import annotations

import pytest

from lowband.comm.shaping import UplinkClock


def test_uplink_clock_queues_operations():
    clock = UplinkClock()
    # 1e6 bytes at 8e6 bit/s: 1 s on the uplink, then 0.1 s of latency.
    assert clock.schedule(10.0, 1_000_000, 8e6, 0.1) == pytest.approx(11.1)
    # Started while the first still occupies the uplink: it queues behind it.
    assert clock.schedule(10.5, 500_000, 8e6, 0.0) == pytest.approx(11.5)
    # Started after the uplink is free: no queueing.
    assert clock.schedule(20.0, 0, 8e6, 0.2) == pytest.approx(20.2)
    assert clock.free_at == pytest.approx(20.0)
