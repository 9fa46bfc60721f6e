"""A job with a roster (issue 44 item 5): the gate takes a member's claim to its slot, its reports of bad messages and
of the job's end only signed by its own key, fresh, never replayed and from its own address, and passes quorum
requests and heartbeats of the registered process only; a healer takes a state only signed by its source member.

In one process: the gate in front of a stand-in Lighthouse (as tests/ft/test_gateway.py), the state transport in
threads (as tests/ft/test_transport.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

grpc = pytest.importorskip("grpc")
pytest.importorskip("cryptography")

from lowband.ft.completion import DONE, done_request, report_done  # noqa: E402
from lowband.ft.gateway import (  # noqa: E402
    ACCUSE,
    ADMIT,
    HEARTBEAT,
    QUORUM,
    SERVICE,
    UNREGISTERED,
    LighthouseGateway,
    accusation_request,
    accuse_at_gate,
    admission_request,
    ask_gate,
    string_field,
)
from lowband.ft.pins import connection_inode, endpoint_of_peer, spell_pins  # noqa: E402
from lowband.ft.protowire import sign_request, signed_parts  # noqa: E402
from lowband.ft.transport import StateTransport, TransferError  # noqa: E402
from lowband.trust.admission import replica_id  # noqa: E402
from lowband.trust.keys import MAX_SKEW_S, load_key, load_roster, sign_call, write_keys  # noqa: E402
from lowband.trust.secret import load_secret  # noqa: E402

FP = "f00d"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "job.secret"
    roster_file, key_files = write_keys(path, 3)
    secret = load_secret(path)
    roster = load_roster(roster_file, secret)
    return secret, roster, [load_key(k, i, roster) for i, k in enumerate(key_files)]


def _member(secret: bytes, slot: int, host: str = "127.0.0.1", uuid: str = "u") -> str:
    return replica_id(FP, slot, secret=secret, store=f"{host}:5000", manager=f"{host}:600{slot}") + f":{uuid}{slot}"


@pytest.fixture
def gate(job):
    secret, roster, _ = job
    seen: list[str] = []

    def handler(path):
        def handle(request, context):
            seen.append(path)
            return b""
        return grpc.unary_unary_rpc_method_handler(handle)

    backend = grpc.server(ThreadPoolExecutor(max_workers=4), handlers=[grpc.method_handlers_generic_handler(
        SERVICE, {"Quorum": handler(QUORUM), "Heartbeat": handler(HEARTBEAT)})])
    port = backend.add_insecure_port("127.0.0.1:0")
    backend.start()
    g = LighthouseGateway(bind="127.0.0.1:0", backend=f"127.0.0.1:{port}", secret=secret, workers=4, roster=roster,
                          pin_grace_s=0.0)  # a refusal at once (the wait for a registration: its own test)
    yield g, seen
    g.shutdown()
    backend.stop(grace=None)


def _call(g, method: str, request: bytes) -> str | None:
    """None when the gate passed the call, else "CODE: details"."""
    with grpc.insecure_channel(g.address().split("://", 1)[-1]) as ch:
        try:
            ch.unary_unary(method)(request, timeout=10)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"
    return None


def _addresses(rid: str) -> tuple[str, str]:
    host = rid.split("_a", 1)[1]
    manager = bytes.fromhex(host.split("_t", 1)[0]).decode().split(",")[1]
    return f"http://{manager}", manager.rsplit(":", 1)[0] + ":5000"


def _admit(rid: str, key=None, pins: str = "") -> bytes:
    return admission_request(rid, *_addresses(rid), key=key, pins=pins)


def test_only_the_process_a_member_registered_with_its_key_passes_quorum_and_heartbeats(job, gate):
    secret, _, keys = job
    g, seen = gate
    g.pin_idle_s = 0.0  # each call here opens a connection of its own; pinning: the test below
    rid = _member(secret, 1)
    quorum, beat = _admit(rid), string_field(1, rid.encode())
    assert UNREGISTERED in _call(g, QUORUM, quorum)  # no process of node 1 registered yet
    assert UNREGISTERED in _call(g, HEARTBEAT, beat)
    assert _call(g, ADMIT, _admit(replica_id(FP, 1, secret=secret, store="127.0.0.1:5000",
                                             manager="127.0.0.1:6001"))) is None  # a question before it starts
    signed = _admit(rid, keys[1])
    assert _call(g, ADMIT, signed) is None  # node 1's claim, signed with its key: it registers this process
    assert _call(g, QUORUM, quorum) is None and _call(g, HEARTBEAT, beat) is None
    assert seen == [QUORUM, HEARTBEAT]
    # the same id with another process's uuid (an id copied from a log, run again): refused, never forwarded
    copy = _member(secret, 1, uuid="copy")
    assert "registered another process" in _call(g, QUORUM, _admit(copy))
    assert "registered another process" in _call(g, HEARTBEAT, string_field(1, copy.encode()))
    assert "registered another process" in _call(g, ADMIT, _admit(copy))  # a process that asks learns it
    # a claim to node 1's slot signed by another member's key; the signed claim replayed; a stale one
    assert "forged" in _call(g, ADMIT, _admit(copy, keys[2]))
    assert "replayed" in _call(g, ADMIT, signed)
    body = _admit(copy)
    _, parts, _ = signed_parts(body)
    t, nonce, sig = sign_call(keys[1], ADMIT, *parts, clock=lambda: time.time() - 2 * MAX_SKEW_S)
    stale = body + b"".join(string_field(n, v.encode()) for n, v in zip((4, 5, 6), (t, nonce, sig), strict=True))
    assert "stale" in _call(g, ADMIT, stale)
    assert g.registered[1] == rid and seen == [QUORUM, HEARTBEAT]
    # a member whose tag vouches for another address than the one it calls from (every call here is from 127.0.0.1)
    far = _member(secret, 2, host="127.0.0.9")
    assert "another address than its member's" in _call(g, ADMIT, _admit(far, keys[2]))
    assert 2 not in g.registered
    # the member itself registering a new process (a restarted node) takes its slot: the old one is refused
    new = _member(secret, 1, uuid="new")
    assert ask_gate(g.address(), new, "http://127.0.0.1:6001", "127.0.0.1:5000", key=keys[1]) is None
    assert "registered another process" in _call(g, QUORUM, quorum)
    assert g.refused["not the process its member registered"] >= 5
    assert g.refused["the call is not signed by its member's key"] == 3


def test_reports_of_bad_messages_and_of_the_jobs_end_count_only_signed_by_their_member(job, gate):
    secret, _, keys = job
    g, _ = gate
    ids = {s: _member(secret, s) for s in range(3)}
    g.breaker.observe((1, 0), {s: (8 << 32) + 8 for s in ids}, ids)
    unsigned = accusation_request(ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000", ids[2], "index out of range")
    assert "not signed by its member's key" in _call(g, ACCUSE, unsigned)
    forged = sign_request(keys[1], ACCUSE, unsigned)  # node 1's key, in node 0's name
    assert "forged" in _call(g, ACCUSE, forged)
    signed = sign_request(keys[0], ACCUSE, unsigned)
    assert _call(g, ACCUSE, signed) is None
    assert "replayed" in _call(g, ACCUSE, signed)
    assert g.breaker.reports[ids[2]] == {0: "127.0.0.1"} and g.breaker.held(2) is None
    assert accuse_at_gate(g.address(), ids[1], ids[2], "index out of range", key=keys[1]) is None
    assert g.breaker.held(2) is not None  # two signed reports of the round's three: node 2 is kept out
    # Done: the same rule
    g.breaker.observe((2, 0), {0: (10 << 32) + 10, 1: (10 << 32) + 10}, {0: ids[0], 1: ids[1]})
    plain = done_request(ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000", 10, "/out0")
    assert "not signed" in _call(g, DONE, plain)
    assert "forged" in _call(g, DONE, sign_request(keys[1], DONE, plain))
    assert report_done(g.address(), ids[0], 10, "/out0", key=keys[0]) is None
    assert not g.completion.complete
    assert report_done(g.address(), ids[1], 10, "/out1", key=keys[1]) is None
    assert g.completion.complete and g.completion.step == 10


# --------------------------------------------------------------------------- the healing source
def _transport(**kw):
    return StateTransport(advertise="127.0.0.1", timeout=timedelta(seconds=2), fingerprint=FP, **kw)


def test_a_healer_takes_a_state_only_signed_by_its_source_member_and_only_from_its_address(job):
    secret, roster, keys = job
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}

    def source(slot: int, host: str = "127.0.0.1"):
        return lambda src_rank: (host, lambda sig, *parts: roster.verify(slot, sig, "lowband-state-source", *parts))

    made = []
    try:
        src = _transport(secret=secret, key=keys[1])
        made.append(src)
        src.send_checkpoint([1, 2, 3, 4], 7, state, timedelta(seconds=2))
        healer = _transport(secret=secret, key=keys[0], source_of=source(1), template=lambda: state)
        made.append(healer)
        got = healer.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=2))
        assert torch.equal(got["w"], state["w"]) and got["step"] == 7
        # a process that holds the secret but not node 1's key (here: node 2's) answers in node 1's name: refused
        impostor = _transport(secret=secret, key=keys[2])
        made.append(impostor)
        impostor.send_checkpoint([1], 7, state, timedelta(seconds=2))
        with pytest.raises(TransferError, match="not signed by the key the job's roster names"):
            healer.recv_checkpoint(0, impostor.metadata(), 7, timedelta(seconds=2))
        unsigned = _transport(secret=secret)  # the secret alone (a job without keys)
        made.append(unsigned)
        unsigned.send_checkpoint([1], 7, state, timedelta(seconds=2))
        with pytest.raises(TransferError):
            healer.recv_checkpoint(0, unsigned.metadata(), 7, timedelta(seconds=2))
        # a state address on another host than the one the source's tag vouches for is not fetched at all
        elsewhere = _transport(secret=secret, key=keys[0], source_of=source(1, host="10.0.0.7"), template=lambda: state)
        made.append(elsewhere)
        with pytest.raises(TransferError, match="not fetched"):
            elsewhere.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=2))
        nobody = _transport(secret=secret, key=keys[0], source_of=lambda r: None)
        made.append(nobody)
        with pytest.raises(TransferError, match="names no member"):
            nobody.recv_checkpoint(9, src.metadata(), 7, timedelta(seconds=2))
    finally:
        for t in made:
            t.shutdown(wait=False)


def test_the_registered_process_is_pinned_to_its_connection_until_it_falls_silent(job, gate):
    """On one host every process has the member's address: a process that copied the registered full id (torchft's
    status page, the node's store) is refused while the member's own connection is live."""
    secret, _, keys = job
    g, _ = gate
    g.pin_idle_s = 0.3
    rid = _member(secret, 0)
    assert g.member_refusal(ADMIT, _admit(rid, keys[0]), "127.0.0.1") is None
    quorum = _admit(rid)
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40001") is None  # the first pins
    assert g.member_refusal(HEARTBEAT, string_field(1, rid.encode()), "127.0.0.1", peer="ipv4:127.0.0.1:40001") is None
    why = g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40002")
    assert why.startswith("not the process its member registered") and "another connection" in why
    time.sleep(0.4)  # the member's connection fell silent (it broke): a new one of it takes the pin
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40003") is None
    assert "another connection" in g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40001")
    assert g.member_refusal(ADMIT, _admit(rid, keys[0]), "127.0.0.1") is None  # registered again: the next call pins
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40004") is None


def test_a_process_that_named_its_connections_is_taken_over_those_only_even_after_they_break(job, gate):
    """The member names its connections, signed (lowband.ft.pins): another process of its host with the copied full id
    is refused also when the member's connection broke (no first-to-call pin), a replayed registration is refused,
    and the member's new connection passes once it named it."""
    secret, _, keys = job
    g, _ = gate
    g.pin_idle_s = 0.0  # the first-to-call pin lapses at once: only the named connections hold
    rid = _member(secret, 0)
    first = _admit(rid, keys[0], pins="127.0.0.1:40001")
    assert g.member_refusal(ADMIT, first, "127.0.0.1") is None
    quorum = _admit(rid)
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40001") is None
    for peer in ("ipv4:127.0.0.1:40002", "ipv6:[::ffff:127.0.0.1]:40003"):
        why = g.member_refusal(QUORUM, quorum, "127.0.0.1", peer=peer)
        assert why.startswith("not the process its member registered") and "another connection" in why, why
    assert "replay" in g.member_refusal(ADMIT, first, "127.0.0.1")  # an old registration sent again: refused
    forged = _admit(rid, keys[1], pins="127.0.0.1:40002")  # another member's key
    assert g.member_refusal(ADMIT, forged, "127.0.0.1").startswith("the call is not signed by its member's key")
    assert "another connection" in g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40002")
    assert g.member_refusal(ADMIT, _admit(rid, keys[0], pins="127.0.0.1:40004"), "127.0.0.1") is None  # reconnected
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40004") is None
    assert "another connection" in g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40001")
    # its connection closed: it names none; nothing of its slot passes, the old port (rebound by another) included
    assert g.member_refusal(ADMIT, _admit(rid, keys[0]), "127.0.0.1") is None
    assert "none now" in g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40004")
    # behind a NAT the named ends are on the member's own (private) address, not the one the gate sees: first to call
    nat = _member(secret, 2, host="10.9.0.5")
    assert g.member_refusal(ADMIT, _admit(nat, keys[2], pins="192.168.1.5:51000"), "10.9.0.5") is None
    assert g.member_refusal(QUORUM, _admit(nat), "10.9.0.5", peer="ipv4:10.9.0.5:61000") is None


