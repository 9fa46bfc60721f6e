"""2-D DCT tiles (FlexDeMo ``tile=t``): the transform, the tiled layout, and the optimizer on them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lowband.bench.methods import method_label, parse_method_spec, shown_params
from lowband.compress import (
    WireFormat,
    dct_basis,
    dct_basis_2d,
    from_tiles,
    idct_sparse,
    num_tiles,
    scatter_chunks,
    to_tiles,
    topk_per_chunk,
)
from lowband.optim import FlexDeMo
from lowband.testing import full_params, run_ranks, tiny_loss, tiny_model, tiny_sharded
from lowband.train.methods import check_hyperparameters, hp_flag

LR = 0.05
# Shapes that exercise every rule: square and ragged matrices, a shard with no rows (FSDP2 gives the
# last ranks nothing of a small parameter), a conv weight (read as 5 × 3·3·3), a 1-D bias, a scalar,
# and a matrix of more than 2^16 tiled elements (transformed in place in its tiled copy, blocks of views).
SHAPES = [(16, 16), (37, 13), (0, 9), (5, 3, 3, 3), (29,), (), (260, 300)]


def test_basis_2d_is_the_separable_dct_of_a_tile():
    # Against the textbook 2-D DCT-II double sum (not built from dct_basis), and against B·x·Bᵀ.
    for t in (1, 3, 4):
        x = torch.randn(t, t, dtype=torch.float64)
        n = torch.arange(t, dtype=torch.float64)
        scale = [math.sqrt((1 if k == 0 else 2) / t) for k in range(t)]
        ref = torch.tensor([[
            scale[i] * scale[j] * (x * torch.outer(torch.cos(math.pi * (2 * n + 1) * i / (2 * t)),
                                                   torch.cos(math.pi * (2 * n + 1) * j / (2 * t)))).sum()
            for j in range(t)] for i in range(t)], dtype=torch.float64)
        b2 = dct_basis_2d(t, torch.float64)
        torch.testing.assert_close((b2 @ x.reshape(-1)).view(t, t), ref, atol=1e-12, rtol=0)
    for t in (4, 16):
        b, b2 = dct_basis(t, torch.float64), dct_basis_2d(t, torch.float64)
        x = torch.randn(t, t, dtype=torch.float64)
        torch.testing.assert_close((b2 @ x.reshape(-1)).view(t, t), b @ x @ b.T, atol=1e-12, rtol=0)
        torch.testing.assert_close(b2 @ b2.T, torch.eye(t * t, dtype=torch.float64), atol=1e-12, rtol=0)
    assert dct_basis_2d(16) is dct_basis_2d(16)  # cached


@pytest.mark.parametrize("shape", [(16, 16), (5, 7), (33, 17), (0, 9), (1, 1), (4, 0)])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_tiles_layout_padding_and_round_trip(shape, t):
    m = torch.randn(shape)
    tiles = to_tiles(m, t)
    rt, ct = -(-shape[0] // t), -(-shape[1] // t)
    assert tiles.shape == (num_tiles(*shape, t), t * t) == (rt * ct, t * t)
    padded = torch.zeros(rt * t, ct * t)
    padded[:shape[0], :shape[1]] = m
    for i in range(rt):  # tile (i, j) is row i·ct + j, its elements row-major; the padding is zeros
        for j in range(ct):
            assert torch.equal(tiles[i * ct + j].view(t, t), padded[i * t:(i + 1) * t, j * t:(j + 1) * t])
    assert torch.equal(from_tiles(tiles, shape), m)
    out = torch.empty(shape)
    assert from_tiles(tiles, shape, out=out) is out and torch.equal(out, m)


@pytest.mark.parametrize("t", [4, 16])  # 16 and 256 terms per tile: idct_sparse's fused sum, its dense product
def test_tile_transform_round_trip_and_full_topk_is_exact(t):
    m = torch.randn(37, 50, dtype=torch.float64)
    b2 = dct_basis_2d(t, torch.float64)
    tiles = to_tiles(m, t)
    coeffs = tiles @ b2.T
    torch.testing.assert_close(coeffs @ b2, tiles, atol=1e-12, rtol=0)
    idx, vals = topk_per_chunk(coeffs, t * t)
    back = idct_sparse(idx, vals, t * t, basis=b2)
    torch.testing.assert_close(from_tiles(back, m.shape), m, atol=1e-12, rtol=0)


def test_sparse_inverse_with_the_2d_basis_equals_the_dense_one():
    b2 = dct_basis_2d(4)
    coeffs = torch.randn(10, 16)
    idx, vals = topk_per_chunk(coeffs, 3)
    torch.testing.assert_close(idct_sparse(idx, vals, 16, basis=b2), scatter_chunks(idx, vals, 16) @ b2,
                               atol=1e-6, rtol=0)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("t", [4, 16])
@pytest.mark.parametrize("overlap", [False, True])
def test_full_topk_fp32_without_sign_is_sgd_at_lr_squared(t, overlap):
    # topk = t², fp32, sign off: every tile's momentum is sent whole and leaves δ, so this is SGD at
    # lr² (overlap: applied one step late), as for 1-D chunks.
    params, ref = _params(), _params()
    opt = FlexDeMo(params, lr=LR, tile=t, topk=t * t, sign=False, values="fp32", overlap=overlap,
                   overlap_apply="stale")
    grads = []
    for step in range(4):
        _grads(params, step)
        grads.append([p.grad.clone() for p in params])
        opt.step()
        if not overlap or step > 0:
            with torch.no_grad():
                for r, g in zip(ref, grads[step - overlap], strict=True):
                    r.sub_(LR * LR * g)
        for p, g in zip(params, grads[step], strict=True):
            if p.dim() >= 2:  # tiled: the scratch is a tiled copy, the gradient is left alone
                assert torch.equal(p.grad, g)
            if p.numel():
                assert opt.state[p]["delta"].abs().max() <= 1e-6  # the momentum emptied (fp32 rounding)
    for a, b in zip(params, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_each_tile_sends_its_topk_2d_coefficients_and_keeps_the_rest():
    # One step from δ = 0 (decay irrelevant), bf16 values: what left δ, q = lr·g − δ, is per tile the
    # inverse 2-D DCT of the k largest 2-D DCT coefficients of lr·g, rounded to bf16; 1-D params the
    # same with the 1-D DCT of t² elements.
    t, k = 4, 3
    params = _params()
    opt = FlexDeMo(params, lr=LR, tile=t, topk=k)
    _grads(params, 0)
    want = [LR * p.grad for p in params]
    opt.step()
    for p, w in zip(params, want, strict=True):
        q = w - opt.state[p]["delta"]
        if p.dim() >= 2:
            mat = w.reshape(w.shape[0], math.prod(w.shape[1:]))
            rows, basis = to_tiles(mat, t), dct_basis_2d(t)
            sent = to_tiles(q.reshape(mat.shape), t)
        else:
            flat = torch.nn.functional.pad(w.reshape(-1), (0, -w.numel() % (t * t)))
            rows, basis = flat.view(-1, t * t), dct_basis(t * t)
            sent = torch.nn.functional.pad(q.reshape(-1), (0, -q.numel() % (t * t))).view(-1, t * t)
        idx, vals = topk_per_chunk(rows @ basis.T, k)
        expect = idct_sparse(idx, vals.bfloat16().float(), t * t, basis=basis)
        if p.dim() >= 2:  # what lands in the padding is not kept
            expect = to_tiles(from_tiles(expect, mat.shape), t)
        else:
            expect.view(-1)[w.numel():] = 0
        torch.testing.assert_close(sent, expect, atol=1e-6, rtol=0)


class _LoopbackLink:
    """Two replicas that send the same message: the all-gather returns this rank's message twice."""

    group_size = 2
    participating = True

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.topology = SimpleNamespace(shards=1, world_size=2, replicas=2)
        self.messages: list[torch.Tensor] = []

    def commit(self) -> bool:
        return True

    def all_gather(self, tensor, *, async_op=False):
        self.messages.append(tensor.clone())
        return torch.stack([tensor, tensor])


