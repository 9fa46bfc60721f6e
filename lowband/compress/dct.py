"""Chunked orthonormal DCT-II and top-k selection: pure tensor code, no processes.

A flat tensor of n elements is zero-padded to a multiple of the chunk size c and viewed as
(n_chunks, c). Each chunk is transformed with the orthonormal DCT-II basis B (c × c, rows are the
basis vectors): X = x·Bᵀ, x = X·B. B is computed once per (c, dtype, device) and cached.

Padding (never the "largest divisor ≤ c" rule of DeToNATION): every tensor gets the chunk size
asked for, so top-k of a chunk always keeps k of c coefficients.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["dct_basis", "num_chunks", "to_chunks", "from_chunks", "dct", "idct", "topk_per_chunk", "scatter_chunks"]


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


def topk_per_chunk(coeffs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest-magnitude coefficients of each row: (indices int64, values), both (n_chunks, k)."""
    c = coeffs.shape[-1]
    if not 1 <= k <= c:
        raise ValueError(f"topk must be in [1, chunk={c}], got {k}")
    idx = coeffs.abs().topk(k, dim=-1, sorted=False).indices
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
