"""The healing state transfer of a fault-tolerant job: tensors and plain data, never code.

torchft 0.2.0's HTTP transport serves a node's state as a pickle and loads it with
``weights_only=False``: whoever answers a healing node's request could run code on it. This module
replaces it (torchft's ``CheckpointTransport`` interface: :meth:`StateTransport.send_checkpoint`,
``recv_checkpoint``, ``metadata``, ``disallow_checkpoint``).

The wire format (one HTTP GET, ``/state/STEP?...``; the body):

- 8 bytes: the header's length, big-endian;
- 32 bytes: with a job secret, a tag (HMAC) over the request's nonce and the header's SHA-256 (``-`` × 32
  without one): the healer checks it before it parses the header;
- the header, JSON: format version, step, job fingerprint, the payload's length, and per tensor its
  name, dtype (from a fixed list), shape, offset and byte length; the rest of the state as plain data
  (``None``, bool, int, float, str, and lists, tuples and dicts of them, every container tagged);
- the payload: the tensors' raw bytes, one after the other;
- a 96-byte trailer: the payload's SHA-256 (hex) and, with a job secret, a tag (HMAC) over the request's
  nonce, the header's SHA-256 and the payload's, made with the secret (``-`` × 32 without one).

What the healer checks before it uses anything: the HTTP status and the announced length against a
bound (its own state's bytes: see :func:`receive_limit`); the header's length against a bound of its own
(:func:`header_limit`), then with a secret the header's tag, and only then the header: format, step and
fingerprint; every tensor's dtype and shape against its own state's where it has that tensor, and
that the tensors tile the payload exactly; the payload's hash and, with a secret, the tag; then what
the state holds (:func:`check_values`: no NaN, no infinity where its own state has none) and whatever the
node checks besides (``check``: the step within the job's, the layout of the trainer's state). The whole
transfer, from connecting to the last byte, is bounded in time: the answer must start within 2 × the
timeout + 1 s (a source waits up to the timeout for torchft to stage its state), the rest within one more
timeout plus its announced length at :data:`MIN_RATE_BPS`, and no read waits more than the timeout for a
byte. A source that fails any of these is abandoned with :class:`TransferError` (one whose state failed a
check of what it holds, after its tag was verified: :class:`PoisonedState`), and nothing of it is loaded.

The server serves only while torchft has staged a state (between ``send_checkpoint`` and
``disallow_checkpoint``), only the staged step and job, at most once per healing rank torchft named,
and with a secret only to a requester whose tag proves it holds the secret (fresh nonce and time). It
takes at most :data:`MAX_CONNECTIONS` connections at once (:data:`MAX_PER_HOST` from one host), reads a
request line of at most :data:`MAX_REQUEST_LINE` bytes within the timeout, and refuses a host that was
refused more than its budget (:class:`lowband.trust.limits.SourceLimiter`) without reading its request.
It listens on exactly the address it is given (the node's checked ``--ft-bind``), or does not start.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import logging
import math
import re
import secrets as _secrets
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lowband.trust.limits import SourceLimiter
from lowband.trust.secret import tag, verify

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "PoisonedState", "StateTransport", "TransferError", "check_values", "decode_header",
           "encode_state", "header_limit", "parse_request", "read_state", "receive_limit", "template_of"]

FORMAT = "lowband-state/2"
MIN_RATE_BPS = 1 << 20  # a transfer slower than 1 MiB/s over its whole length counts as stalled
MAX_HEADER = 64 << 20  # the header's bound whatever the healer's state (see header_limit)
HEADER_TAG = 32
TRAILER = 96
MAX_DIMS = 32  # a tensor's dimensions, at most
MAX_DIM = 1 << 40  # one dimension's extent, at most (a zero-sized tensor may not name an absurd shape)
MAX_CONNECTIONS = 32  # the state server's connections at once
MAX_PER_HOST = 16  # ... from one host (the healing ranks of several nodes on one machine share its address)
MAX_REQUEST_LINE = 2048  # a healer's request line is about 200 bytes
_CHUNK = 1 << 20
_NO_TAG = "-" * 32

#: The dtypes a state may hold, by the name the header gives them (nothing else is decoded).
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class TransferError(RuntimeError):
    """A state transfer that was refused or abandoned (the source lied, stalled, or is not of this job)."""


class PoisonedState(TransferError):
    """A source's state that arrived whole, signed where the job has a secret, and fails a check of what it holds
    (a value that is not finite, a step outside the job's, a layout that is not this node's): its source is a
    member that sends bad state, to be reported like one that sends bad messages."""


# --------------------------------------------------------------------------- encoding
def _encode(obj: Any, tensors: list[tuple[str, torch.Tensor]], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append((path, obj))
        return {"t": len(tensors) - 1}
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, bool | int | float | str)):
                raise TypeError(f"healing state: {path} has a key of type {type(k).__name__}: only plain keys travel")
            items.append([k, _encode(v, tensors, f"{path}.{k}")])
        return {"d": items}
    if isinstance(obj, list | tuple):
        return {"l" if isinstance(obj, list) else "u": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    raise TypeError(f"healing state: {path} is a {type(obj).__module__}.{type(obj).__qualname__}: only tensors and "
                    "plain data (None, bool, int, float, str, list, tuple, dict) travel between nodes")


def _decode(node: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    if depth > 100:
        raise TransferError("the state's plain data nests deeper than 100 levels")
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (kind, v), = node.items()
        if kind == "t" and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(tensors):
            return tensors[v]
        if kind == "f" and v in ("nan", "inf", "-inf"):
            return float(v)
        if kind in ("l", "u") and isinstance(v, list):
            out = [_decode(x, tensors, depth + 1) for x in v]
            return out if kind == "l" else tuple(out)
        if kind == "d" and isinstance(v, list):
            d = {}
            for item in v:
                if not (isinstance(item, list) and len(item) == 2
                        and (item[0] is None or isinstance(item[0], bool | int | float | str))):
                    raise TransferError("the state's header holds a malformed dict entry")
                d[item[0]] = _decode(item[1], tensors, depth + 1)
            return d
    raise TransferError(f"the state's header holds a value lowband does not decode ({str(node)[:60]})")


def encode_state(state: Any, *, step: int, fingerprint: str) -> tuple[bytes, list[torch.Tensor]]:
    """(header, tensors): the header JSON of ``state`` and its tensors (CPU, contiguous) in payload order."""
    found: list[tuple[str, torch.Tensor]] = []
    tree = _encode(state, found, "state")
    specs, tensors, offset = [], [], 0
    for name, t in found:
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.to_local()
        t = t.to("cpu").contiguous()
        dt = str(t.dtype).removeprefix("torch.")
        if dt not in DTYPES:
            raise TypeError(f"healing state: {name} has dtype {t.dtype}, which does not travel ({', '.join(DTYPES)})")
        n = t.numel() * t.element_size()
        specs.append({"name": name, "dtype": dt, "shape": list(t.shape), "offset": offset, "bytes": n})
        tensors.append(t)
        offset += n
    header = {"format": FORMAT, "step": int(step), "fingerprint": fingerprint, "payload_bytes": offset,
              "tensors": specs, "tree": tree}
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode(), tensors


def template_of(state: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name → (dtype, shape) of every tensor in a state, named as :func:`encode_state` names them."""
    found: list[tuple[str, torch.Tensor]] = []
    _encode(state, found, "state")
    out = {}
    for name, t in found:
        local = t.to_local() if isinstance(t, DTensor) else t
        out[name] = (str(local.dtype).removeprefix("torch."), tuple(local.shape))
    return out


