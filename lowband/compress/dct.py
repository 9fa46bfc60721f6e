"""Chunked orthonormal DCT-II and top-k selection: pure tensor code, no processes.

A flat tensor of n elements is zero-padded to a multiple of the chunk size c and viewed as
(n_chunks, c). Each chunk is transformed with the orthonormal DCT-II basis B (c × c, rows are the
basis vectors): X = x·Bᵀ, x = X·B. B is computed once per (c, dtype, device) and cached.

Padding (never the "largest divisor ≤ c" rule of DeToNATION): every tensor gets the chunk size
asked for, so top-k of a chunk always keeps k of c coefficients.

2-D tiles: a (rows, cols) matrix is zero-padded to multiples of t in both dimensions and cut into
t × t tiles (:func:`to_tiles`), each flattened row-major into a row of t² elements. The separable
2-D DCT of a tile, X = B_t·x·B_tᵀ, is the 1-D transform of that row with the Kronecker basis
B_t ⊗ B_t (:func:`dct_basis_2d`, t² × t², orthonormal), so tiles are chunks of c = t² with another
basis, and everything above (top-k per row, :func:`idct_sparse`, the wire format) applies to them.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = [
    "dct_basis", "num_chunks", "to_chunks", "from_chunks", "dct", "idct", "idct_sparse", "topk_per_chunk",
    "scatter_chunks", "dct_basis_2d", "num_tiles", "to_tiles", "from_tiles",
]

# idct_sparse sums the basis rows that a chunk's coefficients select (torch's embedding_bag with
# per-sample weights: gather, multiply and add in one kernel) up to this many coefficients per chunk;
# above it, it scatters them into a dense (n_chunks, c) tensor and multiplies by the basis (c
# multiply-adds per element). The dense path costs the same whatever the number of terms, the fused
# sum grows with it; on a CPU they cross at about 48 terms, so it sums up to 48 (Top-8 decodes of up
# to 6 replicas).
SPARSE_TERMS_MAX = 48


@lru_cache(maxsize=64)
def _basis_cached(chunk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = torch.arange(chunk, dtype=torch.float64)
    k = n.view(-1, 1)
    basis = torch.cos(math.pi * (2 * n + 1) * k / (2 * chunk))  # (k, n)
    basis[0] *= math.sqrt(1.0 / chunk)
    basis[1:] *= math.sqrt(2.0 / chunk)
    return basis.to(dtype=dtype, device=device).contiguous()


def dct_basis(chunk: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix B of size (chunk, chunk): ``X = B @ x`` for a column x."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _basis_cached(int(chunk), dtype, torch.device(device))


@lru_cache(maxsize=16)
def _basis_2d_cached(tile: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    b = _basis_cached(tile, torch.float64, torch.device("cpu"))
    return torch.kron(b, b).to(dtype=dtype, device=device).contiguous()


def dct_basis_2d(tile: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal 2-D DCT-II of a t × t tile as a (t², t²) matrix: B_t ⊗ B_t.

    Row i·t + j is frequency (i, j), column r·t + s the tile's element (r, s) (row-major), so for a
    tile x flattened row-major, ``basis_2d @ x.flatten()`` is ``(B_t @ x @ B_t.T).flatten()``.
    """
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return _basis_2d_cached(int(tile), dtype, torch.device(device))


