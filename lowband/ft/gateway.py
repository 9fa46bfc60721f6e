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

import contextlib
import ipaddress
import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from lowband.ft.breaker import COMMITTED_SCALE, StallBreaker, quorum_round
from lowband.ft.completion import COMPLETE, DONE, CompletionRecord, complete_reason, done_fields, job_complete
from lowband.ft.pins import connection_inode, endpoint_of_peer, parse_pins, plain_ip, spell_pins
from lowband.ft.protowire import (
    MAX_FIELDS,
    call_gate,
    parse_fields,
    sign_request,
    signed_parts,
    string_field,
)
from lowband.ft.protowire import string_of as _string
from lowband.trust.admission import CannotListen, claim_of, proves, same_host
from lowband.trust.keys import MemberKey, ReplayCache, Roster, verify_call, verify_mac
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
def admission_request(rid: str, address: str, store: str, *, key: MemberKey | None = None, pins: str = "") -> bytes:
    """The bytes of a LighthouseQuorumRequest whose requester has replica id ``rid``, Manager ``address`` and
    ``store``: what :data:`ADMIT` reads. With ``key`` (the member's own), signed (:func:`sign_request`): in a job with
    a roster, the gate then takes ``rid`` as the process that holds the member's node slot, calling over the
    connections ``pins`` names (field 2, :func:`lowband.ft.pins.spell_pins`; none named: the first to call)."""
    member = string_field(1, rid.encode()) + string_field(2, address.encode()) + string_field(3, store.encode())
    return sign_request(key, ADMIT, string_field(1, member) + (string_field(2, pins.encode()) if pins else b""))


def accusation_request(rid: str, address: str, store: str, accused: str, why: str, *,
                       key: MemberKey | None = None, secret: bytes | None = None) -> bytes:
    """The bytes of an :data:`ACCUSE` call: the reporting member as in :func:`admission_request` (field 1), the
    replica id of the member it reports (field 2) and what was wrong with its messages (field 3); signed with
    ``key`` when given, else tagged with the job's ``secret`` when given (:func:`~lowband.ft.protowire.sign_request`)."""
    return sign_request(key, ACCUSE, admission_request(rid, address, store) + string_field(2, accused.encode())
                        + string_field(3, why.encode()[:300].decode("utf-8", "ignore").encode()), secret=secret)


