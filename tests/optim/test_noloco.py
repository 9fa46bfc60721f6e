"""lowband/optim/outer/noloco.py: NoLoCo on real gloo processes (groups, traffic, gamma, checkpoints, an odd
replica), in one process, and under fault tolerance without processes.

Fault tolerance: torchft is replaced by a stand-in (a quorum of fixed size, a process group whose
send/recv go through in-memory queues); the nodes of one test run in threads of this process: the
link's exchange through torchft's process group, the group size clipped to the live nodes, the
commit gate, and what a healed replica resets.
"""

from __future__ import annotations

import functools
import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from lowband.comm.link import Link
from lowband.distributed.topology import Topology
from lowband.optim import DiLoCo, NoLoCo, NonFiniteGradientError, noloco_groups
from lowband.optim._common import state_view
from lowband.optim.outer.groups import noloco_group_size
from lowband.testing.ranks import (
    full_params,
    run_ranks,
    tiny_loss,
    tiny_model,
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
    watch_sends,
)

INNER_ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


class _Done:
    def wait(self, timeout=None):
        return True


class _Recv:
    def __init__(self, net, key, buf, fail):
        self.net, self.key, self.buf, self.fail = net, key, buf, fail

    def wait(self, timeout=None):
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        self.buf.copy_(self.net.setdefault(self.key, queue.Queue()).get(timeout=10))
        return True


class FakePG:
    """torchft's process group as the link uses it: send/recv of one tensor with a tag, returning a Work."""

    def __init__(self, net: dict, me: int, lost: set[int]):
        self.net, self.me, self.lost, self.calls = net, me, lost, []

    def send(self, tensors, dst, tag):
        assert tensors[0].device.type == "cpu", "gloo's send/recv read host memory"
        self.calls.append(("send", dst, tag))
        self.net.setdefault((self.me, dst, tag), queue.Queue()).put(tensors[0].clone())
        return _Done()

    def recv(self, tensors, src, tag):
        assert tensors[0].device.type == "cpu", "gloo's send/recv read host memory"
        self.calls.append(("recv", src, tag))
        return _Recv(self.net, (src, self.me, tag), tensors[0], src in self.lost)


class FakeFT:
    """lowband.ft.node.FaultTolerance as the link and the optimizers see it."""

    def __init__(self, *, members: int, rank: int, max_nodes: int, net: dict | None = None, lost=()):
        self.members, self.member_rank = members, rank
        self.cfg = SimpleNamespace(max_nodes=max_nodes)
        self.pg = FakePG({} if net is None else net, rank, set(lost))
        self.errors: list[BaseException] = []

    @property
    def errored(self) -> bool:
        return bool(self.errors)

    def report_error(self, e: BaseException) -> None:
        self.errors.append(e)

    def commit(self) -> bool:
        return not self.errors


def ft_link(**kw) -> Link:
    return Link(Topology(num_nodes=1, ranks_per_node=1), ft=FakeFT(**kw))


# ----------------------------------------------------------------------------- the link
def test_group_rank_and_bounds_with_and_without_fault_tolerance():
    plain = Link(Topology(num_nodes=1, ranks_per_node=1))
    assert (plain.group_rank, plain.group_size, plain.max_group_size) == (0, 1, 1)
    link = ft_link(members=3, rank=2, max_nodes=4)
    assert (link.group_rank, link.group_size, link.max_group_size, link.group_ranks) == (2, 3, 4, [0, 1, 2])
    link.ft.members, link.ft.member_rank = 0, None  # before the first quorum: alone
    assert (link.group_rank, link.group_size) == (0, 1)