def receive_limit(template: dict[str, tuple[str, tuple[int, ...]]], *, factor: int = 8,
                  slack: int = 16 << 20) -> int:
    """The most payload bytes a healer accepts: ``factor`` × its own state's tensors plus ``slack``.

    A node that has not stepped yet has no optimizer state, which the peer's state holds (AdamW: two
    moments; DiLoCo: inner moments, outer momentum and anchor): so the bound is a multiple of the
    healer's own state, not its size.
    """
    own = sum(math.prod(shape) * torch.empty((), dtype=DTYPES[dt]).element_size()
              for dt, shape in template.values() if dt in DTYPES)
    return factor * own + slack


def header_limit(template: dict[str, tuple[str, tuple[int, ...]]] | None, *, factor: int = 8,
                 per_tensor: int = 512, slack: int = 1 << 20) -> int:
    """The most header bytes a healer reads: ``per_tensor`` bytes for ``factor`` × its own state's tensors, plus
    ``slack`` for the plain data (at most :data:`MAX_HEADER`). A tensor's entry is about 200 bytes."""
    if template is None:
        return MAX_HEADER
    return min(MAX_HEADER, factor * per_tensor * len(template) + slack)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is not a finite number")
    return value


def decode_header(raw: bytes, *, step: int, fingerprint: str, limit: int,
                  template: dict[str, tuple[str, tuple[int, ...]]] | None) -> dict:
    """The header, checked: format, step, fingerprint, the tensors' layout and (with ``template``) dtypes/shapes.
    A TransferError for anything else; never another exception."""
    try:
        h = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise TransferError(f"the state's header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise TransferError(f"the source sent a state of another format ({str(h.get('format') if isinstance(h, dict) else h)[:40]!r}, "
                            f"expected {FORMAT!r}): every node must run the same lowband version")
    if h.get("step") != step or isinstance(h.get("step"), bool):
        raise TransferError(f"the source sent the state of step {str(h.get('step'))[:40]}, this node asked for step {step}")
    if h.get("fingerprint") != fingerprint:
        raise TransferError(f"the source runs another job (fingerprint {str(h.get('fingerprint'))[:32]!r}, "
                            f"{fingerprint!r} here)")
    total, specs = h.get("payload_bytes"), h.get("tensors")
    if not isinstance(total, int) or isinstance(total, bool) or not isinstance(specs, list) or not 0 <= total <= limit:
        raise TransferError(f"the source announced {str(total)[:40]} payload bytes, more than this node accepts "
                            f"({limit}: a multiple of its own state)")
    offset = 0
    for s in specs:
        ok = (isinstance(s, dict) and isinstance(s.get("dtype"), str) and s["dtype"] in DTYPES
              and isinstance(s.get("shape"), list) and len(s["shape"]) <= MAX_DIMS
              and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in s["shape"])
              and s.get("offset") == offset and isinstance(s.get("name"), str))
        if not ok:
            raise TransferError(f"the state's header describes a tensor badly ({str(s)[:80]})")
        n = math.prod(s["shape"]) * DTYPES[s["dtype"]].itemsize
        if s.get("bytes") != n or n > total - offset:
            raise TransferError(f"{s['name'][:80]}: {str(s.get('bytes'))[:20]} bytes announced for shape "
                                f"{s['shape']} {s['dtype']}, or past the payload's end")
        mine = (template or {}).get(s["name"])
        if mine is not None and (mine[0] != s["dtype"] or tuple(mine[1]) != tuple(s["shape"])):
            raise TransferError(f"{s['name'][:80]} is {s['dtype']} {tuple(s['shape'])} on the source but {mine[0]} "
                                f"{tuple(mine[1])} here: the nodes run different models, methods or shardings")
        offset += n
    if offset != total:
        raise TransferError(f"the tensors fill {offset} bytes, the source announced {total}")
    return h


