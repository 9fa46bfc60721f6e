"""FlexDeMo's overlap with overlap_apply="local": the own update at once, corrected to the mean one step later.

In one process: R = 1 (no link) and two replicas in two threads over a fake all-gather; and one
2 × 2 gloo run (multiprocess) that the replicas end bit-identical and resume exactly.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from lowband.distributed.topology import Topology
from lowband.optim import FlexDeMo, NonFiniteGradientError
from lowband.testing.ranks import run_ranks, tiny_loss, tiny_model


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _solo_run(steps: int, make, lrs=None, grads_nan_at: int | None = None, after=None) -> list[list[torch.Tensor]]:
    """Parameters after every step (R = 1) of tiny_model under ``make(model)``, then after flush.

    ``lrs``: the lr of each step; ``grads_nan_at``: a NaN in that step's gradient; ``after(step, model,
    opt)``: called after each step."""
    model = tiny_model()
    opt = make(model)
    out = []
    for step in range(steps):
        if lrs is not None:
            for g in opt.param_groups:
                g["lr"] = lrs[step]
        opt.zero_grad()
        tiny_loss(model, 0, step).backward()
        if step == grads_nan_at:
            next(iter(model.parameters())).grad.view(-1)[0] = float("nan")
        opt.step()
        out.append(_params(model))
        if after is not None:
            after(step, model, opt)
    opt.flush()
    out.append(_params(model))
    return out


@pytest.mark.parametrize("kw", [
    dict(topk=16, chunk=16, sign=False, values="fp32"),  # SGD at lr²
    dict(topk=2, chunk=16, decay=0.9, weight_decay=0.01),  # sign, bf16, decay
    dict(topk=3, tile=4, decay=0.9, values="sign"),  # tiles, 1-bit values
])
def test_one_replica_local_overlap_is_the_blocking_step_bit_for_bit(kw):
    # R = 1: the mean is the replica's own update, so the local step is the blocking one and the
    # correction (back to the agreed parameters, then the mean with the lr of its step) changes nothing.
    # The lr changes every step, so a correction taken with the next step's lr would show.
    lrs = [0.05 * (1 + 0.1 * s) for s in range(6)]
    blocking = _solo_run(6, lambda m: FlexDeMo(m.parameters(), lr=0.05, **kw), lrs)
    local = _solo_run(6, lambda m: FlexDeMo(m.parameters(), lr=0.05, overlap=True, **kw), lrs)
    stale = _solo_run(6, lambda m: FlexDeMo(m.parameters(), lr=0.05, overlap=True, overlap_apply="stale", **kw), lrs)
    for a, b in zip(blocking, local, strict=True):
        assert _same(a, b)
    assert not _same(blocking[3], stale[3])  # the stale variant lags one step


def test_one_replica_local_overlap_resumes_exactly():
    def make(m):
        return FlexDeMo(m.parameters(), lr=0.05, topk=3, chunk=32, decay=0.9, weight_decay=0.01, overlap=True)

    straight = _solo_run(6, make)[-1]
    saved: dict = {}

    def save(step, model, opt):
        if step == 2:
            saved["model"] = copy.deepcopy(model.state_dict())
            saved["opt"] = copy.deepcopy(opt.state_dict())  # waits for the step in flight, keeps its outcome

    went_on = _solo_run(6, make, after=save)[-1]
    assert saved["opt"]["state"][0]["pending_status"].item() == 0.0  # settled by state_dict()
    model = tiny_model(seed=123)
    model.load_state_dict(saved["model"])
    opt = make(model)
    opt.load_state_dict(saved["opt"])
    for step in range(3, 6):
        opt.zero_grad()
        tiny_loss(model, 0, step).backward()
        opt.step()
    opt.flush()
    assert _same(straight, went_on)
    assert _same(straight, _params(model))
    assert not _same(straight, _params(tiny_model()))


def test_one_replica_local_overlap_refuses_a_nonfinite_step_whole():
    # The NaN step sends zeros and the flag and steps nothing locally; when it is settled δ and the
    # parameters are as before it, as in the blocking variant.
    kw = dict(lr=0.05, topk=2, chunk=16, decay=0.9, nonfinite="skip")
    blocking = _solo_run(4, lambda m: FlexDeMo(m.parameters(), **kw), grads_nan_at=1)
    local = _solo_run(4, lambda m: FlexDeMo(m.parameters(), overlap=True, **kw), grads_nan_at=1)
    for a, b in zip(blocking, local, strict=True):
        assert _same(a, b)
    with pytest.raises(NonFiniteGradientError):
        _solo_run(3, lambda m: FlexDeMo(m.parameters(), lr=0.05, overlap=True), grads_nan_at=1)


# ----------------------------------------------------------------------------- two replicas in threads
class _Exchange:
    """An all-gather between replicas in threads of one process (topology None: no shards, plain state)."""

    def __init__(self, replicas: int) -> None:
        self.slots: list = [None] * replicas
        self.barrier = threading.Barrier(replicas)
        self.sent: list[list[torch.Tensor]] = [[] for _ in range(replicas)]

    def link(self, rank: int):
        exchange = self

        class _Handle:
            def __init__(self, message):
                self.message = message

            def wait(self):
                exchange.slots[rank] = self.message
                exchange.barrier.wait()
                out = torch.stack(exchange.slots)
                exchange.barrier.wait()
                return out

        class _Link:
            topology = None
            participating = True

            def commit(self):
                return True

            def all_gather(self, message, async_op=False):
                exchange.sent[rank].append(message.clone())
                handle = _Handle(message.clone())
                return handle if async_op else handle.wait()

        return _Link()


def _pair(make, steps: int, loss) -> tuple[list, list]:
    """Two replicas (threads) for ``steps`` steps: per replica its parameters after every step, then after
    flush; and the messages each sent."""
    exchange = _Exchange(2)
    out: list = [None, None]
    errors: list = []

    models = [tiny_model(), tiny_model()]  # here: tiny_model seeds the process-wide generator

    def replica(rank):
        try:
            model = models[rank]
            opt = make(model, exchange.link(rank))
            trace = []
            for step in range(steps):
                opt.zero_grad()
                loss(model, rank, step).backward()
                opt.step()
                trace.append(_params(model))
            opt.flush()
            trace.append(_params(model))
            out[rank] = trace
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out[0], out[1], exchange.sent


def _linear_loss(model, rank, step):
    # A gradient that does not depend on the parameters (rank- and step-dependent): the replicas'
    # momenta, messages and means are the blocking run's, whatever each replica's parameters are.
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return sum((p * torch.randn(p.shape, generator=gen)).sum() for p in model.parameters())


def test_two_replicas_local_overlap_equals_blocking_after_each_correction():
    kw = dict(lr=0.05, topk=2, chunk=16, decay=0.9, weight_decay=0.01)
    b0, b1, b_sent = _pair(lambda m, ln: FlexDeMo(m.parameters(), link=ln, **kw), 5, _linear_loss)
    l0, l1, l_sent = _pair(lambda m, ln: FlexDeMo(m.parameters(), link=ln, overlap=True, **kw), 5, _linear_loss)
    assert all(_same(b, m) for b, m in zip(b_sent, l_sent, strict=True))  # the same messages, step by step
    assert _same(b0[-1], b1[-1]) and _same(l0[-1], l1[-1])
    assert _same(l0[-1], b0[-1])  # after flush, the blocking parameters bit for bit
    assert not _same(l0[2], l1[2])  # in between, each replica holds its own newest step


# ----------------------------------------------------------------------------- 2 × 2 gloo
def _local_overlap_ranks(rank: int, ckpt_dir: str) -> dict:
    import torch.distributed as dist

    from lowband.checkpoint.dcp import load_checkpoint, save_checkpoint
    from lowband.comm.link import Link
    from lowband.testing.ranks import full_params, tiny_sharded, tiny_steps

    topo = Topology.from_env()
    out: dict = {}

    def make(m, ln, **kw):
        return FlexDeMo(m.parameters(), lr=0.05, topk=3, chunk=32, decay=0.9, weight_decay=0.01, link=ln,
                        overlap=True, **kw)

    def local_params(model):
        return [p.to_local().detach().clone() for p in model.parameters()]

    # Replicas: after flush the two model copies' shards are bit-identical; before, they differ.
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = make(model, link)
    traffic = tiny_steps(model, opt, link, rank, range(5))
    mid = local_params(model)
    opt.flush()
    end = local_params(model)
    gathered = [None] * topo.world_size
    dist.all_gather_object(gathered, (mid, end))
    peer = gathered[(rank + topo.ranks_per_node) % topo.world_size]
    out["end_same"] = _same(end, peer[1])
    out["mid_same"] = _same(mid, peer[0])
    out["bytes"] = [t.inter_node_bytes_sent for t in traffic]
    out["payload"] = opt.payload_bytes()
    straight = full_params(model)

    # Checkpoint after step 2: state_dict() settles the step in flight (the model is saved once, not per
    # replica, so its parameters must be the agreed ones); the resumed run ends as the saving run.
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = make(model, link)
    tiny_steps(model, opt, link, rank, range(3))
    save_checkpoint(f"{ckpt_dir}/local", model=model, optimizer=opt, extra={"step": 3})
    tiny_steps(model, opt, link, rank, range(3, 5))
    opt.flush()
    went_on = full_params(model)
    model2 = tiny_sharded(topo, seed=123)
    link2 = Link(topo)
    opt2 = make(model2, link2)
    load_checkpoint(f"{ckpt_dir}/local", model=model2, optimizer=opt2)
    tiny_steps(model2, opt2, link2, rank, range(3, 5))
    opt2.flush()
    out["went_on_same"] = _same(straight, went_on)
    out["resumed_same"] = _same(went_on, full_params(model2))

    # A NaN on one rank at step 1: every rank refuses it when it arrives, δ and the parameters return
    # to what they were before step 1 (the local step of the other copy included), the copies agree.
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = make(model, link, nonfinite="skip")
    tiny_steps(model, opt, link, rank, [0])
    opt.flush()
    x_before = local_params(model)
    delta_before = [opt.state[p]["delta"].to_local().clone() for p in model.parameters()]
    opt.zero_grad()
    tiny_loss(model, rank, 1).backward()
    if rank == 3:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
    opt.step()
    opt.flush()
    out["nan"] = {
        "skipped": opt.skipped_steps,
        "x_back": _same(x_before, local_params(model)),
        "delta_back": _same(delta_before, [opt.state[p]["delta"].to_local() for p in model.parameters()]),
    }
    dist.barrier()
    return out


@pytest.mark.multiprocess
def test_local_overlap_on_2x2_replicas_agree_after_flush_resume_exactly_and_refuse_together(tmp_path):
    results = run_ranks(_local_overlap_ranks, world_size=4, ranks_per_node=2, args=(str(tmp_path),), timeout_s=240)
    for r in results:
        assert r["end_same"] and not r["mid_same"]
        assert r["bytes"] == [r["payload"] + 1] * 5
        assert r["resumed_same"]
        assert not r["went_on_same"]  # saving settled step 2 early: step 3's gradient was taken at the mean
        assert r["nan"] == {"skipped": 1, "x_back": True, "delta_back": True}, r["nan"]