def test_exchange_under_fault_tolerance_posts_receives_first_and_counts_every_peer_as_another_node():
    net: dict = {}
    link = ft_link(members=3, rank=1, max_nodes=3, net=net)
    mine = torch.arange(5.0)
    for peer in (0, 2):  # the peers' messages, already on their way
        net[(peer, 1, 0)] = queue.Queue()
        net[(peer, 1, 0)].put(torch.full((5,), float(peer + 10)))
    handle = link.exchange(mine, [0, 2, 1], async_op=True)  # this node's own rank is left out
    received = handle.wait()
    assert [r.tolist() for r in received] == [[10.0] * 5, [12.0] * 5]
    assert link.ft.pg.calls == [("recv", 0, 0), ("recv", 2, 0), ("send", 0, 0), ("send", 2, 0)]
    assert torch.equal(net[(1, 0, 0)].get_nowait(), mine) and torch.equal(net[(1, 2, 0)].get_nowait(), mine)
    (op,) = link.current.ops
    assert (op.kind, op.group_size, op.payload_bytes, op.messages) == ("exchange", 3, 20, 1)
    assert op.bytes_sent == op.inter_node_bytes_sent == op.inter_node_bytes_recv == 40
    assert op.node_inter_node_bytes_sent == 40  # one rank per node here (S = 1)
    assert link.commit()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_exchange_under_fault_tolerance_stages_device_tensors_through_the_cpu():
    net: dict = {(0, 1, 0): queue.Queue()}
    net[(0, 1, 0)].put(torch.full((3,), 7.0))
    link = ft_link(members=2, rank=1, max_nodes=2, net=net)
    (got,) = link.exchange(torch.arange(3.0, device="cuda"), [0])
    assert got.device.type == "cuda" and got.tolist() == [7.0, 7.0, 7.0]
    assert net[(1, 0, 0)].get_nowait().tolist() == [0.0, 1.0, 2.0]


def test_exchange_under_fault_tolerance_reports_a_lost_peer_and_returns_zeros():
    net: dict = {(0, 1, 0): queue.Queue()}
    net[(0, 1, 0)].put(torch.ones(4))  # peer 0 answered, peer 2 is gone
    link = ft_link(members=3, rank=1, max_nodes=3, net=net, lost={2})
    received = link.exchange(torch.ones(4), [0, 2])  # no exception
    assert all(torch.equal(r, torch.zeros(4)) for r in received)  # partial data is not handed on
    assert len(link.ft.errors) == 1 and "closed by peer" in str(link.ft.errors[0])
    assert not link.commit()
    calls = len(link.ft.pg.calls)
    again = link.exchange(torch.ones(4), [0])  # the step is lost already: nothing more is sent
    assert len(link.ft.pg.calls) == calls and torch.equal(again[0], torch.zeros(4))


def test_exchange_under_fault_tolerance_refuses_peers_outside_the_quorum():
    link = ft_link(members=2, rank=0, max_nodes=4)
    with pytest.raises(ValueError, match=r"peers \[5\] are not replica ranks of the current quorum \(0..1\)"):
        link.exchange(torch.ones(2), [5])


# ----------------------------------------------------------------------------- NoLoCo
def test_group_size_is_clipped_to_the_live_replicas():
    assert noloco_group_size(2, 5) == 2
    assert noloco_group_size(4, 3) == 3
    assert noloco_group_size(2, 1) == 1
    with pytest.raises(ValueError, match="live_replicas must be >= 1"):
        noloco_group_size(2, 0)


def test_group_size_is_checked_against_the_node_slots_under_fault_tolerance():
    model = tiny_model()
    # Before the first quorum the link says 1 live node: n is checked against --ft-max-nodes instead.
    NoLoCo(model.parameters(), INNER_ADAM, link=ft_link(members=0, rank=None, max_nodes=4), group_size=4)
    with pytest.raises(ValueError, match=r"group_size \(n\) must be in \[2, R=4\]"):
        NoLoCo(model.parameters(), INNER_ADAM, link=ft_link(members=0, rank=None, max_nodes=4), group_size=5)


