"""The Lighthouse's gate (lowband.ft.gateway, issue 29 items 1 and 2): only requests whose replica id proves the
job's secret, with the addresses its tag vouches for, reach the Lighthouse; nothing else is served.

In one process: the backend is a stand-in gRPC server that records what reaches it (torchft's Lighthouse runs in
the multi-process layer, tests/e2e/test_admission.py)."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

grpc = pytest.importorskip("grpc")

from lowband.ft.gateway import (  # noqa: E402
    ACCUSE,
    ADMIT,
    COMMITTED_SCALE,
    HEARTBEAT,
    HELD_OUT,
    KEPT_OUT,
    QUORUM,
    REFUSED,
    SERVICE,
    LighthouseGateway,
    StallBreaker,
    accusation_request,
    accuse_at_gate,
    admission_request,
    ask_gate,
    parse_fields,
    peer_host,
    quorum_round,
    refusal,
    string_field,
)
from lowband.ft.managergate import MANAGER_SERVICE, ManagerGate  # noqa: E402
from lowband.trust.admission import proves, replica_id  # noqa: E402

SECRET = b"s" * 32
STORE, MANAGER = "127.0.0.1:5000", "127.0.0.1:6000"
MEMBER = replica_id("f00d", 1, secret=SECRET, store=STORE, manager=MANAGER) + ":uuid"


def _heartbeat(rid: str) -> bytes:  # a LighthouseHeartbeatRequest: field 1, the replica id
    return string_field(1, rid.encode())


# ----------------------------------------------------------------------------- the rule, on request bytes
def test_the_request_bytes_are_read_field_by_field():
    req = admission_request(MEMBER, f"http://{MANAGER}", STORE)
    (member,) = parse_fields(req)[1]
    fields = parse_fields(member)
    assert [fields[i][0] for i in (1, 2, 3)] == [MEMBER.encode(), f"http://{MANAGER}".encode(), STORE.encode()]
    assert parse_fields(bytes([0x20, 0x96, 0x01])) == {4: [150]}  # a varint field (a step)
    for bad in (b"\x0a\x05ab", b"\x00\x01", b"\x20\xff", b"\x0b"):  # past the end, field 0, truncated, wire type 3
        with pytest.raises(ValueError):
            parse_fields(bad)


def test_a_member_passes_and_every_kind_of_outsider_is_refused_with_its_reason():
    assert refusal(SECRET, admission_request(MEMBER, f"http://{MANAGER}", STORE), QUORUM) is None
    assert refusal(SECRET, _heartbeat(MEMBER), HEARTBEAT) is None
    untagged = replica_id("f00d", 1) + ":x"
    other = replica_id("f00d", 1, secret=b"o" * 32, store=STORE, manager=MANAGER) + ":x"
    for rid in (untagged, other, "anything", MEMBER.replace("_node1", "_node2")):  # a slot it has no tag for
        assert "does not prove the job's secret" in refusal(SECRET, admission_request(rid, f"http://{MANAGER}",
                                                                                      STORE), QUORUM)
        assert "does not prove" in refusal(SECRET, _heartbeat(rid), HEARTBEAT)
    # a member's id copied with other addresses: its tag vouches for its own Manager and store only
    assert "not the ones its tag vouches for" in refusal(SECRET, admission_request(MEMBER, "http://10.9.9.9:1",
                                                                                    STORE), QUORUM)
    assert "not the ones its tag vouches for" in refusal(SECRET, admission_request(MEMBER, f"http://{MANAGER}",
                                                                                    "10.9.9.9:2"), QUORUM)
    assert refusal(SECRET, b"\x0a\xff\xff", QUORUM).startswith("malformed request")
    assert "does not prove" in refusal(SECRET, b"", QUORUM)  # no requester at all


# ----------------------------------------------------------------------------- the gate, served
@pytest.fixture
def gate():
    """A gate in front of a stand-in Lighthouse that answers b"quorum:" + the request and counts calls."""
    seen: list[tuple[str, bytes]] = []

    def handler(path):
        def handle(request, context):
            seen.append((path, request))
            return b"answer:" + request[:8]
        return grpc.unary_unary_rpc_method_handler(handle)

    backend = grpc.server(ThreadPoolExecutor(max_workers=4), handlers=[grpc.method_handlers_generic_handler(
        SERVICE, {"Quorum": handler(QUORUM), "Heartbeat": handler(HEARTBEAT)})])
    port = backend.add_insecure_port("127.0.0.1:0")
    backend.start()
    g = LighthouseGateway(bind="127.0.0.1:0", backend=f"127.0.0.1:{port}", secret=SECRET, workers=4)
    yield g, seen, f"127.0.0.1:{port}"
    g.shutdown()
    backend.stop(grace=None)


def _call(address: str, method: str, request: bytes) -> bytes:
    with grpc.insecure_channel(address.split("://", 1)[-1]) as ch:
        return ch.unary_unary(method)(request, timeout=10)


def test_the_gate_forwards_members_bytes_as_they_came_and_refuses_outsiders_before_the_lighthouse(gate):
    g, seen, _ = gate
    good = admission_request(MEMBER, f"http://{MANAGER}", STORE)
    assert _call(g.address(), QUORUM, good) == b"answer:" + good[:8]
    assert _call(g.address(), HEARTBEAT, _heartbeat(MEMBER)) == b"answer:" + _heartbeat(MEMBER)[:8]
    assert seen == [(QUORUM, good), (HEARTBEAT, _heartbeat(MEMBER))]
    outsider = admission_request(replica_id("f00d", 1) + ":x", "http://127.0.0.1:9", "127.0.0.1:9")
    for method, req in ((QUORUM, outsider), (HEARTBEAT, _heartbeat("lowband_f00d_node1:x"))):
        with pytest.raises(grpc.RpcError) as e:
            _call(g.address(), method, req)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and REFUSED in e.value.details()
    assert len(seen) == 2  # nothing of the outsider's reached the Lighthouse
    assert sum(g.refused.values()) == 2


def test_the_gate_serves_no_status_page_kill_route_or_other_call(gate):
    g, seen, _ = gate
    for path in ("/status", "/replica/x/kill"):
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
            urllib.request.urlopen(g.address() + path, timeout=5).read()
    with pytest.raises(grpc.RpcError) as e:
        _call(g.address(), "/torchft.LighthouseService/Status", b"")
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert seen == []


def test_a_node_asks_the_gate_before_it_starts_and_an_ungated_lighthouse_lets_it_go_on(gate):
    g, seen, backend = gate
    assert ask_gate(g.address(), MEMBER, f"http://{MANAGER}", STORE) is None
    why = ask_gate(g.address(), replica_id("f00d", 1) + ":x", f"http://{MANAGER}", STORE)
    assert why is not None and "does not prove the job's secret" in why
    assert seen == []  # the gate answers its own question: the Lighthouse never sees it
    # torchft's own Lighthouse has no gate (UNIMPLEMENTED) and one not up yet cannot answer: the node goes on
    assert ask_gate(f"http://{backend}", replica_id("f00d", 1) + ":x", "x", "y") is None
    answer = _call(g.address(), ADMIT, admission_request(MEMBER, f"http://{MANAGER}", STORE))
    assert parse_fields(answer) == {1: [b"0"]}  # none of its Quorum calls in flight, none lost


# ----------------------------------------------------------------------------- a member that stalls the job
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _varint_field(number: int, value: int) -> bytes:
    out, key = bytearray(), number << 3
    for n in (key, value):
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                break
    return bytes(out)


def _response(rnd: int, steps: dict[int, int]) -> bytes:
    """A LighthouseQuorumResponse of round ``rnd``: members by slot with their steps."""
    members = b"".join(string_field(2, string_field(1, (replica_id("f00d", slot, secret=SECRET, store=STORE,
                                                                   manager=MANAGER) + ":u").encode())
                                    + _varint_field(4, step)) for slot, step in steps.items())
    created = string_field(3, _varint_field(1, 1000 + rnd) + _varint_field(2, 7))
    return string_field(1, _varint_field(1, 5) + members + created)


def test_a_quorum_round_reads_each_members_slot_and_committed_steps():
    from lowband.ft.node import _STEP_SCALE, quorum_step

    assert COMMITTED_SCALE == _STEP_SCALE  # a node reports training step × this + committed steps
    steps = {0: quorum_step(40, 12), 2: quorum_step(41, 12)}
    ids = {slot: replica_id("f00d", slot, secret=SECRET, store=STORE, manager=MANAGER) + ":u" for slot in steps}
    assert quorum_round(_response(3, steps)) == ((1003, 7), steps, ids)
    assert quorum_round(b"\x0a\x02\xff") is None


def _rounds(breaker, clock, rounds):
    """One quorum round each, 5 s apart (a round is known by its time: each member gets the same answer)."""
    for steps in rounds:
        clock.t += 5.0
        breaker.observe((round(clock.t * 1000), 0), steps)
        breaker.observe((round(clock.t * 1000), 0), steps)  # the same round, as another member received it


def q(train: int, committed: int) -> int:
    """A node's quorum step (lowband.ft.node.quorum_step)."""
    return train * COMMITTED_SCALE + committed


