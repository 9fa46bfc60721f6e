"""Robust aggregation (issue 29 item 5) and the poisoning member that tests it (lowband.testing.poison).

The rules on plain vectors, then every method that has them against one poisoning member among three
replicas, in one process: the stand-in link of test_trust returns this rank's message and the
others' (honest copies, and one scaled or sign-flipped re-encoding of it)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from lowband.compress.dct import scatter_chunks
from lowband.compress.quant import BlockQuant
from lowband.compress.sparse import SparseCodec
from lowband.compress.wire import WireFormat
from lowband.optim import DiLoCo, FlexDeMo, NoLoCo, SparseLoCo
from lowband.optim._common import NonFiniteGradientError, outvoted_refusals, state_view
from lowband.optim.robust import (
    AgreementMemory,
    ClipTally,
    agreeing,
    check_aggregate,
    clip_scales,
    dense_gram,
    robust_pull,
    robust_sum,
    sparse_gram,
    trimmed_mean,
)
from lowband.testing.poison import POISON_KINDS, Poison, parse_poison
from lowband.testing.ranks import tiny_loss, tiny_model
from tests.optim.test_trust import (
    INNER,
    NUMEL,
    _dense_reencode,
    _Link,
    _params,
    _set,
    _sparse_reencode,
    _train,
)


# ----------------------------------------------------------------------------- the rules
def test_the_mean_is_the_plain_sum_in_order_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    vs = [torch.randn(100, generator=g) for _ in range(3)]
    assert torch.equal(robust_sum(vs, "mean"), vs[0] + vs[1] + vs[2])


def test_clip_brings_a_huge_member_to_the_median_norm_and_leaves_the_others():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=g), torch.randn(50, generator=g)
    huge = 1000 * torch.randn(50, generator=g)
    total = robust_sum([a, b, huge], "clip")
    median = sorted(float(v.norm()) for v in (a, b, huge))[1]
    scaled = [v * min(1.0, median / float(v.norm())) for v in (a, b, huge)]
    torch.testing.assert_close(total, scaled[0] + scaled[1] + scaled[2])
    assert float((total - a - b).norm()) <= median * (1 + 1e-6)  # the huge one adds at most the median norm


def test_clip_with_two_members_bounds_the_larger_by_the_smaller():
    scales = clip_scales(torch.tensor([1.0, 10.0], dtype=torch.float64))
    assert scales.tolist() == pytest.approx([1.0, 0.1])
    assert clip_scales(torch.tensor([0.0, 0.0], dtype=torch.float64)).tolist() == [1.0, 1.0]


def test_trimmed_mean_drops_the_largest_and_smallest_per_coordinate():
    vs = [torch.tensor([1.0, 5.0]), torch.tensor([2.0, -100.0]), torch.tensor([1000.0, 6.0]), torch.tensor([3.0, 7.0])]
    torch.testing.assert_close(trimmed_mean(vs), torch.tensor([2.5, 5.5]))
    torch.testing.assert_close(robust_sum(vs, "trimmed"), 4 * torch.tensor([2.5, 5.5]))
    with pytest.raises(ValueError, match="at least 3"):
        trimmed_mean(vs[:2])


def test_a_wrong_rule_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="mean, clip, trimmed"):
        check_aggregate("median", method="DiLoCo", dense=True)
    with pytest.raises(ValueError, match="needs dense updates.*use aggregate='clip'"):
        check_aggregate("trimmed", method="SparseLoCo", dense=False)
    with pytest.raises(ValueError, match="trimmed"):
        SparseLoCo(tiny_model().parameters(), INNER, aggregate="trimmed")
    with pytest.raises(ValueError, match="needs dense"):
        FlexDeMo(tiny_model().parameters(), aggregate="trimmed")


def test_poison_specs_parse_and_refuse_clearly():
    assert parse_poison("node2:scale@30", nodes=3) == Poison(2, "scale", 30)
    assert str(parse_poison("node0:flip@0")) == "node0:flip@0"
    assert parse_poison("node1:nan@3") == Poison(1, "nan", 3) and parse_poison("node1:index@3").malformed
    with pytest.raises(ValueError, match="kind one of scale, flip, nan, index"):
        parse_poison("node1:inf@3")
    with pytest.raises(ValueError, match="nodes 0..1"):
        parse_poison("node2:scale@3", nodes=2)
    t = torch.ones(3)
    Poison(0, "flip", 5).update_([t], step=4)
    assert t.tolist() == [1.0, 1.0, 1.0]
    Poison(0, "flip", 5).update_([t], step=5)
    assert t.tolist() == [-1.0, -1.0, -1.0]


# ----------------------------------------------------------------------------- the methods
class _Three(_Link):
    """Three replicas: this rank's message, an honest copy, and ``bad(own message)``."""

    group_size = max_group_size = participants = 3
    group_ranks = [0, 1, 2]

    def __init__(self, bad=None) -> None:
        super().__init__(None if bad is None else (lambda m: [m.clone(), bad(m)]))

    def all_gather(self, tensor, *, async_op=False):
        if self.peer is None:
            return torch.stack([tensor.clone()] * 3)
        return super().all_gather(tensor, async_op=async_op)

    def all_reduce(self, tensor, *, op="avg", async_op=False):
        assert op == "avg"
        others = [tensor.clone(), tensor.clone()] if self.peer is None else self.peer(tensor.clone())
        return tensor.add_(others[0]).add_(others[1]).div_(3)