def _nodes(live: int, *, max_nodes: int, group_size: int, sync_every: int, lost=None, **kw):
    """``live`` NoLoCo replicas (same init) in one quorum; node i cannot reach the nodes in lost[i]."""
    net: dict = {}
    nodes = []
    for i in range(live):
        link = Link(Topology(num_nodes=1, ranks_per_node=1),
                    ft=FakeFT(members=live, rank=i, max_nodes=max_nodes, net=net, lost=(lost or {}).get(i, ())))
        model = tiny_model()
        opt = NoLoCo(model.parameters(), INNER_ADAM, link=link, sync_every=sync_every, group_size=group_size,
                     max_grad_norm=None, **kw)
        nodes.append((model, opt, link))
    return nodes


def _train(nodes, steps) -> None:
    """Every node trains ``steps`` on its own data, all at once (the outer step needs its peers)."""
    errors = []

    def node(i, model, opt):
        try:
            for step in steps:
                opt.zero_grad()
                tiny_loss(model, i, step).backward()
                opt.step()
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            errors.append(e)

    threads = [threading.Thread(target=node, args=(i, m, o)) for i, (m, o, _) in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def _inner_only(rank: int, steps) -> list[torch.Tensor]:
    """θ after ``steps`` inner steps of replica ``rank`` alone (the reference)."""
    model = tiny_model()
    opt = INNER_ADAM(model.parameters())
    for step in steps:
        opt.zero_grad()
        tiny_loss(model, rank, step).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_noloco_under_fault_tolerance_clips_n_to_the_live_nodes_and_averages_over_them(caplog):
    # n = 3 with 4 node slots, 2 of them live: one group of the two, with a warning.
    nodes = _nodes(2, max_nodes=4, group_size=3, sync_every=3)
    phi0 = [p.detach().clone() for p in tiny_model().parameters()]
    _train(nodes, range(3))
    assert "2 live replicas, fewer than group_size n=3" in caplog.text
    thetas = [_inner_only(i, range(3)) for i in range(2)]
    beta = nodes[0][1].param_groups[0]["beta"]
    for model, opt, link in nodes:
        assert opt.last_group == [0, 1] and opt.dropped_outer_steps == 0
        assert [(op.kind, op.group_size) for op in link.current.ops] == [("exchange", 2)]
        # φ was equal on both, δ = 0: φ ← φ + β·mean(θ_j − φ); θ ← φ.
        for p, f0, t0, t1 in zip(model.parameters(), phi0, *thetas, strict=True):
            torch.testing.assert_close(p.detach(), f0 + beta * ((t0 - f0) + (t1 - f0)) / 2, rtol=0, atol=1e-6)
    for p, q in zip(nodes[0][0].parameters(), nodes[1][0].parameters(), strict=True):
        assert torch.equal(p, q)  # one group, one summation order: equal bit for bit


def test_noloco_alone_exchanges_nothing():
    ((model, opt, link),) = _nodes(1, max_nodes=3, group_size=2, sync_every=2)
    _train([(model, opt, link)], range(2))
    assert link.ft.pg.calls == [] and opt.last_group == [0] and opt.outer_steps == 1


def test_a_lost_peer_drops_the_outer_step_and_changes_no_state():
    # Node 1 cannot hear node 2: it drops the outer step; node 2's receive from 1 still works.
    # (R = 3, n = 2: one group of three.)
    nodes = _nodes(3, max_nodes=3, group_size=2, sync_every=2, lost={1: {2}})
    phi0 = [p.detach().clone() for p in tiny_model().parameters()]
    _train(nodes, range(2))
    model, opt, _ = nodes[1]
    assert opt.dropped_outer_steps == 1 and opt.inner_steps == 2 and opt.last_group == [0, 1, 2]
    for p, phi in zip(model.parameters(), phi0, strict=True):
        assert torch.equal(state_view(opt.state[p]["slow"]), phi)  # φ as it was
        assert not state_view(opt.state[p]["delta"]).any()  # δ as it was (0)
    theta = _inner_only(1, range(2))  # θ keeps its inner steps (not reset to φ)
    for p, t in zip(model.parameters(), theta, strict=True):
        torch.testing.assert_close(p.detach(), t, rtol=0, atol=1e-6)
    assert nodes[0][1].dropped_outer_steps == 0 and nodes[2][1].dropped_outer_steps == 0


def test_reset_replica_state_restarts_theta_from_phi_zeroes_error_feedback_and_keeps_delta():
    nodes = _nodes(2, max_nodes=2, group_size=2, sync_every=2, values="int8", quant_block=16)
    _train(nodes, range(3))  # one outer step, then one inner step: θ ≠ φ, δ ≠ 0, error feedback ≠ 0
    model, opt, _ = nodes[0]
    params = list(model.parameters())
    delta = [state_view(opt.state[p]["delta"]).clone() for p in params]
    assert any(d.abs().sum() > 0 for d in delta)
    assert any(state_view(opt.state[p]["error_phi"]).abs().sum() > 0 for p in params)
    assert any(not torch.equal(p.detach(), state_view(opt.state[p]["slow"])) for p in params)
    opt.reset_replica_state()
    for p, d in zip(params, delta, strict=True):
        st = opt.state[p]
        assert torch.equal(p.detach(), state_view(st["slow"]))
        assert torch.equal(state_view(st["delta"]), d)
        assert not state_view(st["error_phi"]).any() and not state_view(st["error_delta"]).any()


def test_a_replica_healed_mid_window_skips_to_the_window_outer_step_and_takes_it_with_the_others():
    # The window quorum: a healed replica goes on at the last inner step of the window, whatever the
    # moment of the window its state was copied at, and the outer step then pairs it with the others.
    nodes = _nodes(2, max_nodes=2, group_size=2, sync_every=4)
    _train(nodes, range(6))  # one outer step (step 3), then inner steps 4 and 5
    healed, other = nodes[0][1], nodes[1][1]
    assert healed.inner_steps == 6 and not healed.communicates_next()
    healed.reset_replica_state()
    assert healed.skip_to_outer_step() == 1  # 4 - 1 - 6 % 4
    assert healed.inner_steps == 7 and healed.communicates_next()
    assert healed.skip_to_outer_step() == 0  # already there
    model = nodes[0][0]
    assert all(torch.equal(p.detach(), state_view(healed.state[p]["slow"])) for p in model.parameters())
    _train(nodes[1:], [6])  # the other replica's last inner step (no exchange)
    assert other.communicates_next()
    _train(nodes, [7])  # the outer step, together
    assert healed.outer_steps == other.outer_steps == 2
    assert healed.dropped_outer_steps == other.dropped_outer_steps == 0


INNER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


# ----------------------------------------------------------------------------- launch 2: NoLoCo, R = 4
def _noloco_r4(rank: int, ckpt_dir: str) -> dict:
    from lowband.checkpoint.dcp import load_checkpoint, save_checkpoint

    topo = Topology.from_env(shards=1)
    out: dict = {"replica": topo.replica_index(rank)}
    H = 2

    # (a) Groups and traffic over several outer steps.
    model = make_model()
    link = Link(topo)
    opt = NoLoCo(model.parameters(), INNER, link=link, sync_every=H, seed=7)
    traffic, last_groups, phis_after_first = [], [], None
    for step in range(4 * H):
        traffic += run(model, opt, link, rank, [step])
        if (step + 1) % H == 0:
            last_groups.append(opt.last_group)
        if step + 1 == H:
            phis_after_first = [gather_replicas(state_view(opt.state[p]["slow"]), topo) for p in model.parameters()]
    out["kinds"] = kinds(traffic)
    out["payload"] = [o.payload_bytes for t in traffic for o in t.ops]
    out["numel"] = sum(p.numel() for p in model.parameters())
    out["last_groups"] = last_groups
    out["groups"] = [noloco_groups(4, 2, seed=7, outer_index=k) for k in range(4)]
    # After the first outer step (all φ started equal), φ is equal inside each group.
    g0 = out["groups"][0]
    out["first_equal_in_group"] = all(torch.equal(ph[g[0]], ph[g[1]]) for ph in phis_after_first for g in g0)
    out["first_differs_between_groups"] = any(not torch.equal(ph[g0[0][0]], ph[g0[1][0]]) for ph in phis_after_first)

    # (b) A pure γ step (α = β = 0) keeps the mean of φ inside each group; replicas start apart.
    model = make_model(seed=rank)
    link = Link(topo)
    opt = NoLoCo(model.parameters(), INNER, link=link, sync_every=1, alpha=0.0, beta=0.0, gamma=0.3, seed=3)
    before = [gather_replicas(p.detach(), topo) for p in model.parameters()]
    run(model, opt, link, rank, [0])
    after = [gather_replicas(state_view(opt.state[p]["slow"]), topo) for p in model.parameters()]
    group = noloco_groups(4, 2, seed=3, outer_index=0)
    mean_err, rule_err = 0.0, 0.0
    for b, a in zip(before, after, strict=True):
        for g in group:
            mean_err = max(mean_err, (b[g].mean(0) - a[g].mean(0)).abs().max().item())
            expected = b[g] - 0.3 * (b[g] - b[g].mean(0))
            rule_err = max(rule_err, (a[g] - expected).abs().max().item())
    out["gamma_mean_err"], out["gamma_rule_err"] = mean_err, rule_err
    out["gamma_moved"] = max((a - b).abs().max().item() for a, b in zip(after, before, strict=True))

    # (c) Checkpoint in the middle of an inner phase, R = 4, S = 1 (φ differs between replicas).
    def fresh(seed: int, group_seed: int = 11):
        m = make_model(seed)
        ln = Link(topo)
        return m, NoLoCo(m.parameters(), INNER, link=ln, sync_every=3, seed=group_seed), ln

    model, opt, link = fresh(0)
    run(model, opt, link, rank, range(8))
    straight = full_params(model)
    model, opt, link = fresh(0)
    run(model, opt, link, rank, range(4))
    save_checkpoint(f"{ckpt_dir}/noloco_r4", model=model, optimizer=opt)
    model2, opt2, link2 = fresh(100 + rank, group_seed=99)  # the seed, too, comes from the checkpoint
    load_checkpoint(f"{ckpt_dir}/noloco_r4", model=model2, optimizer=opt2)
    out["ckpt_seed"] = opt2.param_groups[0]["seed"]
    run(model2, opt2, link2, rank, range(4, 8))
    out["ckpt_maxdiff"] = maxdiff(straight, full_params(model2))
    out["ckpt_replicas_differ"] = not replicas_equal(model2, topo)

    # (d) A NaN in one replica's θ at an outer step: its group refuses; the other group goes on.
    model = make_model()
    link = Link(topo)
    opt = NoLoCo(model.parameters(), INNER, link=link, sync_every=1, seed=5)
    sent_finite = watch_sends(link, "exchange")
    if rank == 0:
        opt.inner_optimizer.register_step_post_hook(
            lambda *_: next(iter(model.parameters())).view(-1).__setitem__(0, float("nan")))
    try:
        run(model, opt, link, rank, [0])
        out["nan_raised"] = None
    except NonFiniteGradientError as e:
        out["nan_raised"] = str(e)
    out["nan_group"] = noloco_groups(4, 2, seed=5, outer_index=0)
    out["nan_phi_finite"] = all(torch.isfinite(state_view(opt.state[p]["slow"])).all().item()
                                for p in model.parameters())
    out["nan_sent_finite"] = sent_finite
    return out


@pytest.mark.multiprocess
def test_noloco_groups_traffic_gamma_checkpoint_and_nan_with_four_replicas(tmp_path):
    results = run_ranks(_noloco_r4, world_size=4, ranks_per_node=2, args=(str(tmp_path),), timeout_s=150)
    groups = results[0]["groups"]
    for rank, r in enumerate(results):
        # Every rank derives the same groups; each replica is in exactly one group of n = 2.
        assert r["groups"] == groups
        for gs in groups:
            assert sorted(x for g in gs for x in g) == [0, 1, 2, 3] and all(len(g) == 2 for g in gs)
        # This rank's group in each outer step is the drawn one (S = 1: replica = rank).
        for k, last in enumerate(r["last_groups"]):
            assert rank in last and last in groups[k], (rank, k, last)
        # Point-to-point only, never more than n = 2 ranks, one flat buffer (φ, θ − φ, flag) per outer step.
        assert r["kinds"] == [{}, {"exchange": (1, 2)}] * 4, r["kinds"]
        assert r["payload"] == [(2 * r["numel"] + 1) * 4] * 4
        assert r["first_equal_in_group"] and r["first_differs_between_groups"]
        assert r["gamma_mean_err"] < 1e-6 and r["gamma_rule_err"] < 1e-6 and r["gamma_moved"] > 1e-2, r
        assert r["ckpt_maxdiff"] == 0.0, (rank, r["ckpt_maxdiff"])
        assert r["ckpt_seed"] == 11
        assert r["ckpt_replicas_differ"]
        nan_group = next(g for g in r["nan_group"] if rank in g)
        if 0 in nan_group:
            assert r["nan_raised"] and "NaN or Inf" in r["nan_raised"], (rank, r["nan_raised"])
        else:
            assert r["nan_raised"] is None
        assert r["nan_phi_finite"]
        assert r["nan_sent_finite"] == [True], r["nan_sent_finite"]
    assert len({str(g) for g in groups}) > 1  # groups vary with the outer step


# ----------------------------------------------------------------------------- launch 4: R = 3, n = 2
def _odd_replicas(rank: int) -> dict:
    topo = Topology.from_env()  # 3 nodes × 1 rank
    res = {}
    for name, make in (
        ("noloco", lambda ps, ln: NoLoCo(ps, INNER, link=ln, sync_every=2, alpha=0.5, beta=0.7, group_size=2,
                                         max_grad_norm=None)),
        ("diloco_hb", lambda ps, ln: DiLoCo(ps, INNER, link=ln, sync_every=2, outer_lr=0.7, outer_momentum=0.5,
                                            nesterov=False)),
    ):
        model = make_model()
        link = Link(topo)
        opt = make(model.parameters(), link)
        traffic = run(model, opt, link, rank, range(4))
        res[name] = {"params": full_params(model), "kinds": kinds(traffic), "equal": replicas_equal(model, topo),
                     "group": getattr(opt, "last_group", None)}
    return {"kinds": res["noloco"]["kinds"], "equal": res["noloco"]["equal"], "group": res["noloco"]["group"],
            "vs_diloco": maxdiff(res["noloco"]["params"], res["diloco_hb"]["params"])}


@pytest.mark.multiprocess
def test_noloco_odd_replica_joins_a_group_of_three():
    results = run_ranks(_odd_replicas, world_size=3, ranks_per_node=1, timeout_s=90)
    for r in results:
        assert r["group"] == [0, 1, 2]
        assert r["kinds"] == [{}, {"exchange": (1, 3)}] * 2
        assert r["equal"]
        assert r["vs_diloco"] < 1e-6, r["vs_diloco"]


def test_single_process_clipping_schedule_and_shared_param_groups():
    model, ref = make_model(), make_model()
    opt = NoLoCo(model.parameters(), functools.partial(torch.optim.Adam, lr=0.05), sync_every=100,
                 max_grad_norm=0.1)
    inner = torch.optim.Adam(ref.parameters(), lr=0.05)
    sched, ref_sched = (warmup_cosine(o, warmup_steps=2, total_steps=6) for o in (opt, inner))
    for step in range(5):
        for m, o, s in ((model, opt, sched), (ref, inner, ref_sched)):
            o.zero_grad()
            loss_of(m, 0, step).backward()
            if o is inner:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
            o.step()
            s.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert opt.inner_optimizer.param_groups is opt.param_groups
    assert opt.inner_optimizer.param_groups[0]["lr"] == inner.param_groups[0]["lr"]
