"""Loading: raw examples, the train/validation split, the tokenizer and the token ids, memoised in the process.

The embedded default corpus is read into memory and tokenised through the token cache
(:mod:`~lowband.train.data.token_cache`), as it always was. A user's data (``path``) is tokenised
once into a token store (:mod:`~lowband.train.data.store`) and read from it on demand
(:mod:`~lowband.train.data.examples`): a second start reads no text, and a rank's memory does not
grow with the corpus.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lowband.train.data.config import Data, DataConfig, Split
from lowband.train.data.examples import DecodedTexts, DocExamples, DocSelection, PackedBlocks
from lowband.train.data.inputs import resolve_input
from lowband.train.data.sources import default_corpus_texts, default_examples
from lowband.train.data.store import TokenStore, TrainedTokenizer, prepare_store
from lowband.train.data.token_cache import encode
from lowband.train.tokenizer import (
    DEFAULT_DATASET_ID,
    SpecialIds,
    cache_root,
    get_tokenizer,
    load_tokenizer_and_ids,
    special_ids,
)

__all__ = ["DEFAULT_VAL_CAP", "DEFAULT_VAL_FRACTION", "data_digest", "load_data", "open_stores", "store_root",
           "training_examples"]

logger = logging.getLogger(__name__)

DEFAULT_VAL_FRACTION, DEFAULT_VAL_CAP = 0.05, 500


def _val_count(n: int, val_size: float | int | None) -> int:
    """How many of ``n`` examples (documents) the validation side takes."""
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
    return n_val


def _split_indices(n: int, val_size: float | int | None, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) index lists, each in ascending order (the embedded corpus)."""
    n_val = _val_count(n, val_size)
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
    if cfg.path is not None or (cfg.kind == "causal" and cfg.packing == "blocks"):
        return len(load_data(cfg).train)
    return len(_read_split(cfg)[0])


def _file_identity(path: str | None) -> tuple[Any, ...]:
    if path is None:
        return (None,)
    try:
        return resolve_input(path).identity()
    except (OSError, ValueError):
        return (path,)


def _read_split(cfg: DataConfig) -> tuple[list[str], list[str] | None, list[str], list[str] | None, str]:
    """The embedded corpus's examples (documents), split: (train sources, train targets, val sources,
    val targets, name)."""
    if cfg.val_path is not None:
        raise ValueError(
            "val_path needs path: give the training file too, or neither for the default data"
        )
    sources, targets = default_examples(cfg.kind)
    if cfg.max_examples is not None:
        sources = sources[: cfg.max_examples]
        targets = targets[: cfg.max_examples] if targets is not None else None
    train_idx, val_idx = _split_indices(len(sources), cfg.val_size, cfg.seed)
    train_sources = [sources[i] for i in train_idx]
    val_sources = [sources[i] for i in val_idx]
    train_targets = [targets[i] for i in train_idx] if targets is not None else None
    val_targets = [targets[i] for i in val_idx] if targets is not None else None
    return train_sources, train_targets, val_sources, val_targets, DEFAULT_DATASET_ID


def store_root(cfg: DataConfig) -> Path:
    """Where ``cfg``'s token stores live: ``store_dir``, or ``$LOWBAND_CACHE/stores``."""
    return Path(cfg.store_dir).expanduser() if cfg.store_dir else cache_root() / "stores"


def _columns(cfg: DataConfig) -> list[tuple[str, str]]:
    if cfg.kind == "seq2seq":
        return [("source", cfg.source_column), ("target", cfg.target_column)]
    return [("text", cfg.text_column)]


def open_stores(cfg: DataConfig) -> tuple[TokenStore, TokenStore | None]:
    """The token stores of a user's data: ``path``'s and, if given, ``val_path``'s (tokenised with the same
    tokenizer), each written first if it does not exist yet (:func:`~lowband.train.data.store.prepare_store`).

    Args:
        cfg: what to load; ``path`` must be set.

    Returns:
        (training store, validation store or None).
    """
    if cfg.path is None:
        raise ValueError("open_stores needs a data path: the embedded corpus has no token store")
    root, columns = store_root(cfg), _columns(cfg)
    eos = None
    if cfg.tokenizer is not None:  # with the ids its configuration names (a pretrained model's own, or --tokenizer)
        tokenizer, special = load_tokenizer_and_ids(cfg.tokenizer)
        eos = special.eos
    else:
        tokenizer = TrainedTokenizer(kind=cfg.tokenizer_kind, vocab_size=cfg.vocab_size,
                                     sample_bytes=cfg.tokenizer_sample_bytes)
    val_input = resolve_input(cfg.val_path) if cfg.val_path is not None else None  # bad input: before any work
    train = prepare_store(resolve_input(cfg.path), columns, tokenizer, root=root, eos=eos)
    if val_input is None:
        return train, None
    val_tokenizer = tokenizer if cfg.tokenizer is not None else train.tokenizer()
    return train, prepare_store(val_input, columns, val_tokenizer, root=root, eos=eos)


