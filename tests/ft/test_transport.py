"""lowband/ft/transport.py: the healing state's wire format and server, in-process (threads, no process).

What must hold (issue 29 item 3): the state travels as tensors and plain data and is never unpickled;
its length is announced and checked; every read is bounded in time; a source that lies (length, hash,
dtype/shape, step, job, a pickle) or stalls is abandoned with a TransferError; with a secret only a
member gets the state and only a member's state is accepted.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import socket
import struct
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lowband.ft.transport import (
    FORMAT,
    StateTransport,
    TransferError,
    encode_state,
    read_state,
    receive_limit,
    template_of,
)

FP = "abc123"
SECRET = b"0123456789abcdef0123456789abcdef"


def _state():
    return {"fingerprint": FP, "trainer": {"step": 7, "train_time_s": 1.5, "tokens": 1 << 40},
            "params": {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)},
            "half": torch.randn(2, 2).to(torch.bfloat16), "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 2),
            "groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "nan": float("nan"), "inf": float("-inf")}],
            "state": {0: {"step": torch.tensor(2.0)}, 3: {}}, "flag": True, "name": "x"}


def _wire(state, *, step=7, fp=FP, secret=None, nonce="n" * 32):
    import hashlib

    from lowband.trust.secret import tag

    header, tensors = encode_state(state, step=step, fingerprint=fp)
    payload = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    digest = hashlib.sha256(payload).hexdigest()
    header_sha = hashlib.sha256(header).hexdigest()
    mac = tag(secret, "lowband-state-response", nonce, header_sha, digest) if secret else "-" * 32
    header_mac = tag(secret, "lowband-state-header", nonce, header_sha) if secret else "-" * 32
    return struct.pack(">Q", len(header)) + header_mac.encode() + header + payload + (digest + mac).encode()


def _read(raw: bytes, **kw):
    args = dict(step=7, fingerprint=FP, limit=1 << 30, template=None, stall_s=2.0)
    args.update(kw)
    return read_state(io.BufferedReader(io.BytesIO(raw)), **args)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def test_a_state_round_trips_tensors_and_plain_data_with_their_types():
    s = _state()
    got = _read(_wire(s), template=template_of(s))
    assert _equal(s, got)


def test_the_sender_refuses_what_is_not_tensors_or_plain_data():
    with pytest.raises(TypeError, match=r"state.bad is a .*only tensors and plain data"):
        encode_state({"bad": object()}, step=0, fingerprint=FP)


@pytest.mark.parametrize("cut", [4, 20, -200, -1])
def test_a_truncated_stream_is_refused(cut):
    with pytest.raises(TransferError, match="ended early|truncated|not valid JSON"):
        _read(_wire(_state())[:cut])


def test_a_wrong_http_length_or_an_oversized_payload_is_refused_before_the_payload_is_read():
    raw = _wire(_state())
    with pytest.raises(TransferError, match="announced .* bytes over HTTP"):
        _read(raw, content_length=len(raw) + 1)
    with pytest.raises(TransferError, match="more than this node accepts"):
        _read(raw, limit=10)


def test_a_tampered_payload_fails_its_hash_and_a_forged_or_missing_tag_fails_the_secret():
    raw = bytearray(_wire(_state()))
    raw[-TRAILER_AT] ^= 1
    with pytest.raises(TransferError, match="SHA-256"):
        _read(bytes(raw))
    with pytest.raises(TransferError, match="not signed with this job's secret"):
        _read(_wire(_state()), secret=SECRET, nonce="n" * 32)
    with pytest.raises(TransferError, match="not signed with this job's secret"):
        _read(_wire(_state(), secret=b"another secret, 32 bytes long..."), secret=SECRET, nonce="n" * 32)
    with pytest.raises(TransferError, match="not signed"):  # a replayed answer to another request
        _read(_wire(_state(), secret=SECRET, nonce="m" * 32), secret=SECRET, nonce="n" * 32)
    s = _state()
    assert _equal(s, _read(_wire(s, secret=SECRET), secret=SECRET, nonce="n" * 32))


TRAILER_AT = 97  # the last payload byte


def test_a_dtype_or_shape_that_differs_from_this_nodes_state_is_refused():
    mine = template_of(_state())
    other = _state()
    other["params"]["w"] = torch.randn(4, 3)
    with pytest.raises(TransferError, match=r"state.params.w is float32 \(4, 3\) on the source but float32 \(3, 4\)"):
        _read(_wire(other), template=mine)
    other = _state()
    other["params"]["w"] = other["params"]["w"].double()
    with pytest.raises(TransferError, match="float64 .* but float32"):
        _read(_wire(other), template=mine)


@pytest.mark.parametrize("kw, needle", [(dict(step=8), "step 7, this node asked for step 8"),
                                        (dict(fingerprint="zzz"), "another job")])
def test_another_step_or_job_is_refused(kw, needle):
    with pytest.raises(TransferError, match=needle):
        _read(_wire(_state()), **kw)


def _pickle_bomb(marker):
    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"user": Bomb()}, buf)
    return buf.getvalue()


def test_a_pickle_is_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    bomb = _pickle_bomb(marker)
    for raw in (bomb, struct.pack(">Q", len(bomb)) + bomb, _wire({}).replace(b'"tree":{"d":[]}', b'"tree":{"p":"x"}')):
        with pytest.raises(TransferError):
            _read(raw)
    # a header whose tree smuggles a pickle as a string stays a string
    s = _read(_wire({"x": pickle.dumps(1).hex()}))
    assert isinstance(s["x"], str)
    assert not marker.exists()


def test_a_stalled_source_is_abandoned_within_the_stall_bound():
    a, b = socket.socketpair()
    try:
        raw = _wire(_state())
        a.sendall(raw[:len(raw) // 2])  # then nothing more
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="stopped sending"):
            read_state(b.makefile("rb"), step=7, fingerprint=FP, limit=1 << 30, template=None, stall_s=0.3, sock=b)
        assert time.monotonic() - t0 < 2.0
    finally:
        a.close()
        b.close()


def test_a_trickling_source_is_abandoned_at_the_overall_deadline():
    a, b = socket.socketpair()
    raw = _wire(_state())
    stop = threading.Event()

    def trickle():
        for i in range(len(raw)):
            if stop.is_set():
                return
            try:
                a.sendall(raw[i:i + 1])
            except OSError:
                return
            time.sleep(0.05)  # always within the 0.3 s stall bound, never done in time

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="in time|stopped sending"):
            read_state(b.makefile("rb"), step=7, fingerprint=FP, limit=1 << 30, template=None, stall_s=0.3, sock=b)
        assert time.monotonic() - t0 < 3.0
    finally:
        stop.set()
        a.close()
        b.close()
        th.join(2)


# --------------------------------------------------------------------------- the server, in threads
def _transport(**kw):
    args = dict(advertise="127.0.0.1", timeout=timedelta(seconds=2), fingerprint=FP)
    args.update(kw)
    return StateTransport(**args)


@pytest.fixture
def pair():
    made = []

    def make(src_kw=None, dst_kw=None):
        src, dst = _transport(**(src_kw or {})), _transport(**(dst_kw or {}))
        made.extend([src, dst])
        return src, dst

    yield make
    for t in made:
        t.shutdown(wait=False)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_healer_fetches_the_staged_state_once_per_healing_rank(pair, secret):
    s = _state()
    src, dst = pair({"secret": secret}, {"secret": secret, "template": lambda: s})
    src.send_checkpoint([1], 7, s, timedelta(seconds=2))
    assert _equal(s, dst.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=2)))
    with pytest.raises(TransferError, match="429"):
        dst.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=2))


def test_the_server_refuses_a_requester_without_the_secret_or_of_another_job(pair):
    s = _state()
    src, dst = pair({"secret": SECRET}, {})
    src.send_checkpoint([1, 2], 7, s, timedelta(seconds=2))
    with pytest.raises(TransferError, match="403"):
        dst.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=2))
    other = _transport(fingerprint="zzz", secret=SECRET)
    try:
        with pytest.raises(TransferError, match="403"):
            other.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=2))
    finally:
        other.shutdown(wait=False)


def test_a_healer_with_the_secret_refuses_a_source_without_it(pair):
    s = _state()
    src, dst = pair({}, {"secret": SECRET})
    src.send_checkpoint([1], 7, s, timedelta(seconds=2))
    with pytest.raises(TransferError, match="not signed with this job's secret"):
        dst.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=2))


def test_nothing_is_served_once_disallowed_and_another_step_is_refused(pair):
    src, dst = pair({"timeout": timedelta(seconds=0.3)}, {"timeout": timedelta(seconds=0.3)})
    src.send_checkpoint([1], 7, _state(), timedelta(seconds=1))
    with pytest.raises(TransferError, match="409"):
        dst.recv_checkpoint(0, src.metadata(), 8, timedelta(seconds=1))
    src.disallow_checkpoint()
    with pytest.raises(TransferError, match="409"):
        dst.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=1))


class _Liar:
    """A tiny HTTP server that answers every request with ``body`` and ``length`` (in a thread)."""

    def __init__(self, body: bytes, length: int | None = None, stall_s: float = 0.0) -> None:
        liar = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                time.sleep(stall_s)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        liar.url = f"http://127.0.0.1:{self.server.server_address[1]}/state/"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("make, needle", [
    (lambda m: _Liar(_pickle_bomb(m)), "header"),  # torchft's own format: a pickle
    (lambda m: _Liar(b"x", length=1 << 50), "more than this node accepts"),
    (lambda m: _Liar(_wire(_state())[:300], length=len(_wire(_state())), stall_s=5), "stopped sending"),
])
def test_a_lying_or_stalling_source_is_abandoned_in_time_and_nothing_runs(tmp_path, make, needle):
    marker = tmp_path / "ran"
    liar = make(marker)
    s = _state()
    dst = _transport(timeout=timedelta(seconds=0.5), template=lambda: s)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=needle):
            dst.recv_checkpoint(0, liar.url, 7, timedelta(seconds=0.5))
        assert time.monotonic() - t0 < 3.0
    finally:
        dst.shutdown(wait=False)
        liar.close()
    assert not marker.exists()


def test_a_source_address_that_is_not_a_state_server_is_refused():
    dst = _transport()
    try:
        with pytest.raises(TransferError, match="not a lowband state server"):
            dst.recv_checkpoint(0, "http://127.0.0.1:1/checkpoint/", 7, timedelta(seconds=1))
    finally:
        dst.shutdown(wait=False)


def test_the_receive_bound_is_a_multiple_of_this_nodes_own_state():
    t = template_of({"w": torch.zeros(1000)})
    assert receive_limit(t, factor=8, slack=0) == 8 * 4000


def test_the_header_names_its_format():
    header, _ = encode_state({"w": torch.zeros(2)}, step=1, fingerprint=FP)
    h = json.loads(header)
    assert h["format"] == FORMAT and h["tensors"][0]["dtype"] == "float32" and h["payload_bytes"] == 8


def test_the_server_listens_on_exactly_its_bind_address_or_does_not_start():
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.1.*--ft-bind"):
        _transport(advertise="127.0.0.1", bind="192.0.2.1")  # TEST-NET-1: never an address of this machine
    t = _transport(advertise="192.0.2.1", bind="127.0.0.1")  # a NAT's address advertised, the local one bound
    try:
        assert t._server.socket.getsockname()[0] == "127.0.0.1"
        assert t.metadata().startswith("http://192.0.2.1:")
    finally:
        t.shutdown(wait=False)


# --------------------------------------------------------------------------- what a healing source's state holds
def test_values_that_are_not_finite_are_refused_unless_this_nodes_own_state_holds_them_there():
    from lowband.ft.transport import PoisonedState, check_values

    own = {"w": torch.ones(3), "mask": torch.tensor([0.0, float("-inf")]), "lr": 0.1, "eps": float("inf"),
           "i": torch.arange(2)}
    check_values({"w": torch.full((3,), 2.0), "mask": torch.tensor([1.0, float("-inf")]), "lr": 0.2,
                  "eps": float("inf"), "i": torch.arange(2), "new": torch.zeros(2)}, own)
    for bad, needle in (({"w": torch.tensor([1.0, float("nan"), 1.0])}, r"state\.w holds 1 value"),
                        ({"w": torch.tensor([1.0, float("inf"), 1.0])}, r"state\.w"),
                        ({"mask": torch.tensor([float("-inf"), float("-inf")])}, r"state\.mask"),
                        ({"mask": torch.tensor([0.0, float("nan")])}, r"state\.mask"),
                        ({"lr": float("nan")}, r"state\.lr is nan"), ({"new": torch.tensor([float("inf")])}, "new"),
                        ({"g": [{"b": (0.9, float("inf"))}]}, r"state\.g\[0\]\.b\[1\]")):
        with pytest.raises(PoisonedState, match=needle):
            check_values(bad, own)


def test_a_poisoned_state_is_refused_reported_and_its_source_never_fetched_from_again(pair):
    from lowband.ft.transport import PoisonedState

    s = _state()
    poisoned = _state()
    poisoned["params"]["w"][1, 2] = float("nan")
    reported, bad = [], {}
    src, dst = pair({"secret": SECRET}, {"secret": SECRET, "template": lambda: s,
                                         "on_poisoned": lambda rank, why: (reported.append((rank, why)),
                                                                           bad.setdefault(rank, why)),
                                         "refuse_source": bad.get})
    src.send_checkpoint([1, 2], 7, poisoned, timedelta(seconds=2))
    with pytest.raises(PoisonedState, match=r"refused, nothing loaded: state\.params\.w holds 1 value"):
        dst.recv_checkpoint(3, src.metadata(), 7, timedelta(seconds=2))
    assert [r for r, _ in reported] == [3] and src._served_left == 1
    with pytest.raises(TransferError, match="not fetched: this source served a poisoned state before"):
        dst.recv_checkpoint(3, src.metadata(), 7, timedelta(seconds=2))
    assert src._served_left == 1 and len(reported) == 1  # nothing fetched, reported once


def test_a_heal_whose_step_the_node_refuses_is_refused_before_anything_is_fetched():
    from lowband.ft.transport import PoisonedState

    reported = []

    def check(step, state, own):
        if step > 100:
            raise ValueError(f"the source is at step {step}, outside the job's [0, 100]")

    dst = _transport(check=check, on_poisoned=lambda rank, why: reported.append(rank))
    try:  # port 1: nothing listens there, and nothing is asked of it
        with pytest.raises(PoisonedState, match=r"refused before fetching: the source is at step 10\*\*12|outside"):
            dst.recv_checkpoint(2, "http://127.0.0.1:1/state/", 10 ** 12, timedelta(seconds=1))
    finally:
        dst.shutdown(wait=False)
    assert reported == [2]


# --------------------------------------------------------------------------- what a stranger can make them do
class _Trickler:
    """A server that accepts and sends ``text`` one byte every ``every_s`` seconds (the status line and headers of
    an answer that never ends), in a thread."""

    def __init__(self, text: bytes, every_s: float) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.stop = threading.Event()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/state/"

        def serve():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                i = 0
                while not self.stop.is_set():
                    try:
                        conn.sendall(text[i % len(text):i % len(text) + 1])
                    except OSError:
                        return
                    i += 1
                    time.sleep(every_s)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.sock.close()
        self.thread.join(2)


def test_a_source_that_trickles_its_status_line_and_headers_is_abandoned_at_the_deadline():
    liar = _Trickler(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 10_000, every_s=0.02)
    dst = _transport(timeout=timedelta(seconds=0.3))
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="did not answer within 1.6 s"):
            dst.recv_checkpoint(0, liar.url, 7, timedelta(seconds=0.3))
        assert time.monotonic() - t0 < 4.0  # 2 × 0.3 s + 1 s, and the watchdog's grace
    finally:
        dst.shutdown(wait=False)
        liar.close()


def test_the_state_server_cuts_a_trickling_requester_and_caps_the_connections_of_one_host(pair):
    src, _ = pair({"timeout": timedelta(seconds=0.3)})
    port = src._server.server_address[1]
    slow = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    try:
        slow.settimeout(5)
        for ch in b"GET /state/7?fp=abc":  # one byte every 50 ms: each within the 0.3 s stall bound
            try:
                slow.sendall(bytes([ch]))
            except OSError:
                break
            time.sleep(0.05)
        try:
            closed = slow.recv(100) == b""
        except ConnectionResetError:
            closed = True
        assert closed and time.monotonic() - t0 < 3.0  # cut off at 2 × 0.3 s of the connection
    finally:
        slow.close()
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]  # MAX_PER_HOST, sending nothing
    try:
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(2)
        t1 = time.monotonic()
        try:
            assert extra.recv(10) == b""  # closed unread, not after the others' time
        except ConnectionResetError:
            pass
        assert time.monotonic() - t1 < 0.5
        extra.close()
    finally:
        for s in held:
            s.close()
