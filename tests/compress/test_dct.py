"""lowband/compress/dct.py: the chunked DCT and 2-D DCT tiles (basis, layout, padding), top-k per chunk, the sparse inverse."""

from __future__ import annotations

import math

import pytest
import torch

from lowband.compress import (
    dct,
    dct_basis,
    dct_basis_2d,
    from_chunks,
    from_tiles,
    idct,
    idct_sparse,
    num_chunks,
    num_tiles,
    scatter_chunks,
    to_chunks,
    to_tiles,
    topk_per_chunk,
)


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 128, 300])
def test_basis_is_orthonormal_and_is_the_dct_ii(chunk):
    b = dct_basis(chunk, torch.float64)
    torch.testing.assert_close(b @ b.T, torch.eye(chunk, dtype=torch.float64), atol=1e-12, rtol=0)
    # Against the textbook DCT-II sum for one random vector.
    x = torch.randn(chunk, dtype=torch.float64)
    n = torch.arange(chunk, dtype=torch.float64)
    ref = torch.stack([
        (x * torch.cos(math.pi * (2 * n + 1) * k / (2 * chunk))).sum() * math.sqrt((1 if k == 0 else 2) / chunk)
        for k in range(chunk)
    ])
    torch.testing.assert_close(dct(x.view(1, -1))[0], ref, atol=1e-10, rtol=0)


def test_basis_is_cached_per_chunk_dtype_device():
    assert dct_basis(128) is dct_basis(128, torch.float32, "cpu")
    assert dct_basis(128, torch.float64) is not dct_basis(128, torch.float32)
    assert dct_basis(64) is not dct_basis(128)


@pytest.mark.parametrize("numel, chunk", [(16204, 128), (4051, 128), (1, 128), (128, 128), (129, 128), (97, 1)])
def test_padding_keeps_the_chunk_size_asked_for(numel, chunk):
    # 16204 = 4·4051: DeToNATION's largest-divisor rule would give chunk 4; a prime gives chunk 1.
    x = torch.randn(numel)
    chunks = to_chunks(x, chunk)
    assert chunks.shape == (num_chunks(numel, chunk), chunk)
    assert torch.equal(from_chunks(chunks, numel), x)
    assert torch.count_nonzero(chunks.reshape(-1)[numel:]) == 0


def test_encode_decode_round_trip():
    x = torch.randn(1000, dtype=torch.float64)
    chunks = to_chunks(x, 128)
    torch.testing.assert_close(from_chunks(idct(dct(chunks)), 1000), x, atol=1e-12, rtol=0)


def test_topk_equal_to_chunk_reconstructs_exactly():
    x = torch.randn(777, dtype=torch.float64)
    coeffs = dct(to_chunks(x, 64))
    idx, vals = topk_per_chunk(coeffs, 64)
    torch.testing.assert_close(from_chunks(idct(scatter_chunks(idx, vals, 64)), 777), x, atol=1e-12, rtol=0)


def test_topk_keeps_the_largest_magnitudes():
    coeffs = torch.tensor([[0.1, -5.0, 3.0, 0.0], [2.0, 0.5, -0.25, -7.0]])
    idx, vals = topk_per_chunk(coeffs, 2)
    assert [sorted(r) for r in idx.tolist()] == [[1, 2], [0, 3]]
    assert sorted(vals[0].tolist()) == [-5.0, 3.0]
    with pytest.raises(ValueError, match="topk"):
        topk_per_chunk(coeffs, 5)
    with pytest.raises(ValueError, match="topk"):
        topk_per_chunk(coeffs, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 4])
def test_topk_integer_magnitudes_pick_as_float_magnitudes(dtype, k):
    # The picks compare |X| as integers (the bits without the sign bit); they must be the float picks,
    # NaN and Inf included (torch picks NaN first, then Inf), and -0.0 counted as 0.
    g = torch.Generator().manual_seed(0)
    coeffs = torch.randn(64, 32, generator=g).to(dtype)
    coeffs[0, 3] = float("nan")
    coeffs[1, 7] = float("inf")
    coeffs[2, 4] = -float("inf")
    coeffs[3, 5] = -float("nan")
    coeffs[4] = -0.0
    coeffs[5] = 0.25  # all tied
    coeffs[6, 9] = -coeffs[6].abs().max() * 2  # a negative largest
    idx, vals = topk_per_chunk(coeffs, k, workspace=torch.empty_like(coeffs))
    mag = coeffs.abs()
    ref = mag.argmax(-1, keepdim=True) if k == 1 else mag.topk(k, dim=-1, sorted=False).indices
    rows = [r for r in range(64) if r not in (4, 5)]  # without ties every pick is determined
    assert [sorted(idx[r].tolist()) for r in rows] == [sorted(ref[r].tolist()) for r in rows]
    assert idx[0].tolist().count(3) == 1 and idx[1].tolist().count(7) == 1 and idx[6].tolist().count(9) == 1
    assert torch.equal(vals.isnan(), coeffs.gather(-1, idx).isnan())
    finite = ~vals.isnan()
    assert torch.equal(vals[finite], coeffs.gather(-1, idx)[finite])
    if k == 1:  # all tied: argmax keeps the first, as torch's float argmax does
        assert idx[5].item() == ref[5].item() == 0 and idx[4].item() == ref[4].item() == 0
    strided = coeffs.t().contiguous().t()  # not contiguous: the float path, the same picks
    idx2, _ = topk_per_chunk(strided, k)
    assert [sorted(idx2[r].tolist()) for r in rows] == [sorted(idx[r].tolist()) for r in rows]