def test_a_connection_from_a_named_end_after_that_one_closed_is_refused_before_the_member_names_again(job, gate):
    """Once a member's connection closes its port is free: another process of its host binds it and calls from the
    very end the member named, before the member's next naming (a poll). The gate tied that end to its own side of the
    connection the member's first call came over, and refuses the new connection's call."""
    import socket
    import struct

    secret, _, keys = job
    g, _ = gate
    port = int(g.address().rsplit(":", 1)[1])

    def connect(at: int = 0) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", at))
        s.connect(("127.0.0.1", port))
        return s

    def wait_served(end, there: bool) -> int:  # the gate's server accepts (and closes) on its own threads
        deadline = time.monotonic() + 10
        while bool(inode := connection_inode((end[0], port), end)) != there and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bool(inode) == there
        return inode

    member = connect()
    end = endpoint_of_peer(f"ipv4:127.0.0.1:{member.getsockname()[1]}")
    first = wait_served(end, True)
    rid = _member(secret, 0)
    assert g.member_refusal(ADMIT, _admit(rid, keys[0], pins=spell_pins(frozenset({end}))), "127.0.0.1") is None
    peer, quorum = f"ipv4:127.0.0.1:{end[1]}", _admit(rid)
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer=peer) is None
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer=peer) is None  # the same connection again
    member.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    member.close()  # reset: the port is free at once
    wait_served(end, False)
    relay = connect(end[1])  # another process, from the end the member named
    try:
        assert wait_served(end, True) != first  # the same four ends, another connection
        why = g.member_refusal(QUORUM, quorum, "127.0.0.1", peer=peer)
        assert why is not None and "another connection calls from the end it named" in why, why
        assert "none now" in g.member_refusal(QUORUM, quorum, "127.0.0.1", peer=peer)  # that end is named no more
    finally:
        relay.close()