def data_digest(cfg: DataConfig) -> str | None:
    """What a user's data is, by content: its token store's digest (and the validation store's), computed
    when the store was written (writing it first if need be; no text is read when it exists). None for
    the embedded corpus. The job's fingerprint takes it, so nodes with the same data under other paths agree.

    Args:
        cfg: the data (``kind`` set as the run sets it).
    """
    if cfg.path is None:
        return None
    train, val = open_stores(cfg)
    return train.digest if val is None else f"{train.digest}+{val.digest}"


def _store_side(cfg: DataConfig, store: TokenStore, docs: DocSelection, tokenizer: Any) -> Split:
    if cfg.kind == "seq2seq":
        return Split(input_ids=DocExamples(store, "source", docs, cfg.max_source_len),
                     target_ids=DocExamples(store, "target", docs, cfg.max_target_len),
                     source_text=DecodedTexts(store, "source", docs, tokenizer),
                     target_text=DecodedTexts(store, "target", docs, tokenizer))
    examples = (PackedBlocks(store, "text", docs, cfg.max_len) if cfg.packing == "blocks"
                else DocExamples(store, "text", docs, cfg.max_len))
    return Split(input_ids=examples, target_ids=None, source_text=DecodedTexts(store, "text", docs, tokenizer),
                 target_text=None)


def _load_store(cfg: DataConfig) -> tuple[Data, int, int]:
    """A user's data from its token store(s): (data, training documents, validation documents).

    The validation documents are drawn (seeded by ``cfg.seed``) from the first ``max_examples``
    documents, without a permutation of them all: memory follows the validation side, not the corpus.
    """
    train_store, val_store = open_stores(cfg)
    tokenizer = train_store.tokenizer()
    n = train_store.documents if cfg.max_examples is None else min(train_store.documents, cfg.max_examples)
    if val_store is not None:
        train_docs, val_docs = DocSelection(limit=n), DocSelection(limit=val_store.documents)
    else:
        n_val = _val_count(n, cfg.val_size)
        val_ids = np.sort(np.random.default_rng([cfg.seed, 0x5EED]).choice(n, size=n_val, replace=False))
        train_docs, val_docs = DocSelection(limit=n, excluded=val_ids), DocSelection(limit=n, included=val_ids)
    # A given tokenizer's ids are those its configuration names (the store was written with its eos).
    special = load_tokenizer_and_ids(cfg.tokenizer)[1] if cfg.tokenizer is not None else special_ids(tokenizer)
    data = Data(tokenizer=tokenizer, kind=cfg.kind, special=special, config=cfg, name=str(cfg.path),
                train=_store_side(cfg, train_store, train_docs, tokenizer),
                val=_store_side(cfg, val_store or train_store, val_docs, tokenizer))
    data.stats["store"] = str(train_store.path)
    data.stats["store_digest"] = train_store.digest
    return data, len(train_docs), len(val_docs)


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
    if cfg.path is not None:
        data, train_docs, val_docs = _load_store(cfg)
        loaded = tokenized = time.perf_counter()  # the store's own index has its tokenisation times
    else:
        train_sources, train_targets, val_sources, val_targets, name = _read_split(cfg)
        train_docs, val_docs = len(train_sources), len(val_sources)
        loaded = time.perf_counter()
        # The default corpus: one tokenizer trained on all of it, whatever the split or cap.
        if cfg.tokenizer is not None:
            # A given tokenizer (a pretrained model's own, or --tokenizer) comes with the ids its configuration names.
            tokenizer, special = load_tokenizer_and_ids(cfg.tokenizer)
        else:
            tokenizer = get_tokenizer(default_corpus_texts(), cfg.vocab_size, kind=cfg.tokenizer_kind)
            special = special_ids(tokenizer)
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
        _check_blocks(data, train_docs=train_docs, val_docs=val_docs)
    done = time.perf_counter()
    data.stats.update({
        "read_s": loaded - start,
        "tokenizer_s": tokenized - loaded,
        "encode_s": done - tokenized,
        "train_examples": len(data.train),
        "val_examples": len(data.val),
    })
    logger.info(
        "data %s (%s): %d train / %d val %s, vocab %d; read %.2f s, tokenizer %.2f s, encode %.2f s%s",
        data.name,
        cfg.kind,
        len(data.train),
        len(data.val),
        f"blocks of {cfg.max_len} tokens (packed from {train_docs} / {val_docs} documents)"
        if data.packed else "examples",
        data.vocab_size,
        data.stats["read_s"],
        data.stats["tokenizer_s"],
        data.stats["encode_s"],
        f"; token store {data.stats['store']}" if "store" in data.stats else "",
    )
    if use_cache:
        _CACHE[key] = data
    return data
