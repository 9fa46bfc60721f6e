"""Chunked DCT, top-k and the wire format, in one process."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lowband.compress import (
    VALUE_FORMATS,
    WireFormat,
    dct,
    dct_basis,
    from_chunks,
    idct,
    idct_sparse,
    num_chunks,
    scatter_chunks,
    to_chunks,
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


@pytest.mark.parametrize("values, chunk, topk", list(itertools.product(VALUE_FORMATS, [4, 128, 256, 257, 4096], [1, 3])))
def test_pack_unpack_round_trip_and_payload_size(values, chunk, topk):
    wire = WireFormat(chunk, topk, values)
    n = 37
    coeffs = torch.randn(n, chunk)
    idx, vals = topk_per_chunk(coeffs, topk)
    buf = wire.pack(idx, vals)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == wire.payload_nbytes(n)
    idx_bytes = 1 if chunk <= 256 else 2
    count = n * topk
    value_bytes = {"bf16": 2 * count, "fp32": 4 * count, "sign": -(-count // 8) + 4}[values]
    assert wire.payload_nbytes(n) == count * idx_bytes + value_bytes
    idx2, vals2 = wire.unpack(buf, n)
    assert torch.equal(idx2, idx)
    if values == "fp32":
        assert torch.equal(vals2, vals)
    elif values == "bf16":
        assert torch.equal(vals2, vals.to(torch.bfloat16).float())
    else:
        scale = vals.abs().mean()
        assert torch.equal(vals2.sign(), torch.where(vals >= 0, 1.0, -1.0))
        torch.testing.assert_close(vals2.abs(), torch.full_like(vals, scale.item()))
    # Gathered buffers with a leading replica dimension unpack row by row.
    stacked = torch.stack([buf, buf])
    idx3, vals3 = wire.unpack(stacked, n)
    assert idx3.shape == (2, n, topk) and torch.equal(idx3[1], idx) and torch.equal(vals3[0], vals2)
    # FlexDeMo takes the values as sent from sent_values, without unpacking: they must be the same floats.
    assert torch.equal(wire.sent_values(vals), vals2)


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


def test_index_dtype_is_the_smallest_that_fits():
    assert WireFormat(128, 1).index_dtype == torch.uint8
    assert WireFormat(256, 1).index_dtype == torch.uint8
    assert WireFormat(257, 1).index_bytes == 2
    assert WireFormat(65536, 1).index_bytes == 2
    assert WireFormat(65537, 1).index_bytes == 4
    # Index 65535 survives the 16-bit path.
    wire = WireFormat(65536, 1, "fp32")
    idx = torch.tensor([[65535], [0], [32768]])
    vals = torch.tensor([[1.0], [2.0], [3.0]])
    assert torch.equal(wire.unpack(wire.pack(idx, vals), 3)[0], idx)


def test_top1_chunk128_is_3_bytes_per_chunk_against_8_for_int32_fp32():
    # Paper setting: Top-1, chunk 128. DeToNATION sends int32 + fp32 = 8 bytes per coefficient.
    n = num_chunks(16204, 128)
    assert WireFormat(128, 1, "bf16").payload_nbytes(n) == 3 * n
    assert 8 * n / WireFormat(128, 1, "bf16").payload_nbytes(n) == pytest.approx(8 / 3)


def test_empty_tensor_packs_to_nothing_but_the_sign_scale():
    for values in VALUE_FORMATS:
        wire = WireFormat(16, 2, values)
        idx = torch.empty(0, 2, dtype=torch.long)
        vals = torch.empty(0, 2)
        buf = wire.pack(idx, vals)
        assert buf.numel() == wire.payload_nbytes(0) == (4 if values == "sign" else 0)
        i2, v2 = wire.unpack(buf, 0)
        assert i2.shape == (0, 2) and v2.shape == (0, 2)


@pytest.mark.parametrize("kwargs", [dict(chunk=0, topk=1), dict(chunk=8, topk=9), dict(chunk=8, topk=0),
                                    dict(chunk=8, topk=1, values="fp8")])
def test_wire_format_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        WireFormat(**kwargs)


def test_all_finite_sees_nan_and_inf_in_any_tensor_and_ignores_empty_ones():
    from lowband.optim._common import all_finite

    ok = [torch.randn(5), torch.empty(0), torch.tensor([3e38, -3e38]), torch.ones(2, dtype=torch.float64)]
    assert all_finite(ok) and all_finite([]) and all_finite([torch.empty(0)])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.zeros(4)
        t[2] = bad
        assert not all_finite(ok + [t]) and not all_finite([t.double()] + ok)


@pytest.mark.parametrize("values, chunk, topk", list(itertools.product(VALUE_FORMATS, [4, 128, 300], [1, 3])))
@pytest.mark.parametrize("rows", [(5,), (0,), (1, 0, 7, 3), (2, 9, 1, 1, 0, 4)])
def test_encode_many_is_the_per_tensor_packs_concatenated(values, chunk, topk, rows):
    # FlexDeMo encodes a param group's tensors at once, their chunks stacked in one matrix: the bytes must
    # be each tensor's own payload, one after the other, and the values as sent those of sent_values.
    g = torch.Generator().manual_seed(sum(rows) + chunk + topk)
    wire = WireFormat(chunk, topk, values)
    picks = [topk_per_chunk(torch.randn(r, chunk, generator=g), topk) for r in rows]
    idx, vals = torch.cat([i for i, _ in picks]), torch.cat([v for _, v in picks])
    payload, sent = wire.encode_many(idx, vals, rows)
    assert torch.equal(payload, torch.cat([wire.pack(i, v) for i, v in picks]))
    assert payload.numel() == wire.payload_nbytes_many(rows) == sum(wire.payload_nbytes(r) for r in rows)
    assert torch.equal(sent, torch.cat([wire.sent_values(v) for _, v in picks]))
    # Decoding a gathered (R, bytes) message gives every replica's indices and the values as sent.
    other = wire.encode_many(idx.flip(0), vals.flip(0) * 2, rows)[0]
    idx2, vals2 = wire.unpack_many(torch.stack([payload, other]), rows)
    assert idx2.shape == (2, sum(rows), topk)
    assert torch.equal(idx2[0], idx) and torch.equal(vals2[0], sent)
    starts = [sum(rows[:t]) for t in range(len(rows))]
    offset = 0
    for t, r in enumerate(rows):  # replica 1's tensors as the per-tensor unpack reads them
        n = wire.payload_nbytes(r)
        i1, v1 = wire.unpack(other[offset:offset + n], r)
        assert torch.equal(idx2[1, starts[t]:starts[t] + r], i1) and torch.equal(vals2[1, starts[t]:starts[t] + r], v1)
        offset += n
    with pytest.raises(ValueError, match="bytes"):
        wire.unpack_many(payload[:-1] if payload.numel() else torch.zeros(1, dtype=torch.uint8), rows)


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
