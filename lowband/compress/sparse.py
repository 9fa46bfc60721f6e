"""Wire format of SparseLoCo's outer message: per-chunk top-k indices and 2-, 1-, 16- or 32-bit values.

The message of one replica holds K = N·k kept values (N chunks of c elements over all parameters,
k per chunk), laid out as::

    [ indices: K × index bytes ][ values ][ scales: 4 × ⌈K / block⌉ (2bit, 1bit only) ][ flag: 1 byte ]

- indices are positions inside a chunk: uint8 for c ≤ 256, 16 bits for c ≤ 65536, int32 above
  (as :class:`lowband.compress.wire.WireFormat`);
- values, in chunk order (chunk 0's k values, then chunk 1's, ...), cut into blocks of ``block``
  values that share one fp32 scale:

  - ``2bit``: with a = max |v| over the block and d = a / 2, q = clamp(⌊v / d⌋, −2, 1) and
    v̂ = (q + ½)·d ∈ {−¾a, −¼a, ¼a, ¾a}; q + 2 is stored, four to a byte (the first value in the
    lowest two bits); the scale is d. |v − v̂| ≤ a / 4.
  - ``1bit``: v̂ = sign(v)·s with s the mean |v| of the block (+ for v ≥ 0), eight to a byte (the
    first value in the highest bit, as WireFormat's sign format); the scale is s.
  - ``bf16`` and ``fp32``: the values themselves (no scales); fp32 is lossless.

Bytes of one message (without the flag byte)::

    K·ib + ⌈K/4⌉ + 4·⌈K/block⌉  (2bit)      K·ib + ⌈K/8⌉ + 4·⌈K/block⌉  (1bit)
    K·(ib + 2)                  (bf16)      K·(ib + 4)                  (fp32)

Decoding is a pure function of the bytes: every rank that decodes the same bytes gets the same
values bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowband.compress.wire import _BITS, _index_dtype

__all__ = ["SPARSE_VALUE_FORMATS", "SparseCodec"]

SPARSE_VALUE_FORMATS = ("2bit", "1bit", "bf16", "fp32")
_SHIFTS2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


@dataclass(frozen=True)
class SparseCodec:
    """Encode (indices, values) of ``topk`` picks per chunk of ``chunk`` (see the module docstring).

    Args:
        chunk: chunk size c (indices lie in [0, c)).
        topk: values kept per chunk, 1 ≤ k ≤ c.
        values: one of :data:`SPARSE_VALUE_FORMATS`.
        block: kept values per fp32 scale (2bit, 1bit).
    """

    chunk: int
    topk: int
    values: str = "2bit"
    block: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {self.chunk!r}")
        if not isinstance(self.topk, int) or not 1 <= self.topk <= self.chunk:
            raise ValueError(f"topk must be an integer in [1, chunk={self.chunk}], got {self.topk!r}")
        if self.values not in SPARSE_VALUE_FORMATS:
            raise ValueError(f"values must be one of {', '.join(SPARSE_VALUE_FORMATS)}, got {self.values!r}")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block (quant_block) must be an integer >= 1, got {self.block!r}")

    @property
    def index_dtype(self) -> torch.dtype:
        return _index_dtype(self.chunk)

    @property
    def index_bytes(self) -> int:
        return torch.empty((), dtype=self.index_dtype).element_size()

    def _blocks(self, count: int) -> int:
        return -(-count // self.block)

    def value_nbytes(self, count: int) -> int:
        """Bytes of ``count`` values (with their scales)."""
        if self.values == "fp32":
            return 4 * count
        if self.values == "bf16":
            return 2 * count
        per_byte = 4 if self.values == "2bit" else 8
        return -(-count // per_byte) + 4 * self._blocks(count)

    def nbytes(self, n_chunks: int) -> int:
        """Bytes of the payload of ``n_chunks`` chunks (the flag byte not counted)."""
        count = n_chunks * self.topk
        return count * self.index_bytes + self.value_nbytes(count)

    # ------------------------------------------------------------------ values
    def _blocked(self, v: torch.Tensor) -> torch.Tensor:
        count = v.numel()
        pad = self._blocks(count) * self.block - count
        return torch.nn.functional.pad(v, (0, pad)).view(-1, self.block)

    def _quantize(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as uint8, one fp32 scale per block) of the flat float32 values ``v``."""
        count = v.numel()
        blocks = self._blocked(v)
        if self.values == "2bit":
            scale = blocks.abs().amax(dim=1) / 2
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.floor(blocks / safe.unsqueeze(1)).clamp_(-2, 1) + 2
        else:
            scale = blocks.abs().sum(dim=1)
            sizes = torch.full_like(scale, float(self.block))
            last = count - (blocks.shape[0] - 1) * self.block
            sizes[-1] = float(last)
            scale = scale / sizes
            q = (blocks >= 0).float()
        return q.reshape(-1)[:count].to(torch.uint8), scale.float()

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        count = codes.numel()
        per_value = scale.repeat_interleave(self.block)[:count]
        if self.values == "2bit":
            return (codes.float() - 1.5) * per_value
        return (codes.float() * 2 - 1) * per_value

    def sent_values(self, v: torch.Tensor) -> torch.Tensor:
        """The flat values as :meth:`decode` will give them back (float32), without the bytes."""
        v = v.reshape(-1).float()
        if self.values == "fp32":
            return v.clone()
        if self.values == "bf16":
            return v.to(torch.bfloat16).float()
        if v.numel() == 0:
            return v.clone()
        return self._dequantize(*self._quantize(v))

    # ------------------------------------------------------------------ bytes
    def encode(self, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """(n_chunks, k) indices and values -> :meth:`nbytes` uint8 bytes."""
        if idx.shape != vals.shape or idx.dim() != 2 or idx.shape[1] != self.topk:
            raise ValueError(f"expected (n_chunks, {self.topk}) indices and values, got {tuple(idx.shape)}, "
                             f"{tuple(vals.shape)}")
        flat_idx = idx.reshape(-1)
        if self.index_dtype == torch.int16:
            flat_idx = flat_idx - 32768
        ib = flat_idx.to(self.index_dtype).view(torch.uint8)
        v = vals.reshape(-1).float()
        if self.values == "fp32":
            vb = v.contiguous().view(torch.uint8)
        elif self.values == "bf16":
            vb = v.to(torch.bfloat16).view(torch.uint8)
        else:
            codes, scale = self._quantize(v) if v.numel() else (v.to(torch.uint8), v.new_zeros(0))
            if self.values == "2bit":
                pad = -codes.numel() % 4
                codes = torch.nn.functional.pad(codes, (0, pad)).view(-1, 4)
                packed = (codes << _SHIFTS2.to(codes.device)).sum(-1, dtype=torch.uint8)
            else:
                pad = -codes.numel() % 8
                codes = torch.nn.functional.pad(codes, (0, pad)).view(-1, 8)
                packed = (codes * _BITS.to(codes.device)).sum(-1, dtype=torch.uint8)
            vb = torch.cat([packed, scale.view(torch.uint8)])
        return torch.cat([ib.reshape(-1), vb.reshape(-1)])

    def decode(self, buf: torch.Tensor, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`encode`'s bytes -> (indices int64, values float32), both (n_chunks, k)."""
        buf = buf.reshape(-1)
        if buf.numel() != self.nbytes(n_chunks):
            raise ValueError(f"payload has {buf.numel()} bytes, expected {self.nbytes(n_chunks)} for {n_chunks} "
                             "chunks")
        count = n_chunks * self.topk
        nib = count * self.index_bytes
        idx = buf[:nib].clone().view(self.index_dtype).long()
        if self.index_dtype == torch.int16:
            idx = idx + 32768
        vb = buf[nib:]
        if self.values == "fp32":
            vals = vb.clone().view(torch.float32)
        elif self.values == "bf16":
            vals = vb.clone().view(torch.bfloat16).float()
        else:
            per_byte = 4 if self.values == "2bit" else 8
            npacked = -(-count // per_byte)
            packed, scale = vb[:npacked], vb[npacked:].clone().view(torch.float32)
            if self.values == "2bit":
                codes = (packed.unsqueeze(-1) >> _SHIFTS2.to(packed.device)) & 3
            else:
                codes = (packed.unsqueeze(-1) & _BITS.to(packed.device)).ne(0).to(torch.uint8)
            vals = self._dequantize(codes.reshape(-1)[:count], scale)
        return idx.view(n_chunks, self.topk), vals.view(n_chunks, self.topk)