def test_the_gate_benches_the_one_member_in_every_failed_quorum_and_none_that_went_through():
    clock = Clock()
    b = StallBreaker(stall_rounds=3, probation_s=20.0, bench_s=100.0, clock=clock)
    # node 2 gets into every other quorum, claiming the others' steps and progress of its own; those steps fail
    rounds, t, c = [], 10, 10
    for k in range(4):
        rounds.append({0: q(t, c), 1: q(t, c)})  # without it: committed
        t, c = t + 1, c + 1
        rounds.append({0: q(t, c), 1: q(t, c), 2: q(t + 40, c + k)})  # with it: dropped
        t += 1
    _rounds(b, clock, rounds)
    assert b.held(2)[0] == "benched" and b.held(0) is None and b.held(1) is None
    clock.t += 101.0
    assert b.held(2) is None  # it may come back; a second offence keeps it out twice as long
    _rounds(b, clock, rounds)
    kind, until = b.held(2)
    assert kind == "benched" and until - clock.t > 150.0


def test_with_the_same_members_every_round_the_gate_finds_it_by_probation():
    clock = Clock()
    b = StallBreaker(stall_rounds=2, probation_s=20.0, bench_s=100.0, clock=clock)

    def failing(slots, t):  # node 0 claims commits of its own; the others drop their steps
        return {s: q(t, 7 + t if s == 0 else 7) for s in slots}

    t = 0

    def run(slots, n, *, until_probation=False):
        nonlocal t
        for _ in range(n):
            t += 1
            _rounds(b, clock, [failing(slots, t)])
            if until_probation and b.probation is not None:
                return

    run((0, 1, 2), 5, until_probation=True)
    assert b.probation[0] == 2  # all joined together: the highest slot first
    run((0, 1), 5)  # without node 2 the steps fail too: its probation runs out, it comes back
    assert b.held(2) is None
    run((0, 1, 2), 5, until_probation=True)
    assert b.probation is not None and b.probation[0] == 1
    run((0, 2), 5)
    run((0, 1, 2), 5, until_probation=True)
    assert b.probation[0] == 0
    _rounds(b, clock, [{1: q(t + 1, 8), 2: q(t + 1, 8)}])  # without node 0 the others commit
    assert b.held(0)[0] == "benched" and b.held(1) is None and b.held(2) is None


def test_a_job_that_commits_waits_or_has_two_members_is_never_held():
    clock = Clock()
    b = StallBreaker(stall_rounds=2, clock=clock)
    _rounds(b, clock, [{0: q(s, s), 1: q(s, s), 2: q(s, s - 1)} for s in range(1, 20)])  # training (2 behind)
    _rounds(b, clock, [{0: q(20, 19), 1: q(20, 19), 2: q(20, 19)}] * 10)  # asking again, not training: no outcome
    _rounds(b, clock, [{0: q(20 + k, 19), 1: q(20 + k, 19)} for k in range(10)])  # two members: nobody can tell
    assert b.probation is None and not b.benched and not any(ok is False for _, ok in b.outcomes if len(_) > 2)


