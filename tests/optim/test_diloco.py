"""lowband/optim/outer/diloco.py: DiLoCo on real gloo processes and in one process, and the refusals and
state handling DiLoCo and NoLoCo share (tests parametrised over both).

Each distributed test is one launch of forked ranks (OMP_NUM_THREADS=1) that checks many things;
results come back to the parent, which asserts. The test-side helpers of the launches are in
tests/optim/replicas.py.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch

from lowband.comm.link import Link, PeerTimeoutError
from lowband.distributed.topology import Topology
from lowband.optim import DiLoCo, NoLoCo, NonFiniteGradientError
from lowband.optim._common import state_view
from lowband.testing.ranks import (
    full_params,
    run_ranks,
)
from lowband.train.schedule import warmup_cosine
from tests.optim.replicas import (
    gather_replicas,
    kinds,
    loss_of,
    make_model,
    maxdiff,
    replicas_equal,
    run,
    sharded,
    watch_sends,
)

INNER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


# ----------------------------------------------------------------------------- launch 1: DiLoCo, 2 × 2
def _diloco_2x2(rank: int) -> dict:
    topo = Topology.from_env()
    out: dict = {}
    H, eta, mu = 2, 0.7, 0.9

    # (a) Numerics of the outer step against the rule computed here on the gathered values.
    model = sharded(topo)
    link = Link(topo)
    opt = DiLoCo(model.named_parameters(), INNER, link=link, sync_every=H, outer_lr=eta, outer_momentum=mu)
    params = list(model.parameters())
    snaps: list[dict] = []

    def before_outer(_opt, _args, _kwargs):
        if (opt.inner_steps + 1) % H == 0:  # the outer step follows this inner step
            snaps.append({
                "theta": [gather_replicas(p.to_local(), topo) for p in params],
                "phi": [state_view(opt.state[p]["slow"]).clone() for p in params],
                "b": [state_view(opt.state[p]["momentum"]).clone() for p in params],
            })

    opt.inner_optimizer.register_step_post_hook(before_outer)
    equal_after, errs, traffic = [], [], []
    for step in range(2 * H):
        traffic += run(model, opt, link, rank, [step])
        equal_after.append(replicas_equal(model, topo))
        if (step + 1) % H == 0:
            s = snaps[-1]
            for i, p in enumerate(params):
                delta = (s["phi"][i] - s["theta"][i]).mean(0)
                b = mu * s["b"][i] + delta
                phi = s["phi"][i] - eta * (delta + mu * b)
                st = opt.state[p]
                errs.append(max((state_view(st["slow"]) - phi).abs().max().item(),
                                (state_view(st["momentum"]) - b).abs().max().item()))
                errs.append(0.0 if torch.equal(p.to_local(), state_view(st["slow"])) else float("inf"))
    out["ref_maxdiff"] = max(errs)
    out["equal_after"] = equal_after
    out["kinds"] = kinds(traffic)
    out["outer_bytes"] = [t.bytes_sent for t in traffic]
    out["local_numel"] = sum(p.to_local().numel() for p in params)
    out["counters"] = (opt.inner_steps, opt.outer_steps, opt.last_sync_time_s > 0)
    # Per-replica state: DTensors over the 2-D mesh with a leading replica dimension of size R.
    out["state_types"] = sorted((k, type(v).__name__, v.device_mesh.ndim if hasattr(v, "device_mesh") else 0,
                                 tuple(v.shape[:1])) for k, v in opt.state[params[0]].items())
    out["moved"] = maxdiff(full_params(model), full_params(make_model()))

    # (b) NoLoCo with n = R = 2 == DiLoCo with heavy-ball momentum (η = β, μ = α); the γ term vanishes.
    res = {}
    for name, make in (
        ("diloco_hb", lambda ps, ln: DiLoCo(ps, INNER, link=ln, sync_every=H, outer_lr=0.7, outer_momentum=0.5,
                                            nesterov=False)),
        ("noloco", lambda ps, ln: NoLoCo(ps, INNER, link=ln, sync_every=H, alpha=0.5, beta=0.7,
                                         max_grad_norm=None)),
        ("noloco_gamma0", lambda ps, ln: NoLoCo(ps, INNER, link=ln, sync_every=H, alpha=0.5, beta=0.7, gamma=0.0,
                                                max_grad_norm=None)),
    ):
        model = sharded(topo)
        link = Link(topo)
        opt = make(model.parameters(), link)
        run(model, opt, link, rank, range(3 * H))
        phis = [gather_replicas(state_view(opt.state[p]["slow"]), topo) for p in model.parameters()]
        res[name] = (full_params(model), max((g - g.mean(0)).abs().max().item() for g in phis))
    out["hb_vs_noloco"] = maxdiff(res["diloco_hb"][0], res["noloco"][0])
    out["noloco_gamma_vs_gamma0"] = maxdiff(res["noloco"][0], res["noloco_gamma0"][0])
    out["noloco_phi_minus_mean"] = res["noloco"][1]

    # (c) Inner steps with clipping on FSDP2 shards == AdamW on the full model with the node's mean
    # gradient clipped to the same norm (the norm is taken over the whole model copy).
    model = sharded(topo)
    link = Link(topo)
    opt = DiLoCo(model.parameters(), INNER, link=link, sync_every=100, max_grad_norm=0.05)
    ref = make_model()
    ref_opt = INNER(ref.parameters())
    norms = []
    for step in range(2):
        run(model, opt, link, rank, [step])
        ref_opt.zero_grad()
        torch.stack([loss_of(ref, r, step) for r in topo.shard_group_ranks(rank)]).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
        ref_opt.step()
    out["clip_maxdiff"] = maxdiff(full_params(model), full_params(ref))
    out["clip_norms"] = norms

    # (d) A non-finite pseudo-gradient on one rank: every rank refuses, nothing non-finite is sent.
    model = sharded(topo)
    link = Link(topo)
    opt = DiLoCo(model.parameters(), INNER, link=link, sync_every=H)
    sent_finite = watch_sends(link, "all_reduce")
    if rank == 3:
        opt.inner_optimizer.register_step_post_hook(
            lambda *_: next(iter(model.parameters())).to_local().view(-1).__setitem__(0, float("nan"))
            if opt.inner_steps + 1 == H else None)
    try:
        run(model, opt, link, rank, range(H))
        out["nan_raised"] = None
    except NonFiniteGradientError as e:
        out["nan_raised"] = str(e)
    out["nan_phi_finite"] = all(torch.isfinite(state_view(opt.state[p]["slow"])).all().item()
                                for p in model.parameters())
    out["nan_sent_finite"] = sent_finite
    return out


def _diloco_demo_like(rank: int) -> dict:
    # S = 1 on 2 nodes × 2 ranks: every rank is a replica (R = 4), no sharding.
    topo = Topology.from_env(shards=1)
    model = make_model()
    link = Link(topo)
    opt = DiLoCo(model.parameters(), INNER, link=link, sync_every=2)
    equal = []
    traffic = []
    for step in range(4):
        traffic += run(model, opt, link, rank, [step])
        equal.append(replicas_equal(model, topo))
    return {"equal": equal, "kinds": kinds(traffic), "replicas": topo.replicas}


@pytest.mark.multiprocess
def test_diloco_outer_step_numerics_fsdp2_and_heavy_ball_equivalence():
    results = run_ranks(_diloco_2x2, world_size=4, ranks_per_node=2, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["ref_maxdiff"] < 1e-6, (rank, r["ref_maxdiff"])
        # Replicas differ inside an inner phase and are identical right after each outer step.
        assert r["equal_after"] == [False, True, False, True], r["equal_after"]
        # Inner steps send nothing; an outer step is one all-reduce over R = 2, fp32 + flag element.
        assert r["kinds"] == [{}, {"all_reduce": (1, 2)}, {}, {"all_reduce": (1, 2)}], r["kinds"]
        assert r["outer_bytes"][1] == (r["local_numel"] + 1) * 4  # ring, R = 2: 2·(R−1)/R·payload
        assert r["counters"] == (4, 2, True)
        assert r["state_types"] == [("momentum", "DTensor", 2, (2,)), ("slow", "DTensor", 2, (2,)),
                                    ("step", "Tensor", 0, ())], r["state_types"]
        assert r["moved"] > 1e-3
        assert r["hb_vs_noloco"] < 1e-6, r["hb_vs_noloco"]
        assert r["noloco_gamma_vs_gamma0"] == 0.0
        assert r["noloco_phi_minus_mean"] == 0.0
        assert r["clip_maxdiff"] < 1e-6 and min(r["clip_norms"]) > 0.05, (r["clip_maxdiff"], r["clip_norms"])
        assert r["nan_raised"] and "NaN or Inf" in r["nan_raised"], r["nan_raised"]
        assert r["nan_phi_finite"]
        assert r["nan_sent_finite"] == [True], r["nan_sent_finite"]  # zeros and the flag, never NaN


@pytest.mark.multiprocess
def test_diloco_demo_like_every_rank_a_replica():
    results = run_ranks(_diloco_demo_like, world_size=4, ranks_per_node=2, timeout_s=120)
    for r in results:
        assert r["replicas"] == 4
        assert r["equal"] == [False, True, False, True]
        assert r["kinds"] == [{}, {"all_reduce": (1, 4)}, {}, {"all_reduce": (1, 4)}]


# ----------------------------------------------------------------------------- launch 3: checkpoints, 2 × 2
def _checkpoint_2x2(rank: int, ckpt_dir: str) -> dict:
    from lowband.checkpoint.dcp import load_checkpoint, save_checkpoint

    topo = Topology.from_env()
    out = {}
    for name, cls, kw in (("diloco", DiLoCo, {}), ("noloco", NoLoCo, dict(seed=5))):
        def fresh(seed: int, cls=cls, kw=kw):
            model = sharded(topo, seed)
            link = Link(topo)
            opt = cls(model.parameters(), INNER, link=link, sync_every=3, **kw)
            return model, opt, link, warmup_cosine(opt, warmup_steps=2, total_steps=8)

        def go(model, opt, link, sched, steps):
            for step in steps:
                run(model, opt, link, rank, [step])
                sched.step()

        model, opt, link, sched = fresh(0)
        go(model, opt, link, sched, range(8))
        straight = full_params(model)
        model, opt, link, sched = fresh(0)
        go(model, opt, link, sched, range(4))  # one outer step (after step 3), then one inner step
        mid_phase_differ = not replicas_equal(model, topo)
        path = f"{ckpt_dir}/{name}"
        save_checkpoint(path, model=model, optimizer=opt, extra={"sched": sched.state_dict()})
        model2, opt2, link2, sched2 = fresh(123)  # different init: everything must come from the checkpoint
        extra = load_checkpoint(path, model=model2, optimizer=opt2)
        sched2.load_state_dict(extra["sched"])
        counters = (opt2.inner_steps, opt2.outer_steps, opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"])
        go(model2, opt2, link2, sched2, range(4, 8))
        out[name] = {"maxdiff": maxdiff(straight, full_params(model2)), "mid_phase_differ": mid_phase_differ,
                     "counters": counters, "moved": maxdiff(straight, full_params(make_model()))}
    return out


@pytest.mark.multiprocess
def test_checkpoint_mid_phase_resumes_exactly_with_fsdp2(tmp_path):
    results = run_ranks(_checkpoint_2x2, world_size=4, ranks_per_node=2, args=(str(tmp_path),), timeout_s=150)
    for rank, r in enumerate(results):
        for name in ("diloco", "noloco"):
            assert r[name]["mid_phase_differ"], name  # the save really holds distinct replicas
            assert r[name]["counters"] == (4, 1, True), (name, r[name]["counters"])
            assert r[name]["moved"] > 1e-3
            assert r[name]["maxdiff"] == 0.0, (rank, name, r[name]["maxdiff"])


# ----------------------------------------------------------------------------- launch 5: peer timeout
def _silent_peer(rank: int) -> dict:
    topo = Topology.from_env()  # 2 nodes × 1 rank
    model = make_model()
    opt = NoLoCo(model.parameters(), INNER, link=Link(topo), sync_every=1, timeout_s=0.5)
    if rank == 1:  # never takes part in the exchange
        time.sleep(2.0)
        return {"error": None}
    start = time.monotonic()
    try:
        run(model, opt, opt.link, rank, [0])
        err = None
    except PeerTimeoutError as e:
        err = str(e)
    return {"error": err, "elapsed_s": time.monotonic() - start, "link_timeout": opt.link.timeout_s}


@pytest.mark.multiprocess
def test_silent_peer_raises_peer_timeout_naming_it():
    start = time.monotonic()
    results = run_ranks(_silent_peer, world_size=2, ranks_per_node=1, timeout_s=60)
    r = results[0]
    assert r["error"] is not None and "peer rank(s) [1]" in r["error"], r["error"]
    assert r["elapsed_s"] < 10
    assert r["link_timeout"] == 300.0  # the per-optimizer timeout does not stick to the link
    assert time.monotonic() - start < 30


# ----------------------------------------------------------------------------- single process
def test_single_process_outer_step_is_torch_sgd_on_the_pseudo_gradient():
    for nesterov in (True, False):
        model, ref = make_model(), make_model()
        opt = DiLoCo(model.parameters(), INNER, sync_every=3, outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
        inner = INNER(ref.parameters())
        slow = [p.detach().clone().requires_grad_() for p in ref.parameters()]
        outer = torch.optim.SGD(slow, lr=0.7, momentum=0.9, nesterov=nesterov)
        for step in range(9):
            for m, o in ((model, opt), (ref, inner)):
                o.zero_grad()
                loss_of(m, 0, step).backward()
                o.step()
            if (step + 1) % 3 == 0:
                with torch.no_grad():
                    for s, p in zip(slow, ref.parameters(), strict=True):
                        s.grad = s - p
                    outer.step()
                    for s, p in zip(slow, ref.parameters(), strict=True):
                        p.copy_(s)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert opt.outer_steps == 3 and opt.inner_steps == 9


def test_nonfinite_gradient_is_refused_before_anything_changes():
    for cls in (DiLoCo, NoLoCo):
        model = make_model()
        opt = cls(model.parameters(), INNER, sync_every=1)
        before = copy.deepcopy(model.state_dict())
        opt.zero_grad()
        loss_of(model, 0, 0).backward()
        next(iter(model.parameters())).grad.view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
            opt.step()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert opt.inner_steps == 0 and not opt.inner_optimizer.state


def test_state_dict_before_the_first_step_changes_nothing():
    for cls in (DiLoCo, NoLoCo):
        model, fresh_model = make_model(), make_model(seed=9)
        opt = cls(model.parameters(), INNER, sync_every=2)
        before = copy.deepcopy(model.state_dict())
        sd = copy.deepcopy(opt.state_dict())  # the inner optimizer has no state yet: a template is saved
        assert not opt.inner_optimizer.state and all(p.grad is None for p in model.parameters())
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert opt.param_groups[0]["lr"] == 1e-2
        fresh = cls(fresh_model.parameters(), INNER, sync_every=2)
        fresh.load_state_dict(sd)
        assert not fresh.inner_optimizer.state  # the template is not restored
        for step in range(5):
            for m, o in ((model, opt), (fresh_model, fresh)):
                o.zero_grad()
                loss_of(m, 0, step).backward()
                o.step()
        for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_inner_optimizer_instance_and_old_state_dicts():
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = DiLoCo(model.parameters(), inner, sync_every=2)
    assert opt.inner_optimizer is inner and inner.param_groups is opt.param_groups
    with pytest.raises(ValueError, match="inner_optimizer"):
        DiLoCo(list(model.parameters())[:2], torch.optim.AdamW(model.parameters()))
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["nesterov"]  # a checkpoint from before the option existed
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["nesterov"] is True and inner.param_groups is opt.param_groups


def test_add_param_group_reaches_the_inner_optimizer():
    model = make_model()
    params = list(model.parameters())
    opt = DiLoCo(params[:2], INNER, sync_every=2)
    opt.add_param_group({"params": params[2:], "lr": 0.5, "outer_lr": 0.3})
    assert len(opt.param_groups) == 2 and opt.inner_optimizer.param_groups is opt.param_groups
    assert opt.param_groups[1]["outer_momentum"] == 0.9 and opt.param_groups[1]["betas"] == (0.9, 0.999)
    for step in range(2):
        opt.zero_grad()
        loss_of(model, 0, step).backward()
        opt.step()
    assert all(p in opt.inner_optimizer.state and opt.state[p]["step"].item() == 2 for p in params)


class _StubLink:
    """Enough of a link to validate hyper-parameters against R = 4 replicas."""

    group_size = max_group_size = 4
    topology = ft = None


@pytest.mark.parametrize(
    "cls, kwargs, needle",
    [
        (DiLoCo, dict(sync_every=0), "sync_every"),
        (DiLoCo, dict(sync_every=1.5), "sync_every"),
        (DiLoCo, dict(outer_lr=0.0), "outer_lr"),
        (DiLoCo, dict(outer_lr=-1.0), "outer_lr"),
        (DiLoCo, dict(outer_momentum=1.0), r"outer_momentum must be in \[0, 1\)"),
        (DiLoCo, dict(outer_momentum=-0.1), "outer_momentum"),
        (DiLoCo, dict(max_grad_norm=0.0), "max_grad_norm"),
        (DiLoCo, dict(inner_optimizer="adam"), "inner_optimizer"),
        (NoLoCo, dict(sync_every=0), "sync_every"),
        (NoLoCo, dict(alpha=1.0), r"alpha must be in \[0, 1\)"),
        (NoLoCo, dict(alpha=-0.5), "alpha"),
        (NoLoCo, dict(beta=1.0), r"beta must be in \[0, 1\)"),
        (NoLoCo, dict(beta=-0.1), "beta"),
        (NoLoCo, dict(gamma=-0.1), "gamma must be >= 0"),
        (NoLoCo, dict(group_size=1), "group_size"),
        (NoLoCo, dict(group_size=5, link=_StubLink()), r"group_size \(n\) must be in \[2, R=4\]"),
        (NoLoCo, dict(timeout_s=0.0), "timeout_s must be > 0"),
        (NoLoCo, dict(timeout_s=-1.0), "timeout_s"),
        (NoLoCo, dict(seed=1.5), "seed"),
    ],
)
def test_bad_hyperparameters(cls, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        cls(make_model().parameters(), **kwargs)
