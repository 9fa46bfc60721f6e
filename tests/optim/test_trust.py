"""Every optimizer checks what it receives (issue 29 item 4): a crafted bad message from replica 1 is
named, counted in ``stats().bad_messages`` and left out of the mean (all-gathers, NoLoCo's exchange),
or, where the method sums in the collective (an all-reduce cannot name its sender), the step is
dropped; a refusal (flag 1) is still honoured; parameters and state stay finite. One process, stand-in
links that return this rank's message and a corrupted copy of it as replica 1's."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import pytest
import torch

from lowband.compress.check import UNATTRIBUTED, BadMessage
from lowband.compress.quant import BlockQuant
from lowband.compress.sparse import SparseCodec
from lowband.compress.wire import WireFormat
from lowband.optim import (
    AdamWFullSync,
    DetoFull,
    DiLoCo,
    FlexDeMo,
    NoLoCo,
    NonFiniteGradientError,
    SparseLoCo,
)
from lowband.optim._common import EVICT_AFTER, BadMessageTally, state_view
from lowband.testing.ranks import tiny_loss, tiny_model

INNER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
NAN = float("nan")


class _Link:
    """Two replicas in one process: replica 1's message is ``peer(own message)``; ``peer=None``: only
    this replica's message comes back (the mean over the good senders, for reference)."""

    group_size = max_group_size = participants = 2
    group_rank, group_ranks, rank = 0, [0, 1], 0
    participating, ft, timeout_s = True, None, None

    def __init__(self, peer=None) -> None:
        self.topology = SimpleNamespace(shards=1, world_size=2, replicas=2)
        self.peer = peer

    def commit(self) -> bool:
        return True

    def all_gather(self, tensor, *, async_op=False):  # async: the tensor stands for its handle
        if self.peer is None:
            return tensor.unsqueeze(0).clone()
        peers = self.peer(tensor.clone())  # one message, or a list: replicas 1, 2, ...
        return torch.stack([tensor.clone(), *(peers if isinstance(peers, list) else [peers])])

    def exchange(self, tensor, peers, *, async_op=False):
        assert not async_op and list(peers) == [1]
        return [tensor.clone() if self.peer is None else self.peer(tensor.clone())]

    def all_reduce(self, tensor, *, op="avg", async_op=False):
        assert op == "avg"  # async: the tensor stands for its handle
        peer = tensor.clone() if self.peer is None else self.peer(tensor.clone())
        return tensor.add_(peer).div_(2)


def _set(m: torch.Tensor, i: int, v) -> torch.Tensor:
    m[i] = v
    return m


# ----------------------------------------------------------------------------- corruptions
def _gather_corruptions(reencode):
    """Corruptions of a uint8 message with one flag byte; ``reencode(m, fn)`` re-encodes the payload with
    its decoded values passed through ``fn`` (a NaN value, or a NaN scale in the scaled formats)."""
    return {
        "index >= chunk": lambda m: _set(m, 0, 255),
        "NaN value, clean flag": lambda m: reencode(m, lambda v: _set(v.reshape(-1), 0, NAN).view_as(v)),
        "flag 3": lambda m: _set(m, -1, 3),  # (2 is "not counted", a legitimate flag)
        "flag -1": lambda m: _set(m, -1, 255),
    }


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(model, opt, steps):
    for step in range(steps):
        opt.zero_grad()
        tiny_loss(model, 0, step).backward()
        opt.step()


def _assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- FlexDeMo
def _flexdemo(link, **kw):
    model = tiny_model()
    kw = dict(lr=1e-2, topk=2, chunk=16, values="fp32", link=link) | kw
    return model, FlexDeMo(model.parameters(), **kw)


