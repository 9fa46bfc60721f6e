"""The Lighthouse behind a gate that only the job's members pass (docs/internet.md).

torchft's Lighthouse asks for no credential: whoever reaches its port can read its status page (every
member's id, address and step), stop a node through its kill route, and ask for quorums. A job's node
screens every quorum (:func:`lowband.trust.admission.screen`) and never trains with an outsider, but an
outsider that keeps asking for quorums keeps the job asking again, and so stalls it. torchft's
Lighthouse cannot be given a credential, so lowband puts it behind this gate:

- torchft's Lighthouse listens on loopback only, on a port of its own (its status page and kill
  route are then for the Lighthouse's own host alone);
- the gate listens on the job's address and serves the two calls a node's Manager makes, ``Quorum``
  and ``Heartbeat`` (gRPC), and nothing else: no status page, no kill route;
- a ``Quorum`` is forwarded only when the asking member's replica id proves the job's secret for what
  it claims (:func:`lowband.trust.admission.proves`: its job, slot, store and Manager addresses) and the
  addresses in the request are the ones its tag vouches for; a ``Heartbeat`` only when its id proves
  the secret. Anything else is refused at once (PERMISSION_DENIED, with :data:`REFUSED` in the
  message), before the Lighthouse sees it: an outsider is never in a quorum, so it cannot make the job
  ask for one again (what its calls still cost is gRPC's work for each, on the gate's host).

The gate also keeps out a member that stalls the job, or that most of the other members report for bad
messages (:class:`StallBreaker`; a report is the gate's own call :data:`ACCUSE`, never forwarded).
It records the job's end (a member's :data:`DONE`, :mod:`lowband.ft.completion`), and tells a node that asks after
it that the job is complete, with where its final checkpoints are.

The gate reads a request's protobuf fields by hand, with bounds (a request of at most :data:`MAX_REQUEST_BYTES`,
refused by gRPC beyond it; at most :data:`MAX_FIELDS` fields a message), checks the replica id's tag before
anything else, and uses three strings of a ``Quorum`` request, one of a ``Heartbeat``: the request bytes are
forwarded as they came, never deserialised into objects. It holds no state of the job, and no table that grows
with what strangers send (refusals are counted by kind; the hosts it names and limits are bounded).
What it does not do: a member of the job (it holds the secret) passes, whatever it does later; and with the secret
alone a replica id copied from a member passes with the member's own addresses (the requests that torchft's Manager
makes carry nothing fresh to sign). With a roster (per-member keys, :mod:`lowband.trust.keys`) the gate also takes a
member's own calls only signed by its key, fresh and never replayed, and ``Quorum`` and ``Heartbeat`` only from the
process the member's key registered, over the connections that process named, signed, from its address
(:meth:`LighthouseGateway.member_refusal`, :mod:`lowband.ft.pins`).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

from lowband.ft.completion import COMPLETE, DONE, CompletionRecord, complete_reason, done_fields, job_complete
from lowband.ft.pins import endpoint_of_peer, parse_pins, spell_pins
from lowband.ft.protowire import (
    MAX_FIELDS,
    RESPONSE_FIELDS,
    call_gate,
    parse_fields,
    sign_request,
    signed_parts,
    string_field,
)
from lowband.ft.protowire import string_of as _string
from lowband.trust.admission import CannotListen, claim_of, proves, same_host
from lowband.trust.keys import MemberKey, ReplayCache, Roster, verify_call
from lowband.trust.limits import SourceLimiter, Tarpit

__all__ = ["ACCUSE", "ADMIT", "COMMITTED_SCALE", "DONE", "HEARTBEAT", "HELD_OUT", "KEPT_OUT", "MAX_FIELDS", "PINNED", "QUORUM",
           "REFUSED", "UNREGISTERED", "LighthouseGateway", "StallBreaker", "accusation_request", "accuse_at_gate",
           "admission_request", "ask_gate", "gate_reason", "parse_fields", "peer_host", "quorum_round", "refusal",
           "sign_request", "signed_parts", "string_field"]

log = logging.getLogger(__name__)

SERVICE = "torchft.LighthouseService"
QUORUM = f"/{SERVICE}/Quorum"
HEARTBEAT = f"/{SERVICE}/Heartbeat"
#: The gate's own call, answered by the gate and never forwarded: may this member pass? (a LighthouseQuorumRequest's
#: bytes, see :func:`admission_request`). A node asks it before it starts torchft's Manager, which would retry a
#: refused quorum until its timeout and then report only the timeout; torchft's Lighthouse answers UNIMPLEMENTED.
GATE_SERVICE = "lowband.LighthouseGate"
ADMIT = f"/{GATE_SERVICE}/Admit"
#: A member's report, answered by the gate and never forwarded: a member of the current quorum sent this one bad
#: messages (:func:`accusation_request`). With the reports of most of the other members the gate removes it from
#: the quorum (:meth:`StallBreaker.accuse`).
ACCUSE = f"/{GATE_SERVICE}/Accuse"
#: In the message of every refusal: a refused node recognises it (:func:`lowband.ft.node` raises AdmissionRefused).
REFUSED = "lowband gateway: not a member of this job"
#: In the refusal of a member that the gate removed from the job: most of the other members reported its messages
#: (a node tells it from a refusal at admission, and leaves).
KEPT_OUT = "the Lighthouse's gate keeps node"
#: In the refusal of a member that the gate holds out for a while: the job's steps failed while it was in the quorum.
#: That is no proof of its own (a link cut by someone else looks the same): the node waits, then joins again and heals.
HELD_OUT = "the Lighthouse's gate holds node"
#: In the refusal of a process of a job with a roster when no process of its slot is registered (the gate forgot it).
UNREGISTERED = "registered no process"
#: In the refusal of a call over another connection than the one the registered process of its slot calls over.
PINNED = "calls over another connection"


def gate_reason(message: str) -> str | None:
    """The gate's reason in an error's ``message`` (grpc's details, or torchft's rendering of the status), or
    None when the message is not the gate's refusal."""
    if REFUSED not in message:
        return None
    return message.split(REFUSED, 1)[1].split('", details', 1)[0].lstrip(": ")


