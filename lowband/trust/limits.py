"""Bounds on what a stranger can make a listener do: per-source budgets of refused calls, in tables of bounded size.

Every listener of a job (the Lighthouse's gate, a node's state server) refuses a caller that fails its checks at
once; a :class:`SourceLimiter` also bounds how often one host is refused before its calls are refused unread, and
every table it keeps is bounded, whoever calls (docs/internet.md, "What a listener takes from a stranger").
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict

__all__ = ["SourceLimiter", "Tarpit"]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class SourceLimiter:
    """Per-source budgets for refused calls: each host may be refused ``burst`` times, then ``rate_per_s`` times a
    second. A host over its budget is refused at once, before its request is read. Never refused this way,
    only by the checks: a host that sent a call that passed in the last ``member_s`` seconds (a member's), and
    loopback (on one machine every node shares it with whoever else runs there, and a stranger there could
    otherwise spend the members' budget). At most ``max_hosts`` hosts are remembered in each table, the least
    recent forgotten first: the tables are bounded whoever calls."""

    def __init__(self, *, rate_per_s: float = 20.0, burst: float = 100.0, max_hosts: int = 4096,
                 member_s: float = 60.0, clock=time.monotonic) -> None:
        self.rate_per_s, self.burst, self.max_hosts, self.member_s = rate_per_s, burst, max_hosts, member_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: OrderedDict[str, tuple[float, float]] = OrderedDict()  # host -> (tokens, when)
        self._members: OrderedDict[str, float] = OrderedDict()  # host -> when a call from it last passed

    def over(self, host: str) -> bool:
        """Whether ``host`` is over its budget of refusals (and sent no call that passed lately)."""
        if _loopback(host):
            return False
        with self._lock:
            now = self._clock()
            seen = self._members.get(host)
            if seen is not None and now - seen < self.member_s:
                return False
            tokens, when = self._tokens.get(host, (self.burst, now))
            return min(self.burst, tokens + (now - when) * self.rate_per_s) < 1.0

    def refused(self, host: str) -> None:
        """Count one refusal of a call from ``host``."""
        with self._lock:
            now = self._clock()
            tokens, when = self._tokens.pop(host, (self.burst, now))
            self._tokens[host] = (max(0.0, min(self.burst, tokens + (now - when) * self.rate_per_s) - 1.0), now)
            while len(self._tokens) > self.max_hosts:
                self._tokens.popitem(last=False)

    def passed(self, host: str) -> None:
        """A call from ``host`` passed the checks."""
        with self._lock:
            self._members.pop(host, None)
            self._members[host] = self._clock()
            while len(self._members) > self.max_hosts:
                self._members.popitem(last=False)

    def __len__(self) -> int:
        return len(self._tokens) + len(self._members)


class Tarpit:
    """Slows a connection whose calls keep being refused, so that a process that floods a listener over it waits
    instead of costing the listener's host a call's work as fast as it can send.

    A connection (gRPC's peer, ``ipv4:HOST:PORT``: one per client channel) refused more than ``free`` times since its
    last call that passed has each of its next calls wait ``delay_s`` (never past its deadline) before the call is read
    and checked; the first that passes clears it. The calls are still checked, so a member whose connection was
    refused for a while (a gate that restarted and forgot it) is slowed, never shut out. At most ``slots`` calls wait
    at once (each holds a worker thread of the gate's pool, which its members need): the others go on at once. At
    most ``max_connections`` connections are remembered, the least recent forgotten first."""

    def __init__(self, *, free: int = 10, delay_s: float = 1.0, slots: int = 32, max_connections: int = 4096,
                 sleep=time.sleep) -> None:
        self.free, self.delay_s, self.max_connections = free, delay_s, max_connections
        self._slots = threading.BoundedSemaphore(slots)
        self._sleep = sleep
        self._lock = threading.Lock()
        self._refused: OrderedDict[str, int] = OrderedDict()  # connection -> refusals since a call passed
        self.waited = 0  # calls slowed so far

    def wait(self, peer: str, remaining_s: float | None = None) -> float:
        """Before a call from ``peer`` is read: wait if its connection is slowed (and a slot is free). Returns the
        seconds waited."""
        with self._lock:
            slowed = self._refused.get(peer, 0) > self.free
        if not slowed or not self._slots.acquire(blocking=False):
            return 0.0
        try:
            delay = self.delay_s if remaining_s is None else max(0.0, min(self.delay_s, remaining_s - 1.0))
            self._sleep(delay)
            self.waited += 1
            return delay
        finally:
            self._slots.release()

    def refused(self, peer: str) -> None:
        with self._lock:
            self._refused[peer] = self._refused.pop(peer, 0) + 1
            while len(self._refused) > self.max_connections:
                self._refused.popitem(last=False)

    def passed(self, peer: str) -> None:
        with self._lock:
            self._refused.pop(peer, None)

    def __len__(self) -> int:
        return len(self._refused)