@pytest.mark.parametrize("values", ["bf16", "fp32", "sign"])
def test_message_is_payload_bytes_and_the_formula(values):
    t, k = 16, 8
    params = _params()
    link = _LoopbackLink()
    opt = FlexDeMo(params, lr=LR, tile=t, topk=k, values=values, link=link)
    wire = WireFormat(t * t, k, values)
    assert wire.index_bytes == 1  # t ≤ 16: one byte per index
    expect = sum(wire.payload_nbytes(num_tiles(p.shape[0], math.prod(p.shape[1:]), t) if p.dim() >= 2
                                     else -(-p.numel() // (t * t))) for p in params)
    assert opt.payload_bytes() == expect
    for step in range(2):
        _grads(params, step)
        opt.step()
    assert [m.numel() for m in link.messages] == [expect + 1] * 2


@pytest.mark.parametrize("overlap", [False, True])
def test_checkpoint_resumes_bit_for_bit(overlap):
    def make(params):
        return FlexDeMo(params, lr=LR, tile=4, topk=3, decay=0.9, weight_decay=0.01, overlap=overlap)

    def run(params, opt, steps):
        for step in steps:
            _grads(params, step)
            opt.step()

    params = _params()
    opt = make(params)
    run(params, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in params]
    run(params, opt, range(3, 6))
    opt.flush()
    resumed = [torch.nn.Parameter(x) for x in saved_params]
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    run(resumed, opt2, range(3, 6))
    opt2.flush()
    assert all(torch.equal(a, b) for a, b in zip(params, resumed, strict=True))
    assert all(torch.equal(opt.state[a]["delta"], opt2.state[b]["delta"]) for a, b in zip(params, resumed, strict=True))


def test_a_nonfinite_gradient_anywhere_in_a_tile_refuses_the_step():
    # FlexDeMo checks only the values it sends: a NaN/Inf in a tiled matrix (first, middle, last
    # element; the ragged ones' edge tiles included) must reach them through the 2-D DCT and the pick.
    params = _params()
    opt = FlexDeMo(params, lr=LR, tile=4, topk=1, nonfinite="skip")
    _grads(params, 0)
    opt.step()  # a good step first: δ is non-zero
    cases = 0
    for t, p in enumerate(params):
        for pos in sorted({0, p.numel() // 2, p.numel() - 1} if p.numel() else set()):
            for bad in (float("nan"), float("inf"), -float("inf")):
                before = [q.detach().clone() for q in params] + [opt.state[q]["delta"].clone() for q in params]
                _grads(params, 1)
                p.grad.view(-1)[pos] = bad
                opt.step()
                after = [q.detach() for q in params] + [opt.state[q]["delta"] for q in params]
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), (t, pos, bad)
                cases += 1
    assert opt.skipped_steps == cases


def test_a_checkpoint_from_before_tiles_loads_as_1d_chunks():
    params = _params()
    opt = FlexDeMo(params, lr=LR, topk=2, chunk=16)
    _grads(params, 0)
    opt.step()
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["tile"]  # the layout of checkpoints written before the option existed
    opt2 = FlexDeMo(_params(), lr=LR, topk=2, chunk=16)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["tile"] == 0


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(tile=4, topk=17), "tile²=16"),
    (dict(tile=-1), "tile"),
    (dict(tile=2.0), "tile"),
])  # fmt: skip
def test_bad_tiles_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        FlexDeMo(_params(), lr=LR, **kwargs)


def test_tile_is_a_method_hyperparameter():
    spec = parse_method_spec("flexdemo:tile=16,topk=8")
    assert spec.given_values() == {"tile": 16, "topk": 8} and spec.hp.tile == 16
    assert method_label("flexdemo", shown_params(spec.hp, spec.given)) == "FlexDeMo Top8 tile=16"
    assert hp_flag("tile") == "--tile"
    assert check_hyperparameters("flexdemo", {"tile": 16, "topk": 200})["tile"] == 16  # topk counts per tile
    with pytest.raises(ValueError, match="tile"):
        check_hyperparameters("flexdemo", {"tile": 4, "topk": 17})
    with pytest.raises(ValueError, match="tile"):
        check_hyperparameters("flexdemo", {"tile": -1})


# ----------------------------------------------------------------------------- FSDP2 shards on 2 × 2
def _tiles_on_2x2(rank: int, ckpt_dir: str) -> dict:
    from lowband.checkpoint import load_checkpoint, save_checkpoint
    from lowband.link import Link
    from lowband.topology import Topology

    topo = Topology.from_env()
    out: dict = {}
    # tiny_model's matrices (37 × 13, 29 × 37, 3 × 29) split by rows over the node's two ranks: uneven
    # shards (19 and 18 rows; 2 and 1) with ragged edges. topk = t², fp32, sign off == SGD at lr².
    model = tiny_sharded(topo)
    out["local_shapes"] = [tuple(p.to_local().shape) for p in model.parameters()]
    link = Link(topo)
    opt = FlexDeMo(model.parameters(), lr=LR, tile=4, topk=16, sign=False, values="fp32", link=link)
    ref = tiny_model()
    sgd = torch.optim.SGD(ref.parameters(), lr=LR**2)
    for step in range(3):
        opt.zero_grad()
        tiny_loss(model, rank, step).backward()
        opt.step()
        link.end_step()
        sgd.zero_grad()
        torch.stack([tiny_loss(ref, r, step) for r in range(topo.world_size)]).mean().backward()
        sgd.step()
    out["vs_sgd"] = max((x - y).abs().max().item() for x, y in zip(full_params(model), full_params(ref), strict=True))
    # Top-3 of 16, bf16, sign on: the replicas stay bit-identical and the link carries payload_bytes + 1.
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = FlexDeMo(model.parameters(), lr=LR, tile=4, topk=3, weight_decay=0.01, link=link)
    sent = []
    for step in range(3):
        opt.zero_grad()
        tiny_loss(model, rank, step).backward()
        opt.step()
        sent.append(link.end_step().ops[0].payload_bytes)
    out["payload"] = (opt.payload_bytes(), sent)
    out["params"] = [p.detach().tolist() for p in full_params(model)]

    # A DCP checkpoint with overlap in the middle: resumed == uninterrupted, bit for bit.
    def run(model, opt, link, steps):
        for step in steps:
            opt.zero_grad()
            tiny_loss(model, rank, step).backward()
            opt.step()
            link.end_step()
        opt.flush()

    def make(model, link):
        return FlexDeMo(model.parameters(), lr=LR, tile=4, topk=3, decay=0.9, link=link, overlap=True,
                        overlap_apply="stale")

    model = tiny_sharded(topo)
    link = Link(topo)
    run(model, make(model, link), link, range(5))
    straight = full_params(model)
    model = tiny_sharded(topo)
    link = Link(topo)
    opt = make(model, link)
    for step in range(3):
        opt.zero_grad()
        tiny_loss(model, rank, step).backward()
        opt.step()
        link.end_step()
    save_checkpoint(f"{ckpt_dir}/tiles", model=model, optimizer=opt, extra={"step": 3})
    model2 = tiny_sharded(topo, seed=123)  # everything must come from the checkpoint
    link2 = Link(topo)
    opt2 = make(model2, link2)
    load_checkpoint(f"{ckpt_dir}/tiles", model=model2, optimizer=opt2)
    run(model2, opt2, link2, range(3, 5))
    out["resume_maxdiff"] = max((a - b).abs().max().item()
                                for a, b in zip(straight, full_params(model2), strict=True))
    return out


@pytest.mark.multiprocess
def test_tiles_on_fsdp2_shards_of_a_2x2_mesh(tmp_path):
    results = run_ranks(_tiles_on_2x2, world_size=4, ranks_per_node=2, args=(str(tmp_path),), timeout_s=180)
    assert {r["local_shapes"][0] for r in results} == {(19, 13), (18, 13)}  # uneven row shards
    for r in results:
        assert r["vs_sgd"] < 1e-5, r["vs_sgd"]
        payload, sent = r["payload"]
        assert all(s == payload + 1 for s in sent), (payload, sent)
        assert r["resume_maxdiff"] == 0.0, r["resume_maxdiff"]
    assert all(r["params"] == results[0]["params"] for r in results[1:])  # every rank: the same full model
