"""lowband/compress/quant.py: the block formats of the compressed outer traffic (sizes, rounding, refusals)."""

from __future__ import annotations

import pytest
import torch

from lowband.compress.quant import BlockQuant


# ----------------------------------------------------------------------------- the formats
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 4097])
def test_block_formats_have_the_stated_sizes_and_rounding(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    blocks = -(-n // 256)
    expected = {"fp32": 4 * n, "bf16": 2 * n, "int8": n + 4 * blocks, "int4": -(-n // 2) + 4 * blocks}
    for values, nbytes in expected.items():
        codec = BlockQuant(values)
        buf = codec.encode(x)
        assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(n) == nbytes, values
        y = codec.decode(buf, n)
        assert y.shape == (n,) and y.dtype == torch.float32
        if values == "fp32":
            assert torch.equal(x, y)
            continue
        if values == "bf16":
            assert torch.equal(y, x.to(torch.bfloat16).float())
            continue
        levels = 127 if values == "int8" else 7
        pad = torch.nn.functional.pad(x, (0, blocks * 256 - n)).view(blocks, 256)
        half_step = (pad.abs().amax(1) / levels / 2).repeat_interleave(256)[:n]
        assert ((x - y).abs() <= half_step * (1 + 1e-5) + 1e-7).all(), values
        assert torch.equal(codec.decode(codec.encode(x), n), y)  # decoding is deterministic


def test_int8_is_4x_and_int4_8x_smaller_than_fp32_apart_from_scales():
    n = 256 * 1000
    fp32 = BlockQuant("fp32").nbytes(n)
    scales = 4 * 1000
    assert BlockQuant("int8").nbytes(n) - scales == fp32 // 4
    assert BlockQuant("int4").nbytes(n) - scales == fp32 // 8


def test_block_format_rejects_bad_settings_and_zero_blocks_decode_to_zero():
    with pytest.raises(ValueError, match="values must be one of"):
        BlockQuant("int2")
    with pytest.raises(ValueError, match="block"):
        BlockQuant("int8", block=0)
    with pytest.raises(ValueError, match="bytes"):
        BlockQuant("int8").decode(torch.zeros(3, dtype=torch.uint8), 10)
    z = torch.zeros(300)
    assert torch.equal(BlockQuant("int4").decode(BlockQuant("int4").encode(z), 300), z)
