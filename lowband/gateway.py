"""The Lighthouse behind a gate that only the job's members pass (docs/internet.md).

torchft's Lighthouse asks for no credential: whoever reaches its port can read its status page (every
member's id, address and step), stop a node through its kill route, and ask for quorums. A job's node
screens every quorum (:func:`lowband.admission.screen`) and never trains with an outsider, but an
outsider that keeps asking for quorums keeps the job asking again, and so stalls it. torchft's
Lighthouse cannot be given a credential, so lowband puts it behind this gate:

- torchft's Lighthouse listens on loopback only, on a port of its own (its status page and kill
  route are then for the Lighthouse's own host alone);
- the gate listens on the job's address and serves the two calls a node's Manager makes, ``Quorum``
  and ``Heartbeat`` (gRPC), and nothing else: no status page, no kill route;
- a ``Quorum`` is forwarded only when the asking member's replica id proves the job's secret for what
  it claims (:func:`lowband.admission.proves`: its job, slot, store and Manager addresses) and the
  addresses in the request are the ones its tag vouches for; a ``Heartbeat`` only when its id proves
  the secret. Anything else is refused at once (PERMISSION_DENIED, with :data:`REFUSED` in the
  message), before the Lighthouse sees it: an outsider is never in a quorum, so it cannot stall one.

The gate reads only three strings of each request (the protobuf fields it needs, by hand: the request
bytes are forwarded as they came, never deserialised into objects) and holds no state of the job.
What it does not do: a member of the job (it holds the secret) passes, whatever it does later; and a
replica id copied from a member (its logs) passes with the member's own addresses (the requests that
torchft's Manager makes carry nothing fresh to sign).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from lowband.admission import claim_of, proves

__all__ = ["ADMIT", "HEARTBEAT", "QUORUM", "REFUSED", "LighthouseGateway", "admission_request", "ask_gate",
           "parse_fields", "refusal", "string_field"]

log = logging.getLogger(__name__)

SERVICE = "torchft.LighthouseService"
QUORUM = f"/{SERVICE}/Quorum"
HEARTBEAT = f"/{SERVICE}/Heartbeat"
#: The gate's own call, answered by the gate and never forwarded: may this member pass? (a LighthouseQuorumRequest's
#: bytes, see :func:`admission_request`). A node asks it before it starts torchft's Manager, which would retry a
#: refused quorum until its timeout and then report only the timeout; torchft's Lighthouse answers UNIMPLEMENTED.
GATE_SERVICE = "lowband.LighthouseGate"
ADMIT = f"/{GATE_SERVICE}/Admit"
#: In the message of every refusal: a refused node recognises it (:func:`lowband.ft` raises AdmissionRefused).
REFUSED = "lowband gateway: not a member of this job"


# --------------------------------------------------------------------------- the request's fields
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def parse_fields(buf: bytes) -> dict[int, list[bytes | int]]:
    """The top-level fields of a protobuf message: field number -> values (bytes for length-delimited
    fields, ints for varints and fixed-width ones). A ValueError for anything malformed."""
    fields: dict[int, list[bytes | int]] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError("a length-delimited field runs past the end")
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(buf):
                raise ValueError("a fixed-width field runs past the end")
            value, i = int.from_bytes(buf[i:i + width], "little"), i + width
        else:
            raise ValueError(f"wire type {wire} is not read here")
        fields.setdefault(number, []).append(value)
    return fields


def _string(fields: dict[int, list[bytes | int]], number: int) -> str:
    values = fields.get(number) or [b""]
    value = values[-1]
    if not isinstance(value, bytes):
        raise ValueError(f"field {number} is not a string")
    return value.decode("utf-8")


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def string_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field: its key (``number``, wire type 2), its length, then ``value``."""
    return _encode_varint(number << 3 | 2) + _encode_varint(len(value)) + value


def admission_request(rid: str, address: str, store: str) -> bytes:
    """The bytes of a LighthouseQuorumRequest whose requester has replica id ``rid``, Manager ``address`` and
    ``store``: what :data:`ADMIT` reads."""
    member = string_field(1, rid.encode()) + string_field(2, address.encode()) + string_field(3, store.encode())
    return string_field(1, member)