class _Recording(_Three):
    """:class:`_Three` (honest copies) that keeps every message this replica sent, in ``sent``."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[torch.Tensor] = []

    def all_gather(self, tensor, *, async_op=False):
        self.sent.append(tensor.clone())
        return super().all_gather(tensor, async_op=async_op)


def _times(factor):
    return lambda v: v.mul(factor)


def _scaled(reencode, factor):
    """The message with its values times ``factor``: re-encoded bytes, or an fp32 all-reduce's values."""
    def bad(m):
        if m.dtype != torch.uint8:  # DiLoCo's fp32 all-reduce (aggregate="mean"): values and a flag
            return torch.cat([m[:-1] * factor, m[-1:]])
        return reencode(m, _times(factor))
    return bad


FP32 = BlockQuant("fp32")
SPARSE = dict(chunk=16, topk=2, values="fp32")
SPARSE_CODEC = SparseCodec(16, 2, "fp32", 256)
CASES = {  # name -> (optimizer class and keywords, re-encode(message, fn) of its message)
    "diloco": ((DiLoCo, {}), functools.partial(_dense_reencode, codec=FP32, numel=NUMEL)),
    "sparseloco": ((SparseLoCo, SPARSE), functools.partial(_sparse_reencode, codec=SPARSE_CODEC)),
}


def _run(case, link, aggregate, steps=4):
    (cls, kw), _ = CASES[case]
    model = tiny_model()
    opt = cls(model.parameters(), INNER, link=link, sync_every=2, aggregate=aggregate, **kw)
    _train(model, opt, steps)
    return model, opt


