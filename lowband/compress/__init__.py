"""Compression of momentum shards: chunked DCT, top-k, and the wire format. Pure tensor code."""

from lowband.compress.dct import (
    dct,
    dct_basis,
    dct_basis_2d,
    from_chunks,
    from_tiles,
    idct,
    idct_sparse,
    num_chunks,
    num_tiles,
    scatter_chunks,
    to_chunks,
    to_tiles,
    topk_per_chunk,
)
from lowband.compress.wire import VALUE_FORMATS, WireFormat

__all__ = [
    "VALUE_FORMATS",
    "WireFormat",
    "dct",
    "dct_basis",
    "dct_basis_2d",
    "from_chunks",
    "from_tiles",
    "idct",
    "idct_sparse",
    "num_chunks",
    "num_tiles",
    "scatter_chunks",
    "to_chunks",
    "to_tiles",
    "topk_per_chunk",
]
