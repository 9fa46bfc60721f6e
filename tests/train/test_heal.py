"""A healing node's state, shard by shard, for every method that runs under fault tolerance: one node of
2 ranks (FSDP2 shards every parameter and every piece of optimizer state over them).

What a restarted node of a fault-tolerant job does at its first quorum, without torchft around it (the
fault-tolerance jobs of tests/e2e/test_fault_tolerance.py do it inside torchft's heal flow, with one
rank per node for each method but FlexDeMo, whose job has two): a trainer that has trained K steps (the
live peer) hands its state (:meth:`FaultTolerantSession.state_now`), the state crosses the healing wire format
(:mod:`lowband.ft.transport`: header, raw tensors, digest; read back against the healer's own state as
the template, as a healer does) and a freshly built trainer (the restarted node) loads it
(:meth:`FaultTolerantSession.load`). Then both train on from step K on the same batches.

What must hold: the checks a healer makes before it loads anything (finite values, the step, the trainer's
layout) pass an honest peer's state; the healer goes on from the peer's step, and from there on the two are the same
replica, bit for bit, on each rank's shard: parameters, every optimizer state tensor, lr, after steps
that cross DiLoCo's, NoLoCo's and SparseLoCo's outer steps. Anything of the state that does not travel,
lands on the wrong shard or is loaded wrongly shows as a difference. The peer applies the method's
per-replica reset too (``reset_replica_state``: FlexDeMo's δ, the inner weights of the local-step
methods), which a survivor of a real job does not: in a job, the next exchange makes the replicas
agree again (checked there); here it makes the two replicas comparable at every step.
"""

from __future__ import annotations

import pytest

from lowband.testing.ranks import run_ranks

pytestmark = pytest.mark.multiprocess

# Every method that passes check_fault_tolerance (tests/ft/test_node.py), with H small enough for outer steps here.
METHODS = {"adamw": {}, "muon": {}, "deto-full": {}, "flexdemo": {"topk": 2}, "diloco": {"H": 2}, "noloco": {"H": 2},
           "sparseloco": {"H": 2}}
TRAINED = 3  # steps the peer trains before the healer copies it: mid-window at H = 2
AFTER = 4  # steps both train after the heal: two outer steps at H = 2


def _wire(state: dict) -> dict:
    """``state`` through the healing wire format and back, read against itself as the healer's template."""
    import hashlib
    import io
    import struct

    from lowband.ft.transport import encode_state, read_state, receive_limit, template_of

    header, tensors = encode_state(state, step=TRAINED, fingerprint="heal-test")
    payload = b"".join(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes() for t in tensors)
    raw = (struct.pack(">Q", len(header)) + b"-" * 32 + header + payload
           + (hashlib.sha256(payload).hexdigest() + "-" * 32).encode())
    template = template_of(state)
    return read_state(io.BufferedReader(io.BytesIO(raw)), step=TRAINED, fingerprint="heal-test",
                      limit=receive_limit(template), template=template, stall_s=5.0)


def _local(state: dict) -> dict:
    """name → this rank's local tensor (or plain value) of a trainer's healing state, flattened."""
    import torch

    out = {}

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            out[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        else:
            out[path] = obj
    walk({k: v for k, v in state.items() if k != "trainer"}, "state")
    return out


def _differences(a: dict, b: dict) -> list[str]:
    import torch

    if a.keys() != b.keys():
        return [f"keys: only on the peer {sorted(a.keys() - b.keys())[:5]}, only here {sorted(b.keys() - a.keys())[:5]}"]
    bad = []
    for k, x in a.items():
        y = b[k]
        same = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                if isinstance(x, torch.Tensor) else x == y)
        if not same:
            bad.append(k)
    return bad


def _heal_all(rank: int, out: str, cache: str) -> dict:
    import os
    from types import SimpleNamespace

    os.environ["LOWBAND_CACHE"] = cache
    from lowband.ft.session import FaultTolerantSession
    from lowband.ft.transport import check_values
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    def trainer(method: str, hp: dict, name: str) -> Trainer:
        t = Trainer(TrainConfig.from_tables({
            "method": {"name": method, **hp}, "model": {"name": "t5-tiny"},
            "schedule": {"steps": TRAINED + AFTER, "batch_size": 2},
            "data": {"max_examples": 300, "val_size": 16, "max_source_len": 32, "max_target_len": 8, "vocab_size": 512},
            "run": {"val_batches": 1, "progress": False, "out": f"{out}/{method}/{name}"},
        }))  # fmt: skip
        t.build()
        # What a fault-tolerant run's config gives these two (the job's fingerprint; no window quorum: NoLoCo's
        # window heal, which also skips to the window's end, is checked by its fault-tolerance job).
        # The session alone, without torchft: its state and load are what a heal runs.
        t.session = FaultTolerantSession(SimpleNamespace(fingerprint="heal-test", window_quorum=False, secret=None,
                                                         steps=TRAINED + AFTER))
        t.session.trainer = t
        return t

    results = {}
    for method, hp in METHODS.items():
        peer = trainer(method, hp, "peer")
        for step in range(TRAINED):
            peer.train_step(step)
        peer.session.next_step = TRAINED  # the step boundary the loop stands at when torchft asks for the state
        healer = trainer(method, hp, "healer")  # a restarted node: built afresh, never stepped
        wired = _wire(peer.session.state_now())
        # What a healer checks before it loads anything (issue 44 item 3) passes an honest peer's state
        own = healer.session.state_now()
        check_values(wired, own)
        healer.session.check_state(wired, own)
        went_on_from = healer.session.load(wired)
        peer.optimizer.reset_replica_state()
        diffs = {"heal": _differences(_local(peer.session.state_now()), _local(healer.session.state_now()))}
        for step in range(TRAINED, TRAINED + AFTER):
            losses = (peer.train_step(step), healer.train_step(step))
            diffs[f"step {step + 1}"] = _differences(_local(peer.session.state_now()), _local(healer.session.state_now()))
            diffs[f"step {step + 1} loss"] = [] if losses[0] == losses[1] else [f"{losses}"]
        n_state = sum(1 for k in _local(peer.session.state_now()) if k.startswith("state.optimizer"))
        results[method] = {"went_on_from": went_on_from, "diffs": diffs, "optimizer_entries": n_state,
                           "lr": (peer.scheduler.get_last_lr(), healer.scheduler.get_last_lr())}
    return results


@pytest.mark.timeout(600)
def test_a_healed_node_is_its_peers_replica_on_every_shard_for_every_method(tmp_path, tmp_path_factory):
    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    results = run_ranks(_heal_all, world_size=2, ranks_per_node=2, args=(str(tmp_path), cache), timeout_s=560)
    for rank, by_method in enumerate(results):
        assert set(by_method) == set(METHODS)
        for method, r in by_method.items():
            assert r["went_on_from"] == TRAINED, (method, rank, r["went_on_from"])
            assert r["optimizer_entries"] > 0, (method, rank)  # the peer had optimizer state to hand over
            assert r["lr"][0] == r["lr"][1], (method, rank, r["lr"])
            bad = {when: d for when, d in r["diffs"].items() if d}
            assert not bad, f"{method}, rank {rank}: the healed replica differs from its peer: {bad}"
