"""Examples read from a token store on demand: what a :class:`~lowband.train.data.config.Split` holds
for a user's data (:mod:`~lowband.train.data.store`).

A split is a :class:`DocSelection` of the store's documents (the training side: the first documents
less the validation ones; the validation side: those), and its examples are sequences over it that
read their ids when indexed, so a rank's memory does not grow with the corpus:

* :class:`PackedBlocks` (causal, ``packing="blocks"``): the selected documents, each followed by
  ``</s>`` (as stored), concatenated in order and cut into full blocks, the remainder dropped: the
  same blocks :func:`~lowband.train.data.packing.pack` makes of the same documents. The selection is
  held as runs of consecutive documents (one per gap that a validation document leaves, and per
  shard), so block ``i`` is found by a binary search and read in one or a few pieces;
* :class:`DocExamples` (``packing="lines"``, seq2seq sources and targets): one example per document,
  truncated to ``max_len - 1`` ids and ``</s>``, as :func:`~lowband.train.data.token_cache.encode` does;
* :class:`DecodedTexts`: the documents' text, decoded from the ids (as the tokenizer normalised it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import numpy as np
from tokenizers import Tokenizer

from lowband.train.data.store import TokenStore

__all__ = ["DecodedTexts", "DocExamples", "DocSelection", "PackedBlocks"]


class DocSelection:
    """Documents of a store, in ascending order: ``[0, limit)`` less ``excluded``, or exactly ``included``.

    Args:
        limit: documents ``[0, limit)`` (the store's count, or ``max_examples``).
        excluded: sorted document numbers to leave out (the validation ones); memory is O(len(excluded)).
        included: sorted document numbers to take instead (the validation side).
    """

    def __init__(self, *, limit: int, excluded: np.ndarray | None = None, included: np.ndarray | None = None) -> None:
        self.limit = int(limit)
        self.included = None if included is None else np.asarray(included, dtype=np.int64)
        self.excluded = np.asarray([] if excluded is None else excluded, dtype=np.int64)
        # The j-th kept document is j plus the number of excluded ones at or before it: with e_k the
        # k-th excluded, e_k - k kept documents come before e_k.
        self._shifted = self.excluded - np.arange(len(self.excluded), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.included) if self.included is not None else self.limit - len(self.excluded)

    def __getitem__(self, j: int) -> int:
        if not 0 <= j < len(self):
            raise IndexError(j)
        if self.included is not None:
            return int(self.included[j])
        return j + int(np.searchsorted(self._shifted, j, side="right"))

    def mask(self, start: int, stop: int) -> np.ndarray:
        """Which of the documents ``[start, stop)`` are selected (a boolean array)."""
        docs = np.arange(start, stop, dtype=np.int64)
        if self.included is not None:
            return np.isin(docs, self.included)
        return (docs < self.limit) & ~np.isin(docs, self.excluded)

    def runs(self, store: TokenStore, field: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The selected documents' ids as runs of consecutive ids: (shard, start, stop) arrays, in order."""
        shards: list[int] = []
        starts: list[int] = []
        stops: list[int] = []
        for s in range(store.num_shards):
            a, b = int(store.shard_docs[s]), int(store.shard_docs[s + 1])
            if self.included is not None:
                local = self.included[(self.included >= a) & (self.included < b)] - a
                if len(local):
                    lo = store.offsets(field, s, local)
                    hi = store.offsets(field, s, local + 1)
                    shards += [s] * len(local)
                    starts += lo.tolist()
                    stops += hi.tolist()
                continue
            b = min(b, self.limit)
            if a >= b:
                break
            gaps = self.excluded[(self.excluded >= a) & (self.excluded < b)] - a
            # Runs: from the shard's first document (or after an excluded one) to the next excluded one.
            run_lo = np.concatenate([[0], gaps + 1])
            run_hi = np.concatenate([gaps, [b - a]])
            positions = np.unique(np.concatenate([run_lo, run_hi]))
            table = dict(zip(positions.tolist(), store.offsets(field, s, positions).tolist(), strict=True))
            for lo, hi in zip(run_lo.tolist(), run_hi.tolist(), strict=True):
                if hi > lo:
                    shards.append(s)
                    starts.append(table[lo])
                    stops.append(table[hi])
        return (np.asarray(shards, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                np.asarray(stops, dtype=np.int64))


class _Lazy(Sequence):
    """A read-only sequence of examples read on demand."""

    def _get(self, i: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        n = len(self)
        if isinstance(i, slice):
            return [self._get(k) for k in range(*i.indices(n))]
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"example {i} is outside [0, {n})")
        return self._get(i)


class PackedBlocks(_Lazy):
    """Full blocks of ``block`` ids over the selected documents (each ending in eos), in order.

    Args:
        store: the store.
        field: its field (``"text"``).
        docs: the documents.
        block: ids per block (``max_len``).
    """

    def __init__(self, store: TokenStore, field: str, docs: DocSelection, block: int) -> None:
        self.store, self.field, self.block = store, field, int(block)
        self._shard, self._start, stop = docs.runs(store, field)
        self._cum = np.concatenate([[0], np.cumsum(stop - self._start)]).astype(np.int64)
        self.tokens = int(self._cum[-1])
        self._n = self.tokens // self.block

    def __len__(self) -> int:
        return self._n

    def _get(self, i: int) -> np.ndarray:
        lo, hi = i * self.block, (i + 1) * self.block
        k = int(np.searchsorted(self._cum, lo, side="right")) - 1
        pieces = []
        while lo < hi:
            take = min(hi, int(self._cum[k + 1])) - lo
            if take > 0:
                start = int(self._start[k]) + lo - int(self._cum[k])
                pieces.append(self.store.ids(self.field, int(self._shard[k]), start, start + take))
                lo += take
            k += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def mean_length(self) -> float:
        """Every block is full."""
        return float(self.block)


class DocExamples(_Lazy):
    """One example per selected document: its ids truncated to ``max_len - 1``, then eos.

    Args:
        store: the store.
        field: its field (``"text"``, ``"source"`` or ``"target"``).
        docs: the documents.
        max_len: ids per example, eos included.
    """

    def __init__(self, store: TokenStore, field: str, docs: DocSelection, max_len: int) -> None:
        self.store, self.field, self.docs, self.max_len = store, field, docs, int(max_len)

    def __len__(self) -> int:
        return len(self.docs)

    def _get(self, i: int) -> np.ndarray:
        shard, a, b = self.store.span(self.field, self.docs[i])
        if b - a <= self.max_len:
            return self.store.ids(self.field, shard, a, b)
        head = self.store.ids(self.field, shard, a, a + self.max_len - 1)
        return np.concatenate([head, np.asarray([self.store.eos], dtype=head.dtype)])

    def mean_length(self) -> float:
        """The mean example length, from the documents' offsets (one shard's offsets in memory at a time)."""
        total = count = 0
        for s in range(self.store.num_shards):
            a, b = int(self.store.shard_docs[s]), int(self.store.shard_docs[s + 1])
            keep = self.docs.mask(a, b)
            if keep.any():
                lengths = np.minimum(np.diff(self.store.offsets(self.field, s)), self.max_len)
                total += int(lengths[keep].sum())
                count += int(keep.sum())
        return total / count if count else 0.0


class DecodedTexts(_Lazy):
    """The selected documents' text, decoded from their ids (eos dropped, stripped)."""

    def __init__(self, store: TokenStore, field: str, docs: DocSelection, tokenizer: Tokenizer) -> None:
        self.store, self.field, self.docs, self.tokenizer = store, field, docs, tokenizer

    def __len__(self) -> int:
        return len(self.docs)

    def _get(self, i: int) -> str:
        ids = self.store.document(self.field, self.docs[i])[:-1]
        return self.tokenizer.decode(ids.tolist()).strip()
