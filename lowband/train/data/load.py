"""Loading: raw examples, the train/validation split, the tokenizer and the token ids, memoised in the process."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lowband.train.data.config import Data, DataConfig, Split
from lowband.train.data.sources import default_corpus_texts, default_examples, read_file
from lowband.train.data.token_cache import encode
from lowband.train.tokenizer import (
    DEFAULT_DATASET_ID,
    SpecialIds,
    get_tokenizer,
    load_tokenizer_and_ids,
    special_ids,
)

__all__ = ["DEFAULT_VAL_CAP", "DEFAULT_VAL_FRACTION", "load_data", "training_examples"]

logger = logging.getLogger(__name__)

DEFAULT_VAL_FRACTION, DEFAULT_VAL_CAP = 0.05, 500


def _split_indices(n: int, val_size: float | int | None, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) index lists, each in ascending order."""
    if val_size is None:
        n_val = min(DEFAULT_VAL_CAP, round(n * DEFAULT_VAL_FRACTION))
    elif isinstance(val_size, float):
        n_val = round(n * val_size)
    else:
        n_val = int(val_size)
    n_val = max(1, n_val)
    if n_val >= n:
        raise ValueError(
            f"val_size {val_size} leaves no training data out of {n} examples; use a smaller val_size"
        )
    perm = np.random.default_rng([seed, 0x5EED]).permutation(n)
    return sorted(int(i) for i in perm[n_val:]), sorted(int(i) for i in perm[:n_val])


def _make_split(
    tokenizer: Tokenizer,
    special: SpecialIds,
    cfg: DataConfig,
    sources: list[str],
    targets: list[str] | None,
) -> Split:
    if cfg.kind == "seq2seq":
        assert targets is not None
        return Split(
            input_ids=encode(tokenizer, sources, cfg.max_source_len, special.eos),
            target_ids=encode(tokenizer, targets, cfg.max_target_len, special.eos),
            source_text=sources,
            target_text=targets,
        )
    packed = cfg.packing == "blocks"
    return Split(
        input_ids=encode(tokenizer, sources, cfg.max_len, special.eos, packed=packed),
        target_ids=None,
        source_text=sources,
        target_text=None,
    )


def _check_blocks(data: Data, *, train_docs: int, val_docs: int) -> None:
    """Packed data: each side must fill at least one block."""
    for side, split, docs in (("training", data.train, train_docs), ("validation", data.val, val_docs)):
        if len(split) == 0:
            raise ValueError(
                f"the {docs} {side} document(s) hold fewer than --max-len {data.config.max_len} tokens, not one "
                f"full packed block; give more {side} text, a smaller --max-len, or --packing lines"
            )


def training_examples(cfg: DataConfig) -> int:
    """How many training examples :func:`load_data` gives for ``cfg``: documents less the validation
    ones, read without tokenising; packed causal data: the blocks, which needs the token ids (loaded,
    and cached on disk for the runs that follow).

    Args:
        cfg: what to load (``kind`` and ``seed`` set as the run sets them).

    Returns:
        The number of training examples (packed: blocks of ``cfg.max_len`` tokens).
    """
    if cfg.kind == "causal" and cfg.packing == "blocks":
        return len(load_data(cfg).train)
    return len(_read_split(cfg)[0])


def _file_identity(path: str | None) -> tuple[Any, ...]:
    if path is None:
        return (None,)
    try:
        st = Path(path).expanduser().stat()
    except OSError:
        return (path,)
    return (str(Path(path).expanduser().resolve()), st.st_size, st.st_mtime_ns)