def check_values(state: Any, own: Any = None, path: str = "state") -> None:
    """Refuse a received state whose values are not finite (:class:`PoisonedState`): a tensor or float holding NaN,
    or ±Inf where this node's own state (``own``, the same layout) has a finite value or nothing. A model may hold
    infinities on purpose (a mask buffer): those the node's own copy holds in the same places pass."""
    if isinstance(state, torch.Tensor):
        if not (state.is_floating_point() or state.is_complex()):
            return
        bad = ~torch.isfinite(state)
        if not bad.any():
            return
        mine = own if isinstance(own, torch.Tensor) and own.shape == state.shape and own.dtype == state.dtype else None
        if state.isnan().any() or mine is None or not torch.equal(state[bad], mine[bad]):
            raise PoisonedState(f"{path[:120]} holds {int(bad.sum())} value(s) that are NaN or infinite (first "
                                f"{state[bad].reshape(-1)[0].item()!r}) where this node's own state holds none")
        return
    if isinstance(state, float):
        if not math.isfinite(state) and not (isinstance(own, float) and (own == state or (own != own and state != state))):
            raise PoisonedState(f"{path[:120]} is {state!r} where this node's own state holds a finite number or none")
        return
    if isinstance(state, dict):
        for k, v in state.items():
            check_values(v, own.get(k) if isinstance(own, dict) else None, f"{path}.{k}")
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            theirs = own[i] if isinstance(own, list | tuple) and i < len(own) else None
            check_values(v, theirs, f"{path}[{i}]")