def test_decode_is_the_true_mean_over_replicas():
    # docs/algorithms.md (FlexDeMo, decoding): replicas sending {1,1} and {3,5} at positions {0,1} and {1,2} must decode to
    # [0.5, 2, 2.5, 0] (DeToNATION's "mean over those who picked it" gives [1, 2, 5, 0]).
    idx = torch.tensor([[[0, 1]], [[1, 2]]])
    vals = torch.tensor([[[1.0, 1.0]], [[3.0, 5.0]]])
    mean = scatter_chunks(idx, vals, 4) / 2
    assert mean.tolist() == [[0.5, 2.0, 2.5, 0.0]]


@pytest.mark.parametrize("terms", [1, 2, 3, 6, 7, 20])
@pytest.mark.parametrize("replicas", [None, 2, 3])
def test_sparse_inverse_dct_equals_the_dense_one(terms, replicas):
    # idct_sparse gathers basis rows (up to SPARSE_TERMS_MAX terms per chunk, else the dense product):
    # the same result as scattering and multiplying, exactly with one term, to float rounding otherwise.
    g = torch.Generator().manual_seed(terms)
    chunk, n = 32, 50
    shape = (n, terms) if replicas is None else (replicas, n, terms)
    idx = torch.stack([torch.randperm(chunk, generator=g)[:terms] for _ in range(math.prod(shape[:-1]))])
    idx = idx.view(shape)
    vals = torch.randn(shape, generator=g)
    dense = idct(scatter_chunks(idx, vals, chunk))
    sparse = idct_sparse(idx, vals, chunk)
    assert sparse.shape == (n, chunk)
    if terms == 1 and replicas is None:
        assert torch.equal(sparse, dense)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-5)
    # Replicas' terms in replica order, duplicates added: the true sum also where replicas picked alike.
    if replicas is not None:
        same = idct_sparse(idx[:1].expand(replicas, -1, -1), vals[:1].expand(replicas, -1, -1), chunk)
        torch.testing.assert_close(same, replicas * idct(scatter_chunks(idx[0], vals[0], chunk)), rtol=0, atol=1e-5)


def test_top1_is_the_largest_magnitude_as_topk_picks_it():
    coeffs = torch.randn(200, 128, generator=torch.Generator().manual_seed(3))
    idx, vals = topk_per_chunk(coeffs, 1)
    ref = coeffs.abs().topk(1, dim=-1).indices
    assert torch.equal(idx, ref) and torch.equal(vals, coeffs.gather(-1, ref))


@pytest.mark.parametrize("terms", [1, 3, 60])
def test_sparse_inverse_dct_writes_into_out_where_it_can(terms):
    # Above SPARSE_TERMS_MAX terms per chunk the dense product is used; `out` takes the result for one
    # term and for the dense product, and the result is the same with or without it.
    from lowband.compress.dct import SPARSE_TERMS_MAX

    g = torch.Generator().manual_seed(terms)
    chunk, n = 64, 40
    idx = torch.stack([torch.randperm(chunk, generator=g)[:terms] for _ in range(n)])
    vals = torch.randn(n, terms, generator=g)
    plain = idct_sparse(idx, vals, chunk)
    out = torch.empty(n, chunk)
    into = idct_sparse(idx, vals, chunk, out=out)
    assert torch.equal(into, plain)
    assert (into.data_ptr() == out.data_ptr()) == (terms == 1 or terms > SPARSE_TERMS_MAX)
    torch.testing.assert_close(plain, idct(scatter_chunks(idx, vals, chunk)), rtol=0, atol=1e-5)


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