def _read_split(cfg: DataConfig) -> tuple[list[str], list[str] | None, list[str], list[str] | None, str]:
    """The raw examples (documents), split: (train sources, train targets, val sources, val targets, name)."""
    if cfg.path is None:
        if cfg.val_path is not None:
            raise ValueError(
                "val_path needs path: give the training file too, or neither for the default data"
            )
        sources, targets = default_examples(cfg.kind)
        name = DEFAULT_DATASET_ID
    else:
        sources, targets = read_file(cfg.path, cfg)
        name = str(cfg.path)
    if cfg.max_examples is not None:
        sources = sources[: cfg.max_examples]
        targets = targets[: cfg.max_examples] if targets is not None else None

    if cfg.val_path is not None:
        val_sources, val_targets = read_file(cfg.val_path, cfg)
        train_sources, train_targets = sources, targets
    else:
        train_idx, val_idx = _split_indices(len(sources), cfg.val_size, cfg.seed)
        train_sources = [sources[i] for i in train_idx]
        val_sources = [sources[i] for i in val_idx]
        train_targets = [targets[i] for i in train_idx] if targets is not None else None
        val_targets = [targets[i] for i in val_idx] if targets is not None else None
    return train_sources, train_targets, val_sources, val_targets, name


_CACHE: dict[tuple[Any, ...], Data] = {}


def load_data(cfg: DataConfig, *, use_cache: bool = True) -> Data:
    """Load, split and tokenise the data described by ``cfg`` (memoised in this process).

    Args:
        cfg: what to load.
        use_cache: reuse a ``Data`` this process already built for the same config and files.
            (Trained tokenizers and token ids are also cached on disk under ``$LOWBAND_CACHE``,
            keyed by content, whatever this flag says.)

    Returns:
        The data with its tokenizer. Treat it as read-only.

    Raises:
        FileNotFoundError: a data or tokenizer path that does not exist.
        ValueError: an unsupported extension, a missing column, no usable examples, or a
            validation size that leaves nothing to train on.
    """
    key = (cfg, _file_identity(cfg.path), _file_identity(cfg.val_path), _file_identity(cfg.tokenizer))
    if use_cache and key in _CACHE:
        return _CACHE[key]
    start = time.perf_counter()

    train_sources, train_targets, val_sources, val_targets, name = _read_split(cfg)
    loaded = time.perf_counter()

    special: SpecialIds | None = None
    if cfg.tokenizer is not None:
        # A given tokenizer (a pretrained model's own, or --tokenizer) comes with the ids its configuration names.
        tokenizer, special = load_tokenizer_and_ids(cfg.tokenizer)
    elif cfg.path is None:
        # The default corpus: one tokenizer trained on all of it, whatever the split or cap.
        tokenizer = get_tokenizer(default_corpus_texts(), cfg.vocab_size, kind=cfg.tokenizer_kind)
    else:
        # A user's data: train on the training texts (sources and targets), never on validation.
        tok_texts = list(train_sources) + (list(train_targets) if train_targets is not None else [])
        tokenizer = get_tokenizer(tok_texts, cfg.vocab_size, kind=cfg.tokenizer_kind)
    special = special or special_ids(tokenizer)
    tokenized = time.perf_counter()

    data = Data(
        tokenizer=tokenizer,
        kind=cfg.kind,
        train=_make_split(tokenizer, special, cfg, train_sources, train_targets),
        val=_make_split(tokenizer, special, cfg, val_sources, val_targets),
        special=special,
        config=cfg,
        name=name,
    )
    if data.packed:
        _check_blocks(data, train_docs=len(train_sources), val_docs=len(val_sources))
    done = time.perf_counter()
    data.stats = {
        "read_s": loaded - start,
        "tokenizer_s": tokenized - loaded,
        "encode_s": done - tokenized,
        "train_examples": len(data.train),
        "val_examples": len(data.val),
    }
    logger.info(
        "data %s (%s): %d train / %d val %s, vocab %d; read %.2f s, tokenizer %.2f s, encode %.2f s",
        name,
        cfg.kind,
        len(data.train),
        len(data.val),
        f"blocks of {cfg.max_len} tokens (packed from {len(train_sources)} / {len(val_sources)} documents)"
        if data.packed else "examples",
        data.vocab_size,
        data.stats["read_s"],
        data.stats["tokenizer_s"],
        data.stats["encode_s"],
    )
    if use_cache:
        _CACHE[key] = data
    return data
