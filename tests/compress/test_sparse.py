"""lowband/compress/sparse.py: SparseLoCo's codec (top-k of chunked DCT coefficients, quantised values): round trips and sizes."""

from __future__ import annotations

import pytest
import torch

from lowband.compress.sparse import SPARSE_VALUE_FORMATS, SparseCodec


# ----------------------------------------------------------------------------- codec
@pytest.mark.parametrize("values", SPARSE_VALUE_FORMATS)
@pytest.mark.parametrize("chunk, topk", [(128, 2), (300, 3), (8, 8)])
def test_codec_round_trip_and_sizes(values, chunk, topk):
    codec = SparseCodec(chunk, topk, values, block=5)
    g = torch.Generator().manual_seed(0)
    idx, vals = torch.randint(0, chunk, (7, topk), generator=g), torch.randn(7, topk, generator=g)
    buf = codec.encode(idx, vals)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(7)
    count, ib = 7 * topk, (1 if chunk <= 256 else 2)
    blocks = -(-count // 5)
    expected = {"2bit": count * ib + -(-count // 4) + 4 * blocks, "1bit": count * ib + -(-count // 8) + 4 * blocks,
                "bf16": count * (ib + 2), "fp32": count * (ib + 4)}[values]
    assert buf.numel() == expected
    idx2, vals2 = codec.decode(buf, 7)
    assert torch.equal(idx2, idx)
    assert torch.equal(vals2.reshape(-1), codec.sent_values(vals))
    v, v2 = vals.reshape(-1), vals2.reshape(-1)
    for b in range(blocks):
        sl = slice(5 * b, 5 * b + 5)
        if values == "2bit":  # 4 levels ±¼a, ±¾a: error at most a/4
            a = v[sl].abs().max()
            assert ((v[sl] - v2[sl]).abs() <= a / 4 + 1e-6).all()
            levels = torch.tensor([-0.75, -0.25, 0.25, 0.75])
            assert ((v2[sl] / a).unsqueeze(1) - levels).abs().min(1).values.max() < 1e-6
        elif values == "1bit":  # sign × the block's mean magnitude
            torch.testing.assert_close(v2[sl].abs(), v[sl].abs().mean().expand_as(v2[sl]))
            assert torch.equal(v2[sl] >= 0, v[sl] >= 0)
    if values == "fp32":
        assert torch.equal(v2, v)
