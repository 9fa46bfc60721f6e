"""lowband/compress/wire.py: the wire format (indices and values packed into one buffer): round trips, payload sizes, refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from lowband.compress import (
    VALUE_FORMATS,
    WireFormat,
    num_chunks,
    topk_per_chunk,
)


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