#: The kinds of refusal (each reason starts with one): what the gate counts, never the caller's text, which would grow.
REFUSAL_KINDS = ("malformed request", "the request names no requester", "replica id does not prove the job's secret",
                 "its addresses are not the ones its tag vouches for", "the call came from another address than its "
                 "member's", "the call is not signed by its member's key", "not the process its member registered",
                 "the report does not prove the job's secret", "too many refused calls from this host")


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
#: How long a connection may carry no call before the gate closes it (a member's carries a heartbeat every half second;
#: a client that calls again reconnects). Idle connections cost the gate memory and file descriptors, not the caller.
IDLE_S = 30
#: How long a new connection has to send HTTP/2's preface.
HANDSHAKE_S = 5
#: The gRPC server's bounds: requests of at most :data:`MAX_REQUEST_BYTES`, headers of at most 8 KiB, no SO_REUSEPORT
#: (gRPC's default on Linux: another process of the same user could bind the same port and take calls), connections
#: closed after :data:`IDLE_S` without a call or :data:`HANDSHAKE_S` without a preface.
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_REQUEST_BYTES), ("grpc.max_metadata_size", 8 << 10),
                  ("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", MAX_STREAMS),
                  ("grpc.max_connection_idle_ms", IDLE_S * 1000), ("grpc.server_handshake_timeout_ms", HANDSHAKE_S * 1000)]


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
        self.served: dict[int, dict] = {}  # node slot -> {a named end: the gate's socket its first call came over}
        self.direct: dict[int, bool] = {}  # node slot -> its process named connections on its own address (no NAT)
        self.pin_grace_s = pin_grace_s
        self._awaiting: Counter[int] = Counter()  # node slot -> calls waiting for its registration (bounded)
        self.pin_idle_s = pin_idle_s
        self.breaker = breaker if breaker is not None else StallBreaker()
        self.limiter = limiter if limiter is not None else SourceLimiter()
        self.tarpit = Tarpit(slots=max(1, workers // 8))  # a refused connection waits; its members keep 7/8 of the pool
        self.refused: Counter[str] = Counter()
        self.in_flight: Counter[int] = Counter()  # node slot -> its Quorum calls the gate holds or forwards now
        self.lost: dict[int, float] = {}  # node slot -> when its last Quorum call ended without a quorum
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
        try:  # the gate's own end of its connections (an IP literal: the checked address it binds)
            self._local = (plain_ip(ipaddress.ip_address(self._host)), self._port)
        except ValueError:
            self._local = None
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
            elif why is None and method in (ACCUSE, DONE):
                why = self.report_refusal(method, request)
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
            with self._in_flight_of(slot if method == QUORUM else None):
                if method in (ADMIT, QUORUM) and self.completion.applies_to(claim.fingerprint if claim else None):
                    # a node back after the job ended: it leaves
                    context.abort(self._grpc.StatusCode.FAILED_PRECONDITION, f"{COMPLETE} {self.completion.answer()}")
                held = self.breaker.held(slot) if slot is not None else None
                if held is not None and method == HEARTBEAT:
                    return b""  # not passed on: the Lighthouse counts the member dead and forms quorums without it
                if held is not None and (held[0] == "removed" or (held[0] == "benched" and method == ADMIT)):
                    self._refuse_held(context, slot, held)  # also asked by a member whose quorum waits (ADMIT)
                if method == ADMIT:
                    return self._admit_answer(slot)
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

    @contextlib.contextmanager
    def _in_flight_of(self, slot: int | None):
        """Count a ``Quorum`` call of ``slot`` while the gate holds or forwards it (what :meth:`_admit_answer` says)."""
        if slot is None:
            yield
            return
        with self._lock:
            self.in_flight[slot] += 1
        try:
            yield
        except BaseException:  # refused, cancelled (its connection broke), or the Lighthouse's error: no quorum
            with self._lock:
                self.lost[slot] = time.monotonic()
                while len(self.lost) > NAMED_HOSTS:
                    del self.lost[next(iter(self.lost))]
            raise
        finally:
            with self._lock:
                self.in_flight[slot] -= 1
                if self.in_flight[slot] <= 0:
                    del self.in_flight[slot]  # bounded: only slots with a call in flight are kept

    def _admit_answer(self, slot: int | None) -> bytes:
        """An admitted member's answer: field 1, how many ``Quorum`` calls of its slot the gate holds or forwards
        now; field 2, the milliseconds since the last one of them ended without a quorum (refused, cancelled:
        its connection broke; absent if none did). torchft's Manager neither retries such a request nor tells its
        ranks: a node whose quorum call waits learns from these that it waits for nothing (:mod:`lowband.ft.quorum`)."""
        if slot is None:
            return b""
        with self._lock:
            n, lost = self.in_flight.get(slot, 0), self.lost.get(slot)
        age = b"" if lost is None else string_field(2, str(int((time.monotonic() - lost) * 1000)).encode())
        return string_field(1, str(n).encode()) + age

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
                    return self._same_connection(claim.node, here)
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
            with self._lock:
                if self.registered.get(claim.node) != rid:
                    self.direct[claim.node] = False  # a new process: first to call, until it names its connections
                self.registered[claim.node] = rid  # bounded: only slots of the roster get here
                self.named[claim.node] = named
                served = self.served.get(claim.node, {})
                self.served[claim.node] = {end: s for end, s in served.items() if end in named}  # still the same
                if named and all(same_host(str(ip), own) for ip, _ in named):
                    self.direct[claim.node] = True  # from now on only what it names, an empty naming included
                self._registered.notify_all()
                self.pinned.pop(claim.node, None)  # unless it named its connections, its next call pins one again
        return None

    def report_refusal(self, method: str, request: bytes) -> str | None:
        """Without a roster, why a member's report (:data:`ACCUSE`, :data:`DONE`) is refused, or None: it must carry an
        HMAC under the job's secret over what it says, the time and a fresh nonce (the replica id alone is no proof:
        torchft's status page and the nodes' stores show it to anyone on their hosts)."""
        try:
            _, parts, (t, nonce, mac) = signed_parts(request)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            return f"malformed request ({e})"
        why = verify_mac(self._secret, self.replays, mac, t, nonce, method, *parts)
        return None if why is None else f"the report does not prove the job's secret: {why}"

    def _same_connection(self, slot: int, here) -> str | None:
        """None when a call from the named end ``here`` came over the connection from it that the slot's first call
        came over (its socket, :func:`lowband.ft.pins.connection_inode`): once the member's connection closed, another
        process may bind its port and call from the same end before the member names its connections again. Refused,
        the end is no longer named. Where the kernel cannot be asked (not Linux), or the connection is gone already (the
        answer reaches no one), it passes."""
        inode = connection_inode(self._local, here) if self._local is not None else None
        if not inode:
            return None
        with self._lock:
            served = self.served.setdefault(slot, {})
            if served.setdefault(here, inode) == inode:
                return None
            served.pop(here, None)
            self.named[slot] = self.named.get(slot, frozenset()) - {here}
        return (f"not the process its member registered: node {slot}'s registered process {PINNED} (another connection "
                f"calls from the end it named, {spell_pins(frozenset({here}))}, after that one closed)")

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
        why = self.completion.done(rid, peer_host(context.peer()), step, where, self.breaker.round_members())
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
    """The host of a gRPC peer string (``ipv4:10.0.0.2:5123``, ``ipv6:[::1]:5123``; an IPv4-mapped one as its IPv4
    address), or "" for another kind."""
    end = endpoint_of_peer(peer)
    return "" if end is None else str(end[0])


def accuse_at_gate(lighthouse: str, rid: str, accused: str, why: str, *, timeout_s: float = 10.0,
                   key: MemberKey | None = None, secret: bytes | None = None) -> str | None:
    """Report to the gate at ``lighthouse`` that the member with replica id ``accused`` sent this member (replica id
    ``rid``) bad messages (``why``), signed with the member's ``key`` when given, else tagged with the job's
    ``secret``: None when the gate counted it, else why not (no gate: torchft's own Lighthouse, which cannot remove a
    member; or the report was refused)."""
    claim = claim_of(rid)
    if claim is None:
        return f"{rid[:80]!r} is not a lowband replica id"
    return call_gate(lighthouse, ACCUSE, accusation_request(rid, f"http://{claim.manager}", claim.store, accused, why,
                                                            key=key, secret=secret), timeout_s=timeout_s)


class GateStatus(NamedTuple):
    """The gate's answer to a node's question: ``why`` it refuses (None: it passes); of an admitted member's slot, the
    ``Quorum`` calls the gate holds or forwards now and the seconds since the last one ended without a quorum (None
    where the gate did not say: torchft's own Lighthouse, an older gate, or no such call)."""

    why: str | None
    in_flight: int | None = None
    lost_age_s: float | None = None


def gate_status(lighthouse: str, rid: str, address: str, store: str, *, timeout_s: float = 10.0,
                key: MemberKey | None = None, pins: str = "") -> GateStatus:
    """:func:`ask_gate`, with what the gate says of the member's ``Quorum`` calls (:class:`GateStatus`)."""
    import grpc  # optional dependency (the ft extra)

    target = lighthouse.split("://", 1)[-1].rstrip("/")
    with grpc.insecure_channel(target) as channel:
        try:
            answer = channel.unary_unary(ADMIT)(admission_request(rid, address, store, key=key, pins=pins),
                                                timeout=timeout_s)
        except grpc.RpcError as e:
            done = complete_reason(e.details() or "") if e.code() == grpc.StatusCode.FAILED_PRECONDITION else None
            if done is not None:
                raise job_complete(lighthouse, done) from None
            why = gate_reason(e.details() or "") if e.code() == grpc.StatusCode.PERMISSION_DENIED else None
            if why is None:
                log.debug("the Lighthouse at %s did not answer the gate's question (%s): no gate, or not up yet",
                          lighthouse, e.code())
            return GateStatus(why)
    try:
        fields = parse_fields(answer or b"")
        n, age = _string(fields, 1), _string(fields, 2)
        return GateStatus(None, int(n) if n.isdigit() and len(n) < 10 else None,
                          int(age) / 1000 if age.isdigit() and len(age) < 15 else None)
    except (ValueError, UnicodeDecodeError):
        return GateStatus(None)


def ask_gate(lighthouse: str, rid: str, address: str, store: str, *, timeout_s: float = 10.0,
             key: MemberKey | None = None, pins: str = "") -> str | None:
    """Ask the gate at ``lighthouse`` (``http://HOST:PORT``) whether a member with replica id ``rid``, Manager
    ``address`` and ``store`` may pass: the gate's reason for refusing it, or None (it passes; or the Lighthouse
    has no gate, or cannot be reached yet: torchft's Manager then finds out by itself). With the member's ``key``
    the question is signed, and in a job with a roster registers ``rid`` as the process of the member's slot, calling
    over the connections ``pins`` names. Raises
    :class:`~lowband.ft.completion.JobComplete` when the gate says the job is complete."""
    return gate_status(lighthouse, rid, address, store, timeout_s=timeout_s, key=key, pins=pins).why
