"""lowband/trust/admission.py: the secret's tag in a node's replica id, every quorum screened, listeners on the
job's network; the fingerprint by content (issue 29, items 1, 2 and 8). No process, no torchft server."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from lowband.ft.node import FaultToleranceConfig
from lowband.trust.admission import (
    AdmissionRefused,
    BindRefused,
    check_bind,
    claim_of,
    is_public,
    job_address,
    member_of,
    proves,
    replica_id,
    screen,
)

S = b"s" * 32  # the job's secret
T = b"t" * 32  # another job's


def rid(fp="a", node=0, *, secret=S, store=None, uuid="u"):
    host = f"10.0.0.{node + 1}"
    return replica_id(fp, node, secret=secret, store=store or f"{host}:29500", manager=f"{host}:4000") + ":" + uuid


def result(ids, *, me=0, heal=False, max_step=0, store=None, src=None, src_addr=""):
    return SimpleNamespace(replica_ids=ids, replica_rank=me, heal=heal, max_step=max_step,
                           store_address=claim_of(ids[0]).store if store is None and claim_of(ids[0]) else store or "",
                           recover_src_replica_rank=src, recover_src_manager_address=src_addr,
                           recover_dst_replica_ranks=[])


def test_a_replica_id_carries_the_job_slot_store_and_a_tag_that_torchft_leaves_alone():
    r = rid("0123abcd", 12, store="10.0.0.7:29500")
    c = claim_of(r)
    assert (c.fingerprint, c.node, c.store, len(c.tag)) == ("0123abcd", 12, "10.0.0.7:29500", 32)
    assert member_of(r) == ("0123abcd", 12) and proves(S, r)
    from torchft.manager import extract_trailing_digits

    assert extract_trailing_digits(r.split(":")[0]) == 12
    assert S.decode() not in r  # the id proves the secret without holding it


@pytest.mark.parametrize("forge", [
    lambda r: r.replace("_node0", "_node1"),  # another slot
    lambda r: r.replace("lowband_a_", "lowband_b_"),  # another job
    lambda r: r.replace(b"10.0.0.1:29500".hex(), b"10.6.6.6:29500".hex()),  # copied, another address
    lambda r: replica_id("a", 0, secret=T, store="10.0.0.1:29500"),  # another job's secret
    lambda r: replica_id("a", 0, store="10.0.0.1:29500"),  # no secret
    lambda r: "someone_node0:x",  # not lowband's
])
def test_a_tag_proves_the_secret_only_for_what_it_was_made_for(forge):
    assert proves(S, rid("a", 0)) and not proves(S, forge(rid("a", 0)))


def test_a_quorum_of_the_job_is_accepted():
    ids = [rid(node=0), rid(node=1), rid(node=2)]
    assert screen(result(ids), secret=S, me=ids[1], new=False, behind=False).verdict == "accept"


def test_outsiders_make_the_job_ask_again_and_never_leave():
    ids = [rid(node=0), rid(node=1), rid(node=2, secret=T)]
    for new in (False, True):  # a running node, or a new one with a peer that proves the secret
        s = screen(result(ids), secret=S, me=ids[0], new=new, behind=True)
        assert s.verdict == "retry" and s.outsiders == [ids[2]] and s.peers == 1
    # a running node alone with many fakes that claim to be ahead: it asks again, it does not leave
    fakes = [rid(node=i, secret=T) for i in (1, 2)] + ["x_node2:y"]
    s = screen(result([rid(node=0)] + fakes, heal=True), secret=S, me=rid(node=0), new=False, behind=True)
    assert s.verdict == "retry" and s.peers == 0


def test_a_node_with_another_secret_or_none_is_the_one_refused():
    job = [rid(node=0), rid(node=1)]
    wrong = rid(node=2, secret=T)
    s = screen(result(job + [wrong]), secret=T, me=wrong, new=True, behind=True)
    assert s.verdict == "refused" and len(s.outsiders) == 2
    bare = replica_id("a", 2) + ":u"
    assert screen(result(job + [bare]), secret=None, me=bare, new=True, behind=True).verdict == "refused"
    # at a new job's start: refused when two or more nodes of another secret are there, else it waits
    assert screen(result(job + [wrong]), secret=T, me=wrong, new=True, behind=False).verdict == "refused"
    assert screen(result([rid(node=0), wrong]), secret=T, me=wrong, new=True, behind=False).verdict == "retry"


def test_the_quorum_store_and_the_state_source_must_be_the_members_own():
    ids = [rid(node=0), rid(node=1)]
    s = screen(result(ids, store="10.6.6.6:1"), secret=S, me=ids[1], new=False, behind=False)
    assert s.verdict == "retry" and "store" in s.why
    good = result(ids, heal=True, src=0, src_addr="http://10.0.0.1:4000")
    assert screen(good, secret=S, me=ids[1], new=True, behind=True).verdict == "accept"
    for addr in ("http://10.6.6.6:4000", "http://10.0.0.1:4001"):  # another host, or the same host, another port
        bad = result(ids, heal=True, src=0, src_addr=addr)
        assert screen(bad, secret=S, me=ids[1], new=True, behind=True).verdict == "retry"


def test_a_copied_public_id_is_never_trained_with():
    ids = [rid(node=0), rid(node=1)]
    copy = ids[0].split(":")[0] + ":other-uuid"  # the id from the Lighthouse's status page, run elsewhere
    q = result(sorted([*ids, copy]))
    assert screen(q, secret=S, me=ids[1], new=False, behind=False).verdict == "retry"
    assert screen(q, secret=S, me=ids[0], new=False, behind=False).verdict == "retry"  # the real one stays
    assert screen(q, secret=S, me=ids[0], new=True, behind=False).verdict == "twin"  # as a node started twice


def _recorder(results, **kw):
    from tests.ft.test_node import _recorder as make

    return make(results, **kw)


def test_the_job_node_asks_again_past_fakes_and_trains_with_its_own(caplog):
    mine = replica_id("a", 0, secret=S, store="h:1", manager="h:1") + ":u"
    peer = rid(node=1)
    fake = rid(node=2, secret=T)
    ft, rec, asked = _recorder([result([mine, peer, fake])] * 50 + [result([mine, peer])], secret=S,
                               quorums=3, timeout_s=0.004)
    assert rec._quorum(step=5).replica_ids == [mine, peer] and len(asked) == 51
    assert "do not prove the job's secret" in caplog.text and S.decode() not in caplog.text


def test_the_node_with_the_wrong_secret_leaves_before_any_process_group_names_the_fix_not_the_secret():
    job = [rid(node=0), rid(node=1)]
    ft, rec, asked = _recorder([result(job + [replica_id("a", 2, secret=T, store="h:1", manager="h:1") + ":u"], heal=True)],
                               secret=T, node=2)
    with pytest.raises(AdmissionRefused, match=r"refused.*--secret-file PATH or LOWBAND_SECRET_FILE.*lowband "
                                               r"secret PATH.*before any process group") as e:
        rec._quorum(step=0)
    assert T.decode() not in str(e.value) and S.decode() not in str(e.value) and not hasattr(ft, "replica_ids")


def test_a_node_that_was_alone_in_its_first_quorums_is_still_refused_when_it_meets_the_job():
    """An intruder without the secret in a free slot while the job's nodes were elsewhere (a CI run: its quorums
    held only itself, then one of the job's nodes restarted into its quorum): it is new to the job until a
    quorum it accepts holds another member, so it is refused then, not trained with."""
    alone = [replica_id("a", 2) + ":u"]
    job_node = rid(node=1)
    ft, rec, asked = _recorder([result(alone), result(alone), result([job_node] + alone)], node=2)
    for _ in range(2):
        assert rec._quorum(step=0).replica_ids == alone
        ft.quorums += 1  # as finish_quorum counts each quorum taken
    assert not ft.had_peers
    with pytest.raises(AdmissionRefused, match="the job's nodes prove a secret and this node has none"):
        rec._quorum(step=0)
    assert len(asked) == 3


@pytest.mark.parametrize("host, public", [
    ("127.0.0.1", False), ("localhost", False), ("::1", False), ("10.0.0.2", False), ("192.168.1.4", False),
    ("fd00::2", False), ("0.0.0.0", True), ("::", True), ("", True), ("8.8.8.8", True), ("2001:4860::8888", True),
])
def test_the_job_network_is_loopback_or_private(host, public):
    assert is_public(host) is public


# Every spelling of an address the resolver or the kernel takes, and what a listener binds for it (issue 44 item 4:
# ``[::ffff:0.0.0.0]`` passed the check and listened on every interface).
@pytest.mark.parametrize("host, bound", [
    ("127.0.0.1", "127.0.0.1"), ("[127.0.0.1]", "127.0.0.1"), ("127.1", "127.0.0.1"), ("0x7f000001", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"), ("2130706433", "127.0.0.1"), ("::1", "::1"),
    ("[::1]", "::1"), ("0:0:0:0:0:0:0:1", "::1"), ("::ffff:127.0.0.1", "127.0.0.1"),
    ("[::ffff:10.0.0.2]", "10.0.0.2"), ("::ffff:a00:2", "10.0.0.2"), ("10.0.0.2", "10.0.0.2"),
    ("172.31.255.1", "172.31.255.1"), ("192.168.1.4", "192.168.1.4"), ("169.254.3.4", "169.254.3.4"),
    ("fd00::2", "fd00::2"), ("fe80::1%lo", "fe80::1%lo"), ("localhost", "127.0.0.1"),
])
def test_every_spelling_of_a_job_address_is_bound_as_the_address_it_is(host, bound):
    a = job_address(host)
    assert a.job and a.address == bound, a
    assert check_bind(host, what="x", flag="--ft-bind", secret=True, trusted_network=False) == bound


@pytest.mark.parametrize("host, why", [
    ("", "wildcard"), ("*", "wildcard"), ("0.0.0.0", "wildcard"), ("0", "wildcard"), ("0.0", "wildcard"),
    ("0x0", "wildcard"), ("00", "wildcard"), ("0.1.2.3", "0.0.0.0/8"), ("::", "wildcard"), ("[::]", "wildcard"),
    ("0:0:0:0:0:0:0:0", "wildcard"), ("::ffff:0.0.0.0", "wildcard"), ("[::ffff:0.0.0.0]", "wildcard"),
    ("::ffff:0:0", "wildcard"), ("::0.0.0.0", "wildcard"),
    ("::127.0.0.1", "IPv4-compatible"), ("::8.8.8.8", "IPv4-compatible"), ("::ffff:8.8.8.8", "public"),
    ("8.8.8.8", "public"), ("0x08080808", "public"), ("134744072", "public"), ("010.010.010.010", "public"),
    ("172.32.0.1", "public"), ("100.64.0.1", "public"), ("224.0.0.1", "public"), ("255.255.255.255", "public"),
    ("192.0.2.1", "public"), ("2001:4860::8888", "public"), ("2002:808:808::1", "public"),
    ("2001:0:4136:e378::1", "public"), ("64:ff9b::808:808", "public"), ("fec0::1", "public"),
    ("127.0.0.1 ", "not an address"), ("127.0.0.1\x00", "not an address"), ("127.0.0.1\n", "not an address"),
    ("a" * 300, "not an address"), ("[127.0.0.1", "not an address"), ("nonexistent.invalid", "does not resolve"),
])
def test_every_spelling_of_a_wildcard_or_public_address_is_refused(host, why):
    a = job_address(host)
    assert not a.job and why in a.why, a
    assert is_public(host)
    with pytest.raises(BindRefused, match=r"--ft-bind 127\.0\.0\.1.*--trusted-network"):
        check_bind(host, what="x", flag="--ft-bind", secret=True, trusted_network=False)


def test_an_address_this_machine_does_not_hold_is_a_clear_error_naming_the_fix():
    pytest.importorskip("grpc")
    from lowband.ft.gateway import LighthouseGateway
    from lowband.trust.admission import CannotListen

    with pytest.raises(CannotListen, match=r"cannot listen on 192\.0\.2\.1:0: not an address of this machine.*ip -brief"):
        LighthouseGateway(bind="192.0.2.1:0", backend="127.0.0.1:1", secret=b"s" * 32, workers=2)


def test_a_host_name_is_the_job_network_only_when_every_address_it_resolves_to_is(monkeypatch):
    import socket

    table = {"vpn.example": ["10.0.0.7"], "evil.example": ["10.0.0.7", "0.0.0.0"], "pub.example": ["8.8.8.8"],
             "mapped.example": ["::ffff:0.0.0.0"]}

    def resolve(name, port, *args, **kwargs):
        if name not in table:
            raise socket.gaierror("no such name")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in table[name]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert job_address("vpn.example").address == "10.0.0.7"
    for name, why in (("evil.example", "0.0.0.0, a wildcard"), ("pub.example", "8.8.8.8, a public"),
                      ("mapped.example", "0.0.0.0, a wildcard"), ("nowhere.example", "does not resolve")):
        assert why in job_address(name).why
    # with --trusted-network a resolved name is bound at its address, never the name again
    assert check_bind("pub.example", what="x", flag="--bind", secret=False, trusted_network=True) == "8.8.8.8"
    assert check_bind("", what="x", flag="--bind", secret=False, trusted_network=True) == "0.0.0.0"


def test_a_public_bind_is_refused_unless_the_network_is_trusted():
    check_bind("127.0.0.1", what="x", flag="--ft-bind", secret=False, trusted_network=False)
    for secret in (False, True):
        with pytest.raises(BindRefused, match=r"0\.0\.0\.0, a public interface.*--ft-bind 127\.0\.0\.1.*WireGuard.*"
                                              r"--trusted-network"):
            check_bind("0.0.0.0", what="x", flag="--ft-bind", secret=secret, trusted_network=False)
    check_bind("0.0.0.0", what="x", flag="--ft-bind", secret=False, trusted_network=True)


def test_lowband_lighthouse_binds_loopback_by_default_and_refuses_a_public_bind():
    from lowband.commands.lighthouse import add_arguments as add_lighthouse_arguments
    from lowband.commands.lighthouse import main as lighthouse_main

    p = argparse.ArgumentParser()
    add_lighthouse_arguments(p)
    assert p.parse_args([]).bind.startswith("127.0.0.1:")
    with pytest.raises(BindRefused, match="stop a node.*--trusted-network"):
        lighthouse_main(p.parse_args(["--bind", "0.0.0.0:29510"]))
    for bind in ("[::]:0", "[::ffff:0.0.0.0]:29510", "0:29510", "0x0:29510", "[::0.0.0.0]:29510"):
        with pytest.raises(BindRefused):
            lighthouse_main(p.parse_args(["--bind", bind]))
    for bind in ("127.0.0.1:x", "127.0.0.1:70000", "127.0.0.1:", "127.0.0.1:+1"):
        with pytest.raises(ValueError, match="--bind: the port must be a number"):
            lighthouse_main(p.parse_args(["--bind", bind]))
    from lowband.trust.secret import SecretError

    with pytest.raises(SecretError, match="no such file .*lowband secret"):  # before anything listens
        lighthouse_main(p.parse_args(["--secret-file", "/nonexistent/job.secret"]))


@pytest.mark.parametrize("bind", ["0.0.0.0", "::ffff:0.0.0.0", "[::ffff:0.0.0.0]", "0", "8.8.8.8"])
def test_a_node_refuses_to_listen_on_a_public_address_before_starting_anything(bind):
    from lowband.ft.node import FaultTolerance

    cfg = FaultToleranceConfig(lighthouse="http://10.0.0.1:1", node=0, max_nodes=2, bind=bind, secret=S)
    with pytest.raises(BindRefused, match="--ft-bind"):
        FaultTolerance(cfg, rank=0, world_size=1, state_dict=dict, load_state_dict=lambda s: None)


def test_torchft_listeners_bind_the_job_network(monkeypatch):
    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager

    from lowband.ft.managergate import listening_on

    seen = {}
    monkeypatch.setattr(manager, "ManagerServer", lambda **kw: seen.update(kw))
    with listening_on("127.0.0.1"):
        manager.ManagerServer(bind="[::]:0", replica_id="r")
        server = http_transport._IPv6HTTPServer(("", 0), None)
    assert seen["bind"] == "127.0.0.1:0"
    assert server.socket.getsockname()[0] == "127.0.0.1"
    server.server_close()
    with listening_on("::1"):
        manager.ManagerServer(bind="[::]:7", replica_id="r")
    assert seen["bind"] == "[::1]:7" and manager.ManagerServer is not http_transport._IPv6HTTPServer


def test_the_secret_is_never_in_the_config_its_repr_or_the_job_file(tmp_path, monkeypatch):
    from lowband.train.args import parse_train_args
    from lowband.train.jobfile import dumps
    from lowband.trust.secret import write_secret

    key = write_secret(tmp_path / "job.secret")
    value = key.read_text().strip()
    cfg = parse_train_args(["--ft-lighthouse", "http://127.0.0.1:1", "--secret-file", str(key)])
    ft = cfg.ft_config(ranks_per_node=1)
    assert ft.secret == value.encode()
    assert value not in repr(ft) and value not in dumps(cfg) and value not in repr(cfg)
    monkeypatch.setenv("LOWBAND_SECRET", value)  # or by the environment only
    assert parse_train_args(["--ft-lighthouse", "http://127.0.0.1:1"]).ft_config(ranks_per_node=1).secret == value.encode()


def test_ftjob_gives_nodes_the_secret_by_environment_not_argv(tmp_path, monkeypatch):
    import subprocess

    from lowband.cluster.ftjob import FaultTolerantJob

    launched = {}
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: launched.update(cmd=cmd, env=kw["env"]))
    job = FaultTolerantJob.__new__(FaultTolerantJob)
    job.__dict__.update(train_args=[], ranks_per_node=1, address="http://127.0.0.1:1", nodes=2, ft_timeout_s=5,
                        start_nodes=None, net=None, secret_file=tmp_path / "job.secret", roster=None)
    monkeypatch.setenv("LOWBAND_SECRET", "this shell's own secret, not the job's")
    job._launch(0, tmp_path / "n0", tmp_path / "n0.log")
    assert launched["env"]["LOWBAND_SECRET_FILE"] == str(tmp_path / "job.secret")
    assert "LOWBAND_SECRET" not in launched["env"]  # only what the job gives its nodes
    assert not any("secret" in str(a) for a in launched["cmd"])
    # An intruder (lowband bench --faults nodeN:intrude@S): the job's command line, no secret at all.
    job._launch(1, tmp_path / "i1", tmp_path / "i1.log", secret_file=False)
    assert not {"LOWBAND_SECRET", "LOWBAND_SECRET_FILE"} & set(launched["env"])


# --------------------------------------------------------------------------- item 8: the fingerprint
def _fp(tmp_path, data="d.jsonl", *extra, ranks=2):
    from lowband.train.args import parse_train_args

    return parse_train_args(["--ft-lighthouse", "http://127.0.0.1:1", "--data", str(data), *extra]
                            ).fingerprint(ranks_per_node=ranks)


def test_the_fingerprint_is_the_data_content_not_its_path(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text('{"source": "a", "target": "b"}\n')
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "d.jsonl").write_text('{"source": "a", "target": "b"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOWBAND_CACHE", str(tmp_path / "cache"))  # the data's token store and tokenizer
    base = _fp(tmp_path, "d.jsonl")
    assert base == _fp(tmp_path, tmp_path / "d.jsonl") == _fp(tmp_path, tmp_path / "copy" / "d.jsonl")
    (tmp_path / "copy" / "d.jsonl").write_text('{"source": "a", "target": "c"}\n')
    assert _fp(tmp_path, tmp_path / "copy" / "d.jsonl") != base


@pytest.mark.parametrize("extra", [
    ["--vocab-size", "4096"], ["--max-source-len", "64"], ["--max-target-len", "16"], ["--max-len", "64"],
    ["--schedule", "cosine"], ["--warmup-steps", "5"], ["--min-lr-ratio", "0.5"], ["--steps", "7"],
    ["--shards", "1"], ["--tokenizer-kind", "unigram"], ["--val-size", "10"], ["--packing", "lines"],
])
def test_the_fingerprint_covers_what_must_match_to_train_one_model(tmp_path, monkeypatch, extra):
    (tmp_path / "d.jsonl").write_text('{"source": "a", "target": "b"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOWBAND_CACHE", str(tmp_path / "cache"))  # the data's token store and tokenizer
    assert _fp(tmp_path, "d.jsonl", *extra) != _fp(tmp_path, "d.jsonl")


def test_the_fingerprint_covers_a_given_tokenizer_by_content(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text('{"source": "a", "target": "b"}\n')
    from lowband.train.tokenizer import train_tokenizer

    # Real tokenizers: the data is tokenised with the one given (into its token store) for its digest.
    train_tokenizer(["a b"], 300).save(str(tmp_path / "t1.json"))
    train_tokenizer(["a b", "c d"], 300).save(str(tmp_path / "t2.json"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOWBAND_CACHE", str(tmp_path / "cache"))  # the data's token store and tokenizer
    assert _fp(tmp_path, "d.jsonl", "--tokenizer", "t1.json") != _fp(tmp_path, "d.jsonl", "--tokenizer", "t2.json")
    assert _fp(tmp_path, "d.jsonl", "--shards", "2") == _fp(tmp_path, "d.jsonl", ranks=2)  # shards per node