# ----------------------------------------------------------------------------- a node's Manager
@pytest.fixture
def manager_backend():
    """A stand-in for a node's torchft Manager that records what reaches it."""
    seen: list[str] = []

    def handler(name):
        def handle(request, context):
            seen.append(name)
            return b"ok:" + request
        return grpc.unary_unary_rpc_method_handler(handle)

    names = ("Quorum", "CheckpointMetadata", "ShouldCommit", "Kill")
    server = grpc.server(ThreadPoolExecutor(max_workers=4), handlers=[grpc.method_handlers_generic_handler(
        MANAGER_SERVICE, {n: handler(n) for n in names})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", seen
    server.stop(grace=None)


@pytest.mark.parametrize("own", [True, False])
def test_a_nodes_manager_gate_serves_no_kill_and_its_own_calls_to_its_own_host_only(manager_backend, own):
    backend, seen = manager_backend
    gate = ManagerGate(bind="127.0.0.1:0", backend=backend, own_hosts={"127.0.0.1" if own else "10.9.9.9"},
                       workers=4)
    try:
        address = f"127.0.0.1:{gate.port}"
        assert _call(address, f"/{MANAGER_SERVICE}/CheckpointMetadata", b"r0") == b"ok:r0"  # healing peers: all
        for name in ("Quorum", "ShouldCommit"):
            if own:
                assert _call(address, f"/{MANAGER_SERVICE}/{name}", b"x") == b"ok:x"
            else:
                with pytest.raises(grpc.RpcError) as e:
                    _call(address, f"/{MANAGER_SERVICE}/{name}", b"x")
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "own ranks only" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            _call(address, f"/{MANAGER_SERVICE}/Kill", b"")
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        gate.shutdown()
    assert "Kill" not in seen
    assert seen == (["CheckpointMetadata", "Quorum", "ShouldCommit"] if own else ["CheckpointMetadata"])


def test_a_peer_strings_host():
    assert peer_host("ipv4:10.0.0.2:5123") == "10.0.0.2"
    assert peer_host("ipv6:[::1]:5123") == "::1"
    assert peer_host("unix:/tmp/x") == ""
    assert peer_host("ipv6:[::ffff:10.0.0.2]:5123") == "10.0.0.2"  # a dual-stack socket's IPv4 caller, as itself


def test_a_call_without_a_deadline_is_passed_on_without_one(gate):
    """torchft's heartbeats carry no deadline: gRPC reports ~9.2e18 s left, and passed on as a timeout that
    failed every heartbeat at once (DEADLINE_EXCEEDED), so the Lighthouse saw no member alive but by its
    quorum requests."""
    g, seen, _ = gate
    with grpc.insecure_channel(g.address().split("://", 1)[-1]) as ch:
        assert ch.unary_unary(HEARTBEAT)(_heartbeat(MEMBER)) == b"answer:" + _heartbeat(MEMBER)[:8]  # no timeout
    assert seen == [(HEARTBEAT, _heartbeat(MEMBER))]


# ----------------------------------------------------------------------------- a member that sends bad messages
def _member(slot: int, host: str) -> str:
    return replica_id("f00d", slot, secret=SECRET, store=f"{host}:5000", manager=f"{host}:6000") + f":u{slot}"


def test_reports_of_bad_messages_remove_a_member_only_when_most_of_the_others_report_it():
    """Each member that evicts a sender from the exchange reports it; the gate benches it once two or more of the
    round's other members, and more than half of them, reported it, each from its own address."""
    clock = Clock()
    b = StallBreaker(bench_s=100.0, clock=clock)
    ids = {s: _member(s, f"10.0.0.{s + 1}") for s in range(4)}
    b.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    # a report counts only from a member of the round, about a member of it, from the reporter's own address
    assert "came from 10.0.0.1" in b.accuse(ids[1], ids[3], "10.0.0.1", "x")  # node 0 speaking for node 1
    forged = _member(1, "10.0.0.1")  # a valid tag for slot 1 at node 0's address: not the round's node 1
    assert "not in the current quorum" in b.accuse(forged, ids[3], "10.0.0.1", "x")
    assert "not (or no longer) in the current quorum" in b.accuse(ids[0], _member(3, "10.0.0.9"), "10.0.0.1", "x")
    assert "not (or no longer)" in b.accuse(ids[0], ids[0], "10.0.0.1", "x")  # itself
    assert b.accuse(ids[0], ids[3], "10.0.0.1", "index out of range") is None
    assert b.accuse(ids[0], ids[3], "10.0.0.1", "index out of range") is None  # the same reporter again: one voice
    assert b.held(3) is None and b.reports[ids[3]] == {0: "10.0.0.1"}
    assert b.accuse(ids[1], ids[3], "10.0.0.2", "index out of range") is None  # 2 of the 3 others
    assert b.held(3) == ("removed", 100.0)
    assert "sent bad messages" in b.why[3] and "nodes 0, 1" in b.why[3] and "index out of range" in b.why[3]
    assert b.held(0) is b.held(1) is b.held(2) is None
    clock.t = 101.0
    assert b.held(3) is None and 3 not in b.why  # its time is up


def test_a_minority_or_a_lone_reporter_cannot_remove_a_member_and_reports_lapse_when_it_leaves():
    clock = Clock()
    b = StallBreaker(clock=clock)
    ids = {s: _member(s, f"10.0.0.{s + 1}") for s in range(5)}
    b.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    b.accuse(ids[0], ids[4], "10.0.0.1", "x")
    b.accuse(ids[1], ids[4], "10.0.0.2", "x")
    assert b.held(4) is None  # 2 of the 4 others: not more than half
    b.observe((2, 0), {s: q(6, 6) for s in range(4)}, {s: ids[s] for s in range(4)})  # node 4 left
    assert ids[4] not in b.reports
    # two members: one's report never removes the other (no majority to speak for the job)
    two = {s: _member(s, f"10.0.0.{s + 1}") for s in range(2)}
    b.observe((3, 0), {s: q(7, 7) for s in two}, two)
    assert b.accuse(two[0], two[1], "10.0.0.1", "x") is None and b.held(1) is None
    # on one host (loopback) every member has the same address: the slots count
    local = {s: _member(s, "127.0.0.1") for s in range(3)}
    b.observe((4, 0), {s: q(8, 8) for s in local}, local)
    b.accuse(local[0], local[2], "127.0.0.1", "x")
    b.accuse(local[1], local[2], "127.0.0.1", "x")
    assert b.held(2) is not None
    # on a network, two reports from one address are one voice (one host running two members)
    b = StallBreaker(clock=clock)
    net = {s: _member(s, "10.0.0.1" if s < 2 else f"10.0.0.{s + 1}") for s in range(3)}
    b.observe((5, 0), {s: q(9, 9) for s in net}, net)
    b.accuse(net[0], net[2], "10.0.0.1", "x")
    b.accuse(net[1], net[2], "10.0.0.1", "x")
    assert b.held(2) is None and b.reports[net[2]] == {0: "10.0.0.1", 1: "10.0.0.1"}


def test_a_member_reported_through_the_gate_is_refused_there_and_leaves_with_the_reason(gate):
    from lowband.ft.node import FaultToleranceConfig, gate_refusal

    g, seen, _ = gate
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    g.breaker.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    assert accuse_at_gate(g.address(), ids[0], ids[2], "index out of range", secret=SECRET) is None
    outsider = replica_id("f00d", 0) + ":x"
    with pytest.raises(grpc.RpcError) as e:  # an outsider's report never reaches the breaker
        _call(g.address(), ACCUSE, accusation_request(outsider, "http://127.0.0.1:6000", "127.0.0.1:5000", ids[2], "x"))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "FAILED_PRECONDITION" in accuse_at_gate(g.address(), _member(1, "127.0.0.9"), ids[2], "x", secret=SECRET)
    assert g.breaker.held(2) is None
    assert accuse_at_gate(g.address(), ids[1], ids[2], "index out of range", secret=SECRET) is None
    with pytest.raises(grpc.RpcError) as e:  # node 2's quorum request: refused, with the reason
        _call(g.address(), QUORUM, admission_request(ids[2], "http://127.0.0.1:6000", "127.0.0.1:5000"))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and KEPT_OUT in e.value.details()
    assert _call(g.address(), HEARTBEAT, _heartbeat(ids[2])) == b""  # its heartbeats go no further
    assert seen == []  # neither reached the Lighthouse
    cfg = FaultToleranceConfig(lighthouse=g.address(), node=2, max_nodes=3, fingerprint="f00d")
    err = str(gate_refusal(cfg, e.value.details().split(REFUSED, 1)[1]))
    assert "node 2 is removed from the job" in err and "bad messages" in err and "secret" not in err


def test_a_node_whose_quorum_waits_asks_the_gate_and_leaves_at_once_when_it_was_removed(gate, monkeypatch):
    """torchft's Manager retries a quorum the gate refuses until its timeout and then reports only the timeout: a
    node whose quorum waits asks the gate itself, and a node the gate removed leaves at once, with the reason."""
    import time

    from lowband.ft import quorum as ft_quorum
    from lowband.ft.node import FaultTolerance, FaultToleranceConfig
    from lowband.trust.admission import AdmissionRefused

    g, seen, _ = gate
    monkeypatch.setattr(ft_quorum, "GATE_POLL_S", 0.2)
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    g.breaker.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.cfg = FaultToleranceConfig(lighthouse=g.address(), node=2, max_nodes=3, fingerprint="f00d", secret=SECRET)
    ft.replica_id = ids[2]
    client = type("C", (), {})()
    client._quorum = lambda **kw: (time.sleep(0.7), "the quorum")[1]  # slow, but a member's: the gate lets it be
    rec = ft_quorum.QuorumRecorder(client, ft)
    assert rec._asked(step=0) == "the quorum"
    for reporter in (0, 1):
        assert accuse_at_gate(g.address(), ids[reporter], ids[2], "index out of range", secret=SECRET) is None
    client._quorum = lambda **kw: time.sleep(60)  # refused at the gate: torchft would wait out its timeout
    t0 = time.monotonic()
    with pytest.raises(AdmissionRefused, match=r"node 2 is removed from the job .*sent bad messages.*nodes 0, 1"):
        rec._asked(step=1)
    assert time.monotonic() - t0 < 5.0
    assert seen == []


def test_a_member_benched_for_failed_steps_is_held_out_and_its_node_waits_then_joins_never_removed(gate, monkeypatch):
    """Failed steps with a member in the quorum prove nothing of its own (a link someone else cuts looks the same):
    the gate holds it out (its quorum request waits, its question is answered HELD_OUT with the time left), and its
    node waits and asks again instead of leaving; once the hold ends it passes. Only reported messages remove."""
    import time

    from lowband.ft import quorum as ft_quorum
    from lowband.ft.node import FaultTolerance, FaultToleranceConfig

    g, seen, _ = gate
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    g.breaker.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    g.breaker._bench(2, g.breaker._clock(), "it was in each failed quorum")
    assert g.breaker.held(2)[0] == "benched"
    quorum = admission_request(ids[2], "http://127.0.0.1:6000", "127.0.0.1:5000")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:  # its quorum request waits, then is refused near its deadline
        with grpc.insecure_channel(g.address().split("://", 1)[-1]) as ch:
            ch.unary_unary(QUORUM)(quorum, timeout=2.0)
    assert time.monotonic() - t0 > 0.9 and e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert HELD_OUT in e.value.details() and KEPT_OUT not in e.value.details()
    why = ask_gate(g.address(), ids[2], "http://127.0.0.1:6000", "127.0.0.1:5000")
    assert HELD_OUT in why and "s more" in why
    assert seen == []
    cfg = FaultToleranceConfig(lighthouse=g.address(), node=2, max_nodes=3, fingerprint="f00d", secret=SECRET)
    # the node waits while held out; the hold ends during its wait: it may join (the gate's answer is None)
    monkeypatch.setattr(ft_quorum, "HELD_POLL_S", 0.1)
    asked = []

    def ask():
        asked.append(1)
        if len(asked) == 3:
            g.breaker.benched[2] = g.breaker._clock() - 1  # the hold ends
        return ask_gate(g.address(), ids[2], "http://127.0.0.1:6000", "127.0.0.1:5000")
    assert ft_quorum.wait_held_out(cfg, why, ask) is None and len(asked) == 3
    # torchft's quorum call failed with the gate's HELD_OUT: the node waits, then asks torchft again (no exit)
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.cfg, ft.replica_id = cfg, ids[2]
    g.breaker._bench(2, g.breaker._clock(), "again")
    calls = []

    def quorum_call(**kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"status: PermissionDenied, message: \"{REFUSED}: {HELD_OUT} 2 out for 9 s more\"")
        raise TimeoutError("torchft's own, after the hold: ends the test")
    client = type("C", (), {})()
    client._quorum = quorum_call
    monkeypatch.setattr(ft_quorum, "GATE_POLL_S", 5.0)
    threading_end = time.monotonic() + 0.5

    def release():
        while time.monotonic() < threading_end:
            time.sleep(0.05)
        g.breaker.benched[2] = g.breaker._clock() - 1
    import threading
    threading.Thread(target=release, daemon=True).start()
    with pytest.raises(TimeoutError, match="after the hold"):
        ft_quorum.QuorumRecorder(client, ft)._quorum(step=3)
    assert len(calls) == 2 + ft_quorum.QUORUM_RETRIES  # asked again once the hold ended (and after each timeout)


def test_a_quorum_request_that_failed_in_torchft_is_asked_again_while_the_gate_admits_the_node(gate, monkeypatch):
    """torchft's Manager leaves its ranks waiting out their timeout when its request to the Lighthouse failed (a broken
    connection, a refusal): a node with the secret asks the gate, and asks torchft again (a few times) while the gate
    admits it; a node the gate removed learns why."""
    from lowband.ft import quorum as ft_quorum
    from lowband.ft.node import FaultTolerance, FaultToleranceConfig
    from lowband.trust.admission import RemovedFromJob

    g, _, _ = gate
    monkeypatch.setattr(ft_quorum, "GATE_POLL_S", 5.0)
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.cfg = FaultToleranceConfig(lighthouse=g.address(), node=2, max_nodes=3, fingerprint="f00d", secret=SECRET)
    ft.replica_id = ids[2]
    calls = []

    def quorum_call(**kw):
        calls.append(1)
        if len(calls) <= ft_quorum.QUORUM_RETRIES + 1:
            raise TimeoutError("status: Cancelled, message: \"Timeout expired\"")
        raise AssertionError("asked more often than QUORUM_RETRIES")
    client = type("C", (), {})()
    client._quorum = quorum_call
    with pytest.raises(TimeoutError):  # asked again QUORUM_RETRIES times, then the timeout stands
        ft_quorum.QuorumRecorder(client, ft)._quorum(step=3)
    assert len(calls) == ft_quorum.QUORUM_RETRIES + 1
    g.breaker.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    g.breaker._bench(2, g.breaker._clock(), "bad messages", removes=True)
    calls.clear()
    with pytest.raises(RemovedFromJob, match="node 2 is removed"):  # the gate's reason, at the first failure
        ft_quorum.QuorumRecorder(client, ft)._quorum(step=3)
    assert len(calls) == 1


def test_the_gate_says_how_many_quorum_calls_of_a_member_it_holds_and_when_one_ended_without_a_quorum(gate):
    """torchft's Manager neither retries a failed request to the Lighthouse nor tells its ranks (they wait out the
    quorum's timeout): the gate answers a member's question with its Quorum calls in flight and the age of the last
    one that ended without a quorum (here: held, then refused near its deadline; a broken connection ends one too)."""
    import threading
    import time

    from lowband.ft.gateway import gate_status

    g, _, _ = gate
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    g.breaker.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    g.breaker._bench(1, g.breaker._clock(), "it was in each failed quorum")  # held out: its quorum waits at the gate
    addresses = ("http://127.0.0.1:6000", "127.0.0.1:5000")
    assert gate_status(g.address(), ids[1], *addresses).why is not None  # held out: refused, with the reason
    assert gate_status(g.address(), ids[2], *addresses) == (None, 0, None)  # nothing in flight, nothing lost
    g.breaker.benched[2] = g.breaker._clock() + 60  # node 2's quorum waits at the gate (its question is refused)
    g.breaker.benched.pop(1)

    def quorum_gives_up():
        with grpc.insecure_channel(g.address().split("://", 1)[-1]) as ch, pytest.raises(grpc.RpcError):
            ch.unary_unary(QUORUM)(admission_request(ids[2], *addresses), timeout=2.0)  # refused 1 s before its end
    t = threading.Thread(target=quorum_gives_up)
    t.start()
    time.sleep(0.4)
    assert g.in_flight[2] == 1
    t.join()
    time.sleep(0.2)
    g.breaker.benched.pop(2)
    status = gate_status(g.address(), ids[2], *addresses)
    assert status.why is None and status.in_flight == 0 and 0 <= status.lost_age_s < 2.0, status
    assert 2 not in g.in_flight  # the table keeps slots with a call in flight only


def test_a_node_whose_quorum_request_ended_at_the_gate_stops_waiting_for_torchft_and_asks_again(gate, monkeypatch):
    import threading
    import time

    from lowband.ft import quorum as ft_quorum
    from lowband.ft.node import FaultTolerance, FaultToleranceConfig

    g, _, _ = gate
    monkeypatch.setattr(ft_quorum, "GATE_POLL_S", 0.2)
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.cfg = FaultToleranceConfig(lighthouse=g.address(), node=2, max_nodes=3, fingerprint="f00d", secret=SECRET)
    ft.replica_id = ids[2]
    client = type("C", (), {})()
    client._quorum = lambda **kw: (time.sleep(1.0), "the quorum")[1]
    g.lost[2] = time.monotonic() - 0.01  # a request of an earlier call: not this one's
    assert ft_quorum.QuorumRecorder(client, ft)._asked(step=0) == "the quorum"
    client._quorum = lambda **kw: time.sleep(60)  # torchft waits out its timeout for a request that ended
    # its connection broken a moment after the call began (a step's quorum call lasts milliseconds)
    threading.Timer(0.02, lambda: g.lost.__setitem__(2, time.monotonic())).start()
    t0 = time.monotonic()
    with pytest.raises(ft_quorum.QuorumLost, match="ended at the Lighthouse's gate"):
        ft_quorum.QuorumRecorder(client, ft)._asked(step=1)
    assert time.monotonic() - t0 < 3.0
    # a request that never reached the gate (nothing of the slot in flight there, nothing lost since): a node of one
    # rank asks again after ABSENT_POLLS polls; one of several ranks waits (its other ranks may not have asked yet)
    ft.local_ranks = 2
    client._quorum = lambda **kw: (time.sleep(1.0), "the quorum")[1]
    assert ft_quorum.QuorumRecorder(client, ft)._asked(step=2) == "the quorum"
    ft.local_ranks = 1
    client._quorum = lambda **kw: time.sleep(60)
    t0 = time.monotonic()
    with pytest.raises(ft_quorum.QuorumLost, match="has not been at the Lighthouse's gate"):
        ft_quorum.QuorumRecorder(client, ft)._asked(step=3)
    assert time.monotonic() - t0 < 3.0


# ----------------------------------------------------------------------------- what a stranger can make it do
def test_a_request_over_the_bound_is_refused_by_grpc_and_never_reaches_the_lighthouse(gate):
    from lowband.ft.gateway import MAX_REQUEST_BYTES

    g, seen, _ = gate
    with grpc.insecure_channel(g.address().split("://", 1)[-1],
                               options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(QUORUM)(string_field(1, b"x" * (MAX_REQUEST_BYTES + 1)), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert seen == [] and sum(g.refused.values()) == 0  # gRPC refused it: the gate's code never read a byte


def test_refusals_are_counted_by_kind_and_a_host_over_its_budget_is_refused_unread_but_never_removed(gate):
    from lowband.ft.gateway import gate_reason

    g, seen, _ = gate
    for i in range(5):  # each with another id: the table of refusals does not grow with them
        with pytest.raises(grpc.RpcError) as e:
            _call(g.address(), HEARTBEAT, _heartbeat(f"lowband_f00d_node{i}:u{i}"))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert dict(g.refused) == {"replica id does not prove the job's secret": 5} and len(g._named) == 1
    assert not g.limiter.over("127.0.0.1")  # loopback: the members' own address on one machine
    g.limiter.over = lambda host: True  # a host over its budget (one of the job's network: the limiter's test below)
    with pytest.raises(grpc.RpcError) as e:
        _call(g.address(), QUORUM, admission_request(MEMBER, f"http://{MANAGER}", STORE))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many refused calls" in e.value.details()
    assert gate_reason(e.value.details()) is None  # not a refusal of the member: its node asks again, never leaves
    assert seen == [] and g.refused["too many refused calls from this host"] == 1


def test_the_gate_names_a_refused_host_once_and_then_logs_a_count_by_kind_at_most_once_a_minute(gate, caplog):
    import logging
    import time

    g, _, _ = gate
    with caplog.at_level(logging.WARNING, logger="lowband.ft.gateway"):
        for i in range(5):
            with pytest.raises(grpc.RpcError):
                _call(g.address(), HEARTBEAT, _heartbeat(f"lowband_f00d_node{i}:u{i}"))
        assert caplog.text.count("refused a call from 127.0.0.1") == 1 and "calls in the last" not in caplog.text
        g._summary = (time.monotonic() - 61.0, g._summary[1])  # a minute later
        with pytest.raises(grpc.RpcError):
            _call(g.address(), HEARTBEAT, _heartbeat("lowband_f00d_node9:u9"))
    assert "refused 6 calls in the last 61 s: 6 replica id does not prove the job's secret" in caplog.text


def test_the_source_limiters_tables_are_bounded_whoever_calls():
    from lowband.trust.limits import SourceLimiter

    clock = Clock()
    lim = SourceLimiter(rate_per_s=1.0, burst=2.0, max_hosts=100, clock=clock)
    for i in range(10_000):
        lim.refused(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
        lim.passed(f"fd00::{i:x}")
    assert len(lim._tokens) == 100 and len(lim._members) == 100
    lim.refused("10.9.9.9")
    lim.refused("10.9.9.9")
    assert lim.over("10.9.9.9")
    clock.t += 1.0  # one refusal a second comes back
    assert not lim.over("10.9.9.9")
    lim.refused("10.9.9.9")
    lim.passed("10.9.9.9")  # a member's call from that host passed: it is checked, never refused unread
    assert not lim.over("10.9.9.9")
    for host in ("127.0.0.1", "::1", "127.3.4.5"):  # loopback: shared by every process of the machine
        for _ in range(10):
            lim.refused(host)
        assert not lim.over(host)


# ----------------------------------------------------------------------------- a job that knows when it is done
def test_the_gate_records_the_jobs_end_only_from_a_member_of_the_round_that_reached_the_last_step():
    """Issue 44 item 6: the record counts a member of the current round, from its own address, for a step no earlier
    than the one it was at in that round; the job is complete once more than half of the round reported the same step
    (one member alone cannot end it), later ones of the same step add their checkpoints, and the answer names the
    step and every path."""
    from lowband.ft.completion import CompletionRecord

    b = StallBreaker()
    ids = {s: _member(s, f"10.0.0.{s + 1}") for s in range(3)}
    b.observe((1, 0), {s: q(699, 699) for s in ids}, ids)
    r = CompletionRecord()
    members = b.round_members()
    assert members[2] == (ids[2], 699)
    again = ids[1].rsplit(":", 1)[0] + ":restarted"  # node 1's slot and tag, another process: not the round's
    assert "not in the current quorum" in r.done(again, "10.0.0.2", 700, "/x", members)
    assert "not in the current quorum" in r.done(_member(5, "10.0.0.6"), "10.0.0.6", 700, "/x", members)  # not in it
    assert "came from 10.0.0.1" in r.done(ids[1], "10.0.0.1", 700, "/x", members)  # node 0 speaking for node 1
    assert "it was at step 699" in r.done(ids[1], "10.0.0.2", 600, "/x", members)  # earlier than it was
    assert not r.complete
    assert r.done(ids[1], "10.0.0.2", 700, "/out1/checkpoints/step_000700", members) is None
    assert not r.complete  # one of three: a member alone (it could lie about the step) does not end the job
    assert r.done(ids[0], "10.0.0.1", 900, "/liar", members) is None and not r.complete  # another step: no majority
    assert r.done(ids[2], "10.0.0.3", 700, "/out2", members) is None
    assert r.complete and r.step == 700  # two of three agree
    assert "already complete at step 700" in r.done(ids[0], "10.0.0.1", 701, "/y", members)
    assert r.answer() == "at step 700; final checkpoints: node1 at /out1/checkpoints/step_000700, node2 at /out2"


def test_in_a_round_of_two_one_report_ends_the_job_only_at_the_last_step_each_member_named_and_reached():
    """Each member's replica id names the job's last step under the secret's tag: a round of two whose other member
    died after the last commit ends on one report, but only of the step every member named and only once every member
    was at that step's quorum (a liar alone cannot end the job earlier than the others' own word)."""
    from lowband.ft.completion import CompletionRecord

    def member(slot: int, last: int | None) -> str:
        host = f"10.0.0.{slot + 1}"
        return replica_id("f00d", slot, secret=SECRET, store=f"{host}:5000", manager=f"{host}:6000",
                          last_step=last) + f":u{slot}"

    for lasts, step, at in (((700, 800), 700, 699),  # node 1 named another end
                            ((700, None), 700, 699),  # node 1 named none
                            ((500, 500), 700, 699),  # a report after the named end: refused outright
                            ((800, 800), 800, 699),  # the named end, but the round (at 699) is not at its quorum
                            ((None, None), 700, 699)):  # no names: both must report
        b = StallBreaker()
        ids = {s: member(s, last) for s, last in enumerate(lasts)}
        b.observe((1, 0), {0: q(at, at), 1: q(at, at)}, ids)
        r = CompletionRecord()
        why = r.done(ids[0], "10.0.0.1", step, "/out0", b.round_members())
        assert (why is None if lasts[0] is None or step <= lasts[0] else "after the job's last step (500)" in why), why
        assert not r.complete, lasts
    b = StallBreaker()
    ids = {s: member(s, 700) for s in range(2)}
    assert proves(SECRET, ids[0]) and not proves(SECRET, ids[0].replace("_l700_", "_l300_"))  # the tag binds it
    b.observe((1, 0), {0: q(699, 699), 1: q(699, 699)}, ids)
    r = CompletionRecord()
    assert r.done(ids[0], "10.0.0.1", 700, "/out0", b.round_members()) is None
    assert r.complete and r.step == 700 and r.where == {0: "/out0"}


def test_a_completion_record_kept_in_a_file_survives_the_gate_and_is_its_jobs_only(tmp_path):
    """With --completion-file the record is written when the job is complete (the owner's only) and read back by a
    gate started again, which then answers the job's nodes, not another job's; a file that is not a record stops
    the start with what to do."""
    from lowband.ft.completion import CompletionRecord
    from lowband.trust.admission import claim_of

    b = StallBreaker()
    ids = {s: _member(s, f"10.0.0.{s + 1}") for s in range(3)}
    b.observe((1, 0), {s: q(699, 699) for s in ids}, ids)
    path = tmp_path / "job.complete"
    r = CompletionRecord(path)
    assert r.done(ids[1], "10.0.0.2", 700, "/out1", b.round_members()) is None
    assert not path.exists()  # one report is not the end
    assert r.done(ids[2], "10.0.0.3", 700, "/out2", b.round_members()) is None
    assert path.stat().st_mode & 0o777 == 0o600
    fp = claim_of(ids[1]).fingerprint
    again = CompletionRecord(path)  # a Lighthouse started again
    assert again.step == 700 and again.applies_to(fp) and not again.applies_to("another-job")
    assert again.answer() == r.answer() == "at step 700; final checkpoints: node1 at /out1, node2 at /out2"
    assert not CompletionRecord(tmp_path / "none").applies_to(fp)  # no file yet: nothing recorded
    for text in ("", "{", '{"format": "lowband-completion/1", "step": 0, "fingerprint": "x", "where": {}}',
                 '{"format": "other"}', "[" * 100_000):
        path.write_text(text)
        with pytest.raises(ValueError, match="delete .*job.complete"):
            CompletionRecord(path)


def test_a_node_that_asks_after_the_job_is_complete_is_told_so_and_leaves_and_a_forged_report_is_refused(gate):
    from lowband.ft.completion import DONE, JobComplete, done_request, report_done

    g, seen, _ = gate
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    g.breaker.observe((1, 0), {s: q(9, 9) for s in ids}, ids)
    outsider = replica_id("f00d", 0) + ":x"  # no secret: refused before the record sees it
    with pytest.raises(grpc.RpcError) as e:
        _call(g.address(), DONE, done_request(outsider, "http://127.0.0.1:6000", "127.0.0.1:5000", 10, "/x"))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "FAILED_PRECONDITION" in report_done(g.address(), _member(4, "127.0.0.1"), 10, "/x",
                                               secret=SECRET)  # not a member
    assert "INVALID_ARGUMENT" in _done_error(g, ids[0], "ten")
    # a member's full replica id (torchft's status page and the nodes' stores show it) without the job's secret: a
    # report with no tag, with another secret's, or a tagged one sent again, is refused before the record sees it
    plain = done_request(ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000", 10, "/stranger")
    tagged = done_request(ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000", 11, "/run/node0", secret=SECRET)
    for request, why in ((plain, "carries no time and nonce"),
                         (done_request(ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000", 10, "/x", secret=b"o" * 32),
                          "forged"), (tagged, None), (tagged, "replayed")):
        if why is None:
            assert _call(g.address(), DONE, request) == b""
            continue
        with pytest.raises(grpc.RpcError) as e:
            _call(g.address(), DONE, request)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "does not prove the job's secret" in \
            e.value.details() and why in e.value.details(), e.value.details()
    assert g.completion._reports == {0: (11, "/run/node0")}  # counted, as the member's own
    # while the job runs a member passes (a node alone during the job trains on)
    assert ask_gate(g.address(), ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000") is None
    assert not g.completion.complete
    assert report_done(g.address(), ids[1], 10, "/run/node1/checkpoints/step_000010", secret=SECRET) is None
    assert not g.completion.complete  # one of three
    assert report_done(g.address(), ids[2], 10, "/run/node2/checkpoints/step_000010", secret=SECRET) is None
    with pytest.raises(JobComplete, match=r"complete at step 10; final checkpoints: node1 at /run/node1/checkpoints"):
        ask_gate(g.address(), ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000")
    with pytest.raises(grpc.RpcError) as e:  # its quorum request too: never reaches the Lighthouse
        _call(g.address(), QUORUM, admission_request(ids[0], "http://127.0.0.1:6000", "127.0.0.1:5000"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "complete at step 10" in e.value.details()
    assert seen == []


def _done_error(g, rid: str, step: str) -> str:
    from lowband.ft.completion import DONE
    from lowband.ft.protowire import sign_request
    from lowband.ft.protowire import string_field as field

    member = field(1, rid.encode()) + field(2, b"http://127.0.0.1:6000") + field(3, b"127.0.0.1:5000")
    try:
        _call(g.address(), DONE, sign_request(None, DONE, field(1, member) + field(2, step.encode()) + field(3, b"/x"),
                                              secret=SECRET))
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"
    return ""


def test_a_node_whose_quorum_waits_when_the_job_ends_leaves_and_lowband_train_exits_0(gate, monkeypatch, capsys):
    import time

    from lowband import cli
    from lowband.ft import quorum as ft_quorum
    from lowband.ft.completion import JobComplete, report_done
    from lowband.ft.node import FaultTolerance, FaultToleranceConfig

    g, _, _ = gate
    monkeypatch.setattr(ft_quorum, "GATE_POLL_S", 0.2)
    ids = {s: _member(s, "127.0.0.1") for s in range(3)}
    g.breaker.observe((1, 0), {s: q(5, 5) for s in ids}, ids)
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.cfg = FaultToleranceConfig(lighthouse=g.address(), node=2, max_nodes=3, fingerprint="f00d", secret=SECRET)
    ft.replica_id, ft.removed = ids[2], False
    client = type("C", (), {})()
    client._quorum = lambda **kw: time.sleep(60)  # torchft would wait out its timeout
    rec = ft_quorum.QuorumRecorder(client, ft)
    assert report_done(g.address(), ids[0], 6, "/out0", secret=SECRET) is None
    assert report_done(g.address(), ids[1], 6, "/out1", secret=SECRET) is None  # two of the round's three: the job is complete
    t0 = time.monotonic()
    with pytest.raises(JobComplete, match="complete at step 6; final checkpoints: node0 at /out0, node1 at /out1"):
        rec._asked(step=6)
    assert time.monotonic() - t0 < 5.0 and ft.removed  # it leaves without waiting for torchft's Manager

    def train_main(args):
        raise JobComplete("the job at X is complete at step 6; final checkpoints: node0 at /out0.")

    exits = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: type("M", (), {
        "main": staticmethod(train_main), "add_arguments": staticmethod(lambda p: None)}))
    cli.main(["train"])
    assert exits == [0] and "complete at step 6; final checkpoints: node0 at /out0" in capsys.readouterr().out


def test_a_node_that_trained_the_last_step_reports_its_final_checkpoint_and_one_stopped_early_does_not(gate, tmp_path):
    from types import SimpleNamespace

    from lowband.ft.node import FaultToleranceConfig
    from lowband.ft.session import FaultTolerantSession

    g, _, _ = gate
    ids = {1: _member(1, "127.0.0.1")}  # the last round held node 1 alone: its own report is the round's majority
    g.breaker.observe((1, 0), {s: q(9, 9) for s in ids}, ids)
    cfg = FaultToleranceConfig(lighthouse=g.address(), node=1, max_nodes=2, fingerprint="f00d", secret=SECRET, steps=10)
    session = FaultTolerantSession(cfg)
    session._record = lambda: None  # ft_rank{R}.json: not this test's
    session.torchft = SimpleNamespace(replica_id=ids[1])
    (tmp_path / "checkpoints" / "step_000010").mkdir(parents=True)
    session.trainer = SimpleNamespace(rank=0, steps_done=9, out=tmp_path, stop=None)  # stopped before the end
    session.finish()
    assert not g.completion.complete
    session.trainer = SimpleNamespace(rank=1, steps_done=10, out=tmp_path)  # not the node's rank 0
    session.finish()
    assert not g.completion.complete
    session.trainer = SimpleNamespace(rank=0, steps_done=10, out=tmp_path)
    session.finish()
    assert g.completion.step == 10 and g.completion.where == {1: str(tmp_path / "checkpoints" / "step_000010")}
