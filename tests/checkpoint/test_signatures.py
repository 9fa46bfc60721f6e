"""lowband/checkpoint/signatures.py: --resume runs no code from a checkpoint and refuses one this job cannot vouch for.

One process, no process group (DCP saves and loads as a single rank). What must hold (issue 29 item 7):
a checkpoint is loaded without unpickling anything but DCP's metadata classes and weights-only items;
a tampered, unsigned (while the job has a secret), foreign-signed or manifest-less checkpoint is refused
with an error that names --trust-checkpoint and never the secret; --trust-checkpoint loads it.
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from lowband.checkpoint.dcp import load_checkpoint, save_checkpoint
from lowband.checkpoint.signatures import MANIFEST, CheckpointRefused, SafePlanner, read_metadata

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"


def _model(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, betas=(0.8, 0.9))
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


@pytest.fixture
def saved(tmp_path):
    def save(secret=None):
        m, opt = _model(0)
        path = save_checkpoint(tmp_path / "step_000003", model=m, optimizer=opt, extra={"step": 3}, secret=secret,
                               fingerprint="fp")
        return path, m

    return save


def _load(path, **kw):
    m, opt = _model(1)
    extra = load_checkpoint(path, model=m, optimizer=opt, **kw)
    return m, opt, extra


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_checkpoint_of_this_job_loads_and_keeps_its_optimizer_groups(saved, secret):
    path, m = saved(secret)
    assert (path / MANIFEST).exists()
    m2, opt2, extra = _load(path, secret=secret)
    assert extra["step"] == 3 and _same(m, m2)
    assert tuple(opt2.param_groups[0]["betas"]) == (0.8, 0.9)


@pytest.mark.parametrize("signed_with, here, needle", [
    (OTHER, SECRET, "signed with another secret"),
    (None, SECRET, "written without a job secret"),
    (SECRET, None, "signed with a job secret and none is set here"),
])
def test_a_checkpoint_this_job_did_not_sign_is_refused_unless_trusted(saved, signed_with, here, needle):
    path, m = saved(signed_with)
    with pytest.raises(CheckpointRefused, match=needle) as e:
        _load(path, secret=here)
    msg = str(e.value)
    assert "--trust-checkpoint" in msg and SECRET.decode() not in msg and OTHER.decode() not in msg
    m2, _, _ = _load(path, secret=here, trust=True)
    assert _same(m, m2)


def test_a_changed_missing_or_added_file_is_refused(saved):
    path, _ = saved(SECRET)
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-20] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointRefused, match=r"differ from those its manifest records \(changed: __0_0.distcp"):
        _load(path, secret=SECRET)
    (path / "extra.bin").write_bytes(b"x")
    with pytest.raises(CheckpointRefused, match="not written by the run: extra.bin"):
        _load(path, secret=SECRET)


def test_a_checkpoint_without_a_manifest_is_refused_with_the_way_out(saved):
    path, m = saved(None)
    (path / MANIFEST).unlink()  # as written before this check, or not by lowband
    with pytest.raises(CheckpointRefused, match="no lowband manifest.*--trust-checkpoint"):
        _load(path)
    assert _same(m, _load(path, trust=True)[0])


class _Bomb:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_metadata_pickle_runs_nothing_even_when_trusted(saved, tmp_path):
    path, _ = saved(None)
    marker = tmp_path / "ran"
    md = read_metadata(path)
    md.planner_data = {"x": _Bomb(marker)}  # a real metadata object carrying a payload
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointRefused, match=r"names posix.system|names os.system"):
        _load(path, trust=True)
    assert not marker.exists()


def test_a_crafted_non_tensor_item_is_not_unpickled(tmp_path):
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_Bomb(marker), buf)
    buf.seek(0)

    class Item:
        class dest_index:  # noqa: N801
            fqn = "optim.param_groups.0.lr"

    planner = SafePlanner()
    with pytest.raises(CheckpointRefused, match="not plain data or tensors"):
        planner.load_bytes(Item, buf)
    assert not marker.exists()


def test_the_trust_flag_parses():
    from lowband.train.args import parse_train_args

    assert parse_train_args(["--trust-checkpoint", "--resume", "auto"], known_only=True).checkpoint.trust
    assert not parse_train_args([], known_only=True).checkpoint.trust
