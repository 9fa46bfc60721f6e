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
import logging
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

from lowband.ft.wire import (  # noqa: F401  (the wire format's names, as callers and tests know them here)
    _CHUNK,
    _NO_TAG,
    DTYPES,
    FORMAT,
    HEADER_TAG,
    MAX_HEADER,
    MAX_REQUEST_LINE,
    MIN_RATE_BPS,
    SIGNATURE,
    TRAILER,
    PoisonedState,
    TransferError,
    _Deadline,
    check_values,
    decode_header,
    encode_state,
    header_limit,
    parse_request,
    read_state,
    receive_limit,
    template_of,
)
from lowband.trust.admission import CannotListen, claim_of
from lowband.trust.admission import same_host as _same_host
from lowband.trust.limits import SourceLimiter
from lowband.trust.secret import tag, verify

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "PoisonedState", "StateTransport", "TransferError", "member_source", "check_values", "decode_header",
           "encode_state", "header_limit", "parse_request", "read_state", "receive_limit", "template_of"]

MAX_CONNECTIONS = 32  # the state server's connections at once
MAX_PER_HOST = 16  # ... from one host (the healing ranks of several nodes on one machine share its address)


# --------------------------------------------------------------------------- the transport
def member_source(rid: str, roster=None):
    """What :class:`StateTransport`'s ``source_of`` answers for the quorum member with replica id ``rid``: the host its
    tag vouches for and, with a roster (:class:`lowband.trust.keys.Roster`), the check of a state's signature by that
    member's key; None for an id lowband did not make."""
    claim = claim_of(rid)
    if claim is None:
        return None
    host = claim.manager.rsplit(":", 1)[0].strip("[]")
    if roster is None:
        return host, None
    return host, lambda signature, *parts: roster.verify(claim.node, signature, "lowband-state-source", *parts)


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
        check: ``check(step, state, own)`` raises ValueError for a heal the node must refuse: called with
            ``state=None`` before anything is fetched (the quorum's step), then with the state received and
            this node's own (``template``'s).
        refuse_source: ``refuse_source(src_rank)``: why this node does not fetch from that member of the
            quorum (it served a poisoned state before), or None.
        on_poisoned: ``on_poisoned(src_rank, why)``: a source's state failed a check of what it holds
            (:class:`PoisonedState`).
        node, rank: this rank's place (named in its requests).
        key: this node's own private key (:class:`lowband.trust.keys.MemberKey`, a job with a roster): the state it
            serves is signed with it (over the healer's nonce and the state's hashes).
        source_of: ``source_of(src_rank)``: where the quorum's member ``src_rank`` may serve a state from (the host its
            tag vouches for) and, in a job with a roster, ``verify(signature, nonce, header_sha, digest)`` with its
            public key (else None); None when ``src_rank`` is no member. A source elsewhere is not fetched from.
    """

    def __init__(self, *, advertise: str, timeout: timedelta, fingerprint: str, secret: bytes | None = None,
                 template: Callable[[], Any] | None = None, node: int = 0, rank: int = 0, port: int = 0,
                 bind: str | None = None, check: Callable[[int, Any, Any], None] | None = None,
                 refuse_source: Callable[[int], str | None] | None = None,
                 on_poisoned: Callable[[int, str], None] | None = None, key=None,
                 source_of: Callable[[int], tuple[str, Callable | None] | None] | None = None) -> None:
        self._key, self._source_of = key, source_of
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
                self.deadline = _Deadline(self.connection, transport._timeout, 2 * transport._timeout, grace=0.0)

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
            raise CannotListen(f"the state server cannot listen on {host}:{port} ({e.strerror or e}): --ft-bind must be an "
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
        signature = SIGNATURE if self._key is not None else 0
        h.send_header("Content-Length", str(8 + HEADER_TAG + len(header) + payload + TRAILER + signature))
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
        if self._key is not None:  # a job with a roster: which member serves it, and to this request only (the nonce)
            h.wfile.write(self._key.sign("lowband-state-source", nonce, header_sha, digest).encode("ascii"))
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
                self._check(int(step), None, None)
            except ValueError as e:
                raise self._poisoned(src_rank, f"healing from {where} (step {step}): refused before fetching: {e}") from None
        if url.scheme != "http" or not url.hostname or not url.port or url.path != "/state/":
            raise TransferError(f"the source's state address {metadata[:100]!r} is not a lowband state server "
                                "(every node must run the same lowband version)")
        signed_by = None
        if self._source_of is not None:
            source = self._source_of(src_rank)
            if source is None:
                raise TransferError(f"healing from {where} (step {step}): the quorum names no member as the source")
            host, signed_by = source
            if not _same_host(url.hostname, host):
                raise TransferError(f"healing from {where} (step {step}): not fetched: the state's address is not the "
                                    f"host its member's tag vouches for ({host[:60]}); another process gave it")
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
                if deadline.expired:  # cut off mid-headers: http.client takes the end of the stream for their end
                    raise TimeoutError
            except (OSError, http.client.HTTPException, ValueError) as e:
                if deadline is not None and deadline.expired or isinstance(e, TimeoutError):
                    raise TransferError(f"the source at {where} did not answer within {2 * stall + 1:g} s: "
                                        "abandoned") from None
                raise TransferError(f"cannot fetch the state from {where}: {type(e).__name__}") from None
            if resp.status != 200:
                raise TransferError(f"the source at {where} refused the state transfer: {resp.status} "
                                    f"{str(resp.reason)[:100]}")
            length = resp.getheader("Content-Length") or ""
            bound = limit + header_limit(template) + 8 + HEADER_TAG + TRAILER + SIGNATURE
            if not re.fullmatch(r"[0-9]{1,20}", length, re.ASCII) or int(length) > bound:
                raise TransferError(f"the source announced {length[:40]!r} bytes, more than this node accepts ({limit} "
                                    "payload bytes: a multiple of its own state), or no length")
            deadline.stall_s = stall
            deadline.extend(stall)
            state = read_state(resp, step=int(step), fingerprint=self._fingerprint, limit=limit, template=template,
                               stall_s=stall, content_length=int(length), sock=sock, secret=self._secret,
                               nonce=nonce, deadline=deadline, signed_by=signed_by)
        except TransferError as e:
            raise TransferError(f"healing from {where} (step {step}): {e}") from None
        finally:
            if deadline is not None:
                deadline.close()
            conn.close()
        try:
            check_values(state, own)
            if self._check is not None:
                self._check(int(step), state, own)
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
