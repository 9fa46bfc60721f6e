"""The healing state transfer of a fault-tolerant job: tensors and plain data, never code.

torchft 0.2.0's HTTP transport serves a node's state as a pickle and loads it with
``weights_only=False``: whoever answers a healing node's request could run code on it. This module
replaces it (torchft's ``CheckpointTransport`` interface: :meth:`StateTransport.send_checkpoint`,
``recv_checkpoint``, ``metadata``, ``disallow_checkpoint``).

The wire format (one HTTP GET, ``/state/STEP?...``; the body):

- 8 bytes: the header's length, big-endian;
- the header, JSON: format version, step, job fingerprint, the payload's length, and per tensor its
  name, dtype (from a fixed list), shape, offset and byte length; the rest of the state as plain data
  (``None``, bool, int, float, str, and lists, tuples and dicts of them, every container tagged);
- the payload: the tensors' raw bytes, one after the other;
- a 96-byte trailer: the payload's SHA-256 (hex) and, with a job secret, a tag (HMAC) over the request's
  nonce, the header's SHA-256 and the payload's, made with the secret (``-`` × 32 without one).

What the healer checks before it uses anything: the HTTP status and the announced length against a
bound (its own state's bytes: see :func:`receive_limit`); the header's length, format, step and
fingerprint; every tensor's dtype and shape against its own state's where it has that tensor, and
that the tensors tile the payload exactly; each read is bounded in time (no byte for ``timeout`` s:
the source stalled) and so is the whole transfer (``timeout`` s plus the payload at
:data:`MIN_RATE_BPS`); the payload's hash and, with a secret, the tag. A source that fails any of
these is abandoned with :class:`TransferError`; torchft then drops the step and this node asks the
next quorum again (torchft picks the source: see docs/fault-tolerance.md).

The server serves only while torchft has staged a state (between ``send_checkpoint`` and
``disallow_checkpoint``), only the staged step and job, at most once per healing rank torchft named,
and with a secret only to a requester whose tag proves it holds the secret (fresh nonce and time).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
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

from lowband.trust.secret import tag, verify

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "StateTransport", "TransferError", "decode_header", "encode_state", "read_state",
           "receive_limit", "template_of"]

FORMAT = "lowband-state/1"
MIN_RATE_BPS = 1 << 20  # a transfer slower than 1 MiB/s over its whole length counts as stalled
MAX_HEADER = 64 << 20
TRAILER = 96
_CHUNK = 1 << 20
_NO_TAG = "-" * 32

#: The dtypes a state may hold, by the name the header gives them (nothing else is decoded).
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class TransferError(RuntimeError):
    """A state transfer that was refused or abandoned (the source lied, stalled, or is not of this job)."""


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


def decode_header(raw: bytes, *, step: int, fingerprint: str, limit: int,
                  template: dict[str, tuple[str, tuple[int, ...]]] | None) -> dict:
    """The header, checked: format, step, fingerprint, the tensors' layout and (with ``template``) dtypes/shapes."""
    try:
        h = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise TransferError(f"the state's header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise TransferError(f"the source sent a state of another format ({str(h.get('format') if isinstance(h, dict) else h)[:40]!r}, "
                            f"expected {FORMAT!r}): every node must run the same lowband version")
    if h.get("step") != step:
        raise TransferError(f"the source sent the state of step {h.get('step')!r}, this node asked for step {step}")
    if h.get("fingerprint") != fingerprint:
        raise TransferError(f"the source runs another job (fingerprint {str(h.get('fingerprint'))[:32]!r}, "
                            f"{fingerprint!r} here)")
    total, specs = h.get("payload_bytes"), h.get("tensors")
    if not isinstance(total, int) or not isinstance(specs, list) or not 0 <= total <= limit:
        raise TransferError(f"the source announced {total!r} payload bytes, more than this node accepts ({limit}: "
                            "a multiple of its own state)")
    offset = 0
    for s in specs:
        ok = (isinstance(s, dict) and s.get("dtype") in DTYPES and isinstance(s.get("shape"), list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s["shape"])
              and s.get("offset") == offset and isinstance(s.get("name"), str))
        if not ok:
            raise TransferError(f"the state's header describes a tensor badly ({str(s)[:80]})")
        n = math.prod(s["shape"]) * torch.empty((), dtype=DTYPES[s["dtype"]]).element_size()
        if s.get("bytes") != n:
            raise TransferError(f"{s['name']}: {s.get('bytes')!r} bytes announced for shape {s['shape']} {s['dtype']}")
        mine = (template or {}).get(s["name"])
        if mine is not None and (mine[0] != s["dtype"] or tuple(mine[1]) != tuple(s["shape"])):
            raise TransferError(f"{s['name']} is {s['dtype']} {tuple(s['shape'])} on the source but {mine[0]} "
                                f"{tuple(mine[1])} here: the nodes run different models, methods or shardings")
        offset += n
    if offset != total:
        raise TransferError(f"the tensors fill {offset} bytes, the source announced {total}")
    return h


# --------------------------------------------------------------------------- reading
class _Deadline:
    """Each read bounded by ``stall_s`` (no byte: the source stalled) and by the transfer's overall deadline."""

    def __init__(self, sock: socket.socket | None, stall_s: float, overall_s: float) -> None:
        self.sock, self.stall_s = sock, stall_s
        self.end = time.monotonic() + overall_s

    def extend(self, seconds: float) -> None:
        self.end += seconds

    def arm(self) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferError("the source did not send the state in time (it stalled or sends too slowly): "
                                "abandoned")
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
        except (OSError, http.client.HTTPException) as e:
            raise TransferError(f"the connection to the source broke while reading {what} ({type(e).__name__})") from None
        if not n:
            raise TransferError(f"the source's stream ended early: {what} truncated ({got} of {len(buf)} bytes)")
        if hasher is not None:
            hasher.update(buf[got:got + n])
        got += n


def read_state(f, *, step: int, fingerprint: str, limit: int, template: dict | None, stall_s: float,
               content_length: int | None = None, sock: socket.socket | None = None, secret: bytes | None = None,
               nonce: str = "") -> Any:
    """Read one state from a stream in the wire format; every check of the module docstring, no pickle."""
    deadline = _Deadline(sock, stall_s, stall_s)
    head = bytearray(8)
    _read_exact(f, memoryview(head), deadline, "the header's length")
    (hlen,) = struct.unpack(">Q", head)
    if hlen > MAX_HEADER:
        raise TransferError(f"the source announced a {hlen}-byte header, more than {MAX_HEADER}")
    deadline.extend(hlen / MIN_RATE_BPS)
    raw = bytearray(hlen)
    _read_exact(f, memoryview(raw), deadline, "the header")
    h = decode_header(bytes(raw), step=step, fingerprint=fingerprint, limit=limit, template=template)
    total = h["payload_bytes"]
    if content_length is not None and content_length != 8 + hlen + total + TRAILER:
        raise TransferError(f"the source announced {content_length} bytes over HTTP, its header "
                            f"{8 + hlen + total + TRAILER}")
    deadline.extend(total / MIN_RATE_BPS)
    hasher = hashlib.sha256()
    tensors = []
    for s in h["tensors"]:
        t = torch.empty(s["shape"], dtype=DTYPES[s["dtype"]])
        if t.numel():
            _read_exact(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()), deadline, s["name"], hasher)
        tensors.append(t)
    trailer = bytearray(TRAILER)
    _read_exact(f, memoryview(trailer), deadline, "the trailer")
    digest, mac = bytes(trailer[:64]).decode("ascii", "replace"), bytes(trailer[64:]).decode("ascii", "replace")
    if digest != hasher.hexdigest():
        raise TransferError("the state's payload does not match its SHA-256: corrupted or tampered with")
    if secret is not None and not verify(secret, mac, "lowband-state-response", nonce,
                                         hashlib.sha256(raw).hexdigest(), digest):
        raise TransferError("the source's state is not signed with this job's secret: a node that is not a member "
                            "of this job answered (check that every node has the same secret)")
    return _decode(h["tree"], tensors)