# --------------------------------------------------------------------------- the request's fields
#: The largest request the gate (and a node's Manager gate) takes: a node's ``Quorum`` request is a few hundred
#: bytes (its replica id, two addresses, a step), a ``Heartbeat`` less. gRPC refuses a larger one
#: (RESOURCE_EXHAUSTED) from its length prefix, before the gate's code sees a byte of it.
MAX_REQUEST_BYTES = 16 << 10
def admission_request(rid: str, address: str, store: str, *, key: MemberKey | None = None, pins: str = "",
                      last_step: int | None = None) -> bytes:
    """The bytes of a LighthouseQuorumRequest whose requester has replica id ``rid``, Manager ``address`` and
    ``store``: what :data:`ADMIT` reads. With ``key`` (the member's own), signed (:func:`sign_request`): in a job with
    a roster, the gate then takes ``rid`` as the process that holds the member's node slot, calling over the
    connections ``pins`` names (field 2, :func:`lowband.ft.pins.spell_pins`; none named: the first to call), in a job
    whose last step is ``last_step`` (field 3: :mod:`lowband.ft.completion`)."""
    member = string_field(1, rid.encode()) + string_field(2, address.encode()) + string_field(3, store.encode())
    return sign_request(key, ADMIT, string_field(1, member) + (string_field(2, pins.encode()) if pins else b"")
                        + (string_field(3, str(int(last_step)).encode()) if last_step is not None else b""))


