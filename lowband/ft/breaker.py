"""The Lighthouse's gate's judge of members that stall the job or send bad messages (:class:`StallBreaker`): it reads
each quorum round the gate forwards (:func:`quorum_round`) and the members' reports, and says whom the gate keeps out
(:mod:`lowband.ft.gateway`)."""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import Counter, deque

from lowband.ft.protowire import RESPONSE_FIELDS, parse_fields
from lowband.ft.protowire import string_of as _string
from lowband.trust.admission import claim_of

__all__ = ["COMMITTED_SCALE", "StallBreaker", "quorum_round"]

log = logging.getLogger("lowband.ft.gateway")  # the gate's log: what it decides is the gate's


#: A lowband node reports training step × this + committed steps to the quorum (:func:`lowband.ft.node.quorum_step`): a
#: dropped step advances the first and not the second.
COMMITTED_SCALE = 1 << 32


def quorum_round(response: bytes) -> tuple[tuple[int, int], dict[int, int], dict[int, str]] | None:
    """A LighthouseQuorumResponse's round: (its ``created`` timestamp, {member's slot: its quorum step}, {member's
    slot: its replica id}), or None when the bytes do not read as one (field 1: the Quorum; its field 2: the members, each with replica id 1 and
    step 4; its field 3: the timestamp, seconds 1 and nanos 2)."""
    try:  # the Lighthouse's answer lists every member: read with a bound of its own
        (quorum,) = parse_fields(response, max_fields=RESPONSE_FIELDS).get(1) or [None]
        if not isinstance(quorum, bytes):
            return None
        q = parse_fields(quorum, max_fields=RESPONSE_FIELDS)
        ts = q.get(3) or [b""]
        t = parse_fields(ts[-1]) if isinstance(ts[-1], bytes) else {}
        created = (int((t.get(1) or [0])[-1]), int((t.get(2) or [0])[-1]))
        members: dict[int, int] = {}
        ids: dict[int, str] = {}
        for raw in q.get(2) or []:
            if not isinstance(raw, bytes):
                return None
            m = parse_fields(raw)
            rid = _string(m, 1)
            claim = claim_of(rid)
            if claim is None:
                return None
            ids[claim.node] = rid
            step = int((m.get(4) or [0])[-1])
            step = step - (1 << 64) if step >= 1 << 63 else step  # int64 on the wire
            members[claim.node] = step  # training step × COMMITTED_SCALE + committed steps (lowband.ft.node.quorum_step)
        return created, members, ids
    except (ValueError, UnicodeDecodeError, TypeError):
        return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StallBreaker:
    """Finds a member that makes the job's steps fail, and keeps it out.

    A member that holds the secret can heartbeat and ask for quorums and then never send (or never configure
    its process group): every step of a quorum that holds it waits out the timeout and is dropped, and the
    collective names no one. The gate sees every quorum round go by, and in it what each member reports: the
    training step it is at and the steps it has committed (:func:`lowband.ft.node.quorum_step`). From one round to
    the next a member *committed* (a step went through), *dropped* (its training step moved on, its commits
    did not) or neither (it waited: the start, a quorum asked again). A round *failed* when more than half of
    its members that are in the next round dropped, and *went through* when more than half committed; a liar
    alone cannot swing either while two honest members are in the round.

    - When, of the last ``4 × stall_rounds`` rounds with an outcome, ``stall_rounds`` or more failed and
      exactly one member was in every one that failed and in none that went through, that member is
      *benched*.
    - When the last ``stall_rounds`` failed and several members were in each (the same members every round,
      nothing went through), one of them (the latest to join first) is put on *probation* for ``probation_s``: its heartbeats go no further (the
      Lighthouse soon counts it dead and forms quorums without it) and its quorum requests wait. If the others
      commit meanwhile, it is benched; if not, it comes back (and heals like any node that was away) and the
      next is tried. Probation needs 3 or more members: with two, each one's absence leaves the other alone.

    - A member that sends *bad messages* (they fail their checks: :mod:`lowband.compress.check`) is evicted from
      the exchange by each member that receives them, and each reports it (:meth:`accuse`). When two or more of
      the round's other members, and more than half of them, reported it, it is benched. A report counts only
      from a member of the current round, about a member of it, and from the address the reporting member's tag
      vouches for: on a network where each node has its own address (a VPN), one member cannot speak for
      others, and the reporters must be on two or more addresses (on loopback, where every node has the same
      one, the slots count). A member alone, or a minority, cannot remove an honest one.

    A benched member is kept out for ``bench_s`` (twice as long each time again): its heartbeats go no further and
    a warning names it. One reported for bad messages is *removed*: its calls are refused with the reason
    (:data:`KEPT_OUT`) and its node leaves. One benched because steps failed while it was in the quorum is *held
    out*: that is no proof of its own (a member whose link someone else cuts or floods looks the same), so its
    quorum requests wait, its question at admission is answered with :data:`HELD_OUT` and the time left, and its
    node waits and then joins again and heals, like a node that was away.
    """

    def __init__(self, *, stall_rounds: int = 3, probation_s: float = 30.0, bench_s: float = 600.0,
                 clock=time.monotonic) -> None:
        self.stall_rounds, self.probation_s, self.bench_s = stall_rounds, probation_s, bench_s
        self._clock = clock
        self._lock = threading.Lock()
        self._created: tuple[int, int] | None = None
        self._last: dict[int, int] | None = None  # the last round: slot -> its quorum step
        self._round = 0
        self._joined: dict[int, int] = {}  # slot -> the round it joined (came back to) the quorum
        self.outcomes: deque[tuple[frozenset[int], bool]] = deque(maxlen=4 * stall_rounds)
        self._tried: set[int] = set()
        self.probation: tuple[int, float, dict[int, int]] | None = None  # slot, until, the others' commits then
        self.benched: dict[int, float] = {}  # slot -> until
        self.why: dict[int, str] = {}  # slot -> why it is benched
        self.removes: set[int] = set()  # benched slots whose own messages the others reported: removed, not held
        self.offences: Counter[int] = Counter()
        self._ids: dict[int, str] = {}  # the last round's members: slot -> replica id
        self.reports: dict[str, dict[int, str]] = {}  # reported replica id -> {reporting slot: its address}

    def observe(self, created: tuple[int, int], members: dict[int, int], ids: dict[int, str] | None = None) -> None:
        """One quorum round as the Lighthouse answered it: {slot: its quorum step} and {slot: its replica id}
        (each member gets the same answer: seen once)."""
        with self._lock:
            if created == self._created:
                return
            self._created, self._round = created, self._round + 1
            if ids is not None:
                self._ids = dict(ids)
                for rid in [r for r in self.reports if r not in self._ids.values()]:
                    del self.reports[rid]  # it left (or came back as a new process): reports about it lapse
            now = self._clock()
            self._expire(now)
            for slot in members:
                if self._last is None or slot not in self._last:
                    self._joined[slot] = self._round
            if self.probation is not None:
                slot, _, before = self.probation
                moved = sum(1 for s, c in before.items() if s in members and members[s] % COMMITTED_SCALE > c)
                if slot not in members and moved * 2 > len(before):
                    self._bench(slot, now, "without it the others committed again; it takes part in quorums but not "
                                "in the exchange")
            if self._last is not None:
                self._outcome(self._last, members)
            self._last = dict(members)
            if self.probation is None:
                self._judge(now)

    def _outcome(self, last: dict[int, int], now: dict[int, int]) -> None:
        both = [s for s in last if s in now]
        committed = sum(1 for s in both if now[s] % COMMITTED_SCALE > last[s] % COMMITTED_SCALE)
        dropped = sum(1 for s in both if now[s] % COMMITTED_SCALE == last[s] % COMMITTED_SCALE
                      and now[s] // COMMITTED_SCALE > last[s] // COMMITTED_SCALE)
        if committed * 2 > len(both):
            self.outcomes.append((frozenset(last), True))
            self._tried.clear()
        elif both and dropped * 2 > len(both):
            self.outcomes.append((frozenset(last), False))

    def _judge(self, now: float) -> None:
        failed = [m for m, ok in self.outcomes if not ok]
        if len(failed) < self.stall_rounds:
            return
        common = frozenset.intersection(*failed)
        for members, ok in self.outcomes:
            if ok:
                common -= members
        if len(common) == 1:
            (slot,) = common
            self._bench(slot, now, f"it was in each of the last {len(failed)} quorums whose steps failed and in "
                                   "none that went through; it takes part in quorums but not in the exchange")
            return
        recent = list(self.outcomes)[-self.stall_rounds:]
        if any(ok for _, ok in recent):
            return
        common = frozenset.intersection(*(m for m, _ in recent))
        left = [s for s in common if s not in self._tried and s not in self.benched]
        size = min(len(m) for m, _ in recent)
        if not left or size < 3:
            if not left:
                self._tried.clear()
            return
        slot = max(left, key=lambda s: (self._joined.get(s, 0), s))  # the latest to join first
        self._tried.add(slot)
        self.outcomes.clear()
        others = {s: v % COMMITTED_SCALE for s, v in (self._last or {}).items() if s != slot}
        self.probation = (slot, now + self.probation_s, others)
        log.warning("the Lighthouse's gate: the last %d quorums of nodes %s failed their steps and none went "
                    "through; node %d is left out for %.0f s to see whether the others commit without it",
                    self.stall_rounds, sorted(common), slot, self.probation_s)

    def accuse(self, reporter: str, accused: str, host: str, what: str) -> str | None:
        """A member's report that the member with replica id ``accused`` sent it bad messages (``what``), from
        the address ``host``. None when it counts, else why it does not."""
        a, b = claim_of(reporter), claim_of(accused)
        with self._lock:
            if a is None or self._ids.get(a.node) != reporter:
                return "the reporting member is not in the current quorum"
            if b is None or self._ids.get(b.node) != accused or b.node == a.node:
                return "the member reported is not (or no longer) in the current quorum"
            own = a.manager.rsplit(":", 1)[0].strip("[]")
            if host != own:
                return f"the report came from {host}, not from the reporting member's address ({own})"
            votes = self.reports.setdefault(accused, {})
            votes[a.node] = host
            loopback = all(_is_loopback(h) for h in votes.values())
            voices = len(votes) if loopback else len(set(votes.values()))
            if voices >= 2 and voices * 2 > len(self._ids) - 1 and b.node not in self.benched:
                del self.reports[accused]
                self._bench(b.node, self._clock(), f"nodes {', '.join(map(str, sorted(votes)))} of the job reported "
                            f"bad messages from it ({what[:200]})", headline="sent bad messages", removes=True)
            return None

    def _bench(self, slot: int, now: float, why: str, *, headline: str = "stalled the job", removes: bool = False) -> None:
        self.offences[slot] += 1
        until = now + self.bench_s * 2 ** (self.offences[slot] - 1)
        self.benched[slot] = until
        self.why[slot] = f"{headline}: {why}"
        (self.removes.add if removes else self.removes.discard)(slot)
        self.probation = None
        self._tried.clear()
        self.outcomes.clear()
        log.warning("the Lighthouse's gate: node %d %s (%s); it is kept out for %.0f s%s", slot, headline, why,
                    until - now, "" if removes else " (its node waits, then joins again and heals)")

    def _expire(self, now: float) -> None:
        if self.probation is not None and now >= self.probation[1]:
            self.probation = None  # the others did not commit without it: it comes back
        for slot in [s for s, until in self.benched.items() if now >= until]:
            del self.benched[slot]
            self.why.pop(slot, None)
            self.removes.discard(slot)

    def round_members(self) -> dict[int, tuple[str, int]]:
        """The current round's members: slot -> (replica id, the training step it was at)."""
        with self._lock:
            return {s: (rid, (self._last or {}).get(s, 0) // COMMITTED_SCALE) for s, rid in self._ids.items()}

    def held(self, slot: int) -> tuple[str, float] | None:
        """("removed", "benched" or "probation", until) for a member the gate keeps out now, else None: "removed" when
        the others reported its messages (it leaves the job), "benched" when steps failed with it (it waits)."""
        with self._lock:
            self._expire(self._clock())
            if slot in self.benched:
                return "removed" if slot in self.removes else "benched", self.benched[slot]
            if self.probation is not None and self.probation[0] == slot:
                return "probation", self.probation[1]
            return None
