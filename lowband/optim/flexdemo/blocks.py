"""FlexDeMo's layout of a param group in chunk rows, cut into blocks (:class:`~lowband.optim.flexdemo.optimizer.FlexDeMo`).

A param group's parameters (those with a gradient) are the rows of one (Σ chunks, c) matrix, each
parameter zero-padded to whole chunks on its own; the rows are cut into blocks that are views of a
large parameter's own storage or packed copies of small ones (:func:`make_plan`), and a step's block
temporaries live in a reused :class:`Workspace`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lowband.compress import WireFormat

__all__ = ["BlockPlan", "Seg", "Work", "Workspace", "gather_block", "make_plan", "scatter_views", "view_block"]


class Seg(NamedTuple):
    """One block of a parameter group's chunk rows (``rows`` rows, the group's rows ``row0`` onwards).

    ``view``: whole chunks of one parameter, elements [start, stop) of its flat shard, used in place.
    Otherwise a packed block: the pieces (param, start, stop, pad, offset) of one or more parameters,
    each zero-padded by ``pad`` elements to whole chunks and copied in at ``offset``.
    """

    view: bool
    pieces: tuple[tuple[int, int, int, int, int], ...]
    rows: int
    row0: int
    dtype: torch.dtype  # of its parameters (a packed block holds one dtype)


class BlockPlan(NamedTuple):
    """How one param group's parameters (those with a gradient this step) are laid out in chunk rows.

    Parameter t has ``rows[t]`` chunks (its shard zero-padded to whole chunks on its own), rows
    ``sum(rows[:t])`` onwards of the group's (Σ rows, c) matrix; the blocks in ``segs`` cover those rows
    in order, each at most ``block_elements // c`` rows (:func:`make_plan`).
    """

    wire: WireFormat
    rows: tuple[int, ...]
    segs: tuple[Seg, ...]
    nbytes: int
    batched: bool = False  # the group layout: per-parameter copies (tiles) are batched by shape too


def make_plan(wire: WireFormat, numels: list[int], dtypes: list[torch.dtype], *, block_elements: int,
              view_min_elements: int | None) -> BlockPlan:
    """The layout of a group's parameters of ``numels`` elements in blocks of about ``block_elements``
    elements; a parameter with at least ``view_min_elements`` elements of whole chunks is used in place
    (None: none is, every parameter is copied into blocks)."""
    chunk = wire.chunk
    per_block = max(1, block_elements // chunk)
    view_min_rows = (max(1, min(per_block, view_min_elements // chunk)) if view_min_elements is not None
                     else float("inf"))
    segs: list[Seg] = []
    pack: list[tuple[int, int, int, int, int]] = []
    pack_rows, pack_row0, pack_dtype = 0, 0, None
    row = 0

    def close() -> None:
        nonlocal pack, pack_rows
        if pack:
            segs.append(Seg(False, tuple(pack), pack_rows, pack_row0, pack_dtype))
        pack, pack_rows = [], 0

    for t, n in enumerate(numels):
        full = n // chunk
        start = 0
        if full >= view_min_rows:
            close()
            for r0 in range(0, full, per_block):
                r = min(per_block, full - r0)
                segs.append(Seg(True, ((t, r0 * chunk, (r0 + r) * chunk, 0, 0),), r, row, dtypes[t]))
                row += r
            start = full * chunk
        while start < n:  # the rest goes into packed blocks, split at a block's capacity
            if pack and (pack_rows == per_block or dtypes[t] != pack_dtype):
                close()
            if not pack:
                pack_row0, pack_dtype = row, dtypes[t]
            take = min(-(-(n - start) // chunk), per_block - pack_rows)
            stop = min(n, start + take * chunk)
            pack.append((t, start, stop, take * chunk - (stop - start), pack_rows * chunk))
            pack_rows += take
            row += take
            start = stop
    close()
    rows = tuple(-(-n // chunk) for n in numels)
    assert row == sum(rows), (row, rows)
    return BlockPlan(wire, rows, tuple(segs), wire.payload_nbytes_many(rows))


def gather_block(seg: Seg, flats: list[torch.Tensor | None], chunk: int, like: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """A packed block's (rows, chunk) copy of ``flats`` (None: zeros), each piece zero-padded, into ``out``.

    One concatenation whatever the number of pieces: the paddings are slices of one kept zero tensor,
    not a fresh tensor (and kernel) each. A missing tensor (a parameter's first step) gets its own zeros."""
    zeros = _zeros(chunk, like.dtype, like.device)
    parts = []
    for t, start, stop, pad, _ in seg.pieces:
        src = flats[t]
        parts.append(src[start:stop] if src is not None else like.new_zeros(stop - start))
        if pad:
            parts.append(zeros[:pad])
    return torch.cat(parts, out=out.view(-1)).view(seg.rows, chunk)


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A read-only supply of at least ``n`` zeros, kept per dtype and device (a padding is under a chunk)."""
    key = (dtype, device)
    buf = _ZEROS.get(key)
    if buf is None or buf.numel() < n:
        buf = _ZEROS[key] = torch.zeros(max(n, 1024), dtype=dtype, device=device)
    return buf


_ZEROS: dict = {}


def view_block(seg: Seg, flats: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """A view block's (rows, chunk) rows of its parameter's flat tensor in ``flats``, in place."""
    t, start, stop, _, _ = seg.pieces[0]
    return flats[t][start:stop].view(seg.rows, chunk)


def scatter_views(seg: Seg, flats: list[torch.Tensor | None], block: torch.Tensor):
    """(destination, source) views: each piece of ``flats`` and its place in a packed block."""
    src = block.reshape(-1)
    dst, out = [], []
    for t, start, stop, _, offset in seg.pieces:
        if flats[t] is not None:
            dst.append(flats[t][start:stop])
            out.append(src[offset:offset + stop - start])
    return dst, out


class Workspace:
    """Buffers for a step's block temporaries, reused block after block and dropped with the step.

    A fresh tensor of a block's size for every temporary of every block costs the allocator (glibc
    hands large blocks back to the system and page-faults them in again); a reused buffer does not.
    """

    def __init__(self, plan: BlockPlan) -> None:
        self._bufs: dict = {}
        self._elements = max((seg.rows for seg in plan.segs), default=0) * plan.wire.chunk  # the largest block

    def __call__(self, name: str, rows: int, chunk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = rows * chunk
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(max(n, self._elements), dtype=dtype, device=device)
        return buf[:n].view(rows, chunk)


class Work(NamedTuple):
    """A param group's share of a step: parameters with a gradient, their layout, and their transform.

    ``tile`` 0: each shard's flat elements in 1-D chunks; t > 0: each shard's matrix in t × t tiles,
    transformed with the 2-D DCT (a group with ``tile`` set gives two: its matrices, then the rest).
    """

    group: dict
    params: list
    plan: BlockPlan
    tile: int
