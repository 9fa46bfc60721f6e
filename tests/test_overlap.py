"""The asynchronous link (handles, the shaped link's clock, exposed time) and overlapped optimizers, on 2 × 2."""

from __future__ import annotations

import time

import pytest
import torch

from lowband.link import Link, LinkHandle
from lowband.testing import run_ranks
from lowband.topology import Topology


def _async_link(rank: int) -> dict:
    topo = Topology.from_env()
    out: dict = {}
    peer = [p for p in topo.replicate_group_ranks(rank) if p != rank]
    # Same results and the same byte records, blocking or not.
    recs = {}
    for mode in (False, True):
        link = Link(topo)
        x = torch.full((1000,), float(rank))
        ar = link.all_reduce(x, op="avg", async_op=mode)
        ag = link.all_gather(torch.full((7,), float(rank)), async_op=mode)
        ex = link.exchange(torch.full((5,), float(rank)), peer, async_op=mode)
        if mode:
            out["handles"] = all(isinstance(h, LinkHandle) for h in (ar, ag, ex)) and link.in_flight == 3
            ar, ag, ex = ar.wait(), ag.wait(), ex.wait()
            out["in_flight_after"] = link.in_flight
        out[f"values_{mode}"] = (ar[0].item(), ag[:, 0].tolist(), ex[0][0].item())
        traffic = link.end_step()
        recs[mode] = [(o.kind, o.payload_bytes, o.bytes_sent, o.inter_node_bytes_sent, o.node_inter_node_bytes_sent,
                       o.messages) for o in traffic.ops]
        out[f"exposed_{mode}"] = (traffic.exposed_comm_time_s, sum(o.exposed_s for o in traffic.ops),
                                  all(o.time_s > 0 for o in traffic.ops))
    out["records_equal"] = recs[False] == recs[True]

    # Shaped: 1 MB/s per node uplink, 20 ms per message. Two all-gathers of 40 kB per rank in
    # flight together: the node sends 80 kB each, 0.08 s apiece; they queue on the uplink.
    link = Link(topo, bandwidth_bps=8e6, latency_s=0.02)
    t0 = time.perf_counter()
    h1 = link.all_gather(torch.zeros(10_000), async_op=True)
    h2 = link.all_gather(torch.zeros(10_000), async_op=True)
    h2.wait()
    both = time.perf_counter() - t0
    h1.wait()
    out["queued"] = (both, h1.record.modelled_link_time_s, h2.record.modelled_link_time_s)
    link.end_step()
    # Overlap with "compute": start, compute 0.2 s, wait. The wait is what is exposed.
    h = link.all_gather(torch.zeros(10_000), async_op=True)
    time.sleep(0.2)
    h.wait()
    step = link.end_step()
    out["overlap"] = (h.record.time_s, h.record.exposed_s, step.exposed_comm_time_s, h.record.modelled_link_time_s)
    # An operation waited on in a later step: its bytes count in the step that started it, its wait
    # in the step that waited.
    h = link.all_gather(torch.zeros(10), async_op=True)
    first = link.end_step()
    h.wait()
    second = link.end_step()
    out["split"] = (len(first.ops), len(second.ops), second.exposed_comm_time_s > 0, h.wait() is h.wait())
    link.drain()
    # A real link (unshaped) with 0.2 s of latency: the latency runs from when the data arrived, so
    # an all-gather left in flight through 0.3 s of compute is not delayed again at its wait; a
    # blocking one waits the whole latency.
    delayed = Link(topo, latency_s=0.2)
    h = delayed.all_gather(torch.zeros(10), async_op=True)
    time.sleep(0.3)
    h.wait()
    hidden = delayed.end_step().exposed_comm_time_s
    delayed.all_gather(torch.zeros(10))
    out["latency"] = (hidden, delayed.end_step().exposed_comm_time_s)
    return out