# --------------------------------------------------------------------------- reading
class _Deadline:
    """One transfer's deadline: each read waits at most ``stall_s`` for a byte, and a watchdog shuts the socket
    down when the overall deadline passes, whatever the source trickles (the status line and headers too)."""

    def __init__(self, sock: socket.socket | None, stall_s: float, overall_s: float) -> None:
        self.sock, self.stall_s = sock, stall_s
        self.end = time.monotonic() + overall_s
        self.expired = False
        self._cond = threading.Condition()
        self._done = False
        if sock is not None:
            threading.Thread(target=self._watch, name="lowband-transfer-deadline", daemon=True).start()

    def _watch(self) -> None:
        with self._cond:
            while not self._done:
                # A little after the deadline: a read that times out by itself says what happened (it stalled).
                left = self.end + 0.25 * self.stall_s - time.monotonic()
                if left <= 0:
                    self.expired = True
                    try:
                        self.sock.shutdown(socket.SHUT_RDWR)  # unblocks whatever read is waiting
                    except OSError:
                        pass
                    return
                self._cond.wait(left)

    def extend(self, seconds: float) -> None:
        with self._cond:
            self.end += seconds
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def late(self) -> TransferError:
        return TransferError("the source did not send the state in time (it stalled or sends too slowly): abandoned")

    def arm(self) -> None:
        left = self.end - time.monotonic()
        if left <= 0 or self.expired:
            raise self.late()
        if self.sock is not None:
            self.sock.settimeout(min(self.stall_s, left))


def _read_exact(f, buf: memoryview, deadline: _Deadline, what: str, hasher=None) -> None:
    got = 0
    while got < len(buf):
        deadline.arm()
        try:
            n = f.readinto(buf[got:got + _CHUNK])
        except TimeoutError:
            raise TransferError(f"the source stopped sending ({what}) for {deadline.stall_s:g} s: abandoned") from None
        except (OSError, ValueError, http.client.HTTPException) as e:
            if deadline.expired:
                raise deadline.late() from None
            raise TransferError(f"the connection to the source broke while reading {what} ({type(e).__name__})") from None
        if not n:
            if deadline.expired:
                raise deadline.late()
            raise TransferError(f"the source's stream ended early: {what} truncated ({got} of {len(buf)} bytes)")
        if hasher is not None:
            hasher.update(buf[got:got + n])
        got += n


def read_state(f, *, step: int, fingerprint: str, limit: int, template: dict | None, stall_s: float,
               content_length: int | None = None, sock: socket.socket | None = None, secret: bytes | None = None,
               nonce: str = "", deadline: _Deadline | None = None, max_header: int | None = None) -> Any:
    """Read one state from a stream in the wire format; every check of the module docstring but those of what the
    state holds (:func:`check_values`), no pickle. A TransferError for anything wrong, never another exception."""
    own_deadline = deadline is None
    if own_deadline:
        deadline = _Deadline(sock, stall_s, stall_s)
    try:
        return _read_state(f, step=step, fingerprint=fingerprint, limit=limit, template=template,
                           content_length=content_length, secret=secret, nonce=nonce, deadline=deadline,
                           max_header=header_limit(template) if max_header is None else max_header)
    finally:
        if own_deadline:
            deadline.close()


