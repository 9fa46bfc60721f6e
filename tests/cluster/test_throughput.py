"""lowband/cluster/throughput.py: the throughput probe at 100 Mbit/s and the byte counters (network namespaces)."""

from __future__ import annotations

import os

import pytest

from lowband.cluster import (
    EmulatedNetwork,
    list_namespaces,
    measure_throughput,
)
from tests.cluster.emulation import (
    PREFIX,
    needs_netns,
    our_namespaces,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.multiprocess
@needs_netns
def test_throughput_at_100mbit_and_byte_counters() -> None:
    limit_bps = 100e6
    with EmulatedNetwork(2, limit_bps, prefix=PREFIX) as net:
        assert [n.ip for n in net.nodes] == ["10.77.0.1", "10.77.0.2"]
        assert all(n.namespace in list_namespaces() for n in net.nodes)
        tx0, rx1 = net.tx_bytes(0), net.rx_bytes(1)
        details: dict[str, float] = {}
        measured = measure_throughput(net, 0, 1, seconds=1.5, details=details)
        assert abs(measured - limit_bps) <= 0.10 * limit_bps, f"{measured / 1e6:.1f} Mbit/s at 100mbit"
        assert details["bytes"] == details["sent_bytes"]
        assert net.tx_bytes(0) - tx0 >= details["sent_bytes"]
        assert net.rx_bytes(1) - rx1 >= details["sent_bytes"]
    assert our_namespaces(os.getpid()) == []
