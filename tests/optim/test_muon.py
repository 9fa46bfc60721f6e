"""lowband/optim/muon.py: Muon on the hidden weight matrices, AdamW on the rest, as DiLoCo's, NoLoCo's and
SparseLoCo's inner optimizer (``inner=muon``): the split, the steps against torch's own optimizers, the
schedule, the state's round trips (checkpoint and fault-tolerance heal), and one FSDP2 run on gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowband.ft.state import load_optimizer_local_state, optimizer_local_state
from lowband.optim import DiLoCo
from lowband.optim.muon import MuonAdamW, hidden_matrices
from lowband.testing.ranks import run_ranks, tiny_loss, tiny_model, tiny_sharded
from lowband.train.methods import build_optimizer, method_config

LR, WD = 0.02, 0.1


class _Net(nn.Module):
    """An embedding, two hidden layers with biases, a norm and an untied output layer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(11, 8)
        self.hidden = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(self.norm(self.hidden(self.emb(ids)))).mean(1)


def _loss(net: _Net, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 11, (4, 5), generator=g)
    return nn.functional.cross_entropy(net(ids), torch.randint(0, 11, (4,), generator=g))


def _train(net, opt, steps, start=0, scheduler=None):
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(net, step).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _hidden(net: _Net) -> list[torch.Tensor]:
    return [net.hidden[0].weight, net.hidden[2].weight]


def test_split_hidden_matrices_muon_the_rest_adamw():
    net = _Net()
    assert [id(p) for p in hidden_matrices(net)] == [id(p) for p in _hidden(net)]
    # From a model (what inner=muon passes), by name (groups of (name, tensor) pairs): the same split.
    for opt in (MuonAdamW(net.parameters(), muon_params=hidden_matrices(net)), MuonAdamW(net.named_parameters())):
        assert [opt.uses_muon(p) for p in net.parameters()] == [
            any(p is q for q in _hidden(net)) for p in net.parameters()]
    # No names, no choice: every 2-D parameter.
    opt = MuonAdamW(net.parameters())
    assert [opt.uses_muon(p) for p in net.parameters()] == [p.ndim == 2 for p in net.parameters()]
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW(net.parameters(), muon_params=[net.hidden[0].bias])
    with pytest.raises(ValueError, match="not given"):
        MuonAdamW(net.head.parameters(), muon_params=_hidden(net))


def test_split_of_the_transformers_models():
    """T5: its shared (tied) embedding and relative attention biases are AdamW's; GPT-2: wte, wpe."""
    from lowband.train.models import build_model

    for name, adamw_2d in (("t5-tiny", ("shared", "relative_attention_bias")), ("gpt-tiny", ("wte", "wpe"))):
        model = build_model(name, vocab_size=19, seed=0).model
        chosen = {id(p) for p in hidden_matrices(model)}
        for n, p in model.named_parameters():
            want = p.ndim == 2 and not any(word in n for word in adamw_2d)
            assert (id(p) in chosen) == want, (name, n)
        assert chosen  # attention and MLP matrices