def accusation_request(rid: str, address: str, store: str, accused: str, why: str, *,
                       key: MemberKey | None = None) -> bytes:
    """The bytes of an :data:`ACCUSE` call: the reporting member as in :func:`admission_request` (field 1), the
    replica id of the member it reports (field 2) and what was wrong with its messages (field 3); signed with
    ``key`` when given."""
    return sign_request(key, ACCUSE, admission_request(rid, address, store) + string_field(2, accused.encode())
                        + string_field(3, why.encode()[:300].decode("utf-8", "ignore").encode()))


#: The kinds of refusal (each reason starts with one): what the gate counts, never the caller's text, which would grow.
REFUSAL_KINDS = ("malformed request", "the request names no requester", "replica id does not prove the job's secret",
                 "its addresses are not the ones its tag vouches for", "the call came from another address than its "
                 "member's", "the call is not signed by its member's key", "not the process its member registered",
                 "too many refused calls from this host")


def refusal_kind(why: str) -> str:
    """Which of :data:`REFUSAL_KINDS` a refusal's reason is (``"other"`` for none)."""
    return next((k for k in REFUSAL_KINDS if why.startswith(k)), "other")


def refusal(secret: bytes, request: bytes, method: str) -> str | None:
    """Why ``request`` (the raw bytes of a ``Quorum`` or ``Heartbeat`` call) is refused, or None.

    ``Quorum`` (LighthouseQuorumRequest: field 1, the requester, a QuorumMember whose fields 1-3 are its
    replica id, Manager address and store address) passes when the id proves the secret and the two
    addresses are those it claims; ``Heartbeat`` (LighthouseHeartbeatRequest: field 1, the replica id)
    when the id proves the secret. Each reason starts with one of :data:`REFUSAL_KINDS`. Never raises: the
    fields are read with bounds (:func:`parse_fields`), then the id's tag is checked (an HMAC) before
    anything else of the request is looked at."""
    try:
        fields = parse_fields(request)
        if method == HEARTBEAT:
            rid = _string(fields, 1)
            return None if proves(secret, rid) else f"replica id does not prove the job's secret ({rid[:80]!r})"
        member = fields.get(1) or [b""]
        if not isinstance(member[-1], bytes):
            return "the request names no requester"
        m = parse_fields(member[-1])
        rid, address, store = _string(m, 1), _string(m, 2), _string(m, 3)
    except (ValueError, UnicodeDecodeError) as e:
        return f"malformed request ({e})"
    if not proves(secret, rid):
        return f"replica id does not prove the job's secret ({rid[:80]!r})"
    claim = claim_of(rid)
    if address.split("://", 1)[-1].rstrip("/") != claim.manager or store != claim.store:
        return (f"its addresses are not the ones its tag vouches for (Manager {address[:60]!r}, store {store[:60]!r}; "
                f"the tag's: {claim.manager!r}, {claim.store!r})")
    return None


# --------------------------------------------------------------------------- a member that stalls the job
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


# --------------------------------------------------------------------------- the gate
#: How often (seconds, at most) the gate logs how many calls it refused since, by kind (a host is named only once).
SUMMARY_S = 60.0
#: The most calls of one slot that wait at once for its process to register or name their connection.
MAX_AWAITING = 4
#: How many refused hosts the gate names in its log (once each); past it the least recent are forgotten.
NAMED_HOSTS = 1024
#: The most calls at once over one connection (torchft's Manager makes its quorum request and heartbeats over one): a
#: flooder cannot get past the tarpit (:class:`~lowband.trust.limits.Tarpit`) by many calls over one connection.
MAX_STREAMS = 16
#: The gRPC server's bounds: requests of at most :data:`MAX_REQUEST_BYTES`, headers of at most 8 KiB, no SO_REUSEPORT
#: (gRPC's default on Linux: another process of the same user could bind the same port and take calls).
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_REQUEST_BYTES), ("grpc.max_metadata_size", 8 << 10),
                  ("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", MAX_STREAMS)]


