"""Dense value formats for the outer steps of DiLoCo and NoLoCo: fp32, bf16, int8 and int4 with per-block scales.

A flat float vector of n elements is cut into blocks of ``block`` elements (default 256; the last
block may be shorter). Per block b with s_b = max |x| over the block:

- ``int8``: q = round(x / (s_b / 127)) in [−127, 127], one byte each; x̂ = q · s_b / 127;
- ``int4``: q = round(x / (s_b / 7)) in [−7, 7], stored as q + 8 in one nibble, two per byte
  (the first element of a pair in the low nibble); x̂ = q · s_b / 7;
- the scales s_b / 127 (or s_b / 7) travel as fp32, after the values.

Bytes for n elements (B = ⌈n / block⌉ blocks)::

    fp32: 4·n        bf16: 2·n        int8: n + 4·B        int4: ⌈n/2⌉ + 4·B

So int8 is 4× and int4 8× smaller than fp32 apart from the scales, which add 4/block bytes per
element (1/64 byte at block 256: +1.6 % of the int8 payload, +3.1 % of the int4 payload). The
rounding error of an element is at most half a step, s_b/254 (int8) or s_b/14 (int4).

Decoding is a pure function of the bytes, so every rank that decodes the same bytes gets the same
values bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OUTER_VALUE_FORMATS", "BlockQuant"]

OUTER_VALUE_FORMATS = ("fp32", "bf16", "int8", "int4")
_LEVELS = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class BlockQuant:
    """Encode a flat float vector in one of :data:`OUTER_VALUE_FORMATS` (see the module docstring).

    Args:
        values: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"``.
        block: elements per scale (int8/int4), >= 1.
    """

    values: str = "fp32"
    block: int = 256

    def __post_init__(self) -> None:
        if self.values not in OUTER_VALUE_FORMATS:
            raise ValueError(f"values must be one of {', '.join(OUTER_VALUE_FORMATS)}, got {self.values!r}")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be an integer >= 1, got {self.block!r}")

    @property
    def lossy(self) -> bool:
        return self.values != "fp32"

    def nbytes(self, n: int) -> int:
        """Bytes of ``n`` encoded elements."""
        blocks = -(-n // self.block)
        if self.values == "fp32":
            return 4 * n
        if self.values == "bf16":
            return 2 * n
        if self.values == "int8":
            return n + 4 * blocks
        return -(-n // 2) + 4 * blocks

    def _scaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q as float, scale per block) for int8/int4."""
        n, levels = x.numel(), _LEVELS[self.values]
        blocks = -(-n // self.block)
        padded = torch.nn.functional.pad(x, (0, blocks * self.block - n)).view(blocks, self.block)
        scale = padded.abs().amax(dim=1) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(padded / safe.unsqueeze(1)).clamp_(-levels, levels)
        return q.reshape(-1)[:n], scale

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """A 1-D float tensor -> :meth:`nbytes` uint8 bytes."""
        x = x.reshape(-1).float()
        if self.values == "fp32":
            return x.clone().view(torch.uint8)
        if self.values == "bf16":
            return x.to(torch.bfloat16).view(torch.uint8)
        q, scale = self._scaled(x)
        if self.values == "int8":
            vb = q.to(torch.int8).view(torch.uint8)
        else:
            u = (q + 8).to(torch.uint8)
            if u.numel() % 2:
                u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
            pairs = u.view(-1, 2)
            vb = pairs[:, 0] | (pairs[:, 1] << 4)
        return torch.cat([vb, scale.float().view(torch.uint8)])

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """:meth:`encode`'s bytes -> the n float32 values as sent."""
        buf = buf.reshape(-1)
        if buf.numel() != self.nbytes(n):
            raise ValueError(f"{self.values} buffer has {buf.numel()} bytes, expected {self.nbytes(n)} for {n} values")
        if self.values == "fp32":
            return buf.clone().view(torch.float32)
        if self.values == "bf16":
            return buf.clone().view(torch.bfloat16).float()
        blocks = -(-n // self.block)
        nv = n if self.values == "int8" else -(-n // 2)
        vb, scale = buf[:nv], buf[nv:].clone().view(torch.float32)
        if self.values == "int8":
            q = vb.clone().view(torch.int8).float()
        else:
            q = torch.stack([vb & 15, vb >> 4], dim=1).reshape(-1)[:n].float() - 8
        q = torch.nn.functional.pad(q, (0, blocks * self.block - n)).view(blocks, self.block)
        return (q * scale.unsqueeze(1)).reshape(-1)[:n]
