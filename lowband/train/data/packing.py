"""Packing causal text into full blocks, as the ecosystem does.

transformers' ``run_clm`` (``group_texts``) and nanoGPT's token stream train a causal LM on
documents tokenised whole, joined by an end-of-text token, concatenated, and cut into blocks of the
context length; the last partial block is dropped. Every position of a block is a real token: no
padding, and a short document shares its block with the next ones instead of being padded to the
length. :func:`pack` does that on token ids; :mod:`~lowband.train.data.token_cache` caches the
result, :mod:`~lowband.train.data.load` packs the training and the validation documents each on
its own (split first, so no block straddles the two).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["pack"]


def pack(docs: Sequence[Sequence[int]], block: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents' ids, each followed by ``eos``, concatenated and cut into blocks of ``block`` tokens.

    Args:
        docs: token ids of each document, untruncated, without ``eos``.
        block: tokens per block (``max_len``).
        eos: the end-of-text id put after every document.

    Returns:
        ``(flat, offsets)`` as :func:`~lowband.train.data.token_cache.encode` stores them: int32 ids
        of ``n`` full blocks and the ``n + 1`` int64 offsets ``0, block, ..., n * block``. The
        tokens after the last full block (fewer than ``block``) are dropped, as ``group_texts`` does.
    """
    if block < 2:
        raise ValueError(f"a block needs at least 2 tokens, got {block}")
    total = sum(len(d) + 1 for d in docs)
    n = total // block
    stream = np.empty(total, dtype=np.int32)
    pos = 0
    for d in docs:
        stream[pos : pos + len(d)] = d
        pos += len(d)
        stream[pos] = eos
        pos += 1
    flat = np.ascontiguousarray(stream[: n * block])
    offsets = np.arange(n + 1, dtype=np.int64) * block
    return flat, offsets