def _read_state(f, *, step, fingerprint, limit, template, content_length, secret, nonce, deadline, max_header):
    head = bytearray(8 + HEADER_TAG)
    _read_exact(f, memoryview(head), deadline, "the header's length")
    (hlen,) = struct.unpack(">Q", head[:8])
    if hlen > max_header:
        raise TransferError(f"the source announced a {hlen}-byte header, more than this node reads ({max_header}: "
                            "in proportion to its own state's tensors)")
    if content_length is not None and 8 + HEADER_TAG + hlen + TRAILER > content_length:
        raise TransferError(f"the source announced {content_length} bytes over HTTP, fewer than its header needs")
    deadline.extend(hlen / MIN_RATE_BPS)
    raw = bytearray(hlen)
    _read_exact(f, memoryview(raw), deadline, "the header")
    header_sha = hashlib.sha256(raw).hexdigest()
    if secret is not None and not verify(secret, bytes(head[8:]).decode("ascii", "replace"), "lowband-state-header",
                                         nonce, header_sha):
        raise TransferError("the source's state is not signed with this job's secret: a node that is not a member "
                            "of this job answered (check that every node has the same secret); its header was "
                            "not read")
    h = decode_header(bytes(raw), step=step, fingerprint=fingerprint, limit=limit, template=template)
    total = h["payload_bytes"]
    if content_length is not None and content_length != 8 + HEADER_TAG + hlen + total + TRAILER:
        raise TransferError(f"the source announced {content_length} bytes over HTTP, its header "
                            f"{8 + HEADER_TAG + hlen + total + TRAILER}")
    deadline.extend(total / MIN_RATE_BPS)
    hasher = hashlib.sha256()
    tensors = []
    for s in h["tensors"]:
        t = torch.empty(s["shape"], dtype=DTYPES[s["dtype"]])
        if t.numel():
            _read_exact(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()), deadline, s["name"][:80], hasher)
        tensors.append(t)
    trailer = bytearray(TRAILER)
    _read_exact(f, memoryview(trailer), deadline, "the trailer")
    digest, mac = bytes(trailer[:64]).decode("ascii", "replace"), bytes(trailer[64:]).decode("ascii", "replace")
    if digest != hasher.hexdigest():
        raise TransferError("the state's payload does not match its SHA-256: corrupted or tampered with")
    if secret is not None and not verify(secret, mac, "lowband-state-response", nonce, header_sha, digest):
        raise TransferError("the source's state is not signed with this job's secret: a node that is not a member "
                            "of this job answered (check that every node has the same secret)")
    return _decode(h["tree"], tensors)


_REQUEST_PATH = re.compile(r"/state/([0-9]{1,20})", re.ASCII)


def parse_request(path: str) -> tuple[int, dict[str, str]] | None:
    """(step, query) of a healer's request path (``/state/STEP?fp=...&node=...``), or None for anything else.
    Never raises: the path is a stranger's."""
    if not isinstance(path, str) or len(path) > MAX_REQUEST_LINE:
        return None
    try:
        url = urllib.parse.urlsplit(path)
        m = _REQUEST_PATH.fullmatch(url.path)
        if m is None:
            return None
        pairs = urllib.parse.parse_qsl(url.query, max_num_fields=16)
    except ValueError:
        return None
    return int(m[1]), dict(pairs)


# --------------------------------------------------------------------------- the transport
class _Capped(io.RawIOBase):
    """A connection's reader that ends after ``limit`` bytes: a request (a GET, no body) is never read past it."""

    def __init__(self, raw, limit: int) -> None:
        self._raw, self._left = raw, limit

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._left <= 0:
            return 0
        n = self._raw.readinto1(memoryview(b)[:self._left])  # what one read gives: never waits to fill ``b``
        self._left -= n or 0
        return n


