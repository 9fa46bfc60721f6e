"""Compression of momentum shards: chunked DCT, top-k, and the wire format. Pure tensor code."""

from lowband.compress.dct import (
    dct,
    dct_basis,
    from_chunks,
    idct,
    idct_sparse,
    num_chunks,
    scatter_chunks,
    to_chunks,
    topk_per_chunk,
)
from lowband.compress.wire import VALUE_FORMATS, WireFormat

__all__ = [
    "VALUE_FORMATS",
    "WireFormat",
    "dct",
    "dct_basis",
    "from_chunks",
    "idct",
    "idct_sparse",
    "num_chunks",
    "scatter_chunks",
    "to_chunks",
    "topk_per_chunk",
]
