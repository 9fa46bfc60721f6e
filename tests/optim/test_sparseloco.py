"""lowband/optim/outer/sparseloco.py: SparseLoCo's error feedback, the DiLoCo limit, byte counts, refusals
(no processes), and one 2 × 2 gloo run against a reference averaged by hand. Its codec: tests/compress/test_sparse.py."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from lowband.comm.link import Link
from lowband.compress.dct import num_chunks
from lowband.compress.sparse import SPARSE_VALUE_FORMATS
from lowband.distributed.topology import Topology
from lowband.optim import DiLoCo, NonFiniteGradientError, SparseLoCo
from lowband.optim._common import state_view
from lowband.optim.outer.sparseloco import sparseloco_message_nbytes
from lowband.testing.ranks import LoopbackLink, run_ranks, tiny_loss, tiny_model, tiny_sharded, tiny_steps

INNER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def _train(model, opt, steps, rank=0, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        tiny_loss(model, rank, step).backward()
        opt.step()


# ----------------------------------------------------------------------------- error feedback
@pytest.mark.parametrize("values", SPARSE_VALUE_FORMATS)
@pytest.mark.parametrize("transform", ["none", "dct"])
def test_error_feedback_keeps_exactly_what_was_not_sent(values, transform):
    # R = 2 replicas sending the same message (loopback): φ ← φ − α·q with q this replica's decoded
    # message, so q = (φ_old − φ_new)/α; then e_new + q must be β·e_old + (φ_old − θ), to rounding.
    model, link = tiny_model(), LoopbackLink()
    chunk, topk, beta, alpha = 16, 2, 0.9, 0.5
    opt = SparseLoCo(model.parameters(), INNER, link=link, sync_every=2, outer_lr=alpha, decay=beta, topk=topk,
                     chunk=chunk, values=values, transform=transform)
    params = list(model.parameters())
    snaps = []
    opt.inner_optimizer.register_step_post_hook(
        lambda *_: snaps.append([(p.detach().clone(), state_view(opt.state[p]["slow"]).clone(),
                                  state_view(opt.state[p]["error"]).clone()) for p in params])
        if (opt.inner_steps + 1) % 2 == 0 else None)
    worst = 0.0
    for outer in range(4):
        _train(model, opt, 2, start=2 * outer)
        for p, (theta, phi_old, e_old) in zip(params, snaps[-1], strict=True):
            st = opt.state[p]
            phi_new, e_new = state_view(st["slow"]), state_view(st["error"])
            q = (phi_old - phi_new) / alpha
            worst = max(worst, (e_new + q - (beta * e_old + phi_old - theta)).abs().max().item())
            assert torch.equal(p.detach(), phi_new)  # θ ← φ
            if transform == "none":  # at most k values per chunk were sent
                n = q.numel()
                padded = torch.nn.functional.pad(q.reshape(-1), (0, num_chunks(n, chunk) * chunk - n))
                assert ((padded.view(-1, chunk) != 0).sum(1) <= topk).all()
        assert any(state_view(opt.state[p]["error"]).abs().max() > 0 for p in params)
    assert worst < 1e-6, worst
    assert opt.outer_steps == 4 and len(link.messages) == 4


def test_all_coefficients_and_lossless_values_is_diloco_without_momentum():
    model, ref = tiny_model(), tiny_model()
    opt = SparseLoCo(model.parameters(), INNER, sync_every=3, outer_lr=0.7, decay=0.95, topk=8, chunk=8,
                     values="fp32", transform="none")
    dil = DiLoCo(ref.parameters(), INNER, sync_every=3, outer_lr=0.7, outer_momentum=0.0, nesterov=False)
    for step in range(9):
        for m, o in ((model, opt), (ref, dil)):
            o.zero_grad()
            tiny_loss(m, 0, step).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(state_view(opt.state[p]["error"]).abs().max() == 0 for p in model.parameters())


@pytest.mark.parametrize("values", SPARSE_VALUE_FORMATS)
@pytest.mark.parametrize("chunk, topk, block", [(128, 2, 256), (16, 3, 7), (300, 1, 64)])
def test_message_size_is_the_documented_formula(values, chunk, topk, block):
    model, link = tiny_model(), LoopbackLink()
    opt = SparseLoCo(model.parameters(), INNER, link=link, sync_every=1, topk=topk, chunk=chunk, values=values,
                     quant_block=block)
    _train(model, opt, 2)
    numels = [p.numel() for p in model.parameters()]
    n_chunks = sum(-(-n // chunk) for n in numels)
    count, ib = n_chunks * topk, (1 if chunk <= 256 else 2)
    values_bytes = {"2bit": -(-count // 4) + 4 * -(-count // block), "1bit": -(-count // 8) + 4 * -(-count // block),
                    "bf16": 2 * count, "fp32": 4 * count}[values]
    expected = count * ib + values_bytes + 1  # + the flag byte
    assert [m.numel() for m in link.messages] == [expected, expected]
    assert opt.message_nbytes() == expected == sparseloco_message_nbytes(numels, chunk=chunk, topk=topk,
                                                                         values=values, quant_block=block)


# ----------------------------------------------------------------------------- refusals, reset, checkpoint
def test_nonfinite_gradient_is_refused_before_anything_changes():
    model = tiny_model()
    opt = SparseLoCo(model.parameters(), INNER, sync_every=1)
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    tiny_loss(model, 0, 0).backward()
    next(iter(model.parameters())).grad.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.inner_steps == 0 and not opt.inner_optimizer.state


def test_nonfinite_pseudo_gradient_refuses_the_outer_step_and_sends_only_the_flag():
    model, link = tiny_model(), LoopbackLink()
    opt = SparseLoCo(model.parameters(), INNER, link=link, sync_every=2)
    _train(model, opt, 2)
    params = list(model.parameters())
    saved = [(state_view(opt.state[p]["slow"]).clone(), state_view(opt.state[p]["error"]).clone()) for p in params]
    opt.inner_optimizer.register_step_post_hook(lambda *_: params[0].data.view(-1).__setitem__(0, float("inf")))
    with pytest.raises(NonFiniteGradientError, match="outer step was refused"):
        _train(model, opt, 2, start=2)
    sent = link.messages[-1]
    assert sent[-1] == 1 and not sent[:-1].any()
    for p, (phi, e) in zip(params, saved, strict=True):
        assert torch.equal(state_view(opt.state[p]["slow"]), phi) and torch.equal(state_view(opt.state[p]["error"]), e)


def test_reset_replica_state_and_bad_arguments():
    model = tiny_model()
    opt = SparseLoCo(model.parameters(), INNER, sync_every=2, topk=1, chunk=8)
    _train(model, opt, 3)  # mid-phase: θ ≠ φ, e ≠ 0
    params = list(model.parameters())
    assert any(state_view(opt.state[p]["error"]).abs().max() > 0 for p in params)
    opt.reset_replica_state()
    for p in params:
        assert torch.equal(p.detach(), state_view(opt.state[p]["slow"]))
        assert not state_view(opt.state[p]["error"]).any()
    assert opt.communicates_next() is True  # step 4 is an outer step
    for kwargs, needle in [(dict(sync_every=30, delay=30), "delay"), (dict(topk=9, chunk=8), "topk"), (dict(decay=1.0), "decay"),
                           (dict(outer_lr=0.0), "outer_lr"), (dict(values="int8"), "values"),
                           (dict(transform="fft"), "transform"), (dict(quant_block=0), "quant_block")]:
        with pytest.raises(ValueError, match=needle):
            SparseLoCo(tiny_model().parameters(), INNER, **kwargs)


def test_checkpoint_mid_phase_resumes_exactly():
    model = tiny_model()
    opt = SparseLoCo(model.parameters(), INNER, sync_every=3, topk=2, chunk=8, values="2bit", transform="dct")
    _train(model, opt, 4)
    sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    _train(model, opt, 5, start=4)
    fresh_model = tiny_model(seed=5)
    fresh = SparseLoCo(fresh_model.parameters(), INNER, sync_every=3, topk=2, chunk=8, values="2bit",
                       transform="dct")
    fresh_model.load_state_dict(msd)
    fresh.load_state_dict(sd)
    _train(fresh_model, fresh, 5, start=4)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- 2 × 2 gloo
def _gather(t: torch.Tensor, topo: Topology) -> torch.Tensor:
    bufs = [torch.empty_like(t) for _ in range(topo.replicas)]
    dist.all_gather(bufs, t.detach().contiguous(), group=topo.replicate_group())
    return torch.stack(bufs)


def _sparseloco_2x2(rank: int) -> dict:
    topo = Topology.from_env()
    out: dict = {}
    H, alpha, beta, chunk, topk = 2, 0.8, 0.9, 16, 2
    for values, transform in (("fp32", "none"), ("2bit", "none"), ("1bit", "dct")):
        model = tiny_sharded(topo)
        link = Link(topo)
        opt = SparseLoCo(model.parameters(), INNER, link=link, sync_every=H, outer_lr=alpha, decay=beta, topk=topk,
                         chunk=chunk, values=values, transform=transform)
        params = list(model.parameters())
        snaps = []
        opt.inner_optimizer.register_step_post_hook(
            lambda *_, opt=opt, params=params, snaps=snaps: snaps.append(
                [(p.to_local().clone(), state_view(opt.state[p]["slow"]).clone(),
                  state_view(opt.state[p]["error"]).clone()) for p in params])
            if (opt.inner_steps + 1) % H == 0 else None)
        errs, picks, equal, traffic = [], [], [], []
        for outer in range(3):
            traffic += tiny_steps(model, opt, link, rank, range(H * outer, H * (outer + 1)))
            for p, (theta, phi_old, e_old) in zip(params, snaps[-1], strict=True):
                st = opt.state[p]
                v = beta * e_old + (phi_old - theta)
                q = v - state_view(st["error"])  # this replica's decoded message (e ← v − q)
                if values == "fp32" and transform == "none":  # the picks, independently: top-k of |v|
                    n = v.numel()
                    vp = torch.nn.functional.pad(v.reshape(-1), (0, num_chunks(n, chunk) * chunk - n)).view(-1, chunk)
                    ref = torch.zeros_like(vp)
                    i = vp.abs().topk(topk, dim=1).indices
                    ref.scatter_(1, i, vp.gather(1, i))
                    picks.append((ref.reshape(-1)[:n].view_as(q) - q).abs().max().item())
                qs = _gather(q, topo)  # every replica's decoded message, averaged by hand
                phi_ref = phi_old - alpha * qs.mean(0)
                errs.append((state_view(st["slow"]) - phi_ref).abs().max().item())
                equal.append(torch.equal(p.to_local(), state_view(st["slow"])))
                g = _gather(p.to_local(), topo)
                equal.append(all(torch.equal(g[0], x) for x in g[1:]))
        msg = opt.message_nbytes()
        kinds = [{k: (d.count, d.largest_group) for k, d in t.by_kind().items()} for t in traffic]
        out[f"{values}-{transform}"] = dict(
            err=max(errs), picks=max(picks) if picks else 0.0, equal=all(equal), kinds=kinds,
            bytes=[t.bytes_sent for t in traffic], msg=msg,
            formula=sparseloco_message_nbytes([p.to_local().numel() for p in params], chunk=chunk, topk=topk,
                                              values=values))
    return out


@pytest.mark.multiprocess
def test_sparseloco_2x2_equals_the_mean_of_the_decoded_messages():
    results = run_ranks(_sparseloco_2x2, world_size=4, ranks_per_node=2, timeout_s=240)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["err"] < 1e-6, (rank, name, r["err"])
            assert r["picks"] < 1e-7, (rank, name, r["picks"])
            assert r["equal"], (rank, name)
            # one all-gather per outer step (every H-th step), nothing in between
            assert [k for k in r["kinds"] if k] == [{"all_gather": (1, 2)}] * 3, (rank, name, r["kinds"])
            assert r["msg"] == r["formula"]
            # R = 2: the ring all-gather sends (R − 1)·M per rank, M the message with its flag byte
            assert [b for b in r["bytes"] if b] == [r["msg"]] * 3, (rank, name, r["bytes"], r["msg"])


def test_bench_spec_label_and_train_flags():
    from lowband.bench.methods import method_label, parse_method_spec, shown_params
    from lowband.train.args import add_arguments, config_from_args
    from lowband.train.methods import build_optimizer

    spec = parse_method_spec("sparseloco:H=30,topk=2,values=2bit")
    assert spec.given_values() == {"sync_every": 30, "topk": 2, "values": "2bit"}
    assert method_label(spec.name, shown_params(spec.hp, spec.given)) == "SparseLoCo Top2 H=30 values=2bit"
    with pytest.raises(ValueError, match="topk"):
        parse_method_spec("sparseloco:topk=9,chunk=8")
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--method", "sparseloco", "--sync-every", "30", "--topk", "2",
                                         "--transform", "dct"]))
    model = tiny_model()
    opt = build_optimizer("sparseloco", model.named_parameters(), link=None, hp=cfg.method.hp)
    assert isinstance(opt, SparseLoCo) and opt.sync_every == 30 and opt.wire.topk == 2 and opt.transform == "dct"
    assert opt.max_grad_norm == 1.0 and opt.param_groups[0]["decay"] == 0.95


@pytest.mark.parametrize("transform", ["none", "dct"])
def test_outer_step_launches_the_same_few_kernels_whatever_the_number_of_parameters(transform):
    # The outer step's compression, checks and update run as a few multi-tensor and whole-message ops
    # (as benchmarks/step_cost.py counts them): what it launches beyond an inner step does not grow with
    # the parameters, and it reads the device once.
    from lowband.testing.launches import count_launches

    class OwnRowLink(LoopbackLink):
        group_rank = 0  # its row of the gather is its message: its own update is not decoded twice

    def outer_beyond_inner(n):
        gen = torch.Generator().manual_seed(n)
        params = [torch.nn.Parameter(torch.randn(3 + 37 * i, generator=gen)) for i in range(n)]
        opt = SparseLoCo(params, lambda groups: torch.optim.SGD(groups, lr=0.01), link=OwnRowLink(), sync_every=2,
                         topk=2, chunk=16, transform=transform)
        counts = []
        for step in range(5):  # steps 2 and 4 are outer steps; 4 and 5 are counted
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            counts.append(count_launches(opt.step) if step >= 3 else opt.step())
        outer, inner = counts[3], counts[4]
        return outer.kernels - inner.kernels, outer.syncs - inner.syncs

    few, many = outer_beyond_inner(4), outer_beyond_inner(64)
    assert few == many, (few, many)
    assert many[0] <= 100 and many[1] == 1, many
