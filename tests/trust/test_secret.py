import os

import pytest

from lowband.trust.secret import SecretError, load_secret, tag, verify, write_secret


def test_a_written_secret_is_private_loaded_and_never_overwritten(tmp_path):
    p = write_secret(tmp_path / "job.secret")
    assert oct(p.stat().st_mode & 0o777) == "0o600"
    s = load_secret(p, environ={})
    assert len(s) == 64
    with pytest.raises(SecretError, match="exists"):
        write_secret(p)


def test_the_option_comes_before_the_environment_and_none_without_either(tmp_path):
    p = write_secret(tmp_path / "a")
    env = {"LOWBAND_SECRET": "x" * 20}
    assert load_secret(p, environ=env) == p.read_bytes().strip()
    assert load_secret(environ=env) == b"x" * 20
    assert load_secret(environ={"LOWBAND_SECRET_FILE": str(p)}) == p.read_bytes().strip()
    assert load_secret(environ={}) is None


def test_weak_unreadable_and_shared_secrets_are_refused_without_showing_them(tmp_path):
    with pytest.raises(SecretError, match="fewer than 16") as e:
        load_secret(environ={"LOWBAND_SECRET": "hunter2"})
    assert "hunter2" not in str(e.value)
    with pytest.raises(SecretError, match="no such file.*lowband secret"):
        load_secret(tmp_path / "missing", environ={})
    p = tmp_path / "shared"
    p.write_text("y" * 40)
    os.chmod(p, 0o644)
    with pytest.raises(SecretError, match="chmod 600") as e:
        load_secret(p, environ={})
    assert "y" * 40 not in str(e.value)


def test_a_tag_proves_the_secret_bound_to_every_claim():
    s = b"s" * 32
    t = tag(s, "job", 2, "10.0.0.2:29500")
    assert verify(s, t, "job", 2, "10.0.0.2:29500")
    assert not verify(s, t, "job", 3, "10.0.0.2:29500")          # another slot
    assert not verify(s, t, "job", 2, "10.0.0.9:29500")          # another address
    assert not verify(b"t" * 32, t, "job", 2, "10.0.0.2:29500")  # another job's secret
    assert not verify(s, "0" * 32, "job", 2, "10.0.0.2:29500")
