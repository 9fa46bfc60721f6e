"""FlexDeMo's 2-D tiles (``tile=t > 0``): a matrix shard in t × t tiles under the 2-D DCT, the rest in
1-D chunks of t² elements (:class:`~lowband.optim.flexdemo.optimizer.FlexDeMo`, whose docstring describes the rule).

A tile is a chunk row of t² elements under the basis B_t ⊗ B_t, so the block machinery
(:mod:`lowband.optim.flexdemo.blocks`) runs unchanged on a tiled copy of each matrix; what differs is
here: the width of a row, which shards are tiled, their rows, the transform, and adding a tiled
update back into a matrix.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn.functional as F

from lowband.compress import dct_basis, dct_basis_2d, from_tiles, num_tiles, to_tiles
from lowband.optim._common import local
from lowband.optim.flexdemo.blocks import Work

__all__ = ["add_tiled_updates", "add_untiled", "as_matrix", "basis_of", "is_tiled", "num_rows", "row_width", "tiled_flat",
           "tiled_flats", "untile_all", "untile_deltas", "width_name"]


def row_width(group: dict) -> int:
    """Elements per chunk row of a param group: t² for t × t tiles, else the chunk size."""
    return group["tile"] ** 2 if group["tile"] else group["chunk"]


def width_name(tile: int, width: int) -> str:
    """How an error names a row's width: ``tile²=64`` or ``chunk=128``."""
    return f"tile²={width}" if tile else f"chunk={width}"


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """A shard (ndim >= 2) as the matrix its tiles cut: dim 0 (FSDP2's row split) by the other dims
    flattened (a conv weight's (out, in·kh·kw)); a view."""
    return x.view(x.shape[0], math.prod(x.shape[1:]))


def is_tiled(x: torch.Tensor) -> bool:
    """Whether a group with ``tile`` set cuts this shard in tiles: matrices (and higher dims) do,
    1-D and 0-D tensors (biases, norms' gains) go in 1-D chunks of t² elements."""
    return x.dim() >= 2


def num_rows(x: torch.Tensor, group: dict) -> int:
    """Chunk rows (chunks or tiles) of a local shard in a param group."""
    tile = group["tile"]
    if tile and is_tiled(x):
        return num_tiles(x.shape[0], math.prod(x.shape[1:]), tile)
    return -(-x.numel() // row_width(group))


def add_untiled(mat: torch.Tensor, tiles: torch.Tensor, tile: int, alpha: float) -> None:
    """mat ← mat + alpha·(``tiles`` untiled): one strided pass, or (a ragged edge) through an untiled copy."""
    rows, cols = mat.shape
    rt, ct = -(-rows // tile), -(-cols // tile)
    if rows == rt * tile and cols == ct * tile:
        mat.view(rt, tile, ct, tile).add_(tiles.view(rt, ct, tile, tile).transpose(1, 2), alpha=alpha)
    else:
        mat.add_(from_tiles(tiles, mat.shape), alpha=alpha)


def basis_of(w: Work, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The transform of a work's chunk rows: B_t ⊗ B_t for tiles, the 1-D DCT-II of c otherwise."""
    if w.tile:
        return dct_basis_2d(w.tile, dtype, device)
    return dct_basis(w.plan.wire.chunk, dtype, device)


def tiled_flat(x: torch.Tensor, tile: int) -> torch.Tensor:
    """A tiled copy of shard ``x`` (its matrix in t × t tiles, row after row), flat: tiles are not views
    of the row-major storage, so writes to it do not go through to ``x``."""
    return to_tiles(as_matrix(x), tile).view(-1)


def untile_deltas(params: list, tiled: list[torch.Tensor], deltas: list[torch.Tensor], chunk: int) -> None:
    """The commit of a tiled work: each parameter's δ, written in tiles (``tiled``, rows of ``chunk``
    = t² elements) over its tiled scratch, untiled into its flat δ in ``deltas``."""
    for p, t, d in zip(params, tiled, deltas, strict=True):
        shape = as_matrix(local(p)).shape
        from_tiles(t.view(-1, chunk), shape, out=d.view(shape))


def add_tiled_updates(targets: list, sinks: list, tile: int, chunk: int, lr: float, *, add: bool) -> None:
    """The apply of a tiled work: each decoded update (in tiles, in ``sinks``) into its target matrix,
    x ← x − lr·update (``add``), or copied untiled into a per-parameter buffer (a drained update)."""
    for x, buf in zip(targets, sinks, strict=True):
        if x is None:
            continue
        mat = as_matrix(x)
        if add:
            add_untiled(mat, buf.view(-1, chunk), tile, -lr)
        else:
            from_tiles(buf.view(-1, chunk), mat.shape, out=mat)


# ----------------------------------------------------------------------------- batched by shape
# The group layout (a GPU's) tiles and untiles all matrices of one shape at once: one stacked copy
# and one strided copy per shape class instead of a copy per matrix, so that a step's kernels do not
# grow with the number of matrices. The values are the same copies, element for element.

def _shape_classes(xs: list) -> dict:
    """Indices of the non-empty matrices of ``xs`` by (matrix shape, dtype, device)."""
    classes: dict = defaultdict(list)
    for i, x in enumerate(xs):
        if x is not None and x.numel():
            classes[(tuple(as_matrix(x).shape), x.dtype, x.device)].append(i)
    return classes


def tiled_flats(xs: list, tile: int) -> list:
    """:func:`tiled_flat` of each shard in ``xs`` (None stays None), matrices of one shape tiled together."""
    out = [tiled_flat(x, tile) if x is not None and not x.numel() else None for x in xs]
    for ((rows, cols), _, _), idxs in _shape_classes(xs).items():
        rt, ct = -(-rows // tile), -(-cols // tile)
        mats = torch.stack([as_matrix(xs[i]) for i in idxs])
        if rows != rt * tile or cols != ct * tile:
            mats = F.pad(mats, (0, ct * tile - cols, 0, rt * tile - rows))
        tiles = mats.view(len(idxs), rt, tile, ct, tile).transpose(2, 3).contiguous().view(len(idxs), -1)
        for j, i in enumerate(idxs):
            out[i] = tiles[j]
    return out


def _untiled(tiled: list, idxs: list[int], shape: tuple[int, int], tile: int) -> torch.Tensor:
    """The matrices of one shape class back from their tiled flats: (m, rows, cols), contiguous."""
    rows, cols = shape
    rt, ct = -(-rows // tile), -(-cols // tile)
    stacked = torch.stack([tiled[i] for i in idxs]).view(len(idxs), rt, ct, tile, tile)
    grid = stacked.transpose(2, 3).reshape(len(idxs), rt * tile, ct * tile)
    return grid[:, :rows, :cols].contiguous()


def untile_all(params: list, tiled: list, dests: list, tile: int, *, alpha: float | None = None) -> None:
    """Each matrix of ``dests`` (flat, or None) ← its tiled flat in ``tiled`` untiled (``alpha`` None),
    or dest ← dest + alpha·untiled; the matrices of one shape untiled together."""
    xs = [local(p) if d is not None else None for p, d in zip(params, dests, strict=True)]
    for (shape, _, _), idxs in _shape_classes(xs).items():
        whole = _untiled(tiled, idxs, shape, tile)
        targets = [dests[i].view(shape) for i in idxs]
        if alpha is None:
            torch._foreach_copy_(targets, list(whole.unbind(0)))
        else:
            torch._foreach_add_(targets, list(whole.unbind(0)), alpha=alpha)