def _flexdemo_reencode(m, fn):
    model = tiny_model()
    wire = WireFormat(16, 2, "fp32")
    rows = tuple(-(-p.numel() // 16) for p in model.parameters())
    idx, vals = wire.unpack_many(m[:-1], rows)
    payload, _ = wire.encode_many(idx, fn(vals.clone()), rows)
    return torch.cat([payload, m[-1:]])


FLEX_BAD = _gather_corruptions(_flexdemo_reencode)


@pytest.mark.parametrize("kind", sorted(FLEX_BAD))
def test_flexdemo_leaves_out_a_bad_message(kind, caplog):
    ref_model, ref = _flexdemo(_Link())
    _train(ref_model, ref, 2)
    model, opt = _flexdemo(_Link(FLEX_BAD[kind]))
    with caplog.at_level(logging.WARNING):
        _train(model, opt, 2)
    _assert_same(_params(model), _params(ref_model))  # the mean over the good sender: replica 0's own
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(state_view(st["delta"])).all() for st in opt.state.values())
    stats = opt.stats()
    assert stats.bad_messages == {1: 2} and stats.bad_in_a_row == {1: 2} and stats.skipped_steps == 0
    assert "replica 1" in caplog.text


def test_flexdemo_a_good_message_passes_and_a_refusal_is_honoured():
    model, opt = _flexdemo(_Link(lambda m: m))
    _train(model, opt, 1)
    assert opt.stats().bad_messages == {}
    before = _params(model)
    refusal = lambda m: _set(m.zero_(), -1, 1)  # noqa: E731
    opt.link.peer = refusal
    with pytest.raises(NonFiniteGradientError):
        _train(model, opt, 1)
    _assert_same(_params(model), before)
    model, opt = _flexdemo(_Link(refusal), nonfinite="skip")
    before = _params(model)
    _train(model, opt, 1)
    _assert_same(_params(model), before)
    assert opt.stats().skipped_steps == 1 and opt.stats().bad_messages == {}


def test_flexdemo_overlap_leaves_out_a_bad_message():
    ref_model, ref = _flexdemo(_Link(), overlap=True, overlap_apply="stale")
    _train(ref_model, ref, 3)
    ref.flush()
    model, opt = _flexdemo(_Link(FLEX_BAD["index >= chunk"]), overlap=True, overlap_apply="stale")
    _train(model, opt, 3)
    opt.flush()
    _assert_same(_params(model), _params(ref_model))
    assert opt.stats().bad_messages == {1: 3}


def test_a_good_streak_resets_the_count_in_a_row():
    model, opt = _flexdemo(_Link(FLEX_BAD["flag -1"]))
    _train(model, opt, 2)
    opt.link.peer = lambda m: m
    _train(model, opt, 1)
    assert opt.stats().bad_messages == {1: 2} and opt.stats().bad_in_a_row == {}


def test_a_sender_bad_three_times_in_a_row_is_evicted_until_the_membership_changes(caplog):
    """After EVICT_AFTER bad messages in a row, whatever the sender sends is left out, well-formed or not (here its
    honest message with the sign flipped): the replica steps as with its own message alone. A new membership (under
    fault tolerance: another quorum's replica ids) names other members by the indices: the eviction ends."""
    ref_model, ref = _flexdemo(_Link())
    _train(ref_model, ref, EVICT_AFTER)
    _train(ref_model, ref, 2)  # the same batches as below
    model, opt = _flexdemo(_Link(FLEX_BAD["index >= chunk"]))
    with caplog.at_level(logging.WARNING):
        _train(model, opt, EVICT_AFTER)
    assert opt.stats().evicted == [1] and "replica 1 is evicted from the exchange after 3 bad messages" in caplog.text
    caplog.clear()
    opt.link.peer = lambda m: _flexdemo_reencode(m, lambda v: -v)  # well-formed, finite, wrong
    with caplog.at_level(logging.WARNING):
        _train(model, opt, 2)
    _assert_same(_params(model), _params(ref_model))
    assert opt.stats().bad_messages == {1: EVICT_AFTER + 2} and caplog.text == ""  # named once, when evicted
    assert opt.stats().screened() == {"bad_messages": {"1": EVICT_AFTER + 2}, "clipped": {}, "left_out": {},
                                      "evicted": [1], "aggregations": 0}  # the run's summary: what the report shows
    opt.link.ft = SimpleNamespace(replica_ids=["lowband_a_node0:1", "lowband_a_node2:2"])
    opt.link.peer = lambda m: m
    _train(model, opt, 1)
    assert opt.bad_messages.evicted == set() and opt.stats().bad_in_a_row == {}
    assert opt.stats().evicted == [1]  # the run's summary keeps who was evicted (by its place then)


def test_an_unattributable_sum_is_never_evicted():
    tally = BadMessageTally()
    for _ in range(EVICT_AFTER + 1):
        tally.record([BadMessage(UNATTRIBUTED, "an impossible mean")], [UNATTRIBUTED], "x", "y")
    assert tally.in_a_row == {UNATTRIBUTED: EVICT_AFTER + 1} and tally.evicted == set()


# ----------------------------------------------------------------------------- the outer-step methods
def _outer(cls, link, **kw):
    model = tiny_model()
    return model, cls(model.parameters(), INNER, link=link, sync_every=2, **kw)


def _sparse_reencode(m, fn, codec):
    n_chunks = sum(-(-p.numel() // codec.chunk) for p in tiny_model().parameters())
    idx, vals = codec.decode(m[:-1], n_chunks)
    return torch.cat([codec.encode(idx, fn(vals.clone())), m[-1:]])


def _dense_reencode(m, fn, codec, numel):
    return torch.cat([codec.encode(fn(codec.decode(m[:-1], numel).clone())), m[-1:]])


NUMEL = sum(p.numel() for p in tiny_model().parameters())
SPARSE = dict(chunk=16, topk=2, values="2bit", quant_block=8)  # 2bit: a NaN value is a NaN scale
SPARSE_CODEC = SparseCodec(16, 2, "2bit", 8)
OUTER_CASES = {
    "sparseloco": (SparseLoCo, SPARSE, _gather_corruptions(functools.partial(_sparse_reencode, codec=SPARSE_CODEC))),
    "diloco-int8": (DiLoCo, dict(values="int8", quant_block=8), _gather_corruptions(
        functools.partial(_dense_reencode, codec=BlockQuant("int8", 8), numel=NUMEL))),
}
del OUTER_CASES["diloco-int8"][2]["index >= chunk"]  # a dense format: no indices


@pytest.mark.parametrize("case, kind", [(c, k) for c, (_, _, bad) in OUTER_CASES.items() for k in sorted(bad)])
def test_all_gather_outer_step_leaves_out_a_bad_message(case, kind, caplog):
    cls, kw, bad = OUTER_CASES[case]
    ref_model, ref = _outer(cls, _Link(), **kw)
    _train(ref_model, ref, 4)
    model, opt = _outer(cls, _Link(bad[kind]), **kw)
    with caplog.at_level(logging.WARNING):
        _train(model, opt, 4)
    _assert_same(_params(model), _params(ref_model))  # the mean over replica 0 alone
    for st in opt.state.values():
        assert all(torch.isfinite(state_view(v)).all() for v in st.values() if isinstance(v, torch.Tensor))
    assert opt.stats().bad_messages == {1: 2} and opt.stats().dropped_steps == 0
    assert "replica 1" in caplog.text


@pytest.mark.parametrize("case", sorted(OUTER_CASES))
def test_all_gather_outer_step_honours_a_refusal(case):
    cls, kw, _ = OUTER_CASES[case]
    model, opt = _outer(cls, _Link(lambda m: _set(m.zero_(), -1, 1)), **kw)
    _train(model, opt, 1)
    phi = [state_view(opt.state[p]["slow"]).clone() for p in model.parameters()]
    with pytest.raises(NonFiniteGradientError, match="outer step was refused"):
        _train(model, opt, 1)
    _assert_same([state_view(opt.state[p]["slow"]) for p in model.parameters()], phi)
    assert opt.stats().bad_messages == {}


def _noloco_corruptions(lossy: bool):
    if lossy:  # a dense format: no indices
        bad = _gather_corruptions(functools.partial(_dense_reencode, codec=BlockQuant("int8", 8), numel=2 * NUMEL))
        del bad["index >= chunk"]
        return bad
    return {
        "NaN value, clean flag": lambda m: _set(m, 0, NAN),
        "Inf value, clean flag": lambda m: _set(m, 3, float("inf")),
        "flag 3": lambda m: _set(m, -1, 3.0),
        "flag -1": lambda m: _set(m, -1, -1.0),
        "flag 0.5": lambda m: _set(m, -1, 0.5),
        "short": lambda m: m[:-2],
        "long": lambda m: torch.cat([m, m[:1]]),
    }


@pytest.mark.parametrize("values, kind", [(v, k) for v in ("fp32", "int8")
                                          for k in sorted(_noloco_corruptions(v != "fp32"))])
def test_noloco_leaves_out_a_bad_peer(values, kind, caplog):
    kw = dict(values=values, quant_block=8)
    ref_model, ref = _outer(NoLoCo, _Link(lambda m: m), **kw)  # an identical peer: the mean is replica 0's own
    _train(ref_model, ref, 4)
    model, opt = _outer(NoLoCo, _Link(_noloco_corruptions(values != "fp32")[kind]), **kw)
    with caplog.at_level(logging.WARNING):
        _train(model, opt, 4)
    _assert_same(_params(model), _params(ref_model))
    assert opt.stats().bad_messages == {1: 2} and "replica 1" in caplog.text
    assert ref.stats().bad_messages == {}


def _not_counted(m):
    return _set(torch.zeros_like(m), -1, 2)


@pytest.mark.parametrize("case", [*sorted(OUTER_CASES), "noloco-fp32", "noloco-int8"])
def test_a_peer_whose_state_is_stale_is_left_out_and_never_counted_as_bad(case):
    """A node healing, or whose heal was refused, under fault tolerance sends zeros marked "not counted" (flag 2):
    the others' mean leaves it out (as if it sent nothing) and no one reports it."""
    cls, kw = (NoLoCo, dict(values=case.split("-")[1], quant_block=8)) if case.startswith("noloco") \
        else OUTER_CASES[case][:2]
    ref_model, ref = _outer(cls, _Link(lambda m: m) if cls is NoLoCo else _Link(), **kw)  # replica 0's own mean
    _train(ref_model, ref, 4)
    model, opt = _outer(cls, _Link(_not_counted), **kw)
    _train(model, opt, 4)
    _assert_same(_params(model), _params(ref_model))
    assert opt.stats().bad_messages == {} and opt.stats().dropped_steps == 0
    stale = _Link(lambda m: m)
    stale.participating = False  # this replica's own state is stale: what it sends is the mark, not its values
    sent = []
    stale.all_gather = lambda t, async_op=False: sent.append(t.clone()) or torch.stack([t.clone(), t.clone()])
    stale.exchange = lambda t, peers, async_op=False: sent.append(t.clone()) or [t.clone()]
    model, opt = _outer(cls, stale, **kw)
    _train(model, opt, 2)
    assert sent and all(m[-1].item() == 2 and not m[:-1].any() for m in sent)


def test_noloco_honours_a_refusal():
    model, opt = _outer(NoLoCo, _Link(lambda m: _set(m.zero_(), -1, 1.0)))
    with pytest.raises(NonFiniteGradientError):
        _train(model, opt, 2)
    assert opt.stats().bad_messages == {}


# ----------------------------------------------------------------------------- all-reduce: no sender
ALL_REDUCE_BAD = {
    "NaN value, clean flag": lambda m: _set(m, 0, NAN),
    "flag 0.5": lambda m: _set(m, -1, 0.5),
    "flag 3": lambda m: _set(m, -1, 3.0),  # (a flag 2 sums like two refusals of two: not told apart)
    "flag -1 alone": lambda m: _set(m, -1, -1.0),
}


@pytest.mark.parametrize("kind", sorted(ALL_REDUCE_BAD))
def test_diloco_fp32_drops_an_impossible_mean(kind, caplog):
    model, opt = _outer(DiLoCo, _Link(ALL_REDUCE_BAD[kind]))
    with caplog.at_level(logging.WARNING):
        _train(model, opt, 2)
    phi = [state_view(opt.state[p]["slow"]) for p in model.parameters()]
    _assert_same(phi, _params(tiny_model()))  # φ unchanged: the outer step was dropped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.equal(state_view(opt.state[p]["momentum"]), torch.zeros_like(p)) for p in model.parameters())
    assert opt.stats().bad_messages == {-1: 1} and opt.stats().dropped_steps == 1
    assert "unattributable" in caplog.text


@pytest.mark.parametrize("cls", [AdamWFullSync, DetoFull])
@pytest.mark.parametrize("kind", sorted(ALL_REDUCE_BAD))
def test_full_sync_skips_an_impossible_mean(cls, kind):
    model = tiny_model()
    opt = cls(model.parameters(), lr=1e-2, link=_Link(ALL_REDUCE_BAD[kind]))
    before = _params(model)
    _train(model, opt, 1)
    _assert_same(_params(model), before)
    assert opt.stats().bad_messages == {-1: 1} and opt.stats().skipped_steps == 1
    opt.link.peer = lambda m: m  # a good mean again: the step goes through
    _train(model, opt, 1)
    assert not all(torch.equal(a, b) for a, b in zip(_params(model), before, strict=True))
    assert opt.stats().bad_in_a_row == {}


def test_full_sync_still_refuses_a_flagged_step():
    model = tiny_model()
    opt = AdamWFullSync(model.parameters(), lr=1e-2, link=_Link(lambda m: _set(m.zero_(), -1, 1.0)))
    with pytest.raises(NonFiniteGradientError):
        _train(model, opt, 1)
    assert opt.stats().bad_messages == {}


# ----------------------------------------------------------------------------- delayed outer steps (τ = 1)
def test_delayed_outer_step_leaves_out_a_bad_message():
    _, kw, bad = OUTER_CASES["sparseloco"]
    ref_model, ref = _outer(SparseLoCo, _Link(), delay=1, **kw)
    _train(ref_model, ref, 5)
    model, opt = _outer(SparseLoCo, _Link(bad["index >= chunk"]), delay=1, **kw)
    _train(model, opt, 5)  # outer steps start after steps 2 and 4, merge after 3 and 5
    _assert_same(_params(model), _params(ref_model))
    assert opt.stats().bad_messages == {1: 2}


def test_delayed_diloco_fp32_drops_an_impossible_mean():
    model, opt = _outer(DiLoCo, _Link(ALL_REDUCE_BAD["NaN value, clean flag"]), delay=1)
    _train(model, opt, 3)
    _assert_same([state_view(opt.state[p]["slow"]) for p in model.parameters()], _params(tiny_model()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.stats().dropped_steps == 1 and opt.stats().bad_messages == {-1: 1}


def test_finite_messages_whose_mean_overflows_drop_the_outer_step(caplog):
    # Each of replicas 1 and 2 passes its check (finite values), but their sum is not finite.
    codec = SparseCodec(16, 2, "fp32")
    kw = dict(chunk=16, topk=2, values="fp32")

    def huge(m):
        m = _sparse_reencode(m, lambda v: _set(v.reshape(-1), 0, 3e38).view_as(v), codec)
        return [m, m.clone()]

    model, opt = _outer(SparseLoCo, _Link(huge), **kw)
    with caplog.at_level(logging.WARNING):
        _train(model, opt, 2)
    _assert_same([state_view(opt.state[p]["slow"]) for p in model.parameters()], _params(tiny_model()))
    assert all(torch.isfinite(state_view(opt.state[p]["error"])).all() for p in model.parameters())
    assert opt.stats().bad_messages == {-1: 1} and opt.stats().dropped_steps == 1
    assert "not finite" in caplog.text


# ----------------------------------------------------------------------------- a failed commit
class _FailingLink(_Link):
    """A link whose commit fails once, at its ``fail_at``-th call (a collective between nodes failed there)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(lambda m: m)  # an identical peer
        self.fail_at, self.calls = fail_at, 0

    def commit(self) -> bool:
        self.calls += 1
        return self.calls != self.fail_at


DROPPERS = {
    "flexdemo": _flexdemo,
    "adamw": lambda link: (m := tiny_model(), AdamWFullSync(m.parameters(), lr=1e-2, link=link)),
    "deto-full": lambda link: (m := tiny_model(), DetoFull(m.parameters(), lr=1e-2, link=link)),
    "diloco": lambda link: _outer(DiLoCo, link),  # sync_every=2: its second step is the outer step
    "sparseloco": lambda link: _outer(SparseLoCo, link, topk=2, chunk=16),
}


@pytest.mark.parametrize("method", sorted(DROPPERS))
def test_a_step_whose_exchange_failed_is_counted_as_dropped_and_moves_no_parameter(method):
    """Under fault tolerance a step whose collective failed somewhere is dropped whole: no parameter moves
    (an outer method: its outer weights φ do not), and ``stats().dropped_steps`` counts it (the trainer's
    "dropped" records and the bench's fault report read it). The steps around it go on."""
    model, opt = DROPPERS[method](_FailingLink(fail_at=2))
    outer = method in ("diloco", "sparseloco")  # they commit at their outer steps, every second step
    period = 2 if outer else 1

    def kept():  # what a dropped step must leave as it was
        return [state_view(opt.state[p]["slow"]).clone() for p in model.parameters()] if outer else _params(model)

    _train(model, opt, period)  # commit 1: applied
    assert opt.stats().dropped_steps == 0
    before = kept()
    _train(model, opt, period)  # commit 2 fails
    _assert_same(kept(), before)
    assert opt.stats().dropped_steps == 1
    _train(model, opt, period)  # commit 3: applied again
    assert opt.stats().dropped_steps == 1 and not all(torch.equal(a, b) for a, b in zip(kept(), before, strict=True))


def test_evicted_members_are_named_by_the_replica_ids_of_the_exchange_that_evicted_them():
    """What a rank reports to the Lighthouse's gate: the evicted sender's replica id in the exchange that evicted
    it (NoLoCo's window quorum may form anew while the inner steps run: its indices would name others)."""
    ids = ("lowband_a_node0:u0", "lowband_a_node1:u1", "lowband_a_node2:u2")
    tally = BadMessageTally()
    tally.membership(ids)
    for _ in range(EVICT_AFTER):
        tally.record([BadMessage(2, "index out of range")], [0, 1, 2], "x", "y")
    assert tally.evicted_members() == {ids[2]: "index out of range"}
    tally.membership(ids[:2])  # another quorum: the eviction ends, and nothing is reported against its indices
    assert tally.evicted_members() == {} and tally.ever_evicted == {2}
    plain = BadMessageTally()  # without fault tolerance there is no one to report to
    plain.membership(None)
    for _ in range(EVICT_AFTER):
        plain.record([BadMessage(1, "NaN")], [0, 1], "x", "y")
    assert plain.evicted == {1} and plain.evicted_members() == {}
