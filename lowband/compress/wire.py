"""Wire format for top-k DCT coefficients: (indices, values) <-> one flat uint8 buffer.

Layout of one tensor's payload (n = chunks, k = kept per chunk):

    [ indices: n·k × index bytes ][ values: n·k × value bytes  |  ⌈n·k/8⌉ sign bits + 4-byte fp32 scale ]

- Indices are positions inside a chunk, so they need only enough bits for the chunk size:
  uint8 for c ≤ 256, 16 bits for c ≤ 65536, int32 above.
- Values: ``bf16`` (default; sign() downstream keeps nothing bf16 loses), ``fp32`` (exact), or
  ``sign``: one bit per value and one fp32 scale per tensor (the mean magnitude of the kept values).

Buffers are plain bytes, so payloads of many tensors concatenate into one message and
all-gather as one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["WireFormat", "VALUE_FORMATS"]

VALUE_FORMATS = ("bf16", "fp32", "sign")
_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def _as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype``: a fresh, aligned copy of the slice (payloads are small)."""
    size = torch.empty((), dtype=dtype).element_size()
    rows, cols = buf.shape
    return buf.reshape(-1).clone().view(dtype).reshape(rows, cols // size)


def _index_dtype(chunk: int) -> torch.dtype:
    if chunk <= 256:
        return torch.uint8
    if chunk <= 65536:
        return torch.int16  # stored as idx − 32768 so the full 16-bit range is usable
    return torch.int32


@dataclass(frozen=True)
class WireFormat:
    """Packs top-k coefficients of chunked tensors.

    Args:
        chunk: chunk size c (the indices are in [0, c)).
        topk: coefficients kept per chunk.
        values: ``"bf16"``, ``"fp32"`` or ``"sign"``.
    """

    chunk: int
    topk: int
    values: str = "bf16"

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if not 1 <= self.topk <= self.chunk:
            raise ValueError(f"topk must be in [1, chunk={self.chunk}], got {self.topk}")
        if self.values not in VALUE_FORMATS:
            raise ValueError(f"values must be one of {VALUE_FORMATS}, got {self.values!r}")

    @property
    def index_dtype(self) -> torch.dtype:
        return _index_dtype(self.chunk)

    @property
    def index_bytes(self) -> int:
        return torch.empty((), dtype=self.index_dtype).element_size()

    def value_nbytes(self, count: int) -> int:
        if self.values == "sign":
            return -(-count // 8) + 4
        return count * (2 if self.values == "bf16" else 4)

    def payload_nbytes(self, n_chunks: int) -> int:
        """Bytes of one tensor's payload with ``n_chunks`` chunks."""
        count = n_chunks * self.topk
        return count * self.index_bytes + self.value_nbytes(count)

    # ------------------------------------------------------------------ pack
    def pack(self, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """(n_chunks, k) indices and values -> flat uint8 buffer of :meth:`payload_nbytes` bytes."""
        if idx.shape != vals.shape or idx.dim() != 2 or idx.shape[1] != self.topk:
            raise ValueError(f"expected (n_chunks, {self.topk}) indices and values, got {tuple(idx.shape)}, "
                             f"{tuple(vals.shape)}")
        it = self.index_dtype
        flat_idx = idx.reshape(-1)
        if it == torch.int16:
            flat_idx = flat_idx - 32768
        ib = flat_idx.to(it).view(torch.uint8)
        flat_vals = vals.reshape(-1)
        if self.values == "bf16":
            vb = flat_vals.to(torch.bfloat16).view(torch.uint8)
        elif self.values == "fp32":
            vb = flat_vals.to(torch.float32).view(torch.uint8)
        else:
            count = flat_vals.numel()
            bits = (flat_vals >= 0).to(torch.uint8)
            pad = -count % 8
            if pad:
                bits = torch.nn.functional.pad(bits, (0, pad))
            packed = (bits.view(-1, 8) * _BITS.to(bits.device)).sum(-1, dtype=torch.uint8)
            scale = flat_vals.abs().float().mean().reshape(1) if count else torch.zeros(1, device=vals.device)
            vb = torch.cat([packed, scale.view(torch.uint8)])
        return torch.cat([ib.reshape(-1), vb.reshape(-1)])

    def sent_values(self, vals: torch.Tensor) -> torch.Tensor:
        """The values as :meth:`unpack` will give them back from :meth:`pack` (float32), without the bytes.

        bf16: rounded to bf16; fp32: unchanged; sign: ±1 (+1 for v ≥ 0) times the tensor's fp32 scale,
        the mean magnitude. ``unpack(pack(idx, vals))[1]`` equals this bit for bit (tested).
        """
        if self.values == "bf16":
            return vals.to(torch.bfloat16).float()
        if self.values == "fp32":
            return vals.to(torch.float32)
        if vals.numel() == 0:
            return vals.float()
        scale = vals.abs().float().mean()
        return ((vals >= 0).float() * 2 - 1) * scale

    def unpack(self, buf: torch.Tensor, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat buffer(s) -> (indices int64, values float32), shaped (..., n_chunks, k).

        ``buf`` may have leading dimensions (e.g. (R, nbytes) after an all-gather).
        """
        lead = buf.shape[:-1]
        expected = self.payload_nbytes(n_chunks)
        if buf.shape[-1] != expected:
            raise ValueError(f"payload has {buf.shape[-1]} bytes, expected {expected} for {n_chunks} chunks")
        count = n_chunks * self.topk
        nib = count * self.index_bytes
        rows = 1
        for d in lead:
            rows *= d
        buf = buf.reshape(rows, expected)
        ib, vb = buf[:, :nib], buf[:, nib:]
        idx = _as(ib, self.index_dtype).long()
        if self.index_dtype == torch.int16:
            idx = idx + 32768
        if self.values == "bf16":
            vals = _as(vb, torch.bfloat16).float()
        elif self.values == "fp32":
            vals = _as(vb, torch.float32)
        else:
            nsign = -(-count // 8)
            packed = vb[:, :nsign]
            scale = _as(vb[:, nsign:], torch.float32)  # (B, 1)
            bits = (packed.unsqueeze(-1) & _BITS.to(packed.device)).ne(0).reshape(rows, -1)[:, :count]
            vals = (bits.float() * 2 - 1) * scale
        shape = (*lead, n_chunks, self.topk)
        return idx.reshape(shape), vals.reshape(shape)