def _farthest(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(_params(a), _params(b), strict=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_clip_makes_a_thousandfold_member_no_worse_than_an_honest_one(case, caplog):
    _, reencode = CASES[case]
    honest, _ = _run(case, _Three(), "clip")
    with caplog.at_level(logging.WARNING):
        clipped, opt = _run(case, _Three(_scaled(reencode, 1000.0)), "clip")
    poisoned, _ = _run(case, _Three(_scaled(reencode, 1000.0)), "mean")
    assert _farthest(clipped, honest) < 1e-5
    assert _farthest(poisoned, honest) > 0.5  # without the rule the one member moves the weights far
    assert opt.stats().clipped.get(2, 0) == 2 and opt.stats().bad_messages == {}
    assert "member 2's update is" in caplog.text and "clipped" in caplog.text


def test_diloco_trimmed_undoes_a_sign_flipped_member_that_clip_lets_through():
    _, reencode = CASES["diloco"]
    honest, _ = _run("diloco", _Three(), "trimmed")
    trimmed, _ = _run("diloco", _Three(lambda m: reencode(m, _times(-1.0))), "trimmed")
    clipped, _ = _run("diloco", _Three(lambda m: reencode(m, _times(-1.0))), "clip")
    assert _farthest(trimmed, honest) == 0.0
    assert _farthest(clipped, honest) > 1e-3


def test_agree_keeps_the_members_that_point_the_way_of_at_least_half_of_the_others():
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(64, generator=g) + 2.0 for _ in range(3)]  # pairwise positive
    flipped = -honest[0]
    assert agreeing(dense_gram([*honest[:2], flipped])).tolist() == [True, True, False]
    assert agreeing(dense_gram([*honest, flipped])).tolist() == [True, True, True, False]
    # two members: no one can tell which is wrong; nobody agreeing with anybody: no evidence, all kept
    assert agreeing(dense_gram([honest[0], flipped])).tolist() == [True, True]
    e = torch.eye(3)
    assert agreeing(dense_gram([e[0], e[1], e[2]])).tolist() == [True, True, True]
    # the sum: R/K times the kept members' clipped sum (here the two honest ones, of equal norm)
    a, b = honest[0], honest[0].clone()
    torch.testing.assert_close(robust_sum([a, b, -a], "agree"), 3 * a)
    tally = ClipTally()
    robust_sum([a, b, -a], "agree", members=[4, 5, 6], tally=tally)
    assert tally.left_out == {6: 1} and tally.clipped == {} and tally.decisions == 1


def test_agree_remembers_a_member_that_keeps_pointing_against_the_others():
    """FlexDeMo's rule decides on remembered cosines (AgreementMemory): a flipper whose cosines are all positive
    on one noisy step is still left out, honest members whose steps point apart now and then are not; the
    memory follows the members by id whatever their order and is forgotten when the membership changes."""
    def gram(*vs):
        return dense_gram([torch.tensor(v, dtype=torch.float64) for v in vs])

    memory = AgreementMemory()
    for _ in range(10):  # honest 7 and 8 agree; 9 points against both
        assert memory.agreeing(gram([1.0, 0.0], [1.0, 0.1], [-1.0, 0.0]), [7, 8, 9]).tolist() == [True, True, False]
    noisy = gram([1.0, 0.0], [1.0, 0.5], [0.2, 1.0])  # every pair positive this step
    assert agreeing(noisy).tolist() == [True, True, True]
    assert memory.agreeing(noisy, [7, 8, 9]).tolist() == [True, True, False]
    order = [2, 0, 1]  # the same members in another order (e.g. one message left out before, then back)
    assert memory.agreeing(noisy[order][:, order], [9, 7, 8]).tolist() == [False, True, True]
    apart = gram([1.0, 1.0], [1.0, -1.0], [0.0, 1.0])  # this step 7 and 8 point apart (cosine 0)
    assert agreeing(apart).tolist() == [True, False, True]  # the step's signs would drop honest 8, keep 9
    assert memory.agreeing(apart, [7, 8, 9]).tolist() == [True, True, False]
    memory.membership(("a", "b", "c"))  # a new quorum: the indices name other members, nothing is remembered
    assert memory.agreeing(noisy, [7, 8, 9]).tolist() == [True, True, True]
    # four honest members with noisy steps: the step's signs leave some out, the memory none once it has begun
    g = torch.Generator().manual_seed(3)
    honest, by_step, by_memory = AgreementMemory(), 0, 0
    for step in range(60):
        vs = [torch.randn(32, generator=g, dtype=torch.float64) + 0.5 for _ in range(4)]
        by_step += int((~agreeing(dense_gram(vs))).sum())
        left_out = int((~honest.agreeing(dense_gram(vs), [0, 1, 2, 3])).sum())
        by_memory += left_out if step >= 10 else 0
    assert by_step > 0 and by_memory == 0


def test_the_sparse_gram_is_the_inner_products_of_the_decoded_messages():
    g = torch.Generator().manual_seed(1)
    r, rows, chunk, k = 3, 5, 16, 4
    idx = torch.stack([torch.stack([torch.randperm(chunk, generator=g)[:k] for _ in range(rows)]) for _ in range(r)])
    vals = torch.randn(r, rows, k, generator=g)
    dense = [scatter_chunks(idx[j], vals[j], chunk).reshape(-1) for j in range(r)]
    torch.testing.assert_close(sparse_gram(idx, vals), dense_gram(dense))


def _flexdemo_flipped(bad, aggregate, steps=4):
    model = tiny_model()
    opt = FlexDeMo(model.parameters(), lr=1.0, topk=2, chunk=16, values="fp32", sign=False, link=_Three(bad),
                   aggregate=aggregate)
    _train(model, opt, steps)
    return model, opt


def _flexdemo_reflip(m):
    rows = tuple(-(-p.numel() // 16) for p in tiny_model().parameters())
    wire = WireFormat(16, 2, "fp32")
    idx, vals = wire.unpack_many(m[:-1], rows)
    return torch.cat([wire.encode_many(idx, -vals, rows)[0], m[-1:]])


@pytest.mark.parametrize("case", [*sorted(CASES), "flexdemo"])
def test_agree_leaves_out_a_sign_flipped_member_that_clip_lets_through(case, caplog):
    """One member of three sends its honest update with the sign flipped: under ``agree`` the replicas step as
    with honest members only; under ``clip`` they do not (it has the honest norm)."""
    if case == "flexdemo":
        run, flip, outer = (lambda bad, agg: _flexdemo_flipped(bad, agg)), _flexdemo_reflip, 4
    else:
        _, reencode = CASES[case]
        run, flip, outer = (lambda bad, agg: _run(case, _Three(bad), agg)), (lambda m: reencode(m, _times(-1.0))), 2
    honest, _ = run(None, "agree")
    with caplog.at_level(logging.WARNING):
        agreed, opt = run(flip, "agree")
    clipped, _ = run(flip, "clip")
    assert _farthest(agreed, honest) < 1e-6
    assert _farthest(clipped, honest) > 1e-3
    assert opt.stats().left_out == {2: outer} and opt.stats().bad_messages == {}
    assert opt.stats().screened()["left_out"] == {"2": outer} and opt.stats().aggregations == outer  # what the report shows
    assert "member 2's update points against most of the others'" in caplog.text


def test_flexdemo_names_the_member_agree_leaves_out_by_its_replica_index_after_a_bad_message_is_screened():
    """Four replicas: this rank, an honest copy, a malformed message (flag 7: screened out) and a flipped one. The
    flipped member is replica 3 wherever the screen left the others: agree leaves out 3, not the row it moved to."""
    class Four(_Three):
        group_size = max_group_size = participants = 4
        group_ranks = [0, 1, 2, 3]

    model = tiny_model()
    link = Four()
    link.peer = lambda m: [m.clone(), _set(m.clone(), -1, 7), _flexdemo_reflip(m)]
    opt = FlexDeMo(model.parameters(), lr=1.0, topk=2, chunk=16, values="fp32", sign=False, link=link,
                   aggregate="agree")
    _train(model, opt, 4)
    assert opt.stats().left_out == {3: 4} and opt.stats().bad_messages == {2: 4} and opt.stats().evicted == [2]


def test_a_minority_refusal_is_outvoted_only_under_a_robust_rule():
    """A member may send a flag of 1 whenever it likes: under a robust rule the refusals of fewer than half of
    the members are left out (this replica's own is reported, not listed); under mean any refusal stops the step."""
    assert outvoted_refusals({0: 0, 1: 0, 2: 1}, "mean", own=0) == ([], False)
    out, own_out = outvoted_refusals({0: 0, 1: 0, 2: 1}, "agree", own=0)
    assert [b.sender for b in out] == [2] and "refused its step" in out[0].reason and not own_out
    assert outvoted_refusals({0: 0, 1: 1, 2: 1}, "clip", own=0) == ([], False)  # half or more: the step is refused
    assert outvoted_refusals({0: 0, 2: 1}, "clip", own=0) == ([], False)  # 1 of 2 is half
    out, own_out = outvoted_refusals({0: 1, 1: 0, 2: 0, 5: 0}, "agree", own=0)
    assert out == [] and own_out


def _refusing(m):
    """What a member that refuses every step sends: zeros and a flag of 1 (well-formed)."""
    sent = torch.zeros_like(m)
    sent[-1] = 1
    return sent


@pytest.mark.parametrize("case", [*sorted(CASES), "flexdemo"])
def test_one_member_refusing_every_step_no_longer_stops_the_others_under_agree(case):
    """Under mean one member's flag stops every replica (a NonFiniteGradientError); under agree the others step
    as the two honest members would, the refuser named, counted and evicted after 3 refusals in a row (FlexDeMo's
    4 steps; the outer-step methods take 2 outer steps here)."""
    if case == "flexdemo":
        run = lambda bad, agg: _flexdemo_flipped(bad, agg)  # noqa: E731
        outer = 4
    else:
        run, outer = (lambda bad, agg: _run(case, _Three(bad), agg)), 2
    honest, _ = run(None, "agree")
    with pytest.raises(NonFiniteGradientError):
        run(_refusing, "mean")
    outvoted, opt = run(_refusing, "agree")
    assert _farthest(outvoted, honest) < 1e-6
    assert opt.stats().bad_messages == {2: outer} and opt.stats().evicted == ([2] if outer >= 3 else [])


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_flexdemo_replica_whose_own_refusal_is_outvoted_follows_its_policy(nonfinite):
    """This replica's gradient is NaN, the two others send the honest message of that step. skip: it keeps δ (zero
    at the first step), counts the skip and applies the others' mean, as the honest replicas do (the weights equal
    an honest run's); raise: it raises."""
    def gathered():
        link = _Recording()
        model = tiny_model()
        _train(model, FlexDeMo(model.parameters(), lr=1.0, topk=2, chunk=16, values="fp32", sign=False,
                               link=link), 1)
        return model, link.sent[0]

    honest, m0 = gathered()
    link = _Three()
    link.peer = lambda m: [m0.clone(), m0.clone()]
    model = tiny_model()
    opt = FlexDeMo(model.parameters(), lr=1.0, topk=2, chunk=16, values="fp32", sign=False, link=link,
                   aggregate="agree", nonfinite=nonfinite)
    opt.zero_grad()
    tiny_loss(model, 0, 0).backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    if nonfinite == "raise":
        with pytest.raises(NonFiniteGradientError):
            opt.step()
        return
    opt.step()
    assert opt.stats().skipped_steps == 1 and opt.stats().bad_messages == {}
    assert all(not state_view(opt.state[p]["delta"]).any() for p in model.parameters())
    assert _farthest(model, honest) < 1e-6


def test_diloco_with_a_rule_gathers_even_fp32_and_without_one_all_reduces():
    calls = []

    class Spy(_Three):
        def all_gather(self, tensor, *, async_op=False):
            calls.append("all_gather")
            return super().all_gather(tensor, async_op=async_op)

        def all_reduce(self, tensor, *, op="avg", async_op=False):
            calls.append("all_reduce")
            return tensor

    _run("diloco", Spy(), "clip", steps=2)
    _run("diloco", Spy(), "mean", steps=2)
    assert calls == ["all_gather", "all_reduce"]


def test_flexdemo_clip_bounds_a_thousandfold_replica():
    wire = WireFormat(16, 2, "fp32")
    rows = tuple(-(-p.numel() // 16) for p in tiny_model().parameters())

    def reencode(m, factor):
        idx, vals = wire.unpack_many(m[:-1], rows)
        payload, _ = wire.encode_many(idx, vals * factor, rows)
        return torch.cat([payload, m[-1:]])

    def run(link, aggregate):
        model = tiny_model()
        opt = FlexDeMo(model.parameters(), lr=1.0, topk=2, chunk=16, values="fp32", sign=False, link=link,
                       aggregate=aggregate)
        _train(model, opt, 3)
        return model, opt

    honest, _ = run(_Three(), "clip")
    clipped, opt = run(_Three(lambda m: reencode(m, 1000.0)), "clip")
    poisoned, _ = run(_Three(lambda m: reencode(m, 1000.0)), "mean")
    assert _farthest(clipped, honest) < 1e-5
    assert _farthest(poisoned, honest) > 0.1
    assert opt.stats().clipped == {2: 3}


def test_noloco_clip_bounds_the_peers_pseudo_gradient_half():
    numel = NUMEL

    def bad(m):  # the peer's θ − φ half times 1000, its φ half honest
        m = m.clone()
        m[numel:2 * numel] *= 1000.0
        return m

    def run(link, aggregate):
        model = tiny_model()
        opt = NoLoCo(model.parameters(), INNER, link=link, sync_every=2, aggregate=aggregate)
        _train(model, opt, 4)
        return model, opt

    honest, _ = run(_Link(), "clip")
    clipped, opt = run(_Link(bad), "clip")
    poisoned, _ = run(_Link(bad), "mean")
    assert _farthest(clipped, honest) < 1e-5
    assert _farthest(poisoned, honest) > 0.5
    assert opt.stats().clipped == {1: 2}


def test_the_pull_bounds_a_members_weights_by_how_far_the_others_lie():
    g = torch.Generator().manual_seed(0)
    own = torch.randn(40, generator=g)
    near = own + 0.01 * torch.randn(40, generator=g)
    far = own + 0.03 * torch.randn(40, generator=g)
    for bad in (-own, 1000 * own):  # weights sent flipped, or 1,000 times too large
        ws = [own, near, bad]
        plain = robust_pull(ws, 0, "mean")
        torch.testing.assert_close(plain, (own + near + bad) / 3)
        clipped = robust_pull(ws, 0, "clip")
        # the bad member's deviation is brought to the honest one's norm: the pull moves no further than it
        assert float((clipped - own).norm()) <= 2 * float((near - own).norm()) / 3 * (1 + 1e-5)
        assert float((plain - own).norm()) > 100 * float((clipped - own).norm())
        # agree's verdict on the updates leaves it out: the mean of the kept two
        torch.testing.assert_close(robust_pull(ws, 0, "agree", torch.tensor([True, True, False])), (own + near) / 2)
    # honest members: the larger deviation brought to the smaller's, the mean otherwise
    ws = [own, near, far]
    s = float((near - own).norm()) / float((far - own).norm())
    torch.testing.assert_close(robust_pull(ws, 0, "clip"), own + ((near - own) + s * (far - own)) / 3)
    torch.testing.assert_close(robust_pull(ws, 0, "trimmed"), trimmed_mean(ws))
    # a group of two: nothing to compare one deviation with, so the plain mean
    torch.testing.assert_close(robust_pull([own, -own], 0, "clip"), torch.zeros(40))
    torch.testing.assert_close(robust_pull([own, near], 1, "agree"), (own + near) / 2)


class _ThreeP2P(_Three):
    """:class:`_Three` for NoLoCo's point-to-point exchange (groups of 3: both peers)."""

    def exchange(self, tensor, peers, *, async_op=False):
        assert not async_op and list(peers) == [1, 2]
        return [tensor.clone(), tensor.clone()] if self.peer is None else self.peer(tensor.clone())


@pytest.mark.parametrize(("factor", "aggregate"), [(1000.0, "clip"), (-1.0, "agree"), (-1.0, "clip")])
def test_noloco_bounds_a_peer_whose_weights_half_is_poisoned_too(factor, aggregate):
    numel = NUMEL

    def bad(m):  # the whole payload, φ and θ − φ, times the factor (what a poisoning node sends)
        m = m.clone()
        m[:2 * numel] *= factor
        return m

    def run(link, aggregate):
        model = tiny_model()
        opt = NoLoCo(model.parameters(), INNER, link=link, sync_every=2, group_size=3, aggregate=aggregate)
        _train(model, opt, 4)
        return model, opt

    honest, _ = run(_ThreeP2P(), aggregate)
    robust, _ = run(_ThreeP2P(bad), aggregate)
    poisoned, _ = run(_ThreeP2P(bad), "mean")
    assert _farthest(poisoned, honest) > 0.1
    if aggregate == "clip" and factor < 0:
        # a flipped θ − φ of honest size is not caught by clip (it costs its share of the step); its φ is
        assert _farthest(robust, honest) < _farthest(poisoned, honest) / 3
    else:
        assert _farthest(robust, honest) < 1e-5


def test_a_poisoning_noloco_node_sends_its_whole_payload_times_the_factor_and_keeps_its_own_step():
    class Replay(_ThreeP2P):
        """Records what this replica sent; its peers send ``replies[k]`` at exchange k (else an echo)."""

        def __init__(self, replies=()):
            super().__init__()
            self.sent, self.replies = [], list(replies)

        def exchange(self, tensor, peers, *, async_op=False):
            self.sent.append(tensor.clone())
            k = len(self.sent) - 1
            if k < len(self.replies):
                return [self.replies[k].clone(), self.replies[k].clone()]
            return super().exchange(tensor, peers, async_op=async_op)

    def run(poison, replies=()):
        model, link = tiny_model(), Replay(replies)
        opt = NoLoCo(model.parameters(), INNER, link=link, sync_every=2, group_size=3, aggregate="agree")
        opt.outgoing_hook = poison
        _train(model, opt, 4)
        return model, link.sent

    honest_model, honest = run(None)
    model, sent = run(Poison(0, "flip", 3), replies=honest)  # its peers send what an honest run's did
    torch.testing.assert_close(sent[0], honest[0])  # before its step (inner step 2): honest
    assert torch.equal(sent[1][:-1], -honest[1][:-1]) and int(sent[1][-1]) == 0  # φ and θ − φ flipped
    assert _farthest(model, honest_model) == 0.0  # its own step used its honest message


def test_the_poisoning_node_sends_its_update_times_the_factor_from_its_step():
    sent = []

    class Watch(_Three):
        def all_gather(self, tensor, *, async_op=False):
            sent.append(FP32.decode(tensor[:-1], NUMEL).clone())
            return super().all_gather(tensor, async_op=async_op)

    model = tiny_model()
    opt = DiLoCo(model.parameters(), INNER, link=Watch(), sync_every=2, aggregate="clip")
    opt.outgoing_hook = Poison(0, "scale", 4)
    honest_model = tiny_model()
    honest = DiLoCo(honest_model.parameters(), INNER, link=Watch(), sync_every=2, aggregate="clip")
    for m, o in ((model, opt), (honest_model, honest)):
        _train(m, o, 4)
    # outer steps at inner steps 2 and 4: the first honest, the second (step 4 >= 4) times 1000
    torch.testing.assert_close(sent[0], sent[2])
    torch.testing.assert_close(sent[1], 1000 * sent[3])
    assert all(torch.isfinite(state_view(opt.state[p]["slow"])).all() for p in model.parameters())


@pytest.mark.parametrize("kind", ["flip", "scale"])
def test_a_poisoning_sparseloco_node_sends_the_wrong_update_and_keeps_its_own_error_feedback_honest(kind):
    """Only the message is poisoned: the error feedback is what the honest message left out. When the poison
    multiplied v = β·e + pseudo-gradient before the top-k, e grew 1000x per outer step under ``scale`` and the
    poisoner's accumulator overflowed within a bench's 200 steps: it flagged its step, and every replica
    stopped with a non-finite error, with clip or without (measured on 3 × t5-tiny)."""
    def run(poison, steps):
        link = _Recording()
        model = tiny_model()
        opt = SparseLoCo(model.parameters(), INNER, link=link, sync_every=2, aggregate="clip", **SPARSE)
        opt.outgoing_hook = poison
        _train(model, opt, steps)
        errors = torch.cat([state_view(opt.state[p]["error"]).reshape(-1) for p in model.parameters()])
        return link.sent, errors

    n_chunks = sum(-(-p.numel() // 16) for p in tiny_model().parameters())
    honest_sent, honest = run(None, 2)
    sent, poisoned = run(Poison(0, kind, 0), 2)
    # The first outer step starts from the same state: the same indices, the values times the factor,
    (i0, v0), (i1, v1) = (SPARSE_CODEC.decode(m[0][:-1], n_chunks) for m in (honest_sent, sent))
    assert torch.equal(i0, i1)
    torch.testing.assert_close(v1, POISON_KINDS[kind] * v0)
    # and the error feedback it keeps is the honest one's, bit for bit.
    assert torch.equal(poisoned, honest)
    _, later = run(Poison(0, kind, 0), 40)  # 20 outer steps, every one poisoned
    assert torch.isfinite(later).all()


@pytest.mark.parametrize("kind", ["flip", "scale"])
def test_a_poisoning_flexdemo_node_sends_the_wrong_update_and_keeps_its_own_momentum_honest(kind):
    """Only the message is poisoned: the node's δ loses what it would honestly have sent. When δ lost the
    poisoned values instead, it grew 2x (flip) or 999x (scale) wherever they were picked, and the poisoner's own
    momentum overflowed within a bench's 150 steps, ending the attack."""
    rows = tuple(-(-p.numel() // 16) for p in tiny_model().parameters())
    wire = WireFormat(16, 2, "fp32")

    def run(poison):
        sent = []

        class Watch(_Three):
            def all_gather(self, tensor, *, async_op=False):
                sent.append(wire.unpack_many(tensor[:-1], rows))
                return super().all_gather(tensor, async_op=async_op)

        model = tiny_model()
        opt = FlexDeMo(model.parameters(), lr=1e-2, topk=2, chunk=16, values="fp32", sign=False, link=Watch())
        opt.outgoing_hook = poison
        _train(model, opt, 40)
        deltas = torch.cat([state_view(opt.state[p]["delta"]).reshape(-1) for p in model.parameters()])
        return sent, deltas

    honest_sent, honest = run(None)
    sent, poisoned = run(Poison(0, kind, 0))
    # The first step starts from the same state: the same indices, the values times the factor.
    assert torch.equal(sent[0][0], honest_sent[0][0])
    torch.testing.assert_close(sent[0][1], POISON_KINDS[kind] * honest_sent[0][1])
    # Its δ stays of honest size (it differs: the applied updates were the poisoned ones).
    assert torch.isfinite(poisoned).all()
    assert float(poisoned.abs().max()) < 4 * float(honest.abs().max())


def test_poison_is_armed_on_the_named_node_only_and_refused_for_all_reduced_methods():
    from types import SimpleNamespace

    from lowband.optim import AdamWFullSync
    from lowband.testing.poison import arm_poison

    def cfg(text, method="diloco"):
        return SimpleNamespace(run=SimpleNamespace(poison=text), method=SimpleNamespace(name=method))

    topo = SimpleNamespace(num_nodes=2, node_of=lambda rank: rank // 2)  # 2 nodes x 2 ranks
    opt = DiLoCo(tiny_model().parameters(), INNER, sync_every=2)
    assert arm_poison(opt, cfg(None), topology=topo, rank=3) is None and opt.outgoing_hook is None
    assert arm_poison(opt, cfg("node1:flip@3"), topology=topo, rank=1) is None and opt.outgoing_hook is None
    assert arm_poison(opt, cfg("node1:flip@3"), topology=topo, rank=2) == Poison(1, "flip", 3)
    assert opt.outgoing_hook == Poison(1, "flip", 3)
    ft = SimpleNamespace(node=4, max_nodes=5)  # under fault tolerance: the node's slot
    assert arm_poison(opt, cfg("node4:scale@1"), ft=ft) == Poison(4, "scale", 1)
    with pytest.raises(ValueError, match="nodes 0..1"):
        arm_poison(opt, cfg("node2:flip@3"), topology=topo, rank=0)
    with pytest.raises(ValueError, match="adamw has no update of its own"):
        arm_poison(AdamWFullSync(tiny_model().parameters()), cfg("node0:scale@1", "adamw"), topology=topo)


# ----------------------------------------------------------------------------- a lying node: malformed messages
def _rows(chunk):
    return tuple(-(-p.numel() // chunk) for p in tiny_model().parameters())


def _lying_run(name, kind):
    """``name``'s optimizer on node 0, lying from inner step 4 on (``--poison node0:KIND@4``): what it sent at
    each exchange, the payload check its peers run, and the model."""
    from lowband.compress.check import dense_problems, float_problems, sparse_problems, wire_problems

    sent = []

    class Watch(_Link if name == "noloco" else _Three):  # NoLoCo: a group of two
        def all_gather(self, tensor, *, async_op=False):
            sent.append(tensor.clone())
            return super().all_gather(tensor, async_op=async_op)

        def all_reduce(self, tensor, *, op="avg", async_op=False):
            sent.append(tensor.clone())
            return super().all_reduce(tensor, op=op, async_op=async_op)

        def exchange(self, tensor, peers, *, async_op=False):
            sent.append(tensor.clone())
            return super().exchange(tensor, peers, async_op=async_op)

    model = tiny_model()
    if name == "flexdemo":
        opt = FlexDeMo(model.parameters(), lr=1.0, topk=2, chunk=16, values="fp32", sign=False, link=Watch())
        check = wire_problems(WireFormat(16, 2, "fp32"), _rows(16))
    elif name == "sparseloco":
        opt = SparseLoCo(model.parameters(), INNER, link=Watch(), sync_every=2, **SPARSE)
        check = sparse_problems(SPARSE_CODEC, sum(_rows(16)))
    elif name == "noloco":
        opt = NoLoCo(model.parameters(), INNER, link=Watch(), sync_every=2)
        check = float_problems  # fp32 values and the flag, exchanged as they are
    else:  # diloco: its fp32 all-reduce (no sender to name), or gathered messages under a rule
        opt = DiLoCo(model.parameters(), INNER, link=Watch(), sync_every=2,
                     aggregate="mean" if name == "diloco" else "clip")
        check = dense_problems(FP32, NUMEL)
    opt.outgoing_hook = Poison(0, kind, 4)
    _train(model, opt, 5 if name == "flexdemo" else 4)  # FlexDeMo's 5th step is its step 4 (it counts from 0)
    return sent, check, model, opt


@pytest.mark.parametrize(("name", "kind", "problem"), [
    ("sparseloco", "nan", "non-finite value(s) (values or scales) with a clean flag"),
    ("sparseloco", "index", "index out of range: indices span [16, 16], chunk 16"),
    ("flexdemo", "nan", "non-finite value(s) (values or scales) with a clean flag"),
    ("flexdemo", "index", "index out of range: indices span [16, 16], chunk 16"),
    ("noloco", "nan", "non-finite value(s) with a clean flag"),
    ("diloco-clip", "nan", "non-finite value(s) with a clean flag"),
])
def test_a_lying_node_sends_what_the_message_checks_refuse_with_a_clean_flag_and_keeps_its_own_state(
        name, kind, problem):
    sent, check, model, _ = _lying_run(name, kind)
    first = 4 if name == "flexdemo" else 1  # FlexDeMo exchanges at every step, the others at inner steps 2, 4
    honest, lying = sent[first - 1], sent[first]
    assert check(honest[:-1].unsqueeze(0)) == [None]  # before its step: an honest message
    (found,) = check(lying[:-1].unsqueeze(0))
    assert int(lying[-1]) == 0 and found is not None and found.endswith(problem), found
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the liar's own state goes on honestly


def test_nan_in_diloco_fp32_all_reduce_names_no_sender_and_every_replica_drops_the_outer_step():
    sent, _, model, opt = _lying_run("diloco", "nan")
    assert torch.isfinite(sent[0]).all() and not torch.isfinite(sent[1][:-1]).all() and float(sent[1][-1]) == 0.0
    assert opt.dropped_outer_steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())


def test_index_poison_needs_a_method_that_sends_indices():
    from types import SimpleNamespace

    from lowband.testing.poison import arm_poison

    topo = SimpleNamespace(num_nodes=2, node_of=lambda rank: rank)
    cfg = SimpleNamespace(run=SimpleNamespace(poison="node0:index@3"), method=SimpleNamespace(name="diloco"))
    with pytest.raises(ValueError, match="diloco sends no indices"):
        arm_poison(DiLoCo(tiny_model().parameters(), INNER, link=_Three(), sync_every=2), cfg, topology=topo, rank=0)
    opt = SparseLoCo(tiny_model().parameters(), INNER, link=_Three(), sync_every=2, **SPARSE)
    cfg.method.name = "sparseloco"
    assert arm_poison(opt, cfg, topology=topo, rank=0) == Poison(0, "index", 3)