# --------------------------------------------------------------------------- the transport
class StateTransport:
    """torchft's ``CheckpointTransport`` with lowband's wire format (see the module docstring).

    Args:
        advertise: the address this node is reached at; the server binds to it.
        timeout: the stall bound of every read and write (``--ft-timeout``).
        fingerprint: the job's fingerprint (a source of another job is refused, and so is a requester).
        secret: the job's secret, or None (then anyone who reaches the port while a state is staged may
            read it once per healing rank; see docs/fault-tolerance.md).
        template: the healer's own state (a function returning it, called once per heal): the dtypes and
            shapes a source's tensors must have, and the bound on what it may send.
        node, rank: this rank's place (named in its requests).
    """

    def __init__(self, *, advertise: str, timeout: timedelta, fingerprint: str, secret: bytes | None = None,
                 template: Callable[[], Any] | None = None, node: int = 0, rank: int = 0, port: int = 0) -> None:
        self._timeout = timeout.total_seconds()
        self._fingerprint, self._secret, self._template = fingerprint, secret, template
        self._node, self._rank, self._advertise = node, rank, advertise
        self._cond = threading.Condition()
        self._staged: tuple[int, bytes, list[torch.Tensor]] | None = None
        self._served_left = 0
        self._sending = 0
        self._nonces: set[str] = set()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = self._timeout  # every socket operation of the server is bounded too

            def log_message(self, fmt, *args):  # noqa: N802 - no access log on stderr
                log.debug("state server: " + fmt, *args)

            def do_GET(self):  # noqa: N802
                transport._serve(self)

        family = socket.AF_INET6 if ":" in advertise.strip("[]") else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        try:
            self._server = Server((advertise.strip("[]"), port), Handler)
        except OSError as e:  # e.g. an address in front of a NAT, not one of this machine's
            log.warning("the state server cannot listen at %s (%s): it listens on every interface instead; "
                        "with no job secret anyone who reaches its port while a heal is staged can read the state",
                        advertise, e.strerror or e)
            Server.address_family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
            self._server = Server(("::" if socket.has_ipv6 else "", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="lowband-state-server", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- serving
    def metadata(self) -> str:
        host = f"[{self._advertise.strip('[]')}]" if ":" in self._advertise.strip("[]") else self._advertise
        return f"http://{host}:{self._server.server_address[1]}/state/"

    def address(self) -> str:
        return self.metadata()

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
        log.warning("state server: refused a request from %s: %s", h.client_address[0], why)
        try:
            h.send_error(code, why)
        except OSError:
            pass

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "state" or not parts[1].isdigit():
            return self._refuse(h, 404, "no such path")
        step = int(parts[1])
        if q.get("fp") != self._fingerprint:
            return self._refuse(h, 403, "the requester runs another job (fingerprint)")
        if self._secret is not None:
            nonce, t = q.get("nonce", ""), q.get("t", "")
            try:
                fresh = abs(time.time() - float(t)) <= max(60.0, 2 * self._timeout)
            except ValueError:
                fresh = False
            if not (fresh and len(nonce) >= 16 and verify(self._secret, q.get("tag", ""), "lowband-state-request",
                                                           self._fingerprint, step, q.get("node"), q.get("rank"),
                                                           nonce, t)):
                return self._refuse(h, 403, "the request does not carry this job's secret (tag), or is stale")
        nonce, refusal = q.get("nonce", ""), None
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
        try:
            self._send(h, staged, q.get("nonce", ""))
        except OSError as e:
            log.warning("state server: sending the state to %s failed (%s)", h.client_address[0], type(e).__name__)
        finally:
            with self._cond:
                self._sending -= 1
                self._cond.notify_all()

    def _send(self, h: BaseHTTPRequestHandler, staged, nonce: str) -> None:
        _, header, tensors = staged
        payload = sum(t.numel() * t.element_size() for t in tensors)
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(8 + len(header) + payload + TRAILER))
        h.end_headers()
        h.wfile.write(struct.pack(">Q", len(header)) + header)
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
        mac = (tag(self._secret, "lowband-state-response", nonce, hashlib.sha256(header).hexdigest(), digest)
               if self._secret is not None else _NO_TAG)
        h.wfile.write((digest + mac).encode("ascii"))
        h.wfile.flush()

    # ---------------------------------------------------------------- receiving
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        url = urllib.parse.urlsplit(metadata)
        if url.scheme != "http" or not url.hostname or not url.port or url.path != "/state/":
            raise TransferError(f"the source's state address {metadata[:100]!r} is not a lowband state server "
                                "(every node must run the same lowband version)")
        stall = min(self._timeout, timeout.total_seconds()) if timeout else self._timeout
        template = template_of(self._template()) if self._template is not None else None
        limit = receive_limit(template) if template is not None else 1 << 40
        nonce, t = _secrets.token_hex(16), repr(time.time())
        query = {"fp": self._fingerprint, "node": str(self._node), "rank": str(self._rank), "nonce": nonce, "t": t}
        if self._secret is not None:
            query["tag"] = tag(self._secret, "lowband-state-request", self._fingerprint, step, query["node"],
                               query["rank"], nonce, t)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=stall)
        t0 = time.perf_counter()
        try:
            try:
                conn.request("GET", f"/state/{int(step)}?{urllib.parse.urlencode(query)}")
                sock = conn.sock  # the response keeps reading from it after getresponse closes ``conn``
                # The server may wait up to its timeout for torchft to stage the state: allow for it.
                sock.settimeout(2 * stall)
                resp = conn.getresponse()
            except TimeoutError:
                raise TransferError(f"the source at {url.hostname}:{url.port} did not answer within {2 * stall:g} s: "
                                    "abandoned") from None
            except (OSError, http.client.HTTPException) as e:
                raise TransferError(f"cannot fetch the state from {url.hostname}:{url.port}: {type(e).__name__}") from None
            if resp.status != 200:
                raise TransferError(f"the source at {url.hostname}:{url.port} refused the state transfer: "
                                    f"{resp.status} {resp.reason}")
            length = resp.getheader("Content-Length")
            if length is None or not length.isdigit() or int(length) > limit + MAX_HEADER + 8 + TRAILER:
                raise TransferError(f"the source announced {length!r} bytes, more than this node accepts ({limit} "
                                    "payload bytes: a multiple of its own state), or no length")
            state = read_state(resp, step=int(step), fingerprint=self._fingerprint, limit=limit, template=template,
                               stall_s=stall, content_length=int(length), sock=sock, secret=self._secret,
                               nonce=nonce)
        except TransferError as e:
            raise TransferError(f"healing from {url.hostname}:{url.port} (step {step}): {e}") from None
        finally:
            conn.close()
        log.info("fetched the state of step %d from %s:%s in %.2f s", step, url.hostname, url.port,
                 time.perf_counter() - t0)
        return state

    def shutdown(self, wait: bool = True) -> None:
        with self._cond:
            self._staged = None
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout)
