"""Emulated nodes on one machine: network namespaces joined by rate-limited links, a TCP
throughput probe, and a launcher that runs one ``torchrun`` per node.

Typical use (as root)::

    from lowband.cluster import EmulatedNetwork, launch_nodes, measure_throughput, netns_available

    ok, reason = netns_available()
    with EmulatedNetwork(2, 100e6) as net:
        print(measure_throughput(net, 0, 1))             # ~95.6e6 bit/s of TCP payload
        result = launch_nodes(num_nodes=2, ranks_per_node=2, module_args=["train"], env={},
                              net=net, timeout_s=600, log_dir=Path("runs/logs"))
        result.raise_for_failure()

Without root, pass ``net=None`` to :func:`launch_nodes`: all nodes then run on loopback.
"""

from lowband.cluster._procs import die_with_parent, signals_as_exit
from lowband.cluster.launch import LaunchResult, free_loopback_port, launch_nodes, torchrun_argv
from lowband.cluster.netns import (
    EmulatedNetwork,
    EmulatedNode,
    cleanup_leftovers,
    default_burst_bytes,
    list_namespaces,
    netns_available,
)
from lowband.cluster.throughput import measure_throughput

__all__ = [
    "EmulatedNetwork",
    "EmulatedNode",
    "LaunchResult",
    "cleanup_leftovers",
    "default_burst_bytes",
    "die_with_parent",
    "free_loopback_port",
    "launch_nodes",
    "list_namespaces",
    "measure_throughput",
    "netns_available",
    "signals_as_exit",
    "torchrun_argv",
]
