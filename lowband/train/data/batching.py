"""Batches: a pure function of (step, rank, world size, batch size, seed).

Each epoch has its own seeded permutation of the training examples, a global batch is
``world_size * batch_size`` consecutive examples of it, and rank ``r`` takes the ``r``-th slice,
so resuming at step ``k`` reproduces the same batches and ranks never see the same example in a
step. Validation batches come in order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from lowband.train.data.config import LABEL_PAD, Data, Split

__all__ = ["batch_indices", "collate", "epoch_of", "passes_note", "passes_over_data", "real_tokens", "steps_per_epoch",
           "train_batch", "val_batch_count", "val_batches"]

def _num_examples(data: Data | int) -> int:
    return data if isinstance(data, int) else len(data.train)


def steps_per_epoch(data: Data | int, *, world_size: int, batch_size: int) -> int:
    """Optimizer steps in one pass over the training data (the last partial global batch is dropped).

    Args:
        data: the data, or the number of training examples.
        world_size: number of ranks that each take ``batch_size`` examples per step.
        batch_size: examples per rank per step.

    Returns:
        Steps per epoch (at least 1).

    Raises:
        ValueError: fewer training examples than one global batch, or non-positive sizes.
    """
    n = _num_examples(data)
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be positive, got {world_size} and {batch_size}")
    global_batch = world_size * batch_size
    if n < global_batch:
        raise ValueError(
            f"{n} training examples are fewer than one global batch of {global_batch} "
            f"({world_size} ranks x {batch_size}); lower the batch size or add data"
        )
    return n // global_batch


def passes_over_data(data: Data | int, *, steps: int, world_size: int, batch_size: int, grad_accum: int = 1) -> float:
    """Passes (epochs) a run of ``steps`` steps makes over the training data.

    ``steps × global batch / training examples``, the global batch being ``world_size × batch_size ×
    grad_accum`` examples (packed causal data: blocks of ``max_len`` tokens).

    Args:
        data: the data, or the number of training examples.
        steps: optimizer steps of the run.
        world_size: ranks that split a global batch.
        batch_size: examples per rank per micro-batch.
        grad_accum: micro-batches per optimizer step.

    Returns:
        The number of passes (1.0: every example once).
    """
    return steps * world_size * batch_size * grad_accum / _num_examples(data)


def _unit(data: Data | int) -> str:
    if isinstance(data, int):
        return "examples"
    if data.packed:
        return f"examples (blocks of {data.config.max_len} packed tokens)"
    return "examples"


def passes_note(data: Data | int, *, steps: int, world_size: int, batch_size: int, grad_accum: int = 1,
                name: str | None = None) -> str | None:
    """What a run that reads its training data more than once should say before it starts; None otherwise.

    Args:
        data: the data, or the number of training examples.
        steps: optimizer steps of the run.
        world_size: ranks that split a global batch.
        batch_size: examples per rank per micro-batch.
        grad_accum: micro-batches per optimizer step.
        name: the data in words (default: the data's name).

    Returns:
        The passes (epochs) in words, with the arithmetic and what to change; None within one pass.
    """
    n = _num_examples(data)
    passes = passes_over_data(n, steps=steps, world_size=world_size, batch_size=batch_size, grad_accum=grad_accum)
    if passes <= 1.0:
        return None
    global_batch = world_size * batch_size * grad_accum
    parts = f"{world_size} rank(s) × batch size {batch_size}" + (f" × grad accum {grad_accum}" if grad_accum > 1 else "")
    if name is None and not isinstance(data, int):
        name = data.name
    of = f" of {name}" if name else ""
    spe = steps_per_epoch(n, world_size=world_size, batch_size=batch_size * grad_accum)
    return (f"the training data will be read {passes:.2f} times, {passes:.2f} passes (epochs): {steps:,} steps × a "
            f"global batch of {global_batch:,} ({parts}) = {steps * global_batch:,} examples, over {n:,} training "
            f"{_unit(data)}{of}; a new epoch, reshuffled, starts every {spe:,} steps. Later epochs repeat examples "
            "already trained on: to stay within one pass, lower --steps or the batch, or add data")


def real_tokens(batch: dict[str, torch.Tensor], *, kind: str) -> int:
    """Real (non-padding) tokens of a batch: the input tokens, plus a seq2seq model's target tokens.

    The token counts lowband reports (``tokens`` in ``metrics.jsonl``, the summaries, the bench's
    results and its plots' token axes) count these: a padded position is not a token trained on.
    Packed causal blocks have no padding: every position counts.
    """
    n = int(batch["attention_mask"].sum())
    if kind == "seq2seq":
        n += int((batch["labels"] != LABEL_PAD).sum())
    return n


def epoch_of(step: int, *, data: Data | int, world_size: int, batch_size: int) -> int:
    """The epoch (0-based) that step ``step`` (0-based) falls in.

    Args:
        step: optimizer step, counted from 0.
        data: the data, or the number of training examples.
        world_size: number of ranks.
        batch_size: examples per rank per step.

    Returns:
        The epoch number.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step // steps_per_epoch(data, world_size=world_size, batch_size=batch_size)


def batch_indices(
    data: Data | int, *, step: int, rank: int, world_size: int, batch_size: int, seed: int
) -> list[int]:
    """Indices into ``data.train`` of rank ``rank``'s examples at ``step``.

    Epoch ``e`` uses the permutation ``numpy.random.default_rng([seed, e])``; step ``s`` of the
    epoch covers positions ``[s*G, (s+1)*G)`` with ``G = world_size * batch_size``, and rank ``r``
    takes positions ``[s*G + r*B, s*G + (r+1)*B)``.

    Args:
        data: the data, or the number of training examples.
        step: optimizer step, counted from 0.
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks that split a global batch.
        batch_size: examples per rank.
        seed: shuffling seed.

    Returns:
        ``batch_size`` distinct indices.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    spe = steps_per_epoch(data, world_size=world_size, batch_size=batch_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, pos = divmod(step, spe)
    perm = _epoch_permutation(_num_examples(data), seed, epoch)
    start = pos * world_size * batch_size + rank * batch_size
    return [int(i) for i in perm[start : start + batch_size]]


_PERM_CACHE: dict[tuple[int, int, int], Any] = {}
#: Above this many training examples an epoch's order is computed per index (:class:`_IndexPermutation`)
#: instead of held as a table of 4 bytes per example, so a rank's memory stays flat at any corpus size.
TABLE_PERMUTATION_MAX = 1 << 23


def _epoch_permutation(n: int, seed: int, epoch: int) -> Any:
    key = (n, seed, epoch)
    perm = _PERM_CACHE.get(key)
    if perm is None:
        if len(_PERM_CACHE) >= 2:  # the epoch a run is in (and the one before): older ones are not read again
            _PERM_CACHE.clear()
        if n > TABLE_PERMUTATION_MAX:
            perm = _IndexPermutation(n, seed, epoch)
        else:
            # Generator.permutation(n) shuffles arange(n); shuffling an int32 arange draws the same swaps, so
            # the order is the same, in half the memory.
            perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
            np.random.default_rng([seed, epoch]).shuffle(perm)
            perm.setflags(write=False)
        _PERM_CACHE[key] = perm
    return perm


class _IndexPermutation:
    """A seeded bijection of ``[0, n)``, computed for the positions asked (``perm[a:b]``), not stored.

    A 4-round Feistel network on the smallest even number of bits that covers ``n``, with cycle-walking
    (a value ``>= n`` is permuted again until it falls inside), as format-preserving encryption does:
    each position maps to a distinct example, and the map depends only on (n, seed, epoch).
    """

    _MUL1, _MUL2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.default_rng([seed, epoch, 0xFE157E1]).integers(0, 2**63, size=4, dtype=np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            h = (right ^ k) * self._MUL1  # wraps modulo 2**64, as meant
            h ^= h >> np.uint64(31)
            h *= self._MUL2
            h ^= h >> np.uint64(29)
            left, right = right, left ^ (h & self.mask)
        return (left << self.half) | right

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, positions: slice) -> np.ndarray:
        start, stop, step = positions.indices(self.n)
        out = self._rounds(np.arange(start, stop, step, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._rounds(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


def _pad(seqs: Sequence[np.ndarray], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    out = np.full((len(seqs), width), value, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return torch.from_numpy(out)


def collate(data: Data, split: Split, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """Pad the examples ``indices`` of ``split`` into a batch (padding to the longest one).

    Args:
        data: the data (gives the kind and the pad id).
        split: ``data.train`` or ``data.val``.
        indices: which examples, in order.

    Returns:
        ``input_ids`` and ``attention_mask`` (batch x longest input), and ``labels`` with -100 on
        padding: the target ids for seq2seq (batch x longest target), the input ids for causal
        (the model shifts them).
    """
    if not indices:
        raise ValueError("cannot collate an empty batch")
    inputs = [split.input_ids[i] for i in indices]
    input_ids = _pad(inputs, data.special.pad)
    lengths = torch.tensor([len(s) for s in inputs])
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    if data.kind == "seq2seq":
        assert split.target_ids is not None
        labels = _pad([split.target_ids[i] for i in indices], LABEL_PAD)
    else:
        labels = input_ids.masked_fill(attention_mask == 0, LABEL_PAD)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_batch(
    data: Data, *, step: int, rank: int, world_size: int, batch_size: int, seed: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s training batch at ``step``: a pure function of its arguments.

    Args:
        data: the data.
        step: optimizer step, counted from 0 (resuming at step k reproduces step k's batch).
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks that split one global batch (disjoint slices).
        batch_size: examples per rank.
        seed: shuffling seed (one permutation per epoch; see :func:`batch_indices`).

    Returns:
        A batch as from :func:`collate`.
    """
    idx = batch_indices(data, step=step, rank=rank, world_size=world_size, batch_size=batch_size, seed=seed)
    return collate(data, data.train, idx)


def val_batches(
    data: Data,
    *,
    batch_size: int,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[dict[str, torch.Tensor]]:
    """Validation batches in order (the last one may be smaller).

    Args:
        data: the data.
        batch_size: examples per batch.
        max_batches: stop after this many batches overall (across ranks); None for all.
        rank: with ``world_size`` > 1, yield only batches ``rank, rank + world_size, ...``.
        world_size: number of ranks sharing the evaluation.

    Yields:
        Batches as from :func:`collate`.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    n = len(data.val)
    total = (n + batch_size - 1) // batch_size
    if max_batches is not None:
        total = min(total, max_batches)
    for b in range(rank, total, world_size):
        yield collate(data, data.val, range(b * batch_size, min(n, (b + 1) * batch_size)))


def val_batch_count(data: Data, *, batch_size: int, max_batches: int | None = None) -> int:
    """Number of validation batches :func:`val_batches` yields overall (all ranks together).

    Args:
        data: the data.
        batch_size: examples per batch.
        max_batches: cap, as in :func:`val_batches`.

    Returns:
        The count.
    """
    total = (len(data.val) + batch_size - 1) // batch_size
    return total if max_batches is None else min(total, max_batches)