@pytest.mark.multiprocess
def test_async_link_same_bytes_own_clock_and_exposed_time():
    results = run_ranks(_async_link, world_size=4, ranks_per_node=2, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["handles"] and r["in_flight_after"] == 0
        assert r["values_False"] == r["values_True"]
        assert r["values_True"][1] == [float(rank % 2), float(rank % 2 + 2)]
        assert r["records_equal"]
        for mode in (False, True):
            step_exposed, ops_exposed, timed = r[f"exposed_{mode}"]
            assert step_exposed == pytest.approx(ops_exposed) and step_exposed > 0 and timed
        both, m1, m2 = r["queued"]
        assert m1 == pytest.approx(0.08 + 0.02, rel=0.05)
        # The second queues behind the first's bytes: its result comes 2 transfers + a latency after
        # the first started, at the earliest (on the clock: independent of how fast the ranks run).
        assert both >= 2 * 0.08 + 0.02 and m2 >= 0.08 + 0.02 - 1e-6
        took, exposed, step_exposed, modelled = r["overlap"]
        assert took >= modelled and took >= 0.2
        assert exposed == pytest.approx(step_exposed) and exposed < took - 0.19  # the compute was not exposed
        assert r["split"] == (1, 0, True, True)
        hidden, blocking = r["latency"]
        assert blocking >= 0.2 and hidden < 0.1, r["latency"]


# ----------------------------------------------------------------------------- FlexDeMo with overlap
def _flex_overlap(rank: int, ckpt_dir: str) -> dict:
    import torch.distributed as dist

    from lowband.checkpoint import load_checkpoint, save_checkpoint
    from lowband.optim import FlexDeMo, NonFiniteGradientError
    from lowband.testing import full_params, tiny_loss, tiny_model, tiny_sharded, tiny_steps

    topo = Topology.from_env()
    out: dict = {}
    lr = 0.05

    def run(model, opt, link, steps):
        return tiny_steps(model, opt, link, rank, steps)

    # (a) topk = chunk, fp32, sign off: the momentum empties every step, so this is SGD at lr² on
    # the mean gradient, applied one step late: x_{t+1} = x_t − lr²·ḡ_{t−1}.
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = FlexDeMo(model.parameters(), lr=lr, topk=16, chunk=16, sign=False, values="fp32", link=link, overlap=True,
                   overlap_apply="stale")
    traffic = run(model, opt, link, range(4))
    opt.flush()
    ref = tiny_model()
    prev = None
    for step in range(5):
        grads = None
        if step < 4:
            ref.zero_grad()
            torch.stack([tiny_loss(ref, r, step) for r in range(topo.world_size)]).mean().backward()
            grads = [p.grad.clone() for p in ref.parameters()]
        if prev is not None:
            with torch.no_grad():
                for p, g in zip(ref.parameters(), prev, strict=True):
                    p.sub_(lr * lr * g)
        prev = grads
    out["delayed_sgd_maxdiff"] = max((a - b).abs().max().item()
                                     for a, b in zip(full_params(model), full_params(ref), strict=True))
    out["ops_per_step"] = [[o.kind for o in t.ops] for t in traffic]
    out["payload"] = opt.payload_bytes()
    out["bytes"] = [t.inter_node_bytes_sent for t in traffic]

    # (b) Checkpoint in the middle: resumed == uninterrupted, bit for bit.
    def make(m, ln):
        return FlexDeMo(m.parameters(), lr=lr, topk=3, chunk=32, decay=0.9, weight_decay=0.01, link=ln, overlap=True,
                        overlap_apply="stale")

    model = tiny_sharded(topo)
    link = Link(topo)
    opt = make(model, link)
    run(model, opt, link, range(6))
    opt.flush()
    straight = full_params(model)
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = make(model, link)
    run(model, opt, link, range(3))
    save_checkpoint(f"{ckpt_dir}/flex", model=model, optimizer=opt, extra={"step": 3})
    run(model, opt, link, range(3, 6))  # the saving run goes on too
    opt.flush()
    went_on = full_params(model)
    model2 = tiny_sharded(topo, seed=123)
    link2 = Link(topo)
    opt2 = make(model2, link2)
    load_checkpoint(f"{ckpt_dir}/flex", model=model2, optimizer=opt2)
    run(model2, opt2, link2, range(3, 6))
    opt2.flush()
    resumed = full_params(model2)
    out["resume_maxdiff"] = max((a - b).abs().max().item() for a, b in zip(straight, resumed, strict=True))
    out["went_on_maxdiff"] = max((a - b).abs().max().item() for a, b in zip(straight, went_on, strict=True))
    out["moved"] = max((a - b).abs().max().item() for a, b in zip(straight, full_params(tiny_model()), strict=True))

    # (c) A NaN on one rank at step 1: zeros + flag are sent, every rank refuses step 1 when it
    # arrives, δ returns to its value before step 1 and the parameters keep what step 1 left.
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = FlexDeMo(model.parameters(), lr=lr, topk=2, chunk=16, link=link, nonfinite="skip", overlap=True,
                   overlap_apply="stale")
    run(model, opt, link, [0])
    delta_before = [opt.state[p]["delta"].to_local().clone() for p in model.parameters()]
    opt.zero_grad()
    tiny_loss(model, rank, 1).backward()
    if rank == 3:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
    sent: list = []
    original = link.all_gather

    def watch(tensor, **kw):
        sent.append(bool(tensor[-1] == 0 or not tensor[:-1].any()))
        return original(tensor, **kw)

    link.all_gather = watch
    opt.step()
    x_after = [p.to_local().clone() for p in model.parameters()]
    opt.flush()
    out["nan"] = {
        "skipped": opt.skipped_steps, "sent_clean": list(sent),
        "delta_back": all(torch.equal(a, opt.state[p]["delta"].to_local())
                          for a, p in zip(delta_before, model.parameters(), strict=True)),
        "x_kept": all(torch.equal(a, p.to_local()) for a, p in zip(x_after, model.parameters(), strict=True)),
    }
    # raise: the step after the bad one raises on every rank.
    opt.nonfinite = "raise"
    opt.zero_grad()
    tiny_loss(model, rank, 2).backward()
    if rank == 0:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    opt.step()
    try:
        run(model, opt, link, [3])
        out["raised"] = None
    except NonFiniteGradientError as e:
        out["raised"] = str(e)
    dist.barrier()
    return out


@pytest.mark.multiprocess
def test_flexdemo_overlap_delays_by_one_step_resumes_exactly_and_refuses_together(tmp_path):
    results = run_ranks(_flex_overlap, world_size=4, ranks_per_node=2, args=(str(tmp_path),), timeout_s=240)
    for r in results:
        assert r["delayed_sgd_maxdiff"] < 1e-6, r["delayed_sgd_maxdiff"]
        # One inter-node operation per step, payload + flag byte (R = 2: (R−1)·(payload + 1)).
        assert r["ops_per_step"] == [["all_gather"]] * 4
        assert r["bytes"] == [r["payload"] + 1] * 4
        assert r["resume_maxdiff"] == 0.0 and r["went_on_maxdiff"] == 0.0 and r["moved"] > 1e-3
        assert r["nan"] == {"skipped": 1, "sent_clean": [True], "delta_back": True, "x_kept": True}, r["nan"]
        assert r["raised"] and "NaN or Inf" in r["raised"]