class StateTransport:
    """torchft's ``CheckpointTransport`` with lowband's wire format (see the module docstring).

    Args:
        advertise: the address the other nodes reach this node at (in :meth:`metadata`).
        bind: the address the server listens on, exactly (the node's checked ``--ft-bind``; default
            ``advertise``). When it cannot listen there it does not start (an OSError naming the address).
        timeout: the stall bound of every read and write (``--ft-timeout``).
        fingerprint: the job's fingerprint (a source of another job is refused, and so is a requester).
        secret: the job's secret, or None (then anyone who reaches the port while a state is staged may
            read it once per healing rank; see docs/fault-tolerance.md).
        template: the healer's own state (a function returning it, called once per heal): the dtypes and
            shapes a source's tensors must have, the bound on what it may send, and where its values may
            be infinite (:func:`check_values`).
        check: ``check(step, state)`` raises ValueError for a heal the node must refuse: called with
            ``state=None`` before anything is fetched (the quorum's step), then with the state received.
        refuse_source: ``refuse_source(src_rank)``: why this node does not fetch from that member of the
            quorum (it served a poisoned state before), or None.
        on_poisoned: ``on_poisoned(src_rank, why)``: a source's state failed a check of what it holds
            (:class:`PoisonedState`).
        node, rank: this rank's place (named in its requests).
    """

    def __init__(self, *, advertise: str, timeout: timedelta, fingerprint: str, secret: bytes | None = None,
                 template: Callable[[], Any] | None = None, node: int = 0, rank: int = 0, port: int = 0,
                 bind: str | None = None, check: Callable[[int, Any], None] | None = None,
                 refuse_source: Callable[[int], str | None] | None = None,
                 on_poisoned: Callable[[int, str], None] | None = None) -> None:
        self._timeout = timeout.total_seconds()
        self._fingerprint, self._secret, self._template = fingerprint, secret, template
        self._check, self._refuse_source, self._on_poisoned = check, refuse_source, on_poisoned
        self._node, self._rank, self._advertise = node, rank, advertise
        self._cond = threading.Condition()
        self._staged: tuple[int, bytes, list[torch.Tensor]] | None = None
        self._served_left = 0
        self._sending = 0
        self._nonces: set[str] = set()
        self.limiter = SourceLimiter()
        self._open: dict[str, int] = {}  # host -> its connections now
        self._named: dict[str, None] = {}  # hosts named in a refusal's warning (once each, bounded)
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = self._timeout  # every socket operation of the server is bounded too

            def setup(self):
                super().setup()
                # The request is read within the timeout and is at most MAX_REQUEST_LINE plus a few headers.
                self.rfile = io.BufferedReader(_Capped(self.rfile, 4 * MAX_REQUEST_LINE))
                self.deadline = _Deadline(self.connection, transport._timeout, 2 * transport._timeout)

            def finish(self):
                self.deadline.close()
                super().finish()

            def log_message(self, fmt, *args):  # noqa: N802 - no access log on stderr
                log.debug("state server: " + fmt, *args)

            def do_GET(self):  # noqa: N802
                transport._serve(self)

        host = (bind or advertise).strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            allow_reuse_address = False  # nobody else's socket on this port, not even a TIME_WAIT one taken over

            def verify_request(self, request, client_address) -> bool:
                return transport._admit(client_address[0])

            def process_request_thread(self, request, client_address):
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    transport._left(client_address[0])

        try:
            self._server = Server((host, port), Handler)
        except OSError as e:
            raise OSError(f"the state server cannot listen on {host}:{port} ({e.strerror or e}): --ft-bind must be an "
                          "address of this machine on the job's network (it listens there and nowhere else)") from None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="lowband-state-server", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- serving
    def metadata(self) -> str:
        host = f"[{self._advertise.strip('[]')}]" if ":" in self._advertise.strip("[]") else self._advertise
        return f"http://{host}:{self._server.server_address[1]}/state/"

    def address(self) -> str:
        return self.metadata()

    def _admit(self, host: str) -> bool:
        """Whether a new connection from ``host`` is served (bounded connections; a host over its refusals'
        budget is closed unread)."""
        with self._cond:
            if (sum(self._open.values()) >= MAX_CONNECTIONS or self._open.get(host, 0) >= MAX_PER_HOST
                    or self.limiter.over(host)):
                return False
            self._open[host] = self._open.get(host, 0) + 1
            return True

    def _left(self, host: str) -> None:
        with self._cond:
            n = self._open.get(host, 1) - 1
            if n > 0:
                self._open[host] = n
            else:
                self._open.pop(host, None)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        header, tensors = encode_state(state_dict, step=step, fingerprint=self._fingerprint)
        with self._cond:
            self._staged = (int(step), header, tensors)
            self._served_left = max(1, len(dst_ranks))
            self._nonces.clear()
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """No more serving; waits (at most the timeout) for transfers in flight, then drops the staged copy."""
        with self._cond:
            self._staged = None
            self._cond.wait_for(lambda: self._sending == 0, timeout=self._timeout)
            self._cond.notify_all()

    def _refuse(self, h: BaseHTTPRequestHandler, code: int, why: str) -> None:
        host = h.client_address[0]
        self.limiter.refused(host)
        with self._cond:
            first = host not in self._named
            if first:
                self._named[host] = None
                while len(self._named) > 1024:
                    self._named.pop(next(iter(self._named)))
        if first:
            log.warning("state server: refused a request from %s: %s (once per host)", host, why)
        try:
            h.send_error(code, why)
        except OSError:
            pass

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        parsed = parse_request(h.path)
        if parsed is None:
            return self._refuse(h, 404, "no such path")
        step, q = parsed
        if q.get("fp") != self._fingerprint:
            return self._refuse(h, 403, "the requester runs another job (fingerprint)")
        if self._secret is not None:
            nonce, t = q.get("nonce", ""), q.get("t", "")
            try:
                fresh = abs(time.time() - float(t)) <= max(60.0, 2 * self._timeout)
            except ValueError:
                fresh = False
            if not (fresh and 16 <= len(nonce) <= 64 and verify(self._secret, q.get("tag", ""), "lowband-state-request",
                                                                 self._fingerprint, step, q.get("node"), q.get("rank"),
                                                                 nonce, t)):
                return self._refuse(h, 403, "the request does not carry this job's secret (tag), or is stale")
        nonce, refusal = q.get("nonce", "")[:64], None
        with self._cond:
            # A healer may ask before torchft staged the state on this node: wait for it, bounded.
            self._cond.wait_for(lambda: self._staged is not None and self._staged[0] == step, timeout=self._timeout)
            staged = self._staged
            if staged is None or staged[0] != step:
                refusal = (409, f"no state of step {step} is staged here")
            elif self._served_left <= 0 or (nonce and nonce in self._nonces):
                refusal = (429, "the state was already served to every healing rank")
            else:
                self._served_left -= 1
                self._nonces.add(nonce)
                self._sending += 1
        if refusal is not None:  # answered outside the lock: a slow requester holds up no one
            return self._refuse(h, *refusal)
        self.limiter.passed(h.client_address[0])
        try:
            self._send(h, staged, nonce)
        except OSError as e:
            log.warning("state server: sending the state to %s failed (%s)", h.client_address[0], type(e).__name__)
        finally:
            with self._cond:
                self._sending -= 1
                self._cond.notify_all()

    def _send(self, h: BaseHTTPRequestHandler, staged, nonce: str) -> None:
        _, header, tensors = staged
        payload = sum(t.numel() * t.element_size() for t in tensors)
        # The healer reads at MIN_RATE_BPS at least: a requester that reads slower is cut off, not waited for.
        h.deadline.extend(self._timeout + (len(header) + payload) / MIN_RATE_BPS)
        header_sha = hashlib.sha256(header).hexdigest()
        header_mac = (tag(self._secret, "lowband-state-header", nonce, header_sha) if self._secret is not None
                      else _NO_TAG)
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(8 + HEADER_TAG + len(header) + payload + TRAILER))
        h.end_headers()
        h.wfile.write(struct.pack(">Q", len(header)) + header_mac.encode("ascii") + header)
        hasher = hashlib.sha256()
        for t in tensors:
            if not t.numel():
                continue
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(view), _CHUNK):
                hasher.update(view[i:i + _CHUNK])
                h.wfile.write(view[i:i + _CHUNK])
                if self._staged is not staged:  # disallowed meanwhile: the healer gets a truncated stream
                    return
        digest = hasher.hexdigest()
        mac = (tag(self._secret, "lowband-state-response", nonce, header_sha, digest)
               if self._secret is not None else _NO_TAG)
        h.wfile.write((digest + mac).encode("ascii"))
        h.wfile.flush()

    # ---------------------------------------------------------------- receiving
    def _poisoned(self, src_rank: int, why: str) -> PoisonedState:
        if self._on_poisoned is not None:
            try:
                self._on_poisoned(src_rank, why)
            except Exception:  # noqa: BLE001 - reporting must not turn a refused heal into a crash
                log.exception("reporting the source of a poisoned state failed")
        return PoisonedState(why)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        url = urllib.parse.urlsplit(metadata)
        where = f"{url.hostname}:{url.port}" if url.scheme == "http" else metadata[:100]
        known = self._refuse_source(src_rank) if self._refuse_source is not None else None
        if known is not None:
            raise TransferError(f"healing from {where} (step {step}): not fetched: this source served a poisoned "
                                f"state before ({known[:200]}); this node waits for another source")
        if self._check is not None:
            try:
                self._check(int(step), None)
            except ValueError as e:
                raise self._poisoned(src_rank, f"healing from {where} (step {step}): refused before fetching: {e}") from None
        if url.scheme != "http" or not url.hostname or not url.port or url.path != "/state/":
            raise TransferError(f"the source's state address {metadata[:100]!r} is not a lowband state server "
                                "(every node must run the same lowband version)")
        stall = min(self._timeout, timeout.total_seconds()) if timeout else self._timeout
        own = self._template() if self._template is not None else None
        template = template_of(own) if own is not None else None
        limit = receive_limit(template) if template is not None else 1 << 40
        nonce, t = _secrets.token_hex(16), repr(time.time())
        query = {"fp": self._fingerprint, "node": str(self._node), "rank": str(self._rank), "nonce": nonce, "t": t}
        if self._secret is not None:
            query["tag"] = tag(self._secret, "lowband-state-request", self._fingerprint, step, query["node"],
                               query["rank"], nonce, t)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=stall)
        deadline = None
        t0 = time.perf_counter()
        try:
            try:
                conn.connect()
                sock = conn.sock  # the response keeps reading from it after getresponse closes ``conn``
                # The server may wait up to its timeout for torchft to stage the state: the answer must start
                # within twice the timeout (and a second), whatever the source trickles.
                deadline = _Deadline(sock, 2 * stall + 1.0, 2 * stall + 1.0)
                deadline.arm()
                conn.request("GET", f"/state/{int(step)}?{urllib.parse.urlencode(query)}")
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException, ValueError) as e:
                if deadline is not None and deadline.expired or isinstance(e, TimeoutError):
                    raise TransferError(f"the source at {where} did not answer within {2 * stall + 1:g} s: "
                                        "abandoned") from None
                raise TransferError(f"cannot fetch the state from {where}: {type(e).__name__}") from None
            if resp.status != 200:
                raise TransferError(f"the source at {where} refused the state transfer: {resp.status} "
                                    f"{str(resp.reason)[:100]}")
            length = resp.getheader("Content-Length") or ""
            bound = limit + header_limit(template) + 8 + HEADER_TAG + TRAILER
            if not re.fullmatch(r"[0-9]{1,20}", length, re.ASCII) or int(length) > bound:
                raise TransferError(f"the source announced {length[:40]!r} bytes, more than this node accepts ({limit} "
                                    "payload bytes: a multiple of its own state), or no length")
            deadline.stall_s = stall
            deadline.extend(stall)
            state = read_state(resp, step=int(step), fingerprint=self._fingerprint, limit=limit, template=template,
                               stall_s=stall, content_length=int(length), sock=sock, secret=self._secret,
                               nonce=nonce, deadline=deadline)
        except TransferError as e:
            raise TransferError(f"healing from {where} (step {step}): {e}") from None
        finally:
            if deadline is not None:
                deadline.close()
            conn.close()
        try:
            check_values(state, own)
            if self._check is not None:
                self._check(int(step), state)
        except (PoisonedState, ValueError) as e:
            raise self._poisoned(src_rank, f"healing from {where} (step {step}): refused, nothing loaded: {e}") from None
        log.info("fetched the state of step %d from %s in %.2f s", step, where, time.perf_counter() - t0)
        return state

    def shutdown(self, wait: bool = True) -> None:
        with self._cond:
            self._staged = None
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout)
