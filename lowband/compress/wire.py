"""Wire format for top-k DCT coefficients: (indices, values) <-> one flat uint8 buffer.

Layout of one tensor's payload (n = chunks, k = kept per chunk):

    [ indices: n·k × index bytes ][ values: n·k × value bytes  |  ⌈n·k/8⌉ sign bits + 4-byte fp32 scale ]

- Indices are positions inside a chunk, so they need only enough bits for the chunk size:
  uint8 for c ≤ 256, 16 bits for c ≤ 65536, int32 above.
- Values: ``bf16`` (default; sign() downstream keeps nothing bf16 loses), ``fp32`` (exact), or
  ``sign``: one bit per value and one fp32 scale per tensor (the mean magnitude of the kept values).

Buffers are plain bytes, so payloads of many tensors concatenate into one message and
all-gather as one tensor. :meth:`WireFormat.encode_many` and :meth:`WireFormat.unpack_many` give
and read that concatenation for many tensors whose chunks lie in one (total chunks, k) matrix,
with a few whole-matrix operations and one rearrangement of byte runs instead of a pack per tensor: the bytes
are the same as the tensors' payloads packed one by one and concatenated (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

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
class _ManyLayout:
    """Where each tensor's bytes lie, for :meth:`WireFormat.encode_many` (cached per tensors' chunk counts).

    The whole-matrix encoding writes a *source* buffer: every tensor's index bytes, then (bf16, fp32)
    every tensor's value bytes, or (sign) every tensor's sign bytes, each tensor's bits padded to whole
    bytes, then one fp32 scale per tensor. The message is that buffer rearranged into the tensors' own
    payloads, one after the other. Both orders are runs of contiguous bytes: the message is the
    source's ``segments`` concatenated, the source the message's ``inv_segments`` (no per-byte index,
    which would hold 8 bytes of int64 per message byte).
    """

    segments: tuple[tuple[int, int], ...] | None  # None: the source is already the message (one tensor)
    inv_segments: tuple[tuple[int, int], ...] | None
    bit_pos: torch.Tensor | None  # sign: each value's position in the padded bit string; None if no padding
    sign_bytes: int  # sign: bytes of all tensors' sign bits
    row_owner: torch.Tensor | None  # sign: the tensor of each chunk row
    row_counts: torch.Tensor | None  # sign: the chunk rows of each tensor
    row_ranges: tuple[tuple[int, int], ...]  # chunk rows [start, stop) of each tensor
    nbytes: int


@lru_cache(maxsize=64)
def _many_layout(wire: WireFormat, rows: tuple[int, ...], device: torch.device) -> _ManyLayout:
    k, ib = wire.topk, wire.index_bytes
    counts = [r * k for r in rows]
    total = sum(counts)
    ranges, r0 = [], 0
    for r in rows:
        ranges.append((r0, r0 + r))
        r0 += r
    nbytes = sum(wire.payload_nbytes(r) for r in rows)
    sign = wire.values == "sign"
    bit_pos = row_owner = None
    sign_bytes = 0
    if sign:
        padded = [-(-c // 8) * 8 for c in counts]
        sign_bytes = sum(padded) // 8
        if padded != counts:
            starts = torch.tensor([0] + padded[:-1]).cumsum(0)
            bit_pos = torch.cat([torch.arange(c) + s for c, s in zip(counts, starts.tolist(), strict=True)])
            bit_pos = bit_pos.to(device)
        row_owner = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)).to(device)
    row_counts = torch.tensor(rows, dtype=torch.long, device=device) if sign else None
    if len(rows) == 1:
        return _ManyLayout(None, None, bit_pos, sign_bytes, row_owner, row_counts, tuple(ranges), nbytes)
    vb = 2 if wire.values == "bf16" else 4
    parts, i0, b0 = [], 0, 0  # the source's byte ranges [start, stop), in message order
    vals0 = total * ib  # the value section's first byte in the source
    scales0 = vals0 + sign_bytes
    for t, c in enumerate(counts):
        parts.append((i0 * ib, (i0 + c) * ib))
        if sign:
            nb = -(-c // 8)
            parts.append((vals0 + b0, vals0 + b0 + nb))
            parts.append((scales0 + 4 * t, scales0 + 4 * t + 4))
            b0 += nb
        else:
            parts.append((vals0 + i0 * vb, vals0 + (i0 + c) * vb))
        i0 += c
    starts_in_message = [0]
    for a, b in parts:
        starts_in_message.append(starts_in_message[-1] + b - a)
    assert starts_in_message[-1] == nbytes, (starts_in_message[-1], nbytes)
    order = sorted(range(len(parts)), key=lambda j: parts[j])  # (start, stop): empty ranges first
    assert all(parts[j][1] == parts[k][0] for j, k in zip(order, order[1:], strict=False)), "ranges must tile"
    inv = tuple((starts_in_message[j], starts_in_message[j + 1]) for j in order)
    return _ManyLayout(tuple(parts), inv, bit_pos, sign_bytes, row_owner, row_counts, tuple(ranges), nbytes)


def _mean_magnitudes(vals: torch.Tensor, row_counts: torch.Tensor) -> torch.Tensor:
    """The sign format's scales: per tensor (``row_counts[t]`` consecutive rows of the (Σ rows, k)
    ``vals``) the mean |v| of its values, 0 for a tensor without any, as float32.

    Summed in float64, row by row, then over each tensor's rows in order (one segmented sum for all
    tensors), so that a tensor's scale is the same bits whether it is packed alone or with others."""
    k = vals.shape[-1] if vals.dim() else 1
    row_sums = vals.reshape(-1, k).abs().double().sum(-1)
    sums = torch.segment_reduce(row_sums, "sum", lengths=row_counts, unsafe=True, initial=0.0)
    return (sums / (row_counts * k).clamp(min=1)).float()


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
            scale = _mean_magnitudes(vals, torch.tensor([vals.shape[0]], device=vals.device))
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
        rows = vals.reshape(-1, self.topk)  # (n_chunks, k), as pack takes them
        scale = _mean_magnitudes(rows, torch.tensor([rows.shape[0]], device=vals.device))[0]
        return ((vals >= 0).float() * 2 - 1) * scale

    # ------------------------------------------------------------------ many tensors at once
    def payload_nbytes_many(self, rows: tuple[int, ...]) -> int:
        """Bytes of the payloads of tensors with ``rows[t]`` chunks each, concatenated."""
        return sum(self.payload_nbytes(r) for r in rows)

    def _sign_scales(self, vals: torch.Tensor, layout: _ManyLayout) -> torch.Tensor:
        """Each tensor's sign scale (mean |v| of its values, 0 for none), as :meth:`pack` computes it."""
        return _mean_magnitudes(vals, layout.row_counts)

    def encode_many(self, idx: torch.Tensor, vals: torch.Tensor,
                    rows: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Many tensors' coefficients at once: (payload bytes, values as sent).

        ``idx``/``vals`` are (Σ rows, k): tensor t's chunks are rows ``sum(rows[:t])`` onwards.
        The bytes equal ``cat([pack(idx_t, vals_t) for t])`` and the values ``cat([sent_values(vals_t)])``
        bit for bit, computed for the whole matrix at once (tensor by tensor only the sign scales).
        """
        if idx.shape != vals.shape or idx.dim() != 2 or idx.shape[1] != self.topk or idx.shape[0] != sum(rows):
            raise ValueError(f"expected ({sum(rows)}, {self.topk}) indices and values, got {tuple(idx.shape)}, "
                             f"{tuple(vals.shape)}")
        layout = _many_layout(self, tuple(rows), vals.device)
        flat_idx = idx.reshape(-1)
        if self.index_dtype == torch.int16:
            flat_idx = flat_idx - 32768
        ib = flat_idx.to(self.index_dtype).view(torch.uint8)
        flat_vals = vals.reshape(-1)
        if self.values == "bf16":
            half = flat_vals.to(torch.bfloat16)
            vb, sent = half.view(torch.uint8), half.float().view_as(vals)
        elif self.values == "fp32":
            sent = vals.to(torch.float32)
            vb = sent.reshape(-1).view(torch.uint8)
        else:
            positive = flat_vals >= 0
            bits = positive.to(torch.uint8)
            if layout.bit_pos is not None:
                bits = torch.zeros(layout.sign_bytes * 8, dtype=torch.uint8, device=vals.device).index_put_(
                    (layout.bit_pos,), bits)
            packed = (bits.view(-1, 8) * _BITS.to(bits.device)).sum(-1, dtype=torch.uint8)
            scales = self._sign_scales(vals, layout)
            vb = torch.cat([packed, scales.view(torch.uint8)])
            sent = (positive.float() * 2 - 1).view_as(vals) * scales[layout.row_owner].unsqueeze(-1)
        source = torch.cat([ib, vb])
        payload = source if layout.segments is None else torch.cat([source[a:b] for a, b in layout.segments])
        return payload, sent

    def unpack_many(self, buf: torch.Tensor, rows: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`encode_many`'s bytes (or the tensors' payloads concatenated) -> (indices, values).

        ``buf`` is (..., :meth:`payload_nbytes_many`), e.g. (R, nbytes) after an all-gather; the result is
        (..., Σ rows, k), equal to the tensors' :meth:`unpack` results concatenated along the chunks.
        """
        layout = _many_layout(self, tuple(rows), buf.device)
        lead = buf.shape[:-1]
        if buf.shape[-1] != layout.nbytes:
            raise ValueError(f"payload has {buf.shape[-1]} bytes, expected {layout.nbytes} for chunks {rows}")
        n_chunks = sum(rows)
        count = n_chunks * self.topk
        nib = count * self.index_bytes
        nrows = math.prod(lead)
        buf = buf.reshape(nrows, layout.nbytes)
        if layout.inv_segments is not None:
            buf = torch.cat([buf[:, a:b] for a, b in layout.inv_segments], dim=1)
        ib, vb = buf[:, :nib], buf[:, nib:]
        idx = self._indices(ib)
        if self.values in ("bf16", "fp32"):
            vals = self._float_values(vb)
        else:
            packed = vb[:, :layout.sign_bytes]
            scales = _as(vb[:, layout.sign_bytes:], torch.float32)  # (B, tensors)
            bits = (packed.unsqueeze(-1) & _BITS.to(packed.device)).ne(0).reshape(nrows, -1)
            if layout.bit_pos is not None:
                bits = bits.index_select(1, layout.bit_pos)
            per_value = scales[:, layout.row_owner].repeat_interleave(self.topk, dim=1)
            vals = (bits.float() * 2 - 1) * per_value
        shape = (*lead, n_chunks, self.topk)
        return idx.reshape(shape), vals.reshape(shape)

    def _indices(self, ib: torch.Tensor) -> torch.Tensor:
        """Index bytes (rows, count·index_bytes) -> int64 indices (int16 is stored offset by 32768)."""
        idx = _as(ib, self.index_dtype).long()
        return idx + 32768 if self.index_dtype == torch.int16 else idx

    def _float_values(self, vb: torch.Tensor) -> torch.Tensor:
        """Value bytes of the bf16 or fp32 format -> float32 values."""
        return _as(vb, torch.bfloat16).float() if self.values == "bf16" else _as(vb, torch.float32)

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
        rows = math.prod(lead)
        buf = buf.reshape(rows, expected)
        ib, vb = buf[:, :nib], buf[:, nib:]
        idx = self._indices(ib)
        if self.values in ("bf16", "fp32"):
            vals = self._float_values(vb)
        else:
            nsign = -(-count // 8)
            packed = vb[:, :nsign]
            scale = _as(vb[:, nsign:], torch.float32)  # (B, 1)
            bits = (packed.unsqueeze(-1) & _BITS.to(packed.device)).ne(0).reshape(rows, -1)[:, :count]
            vals = (bits.float() * 2 - 1) * scale
        shape = (*lead, n_chunks, self.topk)
        return idx.reshape(shape), vals.reshape(shape)