def test_a_call_over_a_connection_its_process_names_a_moment_later_waits_for_it_and_anothers_is_refused(job, gate):
    """torchft's Manager opens a new connection after a failed call and calls over it at once, a moment before the
    node names it (lowband.ft.pins); refused, torchft would wait out its quorum's timeout. The call waits (at most
    pin_grace_s) for the naming; another process's call over a connection that is never named is refused."""
    import threading

    secret, _, keys = job
    g, _ = gate
    g.pin_grace_s = 2.0
    rid = _member(secret, 0)
    assert g.member_refusal(ADMIT, _admit(rid, keys[0], pins="127.0.0.1:40001"), "127.0.0.1") is None
    quorum = _admit(rid)
    timer = threading.Timer(0.3, lambda: g.member_refusal(ADMIT, _admit(rid, keys[0], pins="127.0.0.1:40002"),
                                                          "127.0.0.1"))
    timer.start()
    t0 = time.monotonic()
    assert g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40002") is None  # named meanwhile
    assert 0.25 < time.monotonic() - t0 < 1.5
    timer.join()
    g.pin_grace_s = 0.4
    t0 = time.monotonic()
    assert "another connection" in g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40003")
    assert time.monotonic() - t0 >= 0.35 and g._awaiting[0] == 0
    g._awaiting[0] = 4  # as many calls of the slot already wait as may: the next is refused at once
    t0 = time.monotonic()
    assert "another connection" in g.member_refusal(QUORUM, quorum, "127.0.0.1", peer="ipv4:127.0.0.1:40003")
    assert time.monotonic() - t0 < 0.2


