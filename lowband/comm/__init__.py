"""The one door for traffic between nodes: the link, its byte accounting, and in-process shaping."""

from lowband.comm.link import Link, LinkHandle, PeerLostError, PeerTimeoutError
from lowband.comm.shaping import UplinkClock
from lowband.comm.traffic import (
    OpRecord,
    OpTally,
    StepTraffic,
    exchange_inter_node_bytes,
    merge_tallies,
    nbytes,
    ring_inter_node_bytes,
)

__all__ = ["Link", "LinkHandle", "OpRecord", "OpTally", "PeerLostError", "PeerTimeoutError", "StepTraffic", "UplinkClock", "exchange_inter_node_bytes", "merge_tallies", "nbytes", "ring_inter_node_bytes"]