def refusal(secret: bytes, request: bytes, method: str) -> str | None:
    """Why ``request`` (the raw bytes of a ``Quorum`` or ``Heartbeat`` call) is refused, or None.

    ``Quorum`` (LighthouseQuorumRequest: field 1, the requester, a QuorumMember whose fields 1-3 are its
    replica id, Manager address and store address) passes when the id proves the secret and the two
    addresses are those it claims; ``Heartbeat`` (LighthouseHeartbeatRequest: field 1, the replica id)
    when the id proves the secret."""
    try:
        fields = parse_fields(request)
        if method == HEARTBEAT:
            rid = _string(fields, 1)
            return None if proves(secret, rid) else f"replica id {rid[:80]!r} does not prove the job's secret"
        member = fields.get(1) or [b""]
        if not isinstance(member[-1], bytes):
            return "the request names no requester"
        m = parse_fields(member[-1])
        rid, address, store = _string(m, 1), _string(m, 2), _string(m, 3)
    except (ValueError, UnicodeDecodeError) as e:
        return f"malformed request ({e})"
    if not proves(secret, rid):
        return f"replica id {rid[:80]!r} does not prove the job's secret"
    claim = claim_of(rid)
    if address.split("://", 1)[-1].rstrip("/") != claim.manager or store != claim.store:
        return (f"its addresses (Manager {address[:60]!r}, store {store[:60]!r}) are not the ones its tag vouches "
                f"for ({claim.manager!r}, {claim.store!r})")
    return None


# --------------------------------------------------------------------------- the gate
class LighthouseGateway:
    """Serve ``Quorum`` and ``Heartbeat`` on ``bind`` for the job's members only, forwarded to torchft's
    Lighthouse at ``backend`` (``HOST:PORT``, on loopback). ``address()`` is what nodes pass as
    ``--ft-lighthouse``; ``refused`` counts the refusals by reason."""

    def __init__(self, *, bind: str, backend: str, secret: bytes, workers: int = 64) -> None:
        import grpc

        self._grpc = grpc
        self._secret = secret
        self.refused: Counter[str] = Counter()
        self._named: set[str] = set()
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(backend)
        self._forward = {m: self._channel.unary_unary(m) for m in (QUORUM, HEARTBEAT)}  # bytes in, bytes out
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._handler(path))
                    for name, path in (("Quorum", QUORUM), ("Heartbeat", HEARTBEAT))}
        admit = {"Admit": grpc.unary_unary_rpc_method_handler(self._handler(ADMIT))}
        self._server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowband-gateway"),
                                   handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers),
                                             grpc.method_handlers_generic_handler(GATE_SERVICE, admit)])
        host = bind.rsplit(":", 1)[0]
        self._port = self._server.add_insecure_port(bind)
        if not self._port:
            raise OSError(f"the Lighthouse's gate cannot listen on {bind}")
        self._host = host.strip("[]")
        self._server.start()

    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    def _handler(self, method: str):
        def handle(request: bytes, context) -> bytes:
            why = refusal(self._secret, request, QUORUM if method == ADMIT else method)
            if why is not None:
                self._note(why, context.peer())
                context.abort(self._grpc.StatusCode.PERMISSION_DENIED, f"{REFUSED}: {why}")
            if method == ADMIT:
                return b""
            try:
                return self._forward[method](request, timeout=context.time_remaining())
            except self._grpc.RpcError as e:  # the Lighthouse's own answer (a timeout, ...), passed on
                context.abort(e.code(), e.details() or "")
        return handle

    def _note(self, why: str, peer: str) -> None:
        with self._lock:
            self.refused[why.split(" (", 1)[0]] += 1
            first = peer not in self._named
            self._named.add(peer)
        if first:
            log.warning("the Lighthouse's gate refused %s: %s (once per peer)", peer, why)

    def shutdown(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()


def ask_gate(lighthouse: str, rid: str, address: str, store: str, *, timeout_s: float = 10.0) -> str | None:
    """Ask the gate at ``lighthouse`` (``http://HOST:PORT``) whether a member with replica id ``rid``, Manager
    ``address`` and ``store`` may pass: the gate's reason for refusing it, or None (it passes; or the Lighthouse
    has no gate, or cannot be reached yet: torchft's Manager then finds out by itself)."""
    import grpc

    target = lighthouse.split("://", 1)[-1].rstrip("/")
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(ADMIT)(admission_request(rid, address, store), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED and REFUSED in (e.details() or ""):
                return (e.details() or "").split(REFUSED, 1)[1].lstrip(": ")
            log.debug("the Lighthouse at %s did not answer the gate's question (%s): no gate, or not up yet",
                      lighthouse, e.code())
    return None
