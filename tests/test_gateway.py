"""The Lighthouse's gate (lowband.gateway, issue 29 items 1 and 2): only requests whose replica id proves the
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

from lowband.admission import replica_id  # noqa: E402
from lowband.gateway import (  # noqa: E402
    ADMIT,
    COMMITTED_SCALE,
    HEARTBEAT,
    MANAGER_SERVICE,
    QUORUM,
    REFUSED,
    SERVICE,
    LighthouseGateway,
    ManagerGate,
    StallBreaker,
    admission_request,
    ask_gate,
    parse_fields,
    peer_host,
    quorum_round,
    refusal,
    string_field,
)

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
    assert _call(g.address(), ADMIT, admission_request(MEMBER, f"http://{MANAGER}", STORE)) == b""


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
    from lowband.ft import _STEP_SCALE, quorum_step

    assert COMMITTED_SCALE == _STEP_SCALE  # a node reports training step × this + committed steps
    steps = {0: quorum_step(40, 12), 2: quorum_step(41, 12)}
    assert quorum_round(_response(3, steps)) == ((1003, 7), steps)
    assert quorum_round(b"\x0a\x02\xff") is None


def _rounds(breaker, clock, rounds):
    """One quorum round each, 5 s apart (a round is known by its time: each member gets the same answer)."""
    for steps in rounds:
        clock.t += 5.0
        breaker.observe((round(clock.t * 1000), 0), steps)
        breaker.observe((round(clock.t * 1000), 0), steps)  # the same round, as another member received it


def q(train: int, committed: int) -> int:
    """A node's quorum step (lowband.ft.quorum_step)."""
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


def test_a_call_without_a_deadline_is_passed_on_without_one(gate):
    """torchft's heartbeats carry no deadline: gRPC reports ~9.2e18 s left, and passed on as a timeout that
    failed every heartbeat at once (DEADLINE_EXCEEDED), so the Lighthouse saw no member alive but by its
    quorum requests."""
    g, seen, _ = gate
    with grpc.insecure_channel(g.address().split("://", 1)[-1]) as ch:
        assert ch.unary_unary(HEARTBEAT)(_heartbeat(MEMBER)) == b"answer:" + _heartbeat(MEMBER)[:8]  # no timeout
    assert seen == [(HEARTBEAT, _heartbeat(MEMBER))]
