"""Token ids, computed once and cached on disk.

Ids are cached under ``$LOWBAND_CACHE/tokens``, keyed by the tokenizer, the texts, the length
limit and the packing (one example per text, or texts packed into blocks), so the many processes of a run or a benchmark do not each re-tokenise; in memory each split
is one int32 array viewed per example.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from lowband.train.data.packing import pack
from lowband.train.tokenizer import cache_root, texts_fingerprint
from lowband.util import atomic_path

__all__ = ["encode"]

logger = logging.getLogger(__name__)

_TOKENS_VERSION = 1


def _pack_now(tokenizer: Tokenizer, texts: Sequence[str], block: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise whole texts and pack them into blocks (:func:`~lowband.train.data.packing.pack`)."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return pack([e.ids for e in encodings], block, eos)


def _encode_now(
    tokenizer: Tokenizer, texts: Sequence[str], max_len: int, eos: int
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise: (flat int32 ids, int64 offsets of len(texts) + 1); each text truncated to
    ``max_len - 1`` tokens, then ``</s>``."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    keep = max_len - 1
    lengths = np.fromiter(
        (min(len(e.ids), keep) + 1 for e in encodings), dtype=np.int64, count=len(encodings)
    )
    offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    for i, enc in enumerate(encodings):
        a, b = offsets[i], offsets[i + 1]
        flat[a : b - 1] = enc.ids[:keep]
        flat[b - 1] = eos
    return flat, offsets


def encode(
    tokenizer: Tokenizer, texts: Sequence[str], max_len: int, eos: int, *, use_cache: bool = True,
    packed: bool = False,
) -> list[np.ndarray]:
    """Token ids of each text (truncated, ``</s>`` last) as read-only int32 views of one array.

    With ``packed``, the texts are documents: tokenised whole, each followed by ``</s>``, and cut
    into full blocks of ``max_len`` tokens (:func:`~lowband.train.data.packing.pack`); one view per
    block, the remainder dropped.

    Results are cached on disk under ``$LOWBAND_CACHE/tokens`` keyed by a hash of (packing,
    tokenizer, texts, max_len, eos), so the many processes of a run or a benchmark tokenise once. Files
    appear by atomic rename; processes that race both compute and write identical files.
    """
    flat: np.ndarray | None = None
    target: Path | None = None
    if use_cache:
        # Line-per-text keys keep their old form: caches written before packing existed stay valid.
        mode = "packed|" if packed else ""
        h = hashlib.sha256(f"v{_TOKENS_VERSION}|{mode}{max_len}|{eos}|".encode())
        h.update(hashlib.sha256(tokenizer.to_str().encode()).digest())
        h.update(texts_fingerprint(texts).encode())
        target = cache_root() / "tokens" / f"{h.hexdigest()[:32]}.npz"
        if target.is_file():
            try:
                with np.load(target) as z:
                    flat, offsets = z["flat"], z["offsets"]
                expected = len(flat) // max_len + 1 if packed else len(texts) + 1
                if len(offsets) != expected:
                    flat = None
            except (OSError, ValueError, KeyError) as exc:  # a damaged file: recompute it
                logger.warning("ignoring unreadable token cache %s: %s", target, exc)
                flat = None
    if flat is None:
        flat, offsets = (_pack_now if packed else _encode_now)(tokenizer, texts, max_len, eos)
        if target is not None:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(target) as tmp, open(tmp, "wb") as f:  # a reader never sees a partial file
                    np.savez(f, flat=flat, offsets=offsets)
            except OSError as exc:  # a read-only cache only costs time
                logger.warning("could not cache tokens at %s: %s", target, exc)
    flat.setflags(write=False)
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
