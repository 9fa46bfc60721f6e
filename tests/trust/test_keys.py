"""Per-member keys (lowband.trust.keys, issue 44 item 5): what `lowband secret --nodes` writes, the roster's and the
keys' checks, and signed calls refused when forged, replayed, stale or in another member's name."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

pytest.importorskip("cryptography")

from lowband.cli import main as cli_main  # noqa: E402
from lowband.ft.logs import quiet_torchft, redact_ids  # noqa: E402
from lowband.trust.admission import replica_id  # noqa: E402
from lowband.trust.keys import (  # noqa: E402
    MAX_SKEW_S,
    ReplayCache,
    key_path,
    load_key,
    load_roster,
    roster_path,
    sign_call,
    verify_call,
    write_keys,
)
from lowband.trust.secret import SecretError, load_secret  # noqa: E402


@pytest.fixture
def job(tmp_path):
    secret = tmp_path / "job.secret"
    roster, keys = write_keys(secret, 3)
    return secret, load_secret(secret), load_roster(roster, load_secret(secret)), keys


def test_lowband_secret_nodes_writes_a_secret_a_key_per_slot_and_a_roster_signed_by_the_secret(tmp_path, capsys):
    path = tmp_path / "job.secret"
    assert cli_main(["secret", str(path), "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert str(roster_path(path)) in out and "--key-file" in out
    for p in (path, key_path(path, 0), key_path(path, 1)):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    private = json.loads(key_path(path, 0).read_text())["private"]
    assert private not in out and private not in roster_path(path).read_text()
    roster = load_roster(roster_path(path), load_secret(path))
    assert len(roster) == 2 and load_key(key_path(path, 1), 1, roster).node == 1
    assert not list(tmp_path.glob(".*tmp"))  # nothing half-written left beside them
    # nothing is overwritten, and the refusal says what to do
    with pytest.raises(SecretError, match="not overwritten"):
        write_keys(path, 2)
    # an existing secret gets keys added
    other = tmp_path / "other.secret"
    assert cli_main(["secret", str(other)]) == 0
    before = other.read_bytes()
    write_keys(other, 1)
    assert other.read_bytes() == before and roster_path(other).exists()


def test_a_roster_or_key_that_is_not_the_jobs_is_refused_with_the_fix(job, tmp_path):
    secret_path, secret, roster, keys = job
    with pytest.raises(SecretError, match="not signed by this job's secret"):
        load_roster(roster_path(secret_path), b"another secret, 32 bytes long...")
    doc = json.loads(roster_path(secret_path).read_text())
    doc["members"]["2"] = doc["members"]["0"]  # a member's key swapped for another's
    altered = tmp_path / "altered.roster"
    altered.write_text(json.dumps(doc))
    with pytest.raises(SecretError, match="altered"):
        load_roster(altered, secret)
    for bad in ("", "{}", "[1]", json.dumps({"format": "lowband-roster/1", "members": {"0": "zz"}})):
        altered.write_text(bad)
        with pytest.raises(SecretError, match="not a lowband roster"):
            load_roster(altered, secret)
    with pytest.raises(SecretError, match="no such file"):
        load_roster(tmp_path / "missing", secret)
    with pytest.raises(SecretError, match="needs the job's secret"):
        load_roster(roster_path(secret_path), None)
    with pytest.raises(SecretError, match="is node 0's key"):
        load_key(keys[0], 1, roster)
    os.chmod(keys[1], 0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        load_key(keys[1], 1, roster)
    other = write_keys(tmp_path / "b.secret", 3)[1]  # another job's key for the same slot
    with pytest.raises(SecretError, match="not the key the roster names"):
        load_key(other[2], 2, roster)


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_signed_call_is_refused_when_forged_replayed_stale_or_in_another_members_name(job):
    _, _, roster, keys = job
    k1 = load_key(keys[1], 1, roster)
    clock = Clock()
    cache = ReplayCache(clock=clock)
    parts = ("/lowband.LighthouseGate/Accuse", "rid1", "http://h:1", "h:2", "rid2", "bad index")
    t, nonce, sig = sign_call(k1, *parts, clock=clock)
    assert verify_call(roster, cache, 1, sig, t, nonce, *parts) is None
    assert "replayed" in verify_call(roster, cache, 1, sig, t, nonce, *parts)
    t, nonce, sig = sign_call(k1, *parts, clock=clock)
    assert "forged" in verify_call(roster, cache, 1, sig, t, nonce, *parts[:-1], "other text")  # altered
    assert "forged" in verify_call(roster, cache, 2, sig, t, nonce, *parts)  # node 1's key, in node 2's name
    flipped = sig[:-1] + ("1" if sig[-1] == "0" else "0")  # another last digit (ending in "00" could be the real one)
    assert "forged" in verify_call(roster, cache, 1, flipped, t, nonce, *parts)
    assert "no key in the job's roster" in verify_call(roster, cache, 7, sig, t, nonce, *parts)
    for bad_t, bad_nonce in (("nan", nonce), ("inf", nonce), ("x" * 40, nonce), (t, "short"), (t, "Z" * 32)):
        assert "no time and nonce" in verify_call(roster, cache, 1, sig, bad_t, bad_nonce, *parts)
    old = sign_call(k1, *parts, clock=lambda: clock.t - MAX_SKEW_S - 1)
    assert "stale" in verify_call(roster, cache, 1, old[2], old[0], old[1], *parts)
    ahead = sign_call(k1, *parts, clock=lambda: clock.t + MAX_SKEW_S + 1)
    assert "stale" in verify_call(roster, cache, 1, ahead[2], ahead[0], ahead[1], *parts)
    assert verify_call(roster, cache, 1, sig, t, nonce, *parts) is None  # the genuine one still passes, once


def test_the_replay_cache_is_bounded_and_never_takes_a_forgotten_nonce_again():
    clock = Clock()
    cache = ReplayCache(max_entries=4, clock=clock)
    for i in range(10):
        assert cache.check(clock.t - 10 + i, f"{i:032x}") is None
    assert len(cache) == 4
    assert "replayed" in cache.check(clock.t - 10, f"{0:032x}")  # forgotten, and refused all the same
    assert cache.check(clock.t, "f" * 32) is None
    clock.t += 3 * MAX_SKEW_S  # old entries lapse with time too
    assert cache.check(clock.t, "e" * 32) is None and len(cache) == 1


def test_torchfts_logs_never_carry_a_replica_id(monkeypatch, caplog):
    for last in (None, 700):  # an id that names the job's last step too
        rid = replica_id("f00d", 3, secret=b"s" * 32, store="10.0.0.3:5000", manager="10.0.0.3:6000", last_step=last)
        full = f"{rid}:0b5e2c7a-1c2d-4e5f-8a9b-0123456789ab"
        assert redact_ids(f"[{full}/0 - step 5] Quorum! members [{rid}]") == \
            "[lowband_f00d_node3/0 - step 5] Quorum! members [lowband_f00d_node3]"
    monkeypatch.setenv("RUST_LOG", "info")
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "warn"  # torchft's Rust side: its per-step INFO lines name every member
    monkeypatch.setenv("RUST_LOG", "error")
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "error"  # quieter is kept
    with caplog.at_level(logging.INFO):
        logging.getLogger("torchft.manager").info("[%s/0 - step 1] reconfiguring", full)
        logging.getLogger("torchft_quorums").info("", extra={"replica_id": full})
        logging.getLogger("lowband.other").info("%s", "0b5e2c7a-1c2d-4e5f-8a9b-0123456789ab")
    torchft = [r for r in caplog.records if r.name.startswith("torchft")]
    assert len(torchft) == 2 and all(full not in r.getMessage() and rid not in r.getMessage() for r in torchft)
    assert torchft[1].replica_id == "lowband_f00d_node3"
    assert caplog.records[-1].getMessage() == "0b5e2c7a-1c2d-4e5f-8a9b-0123456789ab"  # others' records untouched


def test_a_connection_refused_again_and_again_waits_before_each_call_and_a_passing_call_clears_it():
    from lowband.trust.limits import Tarpit

    slept: list[float] = []
    t = Tarpit(free=3, delay_s=1.0, slots=1, max_connections=4, sleep=slept.append)
    for _ in range(3):
        t.refused("ipv4:127.0.0.1:1")
    assert t.wait("ipv4:127.0.0.1:1") == 0.0  # within its free refusals
    t.refused("ipv4:127.0.0.1:1")
    assert t.wait("ipv4:127.0.0.1:1") == 1.0 and t.wait("ipv4:127.0.0.1:2") == 0.0  # another connection: not slowed
    assert t.wait("ipv4:127.0.0.1:1", remaining_s=1.5) == 0.5  # never past the caller's deadline (a second kept)
    t._slots.acquire()  # every slot taken: the call goes on at once (the pool's threads are the members')
    assert t.wait("ipv4:127.0.0.1:1") == 0.0
    t._slots.release()
    t.passed("ipv4:127.0.0.1:1")  # one call that passed clears it
    assert t.wait("ipv4:127.0.0.1:1") == 0.0 and slept == [1.0, 0.5]
    for i in range(10):
        t.refused(f"ipv4:10.0.0.1:{i}")
    assert len(t) == 4  # bounded, whoever calls


def test_lowband_train_refuses_keys_that_do_not_go_together_before_anything_starts(job):
    from lowband.train.args import parse_train_args

    secret_path, _, _, keys = job
    base = ["--method", "flexdemo", "--steps", "2", "--ft-lighthouse", "http://127.0.0.1:1", "--ft-max-nodes", "3"]
    roster = str(roster_path(secret_path))
    cases = [
        (["--ft-node", "0", "--key-file", str(keys[0])], "go together"),
        (["--ft-node", "0", "--roster", roster, "--secret-file", str(secret_path)], "go together"),
        (["--ft-node", "1", "--key-file", str(keys[0]), "--roster", roster, "--secret-file", str(secret_path)],
         "is node 0's key"),
        (["--ft-node", "0", "--key-file", str(keys[0]), "--roster", roster], "needs the job's secret"),
    ]
    for extra, needle in cases:
        with pytest.raises(ValueError, match=needle):
            parse_train_args([*base, *extra]).ft_config(1)
    cfg = parse_train_args([*base, "--ft-node", "2", "--key-file", str(keys[2]), "--roster", roster,
                            "--secret-file", str(secret_path)])
    ft = cfg.ft_config(1)
    assert ft.key.node == 2 and len(ft.roster) == 3 and "private" not in repr(ft)
    plain = parse_train_args([*base, "--ft-node", "2", "--secret-file", str(secret_path)])
    assert plain.fingerprint(1) != cfg.fingerprint(1)  # with a roster and without: two jobs