def _listen(server, bind: str, what: str) -> int:
    """Bind ``server`` to exactly ``bind`` (a checked ``HOST:PORT``): its port, or an OSError naming the address."""
    fix = ("not an address of this machine, or the port is taken (pass an address this machine holds, `ip -brief "
           "address` lists them, and a free port)")
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError as e:
        raise CannotListen(f"{what} cannot listen on {bind}: {fix}; gRPC says: {e}") from None
    if not port:
        raise CannotListen(f"{what} cannot listen on {bind}: {fix}")
    return port


def _timeout(context) -> float | None:
    """The seconds left to the caller's deadline, for the call passed on; None when it set none (gRPC then
    reports about 9.2e18 s, and a deadline that far away fails the passed-on call at once: torchft's heartbeats
    carry no deadline)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e6 else None


class LighthouseGateway:
    """Serve ``Quorum`` and ``Heartbeat`` on ``bind`` for the job's members only, forwarded to torchft's
    Lighthouse at ``backend`` (``HOST:PORT``, on loopback). ``address()`` is what nodes pass as
    ``--ft-lighthouse``; ``refused`` counts the refusals by kind (:data:`REFUSAL_KINDS`).

    What a caller can make it do: a request over :data:`MAX_REQUEST_BYTES` is refused by gRPC from its length
    prefix; at most ``workers`` calls run at once (more are refused by gRPC, RESOURCE_EXHAUSTED); a host refused
    more than its budget (:class:`SourceLimiter`) is refused before its request is read; the warning that names
    a refused host is written once per host, for at most :data:`NAMED_HOSTS` hosts. ``completion_file``: where the
    job's completion record is kept (:class:`~lowband.ft.completion.CompletionRecord`)."""

    def __init__(self, *, bind: str, backend: str, secret: bytes, workers: int = 256,
                 breaker: StallBreaker | None = None, limiter: SourceLimiter | None = None,
                 roster: Roster | None = None, replays: ReplayCache | None = None, pin_idle_s: float = 3.0,
                 pin_grace_s: float = 2.0, completion_file=None) -> None:
        import grpc  # optional dependency (the ft extra)

        self._grpc = grpc
        self._secret = secret
        self.roster = roster
        self.replays = replays if replays is not None else ReplayCache()
        self.registered: dict[int, str] = {}  # with a roster: node slot -> the replica id its key last registered
        self.pinned: dict[int, tuple[str, float]] = {}  # node slot -> (the connection its process calls over, when)
        self.named: dict[int, frozenset] = {}  # node slot -> the connections its registered process named (signed)
        self.direct: dict[int, bool] = {}  # node slot -> its process named connections on its own address (no NAT)
        self.pin_grace_s = pin_grace_s
        self._awaiting: Counter[int] = Counter()  # node slot -> calls waiting for its registration (bounded)
        self.declared: dict[int, int] = {}  # node slot -> the job's last step, as its registration declared it (signed)
        self.pin_idle_s = pin_idle_s
        self.breaker = breaker if breaker is not None else StallBreaker()
        self.limiter = limiter if limiter is not None else SourceLimiter()
        self.tarpit = Tarpit(slots=max(1, workers // 8))  # a refused connection waits; its members keep 7/8 of the pool
        self.refused: Counter[str] = Counter()
        self.completion = CompletionRecord(completion_file)  # the job's end (lowband.ft.completion)
        self._named: OrderedDict[str, None] = OrderedDict()
        self._summary: tuple[float, Counter[str]] = (time.monotonic(), Counter())  # when the refusals were last logged
        self._lock = threading.Lock()
        self._registered = threading.Condition(self._lock)  # notified at each registration
        self._channel = grpc.insecure_channel(backend)
        self._forward = {m: self._channel.unary_unary(m) for m in (QUORUM, HEARTBEAT)}  # bytes in, bytes out
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._handler(path))
                    for name, path in (("Quorum", QUORUM), ("Heartbeat", HEARTBEAT))}
        admit = {"Admit": grpc.unary_unary_rpc_method_handler(self._handler(ADMIT)),
                 "Accuse": grpc.unary_unary_rpc_method_handler(self._handler(ACCUSE)),
                 "Done": grpc.unary_unary_rpc_method_handler(self._handler(DONE))}
        self._server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowband-gateway"),
                                   handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers),
                                             grpc.method_handlers_generic_handler(GATE_SERVICE, admit)],
                                   options=SERVER_OPTIONS, maximum_concurrent_rpcs=workers)
        host = bind.rsplit(":", 1)[0]
        self._port = _listen(self._server, bind, "the Lighthouse's gate")
        self._host = host.strip("[]")
        self._server.start()

    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    def _handler(self, method: str):
        def handle(request: bytes, context) -> bytes:
            peer = context.peer()
            host = peer_host(peer)
            self.tarpit.wait(peer, context.time_remaining())  # a connection refused again and again waits first
            if self.limiter.over(host):  # unread; not a member's refusal (no REFUSED): a node retries, never leaves
                self._note(REFUSAL_KINDS[-1], host, log_it=False)
                self.tarpit.refused(peer)
                context.abort(self._grpc.StatusCode.RESOURCE_EXHAUSTED, f"lowband gateway: {REFUSAL_KINDS[-1]}")
            why = refusal(self._secret, request, method if method in (QUORUM, HEARTBEAT) else QUORUM)
            if why is None and self.roster is not None:
                why = self.member_refusal(method, request, host, peer=context.peer())
            if why is not None:
                self.tarpit.refused(peer)
                self.limiter.refused(host)
                self._note(why, host)
                context.abort(self._grpc.StatusCode.PERMISSION_DENIED, f"{REFUSED}: {why}")
            self.limiter.passed(host)
            self.tarpit.passed(peer)
            if method == ACCUSE:
                return self._accuse(request, context)
            if method == DONE:
                return self._done(request, context)
            claim = self._claim(request, HEARTBEAT if method == HEARTBEAT else QUORUM)
            slot = claim.node if claim is not None else None
            if method in (ADMIT, QUORUM) and self.completion.applies_to(claim.fingerprint if claim else None):
                # a node back after the job ended: it leaves
                context.abort(self._grpc.StatusCode.FAILED_PRECONDITION, f"{COMPLETE} {self.completion.answer()}")
            held = self.breaker.held(slot) if slot is not None else None
            if held is not None and method == HEARTBEAT:
                return b""  # not passed on: the Lighthouse counts the member dead and forms quorums without it
            if held is not None and (held[0] == "removed" or (held[0] == "benched" and method == ADMIT)):
                self._refuse_held(context, slot, held)  # also asked by a member whose quorum waits (ADMIT)
            if method == ADMIT:
                return b""
            while held is not None:  # benched or on probation: its quorum request waits until that ends
                remaining = context.time_remaining()
                if remaining is not None and remaining < 1.0:
                    if held[0] == "benched":
                        self._refuse_held(context, slot, held)
                    context.abort(self._grpc.StatusCode.UNAVAILABLE, "the Lighthouse's gate holds this node out "
                                  "for a while (probation: does the job commit without it?)")
                time.sleep(min(0.2, max(0.0, held[1] - time.monotonic())) or 0.05)
                held = self.breaker.held(slot)
                if held is not None and held[0] == "removed":
                    self._refuse_held(context, slot, held)
            call = self._forward[method].future(request, timeout=_timeout(context))
            context.add_callback(call.cancel)  # the caller gave up (a quorum request's retry): so does this call,
            try:  # and its thread is free again (left waiting, they filled the pool and heartbeats stopped)
                answer = call.result()
            except self._grpc.FutureCancelledError:
                context.abort(self._grpc.StatusCode.CANCELLED, "the caller cancelled")
            except self._grpc.RpcError as e:  # the Lighthouse's own answer (a timeout, ...), passed on
                context.abort(e.code(), e.details() or "")
            if method == QUORUM:
                seen = quorum_round(answer)
                if seen is not None:
                    self.breaker.observe(*seen)
            return answer
        return handle

    def _refuse_held(self, context, slot: int, held: tuple[str, float]) -> None:
        """Refuse a call of a member the breaker keeps out: removed (:data:`KEPT_OUT`) or held out (:data:`HELD_OUT`)."""
        what = KEPT_OUT if held[0] == "removed" else HELD_OUT
        context.abort(self._grpc.StatusCode.PERMISSION_DENIED,
                      f"{REFUSED}: {what} {slot} out for {max(0.0, held[1] - time.monotonic()):.0f} s more: it "
                      f"{self.breaker.why.get(slot, 'stalled the job')}")

    def _await_registration(self, slot: int, rid: str, here) -> None:
        """Wait, at most ``pin_grace_s``, until ``rid`` is the registered process of ``slot`` and, where it names its
        connections, ``here`` is one of them: torchft's Manager opens a new connection after a failed call (and a
        restarted gate knows no process) and calls over it at once, a moment before the process names it (or
        registers again); refused, torchft would wait out its quorum's timeout. Another process's calls wait and are
        refused; at most :data:`MAX_AWAITING` wait for one slot at once (the others are refused at once)."""
        def ready() -> bool:
            return self.registered.get(slot) == rid and (not self.direct.get(slot) or here in self.named.get(slot, ()))
        if self.pin_grace_s <= 0:
            return
        deadline = time.monotonic() + self.pin_grace_s
        with self._registered:
            if ready() or self._awaiting[slot] >= MAX_AWAITING:
                return
            self._awaiting[slot] += 1
            try:
                while not ready() and (left := deadline - time.monotonic()) > 0:
                    self._registered.wait(left)
            finally:
                self._awaiting[slot] -= 1

    def member_refusal(self, method: str, request: bytes, host: str, *, peer: str = "") -> str | None:
        """With a roster, what a call whose replica id proved the secret must also show (one of :data:`REFUSAL_KINDS`,
        or None): it comes from the address its member's tag vouches for; a report (:data:`ACCUSE`, :data:`DONE`) is
        signed by its member's own key, fresh and never seen before; an :data:`ADMIT` that is signed registers its
        replica id as the process that holds the member's node slot (the latest one signed wins); a ``Quorum`` or
        ``Heartbeat`` passes only for that registered process, over the connections (``peer``: gRPC's ``ipv4:HOST:PORT``)
        its latest registration named (:mod:`lowband.ft.pins`); where it named none, or a NAT stands between (the
        named ends are on another address than the call's), over the connection its first such call after the
        registration came over, until that connection was idle ``pin_idle_s`` (torchft's Manager makes them all over
        one connection). An unsigned ``Admit`` only asks (whether the job is
        complete, whether the member is kept out; for a process, an id with torchft's ``:uuid``, also whether it is the
        registered one) and registers nothing."""
        try:  # a Quorum and a Heartbeat are torchft's: only their replica id is read (as refusal() read it)
            if method == HEARTBEAT:
                rid, parts, (t, nonce, sig) = _string(parse_fields(request), 1), (), ("", "", "")
            elif method == QUORUM:
                rid, parts, (t, nonce, sig) = _string(parse_fields(parse_fields(request)[1][-1]), 1), (), ("", "", "")
            else:
                rid, parts, (t, nonce, sig) = signed_parts(request)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            return f"malformed request ({e})"
        claim = claim_of(rid)
        if claim is None:  # refusal() has refused it already; never raises if called alone
            return f"replica id does not prove the job's secret ({rid[:80]!r})"
        own = claim.manager.rsplit(":", 1)[0]
        if not same_host(host, own):
            return (f"the call came from another address than its member's ({host[:60]}; its tag vouches for "
                    f"{own[:60]})")
        if method in (QUORUM, HEARTBEAT) or (method == ADMIT and not sig and ":" in rid):
            here = endpoint_of_peer(peer) if method != ADMIT else None
            if here is not None:  # torchft's call over a connection its process may be about to name: it may wait
                self._await_registration(claim.node, rid, here)
            if self.registered.get(claim.node) != rid:
                return (f"not the process its member registered: node {claim.node}'s key "
                        f"{'registered another process' if claim.node in self.registered else UNREGISTERED} (a copied "
                        "replica id, or a process of the node that another one replaced)")
            if method == ADMIT or not peer:
                return None
            if self.direct.get(claim.node) and here is not None:  # it named its connections, no NAT between
                named = self.named.get(claim.node, frozenset())
                if here in named:
                    return None
                return (f"not the process its member registered: node {claim.node}'s registered process {PINNED} "
                        f"(it named {spell_pins(named)[:120] or 'none now'}; this one is {peer[:60]})")
            with self._lock:
                now, pin = time.monotonic(), self.pinned.get(claim.node)
                if pin is None or pin[0] == peer or now - pin[1] >= self.pin_idle_s:
                    self.pinned[claim.node] = (peer, now)
                    return None
            return (f"not the process its member registered: node {claim.node}'s registered process {PINNED}, live "
                    f"{now - pin[1]:.1f} s ago (its replica id used by another process)")
        if method == ADMIT and not sig:  # a node's question before its Manager starts: whether it may pass at all
            return None
        why = verify_call(self.roster, self.replays, claim.node, sig, t, nonce, method, *parts)
        if why is not None:
            return f"the call is not signed by its member's key: {why}"
        if method == ADMIT:
            try:
                named = parse_pins(parts[3])
            except ValueError as e:
                return f"malformed request ({e})"
            if parts[4] and not (parts[4].isdigit() and len(parts[4]) <= 12):
                return f"malformed request (the job's last step is not a number: {parts[4][:20]!r})"
            with self._lock:
                if self.registered.get(claim.node) != rid:
                    self.direct[claim.node] = False  # a new process: first to call, until it names its connections
                self.registered[claim.node] = rid  # bounded: only slots of the roster get here
                self.named[claim.node] = named
                if named and all(same_host(str(ip), own) for ip, _ in named):
                    self.direct[claim.node] = True  # from now on only what it names, an empty naming included
                self._registered.notify_all()
                if parts[4]:
                    self.declared[claim.node] = int(parts[4])
                self.pinned.pop(claim.node, None)  # unless it named its connections, its next call pins one again
        return None

    def _accuse(self, request: bytes, context) -> bytes:
        """A member's report of another's bad messages (:data:`ACCUSE`; the reporter is already admitted)."""
        try:
            fields = parse_fields(request)
            reporter = _string(parse_fields((fields.get(1) or [b""])[-1]), 1)
            accused, what = _string(fields, 2), _string(fields, 3)
        except (ValueError, UnicodeDecodeError, TypeError) as e:
            context.abort(self._grpc.StatusCode.INVALID_ARGUMENT, f"malformed report ({e})")
        why = self.breaker.accuse(reporter, accused, peer_host(context.peer()), what)
        if why is not None:
            context.abort(self._grpc.StatusCode.FAILED_PRECONDITION, f"lowband gateway: the report is not counted: {why}")
        return b""

    def _done(self, request: bytes, context) -> bytes:
        """A member's report that it committed the job's last step (:data:`DONE`; the reporter is already admitted)."""
        try:
            rid, step, where = done_fields(request)
        except ValueError as e:
            context.abort(self._grpc.StatusCode.INVALID_ARGUMENT, f"malformed report ({e})")
        why = self.completion.done(rid, peer_host(context.peer()), step, where, self.breaker.round_members(),
                                   dict(self.declared))
        if why is not None:
            context.abort(self._grpc.StatusCode.FAILED_PRECONDITION, f"lowband gateway: the report is not counted: {why}")
        return b""

    @staticmethod
    def _claim(request: bytes, method: str):
        """What the (already admitted) request's replica id claims (:class:`lowband.trust.admission.Claim`), or None."""
        try:
            fields = parse_fields(request)
            if method == QUORUM:
                fields = parse_fields((fields.get(1) or [b""])[-1])  # the requester
            return claim_of(_string(fields, 1))
        except (ValueError, UnicodeDecodeError, TypeError):
            return None

    def _note(self, why: str, host: str, *, log_it: bool = True) -> None:
        with self._lock:
            self.refused[refusal_kind(why)] += 1
            first = log_it and host not in self._named
            if first:
                self._named[host] = None
                while len(self._named) > NAMED_HOSTS:
                    self._named.popitem(last=False)
            now, since = time.monotonic(), None
            if now - self._summary[0] >= SUMMARY_S:  # the refusals since the last summary, by kind
                since = {k: n - self._summary[1][k] for k, n in self.refused.items() if n > self._summary[1][k]}
                since_s, self._summary = now - self._summary[0], (now, Counter(self.refused))
        if first:
            log.warning("the Lighthouse's gate refused a call from %s: %s (once per host; then a count a minute)",
                        host or "?", why[:300])
        elif since:
            log.warning("the Lighthouse's gate refused %d calls in the last %.0f s: %s", sum(since.values()), since_s,
                        ", ".join(f"{n} {k}" for k, n in sorted(since.items())))

    def shutdown(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.2:5123``, ``ipv6:[::1]:5123``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return rest.rsplit(":", 1)[0] if kind == "ipv4" else ""


def accuse_at_gate(lighthouse: str, rid: str, accused: str, why: str, *, timeout_s: float = 10.0,
                   key: MemberKey | None = None) -> str | None:
    """Report to the gate at ``lighthouse`` that the member with replica id ``accused`` sent this member (replica id
    ``rid``) bad messages (``why``), signed with the member's ``key`` when given: None when the gate counted it,
    else why not (no gate: torchft's own Lighthouse, which cannot remove a member; or the report was refused)."""
    claim = claim_of(rid)
    if claim is None:
        return f"{rid[:80]!r} is not a lowband replica id"
    return call_gate(lighthouse, ACCUSE, accusation_request(rid, f"http://{claim.manager}", claim.store, accused, why,
                                                            key=key), timeout_s=timeout_s)


def ask_gate(lighthouse: str, rid: str, address: str, store: str, *, timeout_s: float = 10.0,
             key: MemberKey | None = None, pins: str = "", last_step: int | None = None) -> str | None:
    """Ask the gate at ``lighthouse`` (``http://HOST:PORT``) whether a member with replica id ``rid``, Manager
    ``address`` and ``store`` may pass: the gate's reason for refusing it, or None (it passes; or the Lighthouse
    has no gate, or cannot be reached yet: torchft's Manager then finds out by itself). With the member's ``key``
    the question is signed, and in a job with a roster registers ``rid`` as the process of the member's slot, calling
    over the connections ``pins`` names, in a job whose last step is ``last_step``. Raises :class:`~lowband.ft.completion.JobComplete` when the gate says the job is complete."""
    import grpc  # optional dependency (the ft extra)

    target = lighthouse.split("://", 1)[-1].rstrip("/")
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(ADMIT)(admission_request(rid, address, store, key=key, pins=pins, last_step=last_step),
                                      timeout=timeout_s)
        except grpc.RpcError as e:
            done = complete_reason(e.details() or "") if e.code() == grpc.StatusCode.FAILED_PRECONDITION else None
            if done is not None:
                raise job_complete(lighthouse, done) from None
            why = gate_reason(e.details() or "") if e.code() == grpc.StatusCode.PERMISSION_DENIED else None
            if why is not None:
                return why
            log.debug("the Lighthouse at %s did not answer the gate's question (%s): no gate, or not up yet",
                      lighthouse, e.code())
    return None