def test_steps_are_torchs_muon_and_adamw_on_their_parameters():
    net, ref = _Net(), _Net()
    opt = MuonAdamW(net.named_parameters(), lr=LR, weight_decay=WD, muon_params=_hidden(net))
    hidden = {id(p) for p in _hidden(ref)}
    muon = torch.optim.Muon([p for p in ref.parameters() if id(p) in hidden], lr=LR, weight_decay=WD,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in hidden], lr=LR, weight_decay=WD)
    for step in range(4):
        for o in (opt, muon, adamw):
            o.zero_grad()
        _loss(net, step).backward()
        _loss(ref, step).backward()
        opt.step()
        muon.step()
        adamw.step()
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b), step
    assert set(opt.state[net.hidden[0].weight]) == {"momentum_buffer"}
    assert set(opt.state[net.head.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_the_schedule_reaches_both_parts():
    net, ref = _Net(), _Net()
    opt = MuonAdamW(net.parameters(), lr=LR, weight_decay=WD, muon_params=_hidden(net))
    ref_opt = MuonAdamW(ref.parameters(), lr=LR, weight_decay=WD, muon_params=_hidden(ref))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for step in range(3):
        _train(net, opt, 1, start=step, scheduler=sched)
        for g in ref_opt.param_groups:  # the same lr set by hand
            g["lr"] = LR * (1.0 / (1 + step))
        _train(ref, ref_opt, 1, start=step)
        assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[0]["lr"] == LR * (1.0 / (1 + step))
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    # Through the outer optimizer that shares its groups: its scheduler drives both parts.
    net = _Net()
    dil = DiLoCo(net.parameters(), lambda groups: MuonAdamW(groups, lr=LR, weight_decay=WD), sync_every=2)
    sched = torch.optim.lr_scheduler.LambdaLR(dil, lambda s: 0.5 ** s)
    _train(net, dil, 3, scheduler=sched)
    inner = dil.inner_optimizer
    assert inner.param_groups is dil.param_groups
    assert inner.muon.param_groups[0]["lr"] == inner.adamw.param_groups[0]["lr"] == LR * 0.25
    # Muon's own keys do not collide with DiLoCo's outer "nesterov".
    dil.param_groups[0]["nesterov"] = False
    _train(net, dil, 1, start=3)
    assert inner.muon.param_groups[0]["nesterov"] is True


def test_state_dict_round_trip():
    net = _Net()
    opt = MuonAdamW(net.parameters(), lr=LR, weight_decay=WD, muon_params=_hidden(net))
    _train(net, opt, 3)
    sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(net.state_dict())
    _train(net, opt, 3, start=3)
    fresh = _Net(seed=7)
    fresh_opt = MuonAdamW(fresh.parameters(), lr=0.5, weight_decay=0.0, muon_params=_hidden(fresh))
    fresh.load_state_dict(msd)
    fresh_opt.load_state_dict(sd)
    assert fresh_opt.param_groups[0]["lr"] == LR
    _train(fresh, fresh_opt, 3, start=3)
    for a, b in zip(net.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_outer_checkpoint_and_heal_carry_the_muon_state(method):
    """DiLoCo's and SparseLoCo's per-replica checkpoint (``inner`` per parameter), mid-phase, and the
    fault-tolerance heal (a joining node copies a peer's local state) both resume bit for bit."""
    hp = {"inner": "muon", "lr": LR, "H": 3}

    def build(net):
        return build_optimizer(method, net.named_parameters(), link=None, hp=hp, model=net)

    net = _Net()
    opt = build(net)
    _train(net, opt, 4)
    assert "momentum_buffer" in opt.state_dict()["state"][1]["inner"]  # hidden[0].weight, Muon's
    sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(net.state_dict())
    peer = [optimizer_local_state(o) for o in opt.state_owners()]
    _train(net, opt, 5, start=4)
    for load in ("checkpoint", "heal"):
        fresh = _Net(seed=3)
        fresh_opt = build(fresh)
        if load == "checkpoint":
            fresh.load_state_dict(msd)
            fresh_opt.load_state_dict(sd)
        else:
            with torch.no_grad():
                for p, q in zip(fresh.parameters(), msd.values(), strict=True):
                    p.copy_(q)
            for owner, state in zip(fresh_opt.state_owners(), peer, strict=True):
                load_optimizer_local_state(owner, copy.deepcopy(state), None)
        _train(fresh, fresh_opt, 5, start=4)
        for a, b in zip(net.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b), load


def test_bad_inner_is_refused_naming_the_choices():
    for method in ("diloco", "noloco", "sparseloco"):
        with pytest.raises(ValueError, match="inner must be one of adamw, muon, got 'sgd'"):
            method_config(method, {"inner": "sgd"})
    with pytest.raises(ValueError, match="no hyper-parameter 'inner'"):
        method_config("flexdemo", {"inner": "muon"})


@pytest.mark.parametrize("method", ["diloco", "noloco", "sparseloco"])
def test_inner_muon_trains_a_tiny_model(method):
    net = _Net()
    opt = build_optimizer(method, net.named_parameters(), link=None, hp={"inner": "muon", "H": 2, "lr": LR},
                          model=net)
    inner = opt.inner_optimizer
    assert isinstance(inner, MuonAdamW)
    assert [inner.uses_muon(p) for p in net.parameters()] == [any(p is q for q in _hidden(net))
                                                             for p in net.parameters()]
    first = _loss(net, 0).item()
    for _ in range(4):  # 4 passes over the same 4 batches
        _train(net, opt, 4)
    assert _loss(net, 0).item() < first - 0.2
    assert opt.outer_steps == 8
    # inner=adamw (the default) builds what it always built: torch's AdamW with lr and weight_decay.
    plain = build_optimizer(method, _Net().named_parameters(), link=None, hp={"lr": LR})
    assert type(plain.inner_optimizer) is torch.optim.AdamW


# ----------------------------------------------------------------------------- FSDP2 shards, gloo
def _sharded_vs_whole(rank: int) -> dict:
    """One node of 2 ranks (the tiny model's matrices sharded by rows, unevenly: 37 = 19 + 18), DiLoCo
    with inner=muon, against the same run unsharded in this process (the same batch on both ranks; no
    clipping, whose norm over shards rounds differently)."""
    from torch.distributed.tensor import DTensor

    from lowband.comm.link import Link
    from lowband.distributed.topology import Topology

    topo = Topology.from_env()
    hp = {"inner": "muon", "H": 2, "lr": LR, "clip": None}
    net, whole = tiny_sharded(topo), tiny_model()
    opt = build_optimizer("diloco", net.named_parameters(), link=Link(topo), hp=hp, model=net)
    ref = build_optimizer("diloco", whole.named_parameters(), link=None, hp=hp, model=whole)
    start = [p.detach().clone() for p in whole.parameters()]
    for step in range(5):
        for m, o in ((net, opt), (whole, ref)):
            o.zero_grad()
            tiny_loss(m, 0, step).backward()
            o.step()
    muon = [opt.inner_optimizer.uses_muon(p) for p in net.parameters()]
    diff = [(p.full_tensor() - q).abs().max().item() for p, q in zip(net.parameters(), whole.parameters(), strict=True)]
    moved = [(q - s).abs().max().item() for q, s in zip(whole.parameters(), start, strict=True)]
    buf = opt.inner_optimizer.state[next(iter(net.parameters()))]["momentum_buffer"]
    return dict(muon=muon, diff=diff, moved=moved, dtensor=isinstance(buf, DTensor))


@pytest.mark.multiprocess
def test_fsdp2_shards_step_as_the_unsharded_run():
    """The sharded Muon step (gather, torch's Newton–Schulz on the full matrix, own rows) is torch's."""
    for r in run_ranks(_sharded_vs_whole, world_size=2, ranks_per_node=2, timeout_s=120):
        # tiny_model: Linear(13, 37), Linear(37, 29), Linear(29, 3); the last is the output layer.
        assert r["muon"] == [True, False, True, False, False, False]
        assert r["dtensor"] and min(r["moved"]) > 0
        assert r["diff"] == [0.0] * 6, r  # bit for bit


# ----------------------------------------------------------------------------- the full-sync reference, method muon
def test_muon_full_sync_in_one_process_is_muon_adamw():
    """The method ``muon`` (MuonFullSync) with no link steps as MuonAdamW, bit for bit; a NaN gradient is refused."""
    from lowband.optim import MuonFullSync, NonFiniteGradientError

    a, b = _Net(), _Net()
    ref = MuonAdamW(a.named_parameters(), lr=LR, weight_decay=WD, muon_params=hidden_matrices(a))
    opt = method_config("muon", {"lr": LR, "weight_decay": WD}).build(list(b.named_parameters()), link=None, model=b)
    assert isinstance(opt, MuonFullSync) and [opt.uses_muon(p) for p in b.parameters()] == \
        [ref.uses_muon(p) for p in a.parameters()]
    _train(a, ref, 4)
    _train(b, opt, 4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    opt.zero_grad()
    _loss(b, 9).backward()
    next(iter(b.parameters())).grad.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        opt.step()


def _full_sync_vs_mean(rank: int) -> dict:
    """2 nodes x 2 ranks: the method muon through the link (each rank its own batch) against MuonAdamW on the
    mean of the four ranks' losses in this process."""
    from lowband.comm.link import Link
    from lowband.distributed.topology import Topology

    topo = Topology.from_env()
    net, whole = tiny_sharded(topo), tiny_model()
    link = Link(topo)
    opt = build_optimizer("muon", net.named_parameters(), link=link, hp={"lr": LR}, model=net)
    ref = MuonAdamW(whole.named_parameters(), lr=LR, muon_params=hidden_matrices(whole))
    start = [p.detach().clone() for p in whole.parameters()]
    sent = []
    for step in range(4):
        opt.zero_grad()
        tiny_loss(net, rank, step).backward()
        opt.step()
        sent.append(link.end_step())
        ref.zero_grad()
        (sum(tiny_loss(whole, r, step) for r in range(4)) / 4).backward()
        ref.step()
    diff = [(p.full_tensor() - q).abs().max().item() for p, q in zip(net.parameters(), whole.parameters(), strict=True)]
    moved = [(q - s).abs().max().item() for q, s in zip(whole.parameters(), start, strict=True)]
    adamw_net, adamw_link = tiny_sharded(topo), Link(topo)
    adamw = build_optimizer("adamw", adamw_net.named_parameters(), link=adamw_link, hp={"lr": LR})
    adamw_net(torch.zeros(1, 13)).sum().backward()
    adamw.step()
    return dict(diff=diff, moved=moved, ops=sorted({o.kind for t in sent for o in t.ops}),
                bytes=[t.inter_node_bytes_sent for t in sent], adamw_bytes=adamw_link.end_step().inter_node_bytes_sent)


@pytest.mark.multiprocess
def test_muon_full_sync_on_2x2_steps_as_muon_on_the_mean_gradient():
    """The all-reduced gradient is the mean over all four ranks, and Muon steps on it (up to the sum's rounding,
    which bf16 Newton–Schulz carries into the update)."""
    for r in run_ranks(_full_sync_vs_mean, world_size=4, ranks_per_node=2, timeout_s=120):
        assert min(r["moved"]) > 1e-3, r
        # Within 1e-4, or within 2^-6 of how far the parameter moved: bf16 Newton-Schulz turns a different
        # rounding of the sum into a bf16 rounding flip of an update (on this CPU, 1.9e-4 on one matrix that
        # moved by more than 1e-2). A rank on its own gradient, not the mean, misses by tens of percent.
        assert all(d < max(1e-4, 2**-6 * m) for d, m in zip(r["diff"], r["moved"], strict=True)), r
        assert r["ops"] == ["all_reduce"], r
        assert r["bytes"] == [r["adamw_bytes"]] * 4 and r["adamw_bytes"] > 0, r  # AdamW's message, every step
