"""The in-process shaping clock: a node's rate-limited uplink as one resource with its own clock.

When no real link limit is in place, :class:`lowband.comm.link.Link` can shape its traffic: the node's
uplink carries ``bandwidth_bps`` shared by all ranks of the node, and each sequential message costs
``latency_s``. An operation's bytes occupy the uplink from max(start, when it is free) for
bytes·8 / bandwidth, and its result is ready one latency per message after the last byte left; so
operations in flight together queue on the link, and a blocking call or a wait returns no earlier
than the real link would deliver.
"""

from __future__ import annotations

__all__ = ["UplinkClock"]


class UplinkClock:
    """When a node's shaped uplink is free next (``time.perf_counter`` seconds), and when results arrive."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def schedule(self, start: float, node_bytes: int, bandwidth_bps: float, latency_s: float) -> float:
        """Place ``node_bytes`` (the node's bytes of one operation started at ``start``) on the uplink.

        Returns when the result is ready: after the last byte left (queued behind operations still
        on the uplink) and ``latency_s`` (the operation's messages' latency) more.
        """
        transfer = node_bytes * 8.0 / bandwidth_bps
        begin = max(start, self.free_at)
        self.free_at = begin + transfer
        return self.free_at + latency_s