@pytest.mark.multiprocess
def test_a_node_names_its_own_connections_to_the_gate_and_the_gate_then_takes_no_other(job, gate):
    """lowband.ft.pins on a real gate: PinKeeper finds this process's connection to the gate in /proc and registers
    it; a connection of another process of this host, with the member's full id, is then refused."""
    import subprocess
    import sys

    from lowband.ft.pins import PinKeeper, own_connections

    secret, _, keys = job
    g, seen = gate
    host, port = g.address().split("://", 1)[1].rsplit(":", 1)
    rid = _member(secret, 1)
    assert _call(g, ADMIT, _admit(rid, keys[1])) is None  # registered before torchft's Manager starts: no connection
    manager = grpc.insecure_channel(f"{host}:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        manager.unary_unary(HEARTBEAT)(string_field(1, rid.encode()), timeout=10)  # torchft's connection, pinned first
        mine = own_connections(host, int(port))
        assert mine and all(str(ip) == "127.0.0.1" for ip, _ in mine)
        keeper = PinKeeper(host, int(port), lambda pins: ask_gate(g.address(), rid, *_addresses(rid), key=keys[1],
                                                                  pins=pins), poll_s=60)
        keeper.check()
        keeper.stop()
        assert mine <= keeper.named and g.named[1] == keeper.named
        g.pin_idle_s = 0.0  # the first-to-call pin lapses at once: the named connection alone holds the slot
        code = (f"import grpc; ch = grpc.insecure_channel('{host}:{port}')\n"
                f"try: ch.unary_unary('{HEARTBEAT}')({string_field(1, rid.encode())!r}, timeout=10); print('passed')\n"
                "except grpc.RpcError as e: print(e.details())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        assert "another connection" in out, out
        manager.unary_unary(HEARTBEAT)(string_field(1, rid.encode()), timeout=10)  # the member's own still passes
    finally:
        manager.close()
    assert seen.count(HEARTBEAT) == 2


def test_an_outsider_that_keeps_calling_over_one_connection_waits_and_a_member_does_not(job, gate):
    secret, _, keys = job
    g, _ = gate
    g.tarpit.delay_s = 0.6
    outsider = admission_request(replica_id(FP, 1) + ":x", "http://127.0.0.1:6001", "127.0.0.1:5000")
    with grpc.insecure_channel(g.address().split("://", 1)[-1], options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        call = ch.unary_unary(QUORUM)
        times = []
        for _ in range(g.tarpit.free + 3):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError):
                call(outsider, timeout=10)
            times.append(time.monotonic() - t0)
    assert max(times[:g.tarpit.free]) < 0.5 and min(times[-2:]) >= 0.6  # refused at once, then slowed
    assert g.tarpit.waited >= 2
    rid = _member(secret, 0)
    # a member is another process, with a connection of its own (in this process gRPC would share the outsider's)
    with grpc.insecure_channel(g.address().split("://", 1)[-1], options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        t0 = time.monotonic()
        ch.unary_unary(ADMIT)(_admit(rid, keys[0]), timeout=10)
        assert time.monotonic() - t0 < 0.5  # not slowed


def test_a_node_whose_gate_forgot_it_registers_again_and_one_replaced_by_a_new_process_leaves(job, gate, monkeypatch):
    """A restarted Lighthouse forgets the registrations: a node whose quorum waits asks the gate, learns it, and
    registers again with its key. A process of the node that a newer one replaced is told so and leaves."""
    from lowband.ft import quorum as ft_quorum
    from lowband.ft.node import FaultTolerance, FaultToleranceConfig
    from lowband.trust.admission import AdmissionRefused

    secret, roster, keys = job
    g, _ = gate
    monkeypatch.setattr(ft_quorum, "GATE_POLL_S", 0.2)
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.cfg = FaultToleranceConfig(lighthouse=g.address(), node=1, max_nodes=3, fingerprint=FP, secret=secret,
                                  roster=roster, key=keys[1])
    ft.replica_id = _member(secret, 1)
    client = type("C", (), {})()
    client._quorum = lambda **kw: (time.sleep(0.7), "the quorum")[1]
    rec = ft_quorum.QuorumRecorder(client, ft)
    assert 1 not in g.registered
    assert rec._asked(step=0) == "the quorum"
    assert g.registered[1] == ft.replica_id  # registered again, signed, while its quorum waited
    assert ask_gate(g.address(), _member(secret, 1, uuid="new"), "http://127.0.0.1:6001", "127.0.0.1:5000",
                    key=keys[1]) is None  # node 1 started again: its new process holds the slot
    with pytest.raises(AdmissionRefused, match="registered another process.*registered last"):
        rec._asked(step=1)
    assert g.registered[1].endswith(":new1")  # the old process did not take it back
