"""The healing state's wire format (:mod:`lowband.ft.transport` serves and fetches it): encoding a state as
tensors and plain data, and reading one back with every check a healer makes before it uses anything; and the
healer's request path. Nothing here unpickles, and nothing raises but :class:`TransferError` on what a source or a
requester sends (tests/ft/test_parsers_fuzz.py).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lowband.trust.secret import verify

__all__ = ["DTYPES", "FORMAT", "HEADER_TAG", "MAX_HEADER", "MAX_REQUEST_LINE", "MIN_RATE_BPS", "SIGNATURE", "TRAILER",
           "PoisonedState", "TransferError", "check_values", "decode_header", "encode_state", "header_limit",
           "parse_request", "read_state", "receive_limit", "template_of"]

FORMAT = "lowband-state/2"
MIN_RATE_BPS = 1 << 20  # a transfer slower than 1 MiB/s over its whole length counts as stalled
MAX_HEADER = 64 << 20  # the header's bound whatever the healer's state (see header_limit)
HEADER_TAG = 32
TRAILER = 96
SIGNATURE = 128  # in a job with a roster: the source member's Ed25519 signature (hex) after the trailer
MAX_DIMS = 32  # a tensor's dimensions, at most
MAX_DIM = 1 << 40  # one dimension's extent, at most (a zero-sized tensor may not name an absurd shape)
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

    def __init__(self, sock: socket.socket | None, stall_s: float, overall_s: float, *, grace: float = 0.25) -> None:
        self.sock, self.stall_s, self.grace = sock, stall_s, grace
        self.end = time.monotonic() + overall_s
        self.expired = False
        self._cond = threading.Condition()
        self._done = False
        if sock is not None:
            threading.Thread(target=self._watch, name="lowband-transfer-deadline", daemon=True).start()

    def _watch(self) -> None:
        with self._cond:
            while not self._done:
                # A little after the deadline (``grace`` × the stall bound): a read that times out by itself says
                # what happened (it stalled); the watchdog is for a source that trickles.
                left = self.end + self.grace * self.stall_s - time.monotonic()
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
               nonce: str = "", deadline: _Deadline | None = None, max_header: int | None = None,
               signed_by: Callable[[str, str, str, str], bool] | None = None) -> Any:
    """Read one state from a stream in the wire format; every check of the module docstring but those of what the
    state holds (:func:`check_values`), no pickle. A TransferError for anything wrong, never another exception.
    ``signed_by(signature, nonce, header_sha, digest)``: in a job with a roster, whether the source member's own key
    signed the state (a :data:`SIGNATURE` after the trailer, checked before the state is decoded)."""
    own_deadline = deadline is None
    if own_deadline:
        deadline = _Deadline(sock, stall_s, stall_s)
    try:
        return _read_state(f, step=step, fingerprint=fingerprint, limit=limit, template=template,
                           content_length=content_length, secret=secret, nonce=nonce, deadline=deadline,
                           max_header=header_limit(template) if max_header is None else max_header,
                           signed_by=signed_by)
    finally:
        if own_deadline:
            deadline.close()


def _read_state(f, *, step, fingerprint, limit, template, content_length, secret, nonce, deadline, max_header,
                signed_by=None):
    end = TRAILER + (SIGNATURE if signed_by is not None else 0)
    head = bytearray(8 + HEADER_TAG)
    _read_exact(f, memoryview(head), deadline, "the header's length")
    (hlen,) = struct.unpack(">Q", head[:8])
    if hlen > max_header:
        raise TransferError(f"the source announced a {hlen}-byte header, more than this node reads ({max_header}: "
                            "in proportion to its own state's tensors)")
    if content_length is not None and 8 + HEADER_TAG + hlen + end > content_length:
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
    if content_length is not None and content_length != 8 + HEADER_TAG + hlen + total + end:
        raise TransferError(f"the source announced {content_length} bytes over HTTP, its header "
                            f"{8 + HEADER_TAG + hlen + total + end}" + ("" if signed_by is None else
                                                                        " with its member's signature"))
    deadline.extend(total / MIN_RATE_BPS)
    hasher = hashlib.sha256()
    tensors = []
    for s in h["tensors"]:
        t = torch.empty(s["shape"], dtype=DTYPES[s["dtype"]])
        if t.numel():
            _read_exact(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()), deadline, s["name"][:80], hasher)
        tensors.append(t)
    trailer = bytearray(end)
    _read_exact(f, memoryview(trailer), deadline, "the trailer")
    digest, mac = bytes(trailer[:64]).decode("ascii", "replace"), bytes(trailer[64:]).decode("ascii", "replace")
    if digest != hasher.hexdigest():
        raise TransferError("the state's payload does not match its SHA-256: corrupted or tampered with")
    mac, signature = mac[:32], mac[32:]
    if secret is not None and not verify(secret, mac, "lowband-state-response", nonce, header_sha, digest):
        raise TransferError("the source's state is not signed with this job's secret: a node that is not a member "
                            "of this job answered (check that every node has the same secret)")
    if signed_by is not None and not signed_by(signature, nonce, header_sha, digest):
        raise TransferError("the source's state is not signed by the key the job's roster names for the source "
                            "member: another process answered at its address (nothing of it was loaded)")
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
