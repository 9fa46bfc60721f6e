"""What data to load (:class:`DataConfig`) and what loading gives (:class:`Data`, one :class:`Split` per side)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lowband.train.fields import option
from lowband.train.tokenizer import SpecialIds
from lowband.units import parse_size

__all__ = ["KINDS", "LABEL_PAD", "PACKINGS", "Data", "DataConfig", "Split", "describe"]

KINDS: tuple[str, ...] = ("seq2seq", "causal")
#: How causal text becomes examples (:attr:`DataConfig.packing`).
PACKINGS: tuple[str, ...] = ("blocks", "lines")
#: The label of a padding position: ignored by the loss.
LABEL_PAD = -100


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """What data to train on and how to cut it (a job's ``[data]`` table; :mod:`lowband.train.config`).

    Args:
        path: a user's data (see :mod:`~lowband.train.data.inputs`): a file (``.txt``, ``.jsonl``/``.json``,
            ``.csv``/``.tsv``, ``.parquet``, ``.arrow``), a glob of them, a directory of them or of a dataset
            saved with ``save_to_disk``; tokenised once into a token store (:mod:`~lowband.train.data.store`).
            None for the embedded default corpus (Wikipedia vital articles).
        kind: ``"seq2seq"`` (source -> target) or ``"causal"`` (one text per example).
        source_column: source column of a user's jsonl/csv (seq2seq).
        target_column: target column of a user's jsonl/csv (seq2seq).
        text_column: text column of a user's jsonl/csv (causal); a ``.txt`` file is one
            example per non-empty line.
        val_path: optional separate validation file (same format); when given, ``val_size`` is
            ignored and all of ``path`` is training data.
        val_size: validation share: a fraction in (0, 1), a count of examples (documents when packed: the
            split comes before packing; int >= 1, default 256),
            or None for 5 % of the examples capped at 500 (493 of the default corpus's 9,862).
        max_source_len: source tokens per example, ``</s>`` included (paper: 512).
        max_target_len: target tokens per example, ``</s>`` included (paper: 150).
        max_len: tokens per causal example, ``</s>`` included (``packing="blocks"``: the block length).
        packing: how causal text becomes examples. ``"blocks"`` (the default): the documents (one
            per non-empty line of a ``.txt``, one per row of a text column, one per lead paragraph of
            the embedded corpus) are tokenised whole, each followed by ``</s>``, concatenated and cut
            into full blocks of ``max_len`` tokens, the last partial block dropped, as transformers'
            ``run_clm`` (``group_texts``) and nanoGPT do: no padding, and a block spans documents.
            The validation documents are split off first and packed on their own, so no block
            straddles train and validation. ``"lines"``: one example per document, truncated to
            ``max_len`` and padded in the batch. Seq2seq pairs are never packed (this is ignored).
        vocab_size: vocabulary size of the tokenizer lowband trains.
        tokenizer: a user's ``tokenizer.json`` or a directory holding one; None trains one (cached, see
            :mod:`lowband.train.tokenizer`): on the whole embedded corpus, or on the first
            ``tokenizer_sample_bytes`` of a user's documents (validation ones included); a pretrained
            model's own tokenizer is set here by the trainer (:mod:`lowband.train.pretrained`).
        tokenizer_kind: ``"bpe"`` or ``"unigram"`` for a trained tokenizer.
        tokenizer_sample_bytes: how much of a user's text (the first documents, in order) a trained
            tokenizer learns from, so that its training costs the same at any corpus size.
        store_dir: where token stores are written (default ``$LOWBAND_CACHE/stores``): a folder on a
            local disk with room for about half the text's size (uint16 ids).
        seed: seed of the train/validation split. Fixed for a data set, not the run's seed: runs
            at several seeds are validated on the same documents (and share one tokenizer), so their
            spread is the training's noise, not the validation set's.
        max_examples: keep at most this many examples (documents when packed; after dropping empty
            ones, before the split); None keeps all. Handy for quick runs.
    """

    path: str | None = option(None, "local data: a .txt/.jsonl/.json/.csv/.tsv/.parquet/.arrow file, a glob of them "
                              "(quoted), a directory of them or of a dataset saved with save_to_disk; tokenized once "
                              "into a token store (default: embedded Wikipedia lead paragraph -> description pairs)",
                              flag="--data")
    kind: str = "seq2seq"  # not a job key: the trainer sets it from the model
    source_column: str = option("source", "seq2seq data: the input column")
    target_column: str = option("target", "seq2seq data: the output column")
    text_column: str = option("text", "causal LM data: the text column")
    val_path: str | None = option(None, "separate validation file (same format as --data)", flag="--val-data")
    # 256, not a share: every bench and golden is measured on the same 256 examples.
    val_size: float | int | None = option(256, "validation examples (>= 1) or share (< 1)", type=float)
    max_source_len: int = option(128, "tokens per source, truncated (paper: 512)")
    max_target_len: int = option(32, "tokens per target, truncated (paper: 150)")
    max_len: int = option(128, "causal LM sequence length (packed: the block length)")
    packing: str = option("blocks", "causal LM text: 'blocks' packs the documents (a .txt's lines, a text column's "
                          "rows), each ended by </s>, into full blocks of --max-len tokens, the remainder dropped "
                          "(as run_clm's group_texts); 'lines' keeps one example per document, truncated and "
                          "padded. Seq2seq pairs are never packed", choices=PACKINGS)
    vocab_size: int = option(8192, "size of the tokenizer trained on the data")
    tokenizer: str | None = option(None, "a tokenizer.json or its directory (default: a pretrained model's own; "
                                   "else one trained on the data, cached). With a pretrained model it must have the "
                                   "model's vocabulary and special ids, or it is refused")
    tokenizer_kind: str = option("bpe", "the kind of tokenizer trained on the data", choices=("bpe", "unigram"))
    tokenizer_sample_bytes: int = option(32_000_000, "a tokenizer trained on --data learns from its first documents, "
                                         "up to this much text (e.g. 32MB, 1GB)", flag="--tokenizer-sample",
                                         type=parse_size, metavar="SIZE")
    store_dir: str | None = option(None, "folder of the token stores --data is tokenized into (default "
                                   "$LOWBAND_CACHE/stores, ~/.cache/lowband/stores)")
    seed: int = 0  # not a job key: every run of a data set splits it the same way
    max_examples: int | None = option(None, "use at most this many examples (documents, before packing)")

    def __post_init__(self) -> None:
        if isinstance(self.tokenizer_sample_bytes, str):  # "32MB" from a job file
            object.__setattr__(self, "tokenizer_sample_bytes", parse_size(self.tokenizer_sample_bytes))
        if self.tokenizer_sample_bytes < 1:
            raise ValueError(f"tokenizer_sample_bytes must be positive, got {self.tokenizer_sample_bytes}")
        if self.kind not in KINDS:
            raise ValueError(f"unknown data kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.packing not in PACKINGS:
            raise ValueError(f"unknown packing {self.packing!r}; choose one of {', '.join(PACKINGS)}")
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

    The embedded corpus's splits are lists in memory; a user's data are sequences that read each
    example from its token store when indexed (:mod:`~lowband.train.data.examples`), so they hold no
    more memory for a larger corpus.

    Args:
        input_ids: token ids per example (1-D integer arrays: int32 in memory, the store's uint16 or
            uint32 from a token store), each ending in ``</s>`` (seq2seq: the source).
        target_ids: seq2seq target ids per example, each ending in ``</s>``; None for causal.
        source_text: untruncated source (seq2seq) or text (causal) per document; packed causal data:
            the documents packed into the blocks, in order (not one per block). From a token store:
            decoded from the ids (the text as the tokenizer normalised it).
        target_text: untruncated reference target per example (seq2seq); None for causal.
    """

    input_ids: Sequence[np.ndarray]
    target_ids: Sequence[np.ndarray] | None
    source_text: Sequence[str]
    target_text: Sequence[str] | None

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
    def packed(self) -> bool:
        """Whether the examples are packed blocks of ``config.max_len`` tokens (causal, ``packing="blocks"``)."""
        return self.kind == "causal" and self.config.packing == "blocks"

    @property
    def pad_id(self) -> int:
        """Padding id of inputs."""
        return self.special.pad


def describe(data: Data) -> dict[str, Any]:
    """A JSON-able summary of the data (for logs and results files).

    Args:
        data: the data.

    Returns:
        Name, kind, packing (causal), sizes (packed: blocks, and the documents they hold), vocab
        size, and mean token lengths.
    """

    def mean_len(seqs: Sequence[np.ndarray] | None) -> float | None:
        if seqs is None or len(seqs) == 0:
            return None
        fast = getattr(seqs, "mean_length", None)  # a token store's examples: without reading each one
        return float(fast()) if fast else float(sum(len(s) for s in seqs) / len(seqs))

    return {
        "name": data.name,
        "kind": data.kind,
        "packing": data.config.packing if data.kind == "causal" else None,
        "train_examples": len(data.train),
        "val_examples": len(data.val),
        "train_documents": len(data.train.source_text),
        "vocab_size": data.vocab_size,
        "mean_input_tokens": mean_len(data.train.input_ids),
        "mean_target_tokens": mean_len(data.train.target_ids),
    }