def num_tiles(rows: int, cols: int, tile: int) -> int:
    """t × t tiles of a (rows, cols) matrix zero-padded to multiples of t in both dimensions."""
    return -(-rows // tile) * -(-cols // tile)


def to_tiles(mat: torch.Tensor, tile: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """A (rows, cols) matrix as (n_tiles, tile²) rows: zero-padded to multiples of ``tile`` in both
    dimensions, the tiles in row-major order of the tile grid, each tile's elements row-major.

    One strided copy; a ragged matrix (rows or cols not multiples of ``tile``) costs a padded copy
    first. ``out``: a contiguous tensor of :func:`num_tiles` · tile² elements to write into.
    """
    rows, cols = mat.shape
    rt, ct = -(-rows // tile), -(-cols // tile)
    out = mat.new_empty(rt * ct, tile * tile) if out is None else out.view(rt * ct, tile * tile)
    if rows != rt * tile or cols != ct * tile:
        mat = F.pad(mat, (0, ct * tile - cols, 0, rt * tile - rows))
    out.view(rt, ct, tile, tile).copy_(mat.reshape(rt, tile, ct, tile).transpose(1, 2))
    return out


def from_tiles(tiles: torch.Tensor, shape: tuple[int, int], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`to_tiles`: the (rows, cols) matrix of ``shape``, the padding dropped.

    ``out``: a contiguous (rows, cols) tensor to write into (else a new one).
    """
    rows, cols = shape
    tile = math.isqrt(tiles.shape[-1])
    rt, ct = -(-rows // tile), -(-cols // tile)
    grid = tiles.reshape(rt, ct, tile, tile).transpose(1, 2)  # (rt, t, ct, t): the padded matrix
    out = tiles.new_empty(rows, cols) if out is None else out
    if rows == rt * tile and cols == ct * tile:
        out.view(rt, tile, ct, tile).copy_(grid)
    else:
        out.view(rows, cols).copy_(grid.reshape(rt * tile, ct * tile)[:rows, :cols])
    return out


def num_chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


def to_chunks(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """Zero-pad a 1-D tensor to a multiple of ``chunk`` and view it as (n_chunks, chunk)."""
    flat = flat.reshape(-1)
    pad = num_chunks(flat.numel(), chunk) * chunk - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, chunk)


def from_chunks(chunks: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`to_chunks`: drop the padding, return a flat tensor of ``numel`` elements."""
    return chunks.reshape(-1)[:numel]


def dct(chunks: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of each row of a (n_chunks, c) tensor."""
    b = dct_basis(chunks.shape[-1], chunks.dtype, chunks.device)
    return chunks @ b.T


def idct(coeffs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct` (the basis is orthonormal, so the inverse is its transpose)."""
    b = dct_basis(coeffs.shape[-1], coeffs.dtype, coeffs.device)
    return coeffs @ b


# The signed integer type of each float width: |x| is x's bits with the sign bit cleared, and for such
# bit patterns the integer order is the order of the magnitudes (NaN above Inf above every finite value).
_MAGNITUDE_INT = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF), 8: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def topk_per_chunk(coeffs: torch.Tensor, k: int, *,
                   workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest-magnitude coefficients of each row: (indices int64, values), both (n_chunks, k).

    The magnitudes are compared as integers: a float's bits with the sign bit cleared, read as a signed
    integer of the same width, order exactly as the magnitudes do (NaN, whose bits are the largest,
    is picked first, as torch's float argmax and topk pick it), so the picks are those of ``|X|``
    compared as floats. It is cheaper: on a CPU the bitwise mask and integer argmax take about half
    the time of ``abs`` and the float argmax (docs/algorithms.md). Top-1 is a reduction (argmax)
    instead of a selection: the same pick, except among exact ties.

    ``workspace``: a tensor of ``coeffs``' size and dtype to hold the magnitudes (else a new one).
    """
    c = coeffs.shape[-1]
    if not 1 <= k <= c:
        raise ValueError(f"topk must be in [1, chunk={c}], got {k}")
    as_int = _MAGNITUDE_INT.get(coeffs.element_size()) if coeffs.is_floating_point() else None
    if as_int is not None and coeffs.is_contiguous():
        int_dtype, mask = as_int
        out = workspace.view(int_dtype) if workspace is not None else None
        mag = torch.bitwise_and(coeffs.view(int_dtype), mask, out=out)
    else:
        mag = torch.abs(coeffs, out=workspace)
    if k == 1:
        idx = mag.argmax(dim=-1, keepdim=True)
    else:
        idx = mag.topk(k, dim=-1, sorted=False).indices
    return idx, coeffs.gather(-1, idx)


def scatter_chunks(idx: torch.Tensor, vals: torch.Tensor, chunk: int) -> torch.Tensor:
    """Dense (..., n_chunks, chunk) coefficients from per-chunk (indices, values); leading dims are summed.

    ``idx``/``vals`` may carry a leading replica dimension (R, n_chunks, k): the result is the *sum*
    over replicas (each replica's coefficients added, also where two replicas picked the same index).
    """
    n_chunks, k = idx.shape[-2], idx.shape[-1]
    out = torch.zeros(n_chunks, chunk, dtype=vals.dtype, device=vals.device)
    if idx.dim() == 3:
        # (R, n, k) -> (n, R·k): scatter_add adds duplicates, as the sum over replicas requires.
        r = idx.shape[0]
        idx = idx.permute(1, 0, 2).reshape(n_chunks, r * k)
        vals = vals.permute(1, 0, 2).reshape(n_chunks, r * k)
    elif idx.dim() != 2:
        raise ValueError(f"indices must be (n_chunks, k) or (R, n_chunks, k), got {tuple(idx.shape)}")
    return out.scatter_add_(-1, idx.long(), vals)


def idct_sparse(idx: torch.Tensor, vals: torch.Tensor, chunk: int, *, out: torch.Tensor | None = None,
                basis: torch.Tensor | None = None) -> torch.Tensor:
    r"""``idct(scatter_chunks(idx, vals, chunk))`` without the dense product, up to float rounding.

    A chunk with coefficients (i_j, v_j), j = 1..k, decodes to x = Σ_j v_j·B[i_j] (B's rows are the
    basis vectors), so the inverse transform sums k basis rows instead of a (c × c) product::

        x ← Σ_j v_j·B[i_j]          (per chunk, all chunks at once)

    One term is a row gather and a product; more are one fused gather-multiply-sum
    (``torch.nn.functional.embedding_bag`` with per-sample weights, the basis as the table).
    ``idx``/``vals`` are (n_chunks, k) or, with a leading replica dimension, (R, n_chunks, k): then the
    result is the sum over replicas, terms in replica order (replica 0's k terms, then replica 1's, ...;
    every rank that decodes the same bytes gets the same floats). Above :data:`SPARSE_TERMS_MAX`
    terms per chunk it falls back to the dense product. With one term per chunk the result is exactly
    the dense one (the product of one non-zero coefficient with a basis row, plus zeros); with more,
    the sum is taken in another order than the matrix product's, a difference of float rounding.

    ``out``: a (n_chunks, chunk) tensor of ``vals``' dtype that the result is written into where the
    kernel allows it (one term, the dense product); the result is returned either way.

    ``basis``: the (chunk, chunk) matrix whose rows are summed, of ``vals``' dtype and device
    (default: :func:`dct_basis`; :func:`dct_basis_2d` for t × t tiles, chunk = t²).
    """
    if idx.dim() == 3:
        n_chunks = idx.shape[1]
        idx = idx.permute(1, 0, 2).reshape(n_chunks, -1)
        vals = vals.permute(1, 0, 2).reshape(n_chunks, -1)
    elif idx.dim() != 2:
        raise ValueError(f"indices must be (n_chunks, k) or (R, n_chunks, k), got {tuple(idx.shape)}")
    terms = idx.shape[-1]
    b = dct_basis(chunk, vals.dtype, vals.device) if basis is None else basis
    if terms > SPARSE_TERMS_MAX:
        dense = scatter_chunks(idx, vals, chunk)
        return torch.matmul(dense, b) if out is None else torch.matmul(dense, b, out=out)
    if terms == 1:
        rows = b.index_select(0, idx[:, 0]) if out is None else torch.index_select(b, 0, idx[:, 0], out=out)
        return rows.mul_(vals)
    return F.embedding_bag(idx.contiguous(), b, mode="sum", per_sample_weights=vals.contiguous())
