"""Tokenizers for ``lowband train``: trained once on the training text, cached on disk.

A tokenizer is either

* trained with the ``tokenizers`` library on a list of texts (byte-level BPE by default, or
  Unigram), with the special tokens ``<pad>`` = 0, ``</s>`` = 1 and ``<unk>`` = 2 (the ids a
  randomly initialised T5 expects), and cached under ``$LOWBAND_CACHE/tokenizers`` (default
  ``~/.cache/lowband``) keyed by a hash of (texts, vocabulary size, kind); or
* loaded from a user's local ``tokenizer.json`` (or a directory holding one), or a pretrained
  model's own: a directory saved by a Hugging Face tokenizer (``tokenizer_config.json`` beside
  ``tokenizer.json``) is loaded with transformers' ``AutoTokenizer``, and its special ids are the
  ones its configuration names (:func:`load_tokenizer_and_ids`), not guessed from token names.

A run writes the tokenizer it used to ``OUT/tokenizer`` (:func:`save_for_transformers`), as a
transformers tokenizer directory, so that the run directory and its exported models
(``lowband export``) are self-contained.

Training is deterministic (the same texts give byte-identical ``tokenizer.json`` whatever the
number of threads), so nodes without a shared file system still agree on the token ids.
Several ranks starting at once are safe: one process trains while the others wait on a file
lock, and the file appears through an atomic rename, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from lowband.util import atomic_dir, atomic_path

logger = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2

TOKENIZER_KINDS: tuple[str, ...] = ("bpe", "unigram")
DEFAULT_DATASET_ID = "wiki-vital-en"
"""Name of the embedded default corpus (see :mod:`lowband.train.data`)."""

# Bump when the trained tokenizer's recipe changes, so old cache entries are not reused.
_RECIPE_VERSION = 1
_LOCK_TIMEOUT_S = 600.0

# How many tokenizers this process has trained (tests use it to see that the cache is reused).
train_count = 0

_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_EOS_NAMES = ("</s>", "<eos>", "<|endoftext|>", "[SEP]", "<|eos|>")
_UNK_NAMES = ("<unk>", "[UNK]", "<|unk|>")
# A slow tokenizer's files, which transformers' AutoTokenizer reads (with the model's config.json) where a
# directory has no tokenizer.json: older saved models (GPT-2's vocab.json and merges.txt, SentencePiece models).
_SLOW_TOKENIZER_FILES = ("vocab.json", "spiece.model", "tokenizer.model")


def cache_root() -> Path:
    """The lowband cache directory: ``$LOWBAND_CACHE`` or ``~/.cache/lowband``.

    Returns:
        The directory (not created here).
    """
    env = os.environ.get("LOWBAND_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lowband"


@dataclass(kw_only=True, frozen=True)
class SpecialIds:
    """Ids of the special tokens a data pipeline needs.

    Args:
        pad: id used to pad inputs (labels are padded with -100 instead).
        eos: id appended to every sequence.
        unk: id of the unknown token, or None when the tokenizer has none.
        bos: id of the beginning-of-sequence token, or None when the tokenizer names none (lowband's
            trained tokenizers have none; the data never inserts one).
    """

    pad: int
    eos: int
    unk: int | None
    bos: int | None = None


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """Find pad / eos / unk ids of a tokenizer (ours: 0 / 1 / 2; a user's: looked up by name).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.

    Returns:
        The ids. A tokenizer without a pad token pads with its eos id.

    Raises:
        ValueError: the tokenizer has no end-of-sequence token under any usual name.
    """

    def find(names: Sequence[str]) -> int | None:
        for name in names:
            idx = tokenizer.token_to_id(name)
            if idx is not None:
                return idx
        return None

    eos = find(_EOS_NAMES)
    if eos is None:
        raise ValueError(
            f"the tokenizer has no end-of-sequence token (looked for {', '.join(_EOS_NAMES)}); "
            "use a tokenizer that has one, or let lowband train its own (omit the tokenizer path)"
        )
    pad = find(_PAD_NAMES)
    return SpecialIds(pad=eos if pad is None else pad, eos=eos, unk=find(_UNK_NAMES))


def texts_fingerprint(texts: Iterable[str]) -> str:
    """A content hash of a sequence of texts (order and boundaries included).

    Args:
        texts: the texts.

    Returns:
        Hex SHA-256 digest.
    """
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _new_tokenizer(kind: str, vocab_size: int) -> tuple[Tokenizer, trainers.Trainer]:
    """An untrained tokenizer and its trainer for ``kind``."""
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer: trainers.Trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            unk_token=UNK_TOKEN,
            show_progress=False,
        )
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(TOKENIZER_KINDS)}")
    return tok, trainer


def train_tokenizer(texts: Sequence[str], vocab_size: int, *, kind: str = "bpe") -> Tokenizer:
    """Train a tokenizer (no caching; see :func:`get_tokenizer`).

    Args:
        texts: training texts.
        vocab_size: target vocabulary size, special tokens included. A small corpus may give
            fewer entries; read the real size with ``tokenizer.get_vocab_size()``.
        kind: ``"bpe"`` (byte-level BPE: never produces ``<unk>``) or ``"unigram"``.

    Returns:
        The trained tokenizer, with ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2.

    Raises:
        ValueError: bad ``kind`` or ``vocab_size``, or no texts.
    """
    global train_count
    if vocab_size < len(SPECIAL_TOKENS) + 1 or (kind == "bpe" and vocab_size < 256 + len(SPECIAL_TOKENS)):
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a {kind} tokenizer "
            f"(byte-level BPE needs at least {256 + len(SPECIAL_TOKENS)})"
        )
    if len(texts) == 0:
        raise ValueError("cannot train a tokenizer on no text: the training data is empty")
    tok, trainer = _new_tokenizer(kind, vocab_size)
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    train_count += 1
    for token, idx in zip(SPECIAL_TOKENS, (PAD_ID, EOS_ID, UNK_ID), strict=True):
        if tok.token_to_id(token) != idx:  # pragma: no cover - guaranteed by the trainers
            raise RuntimeError(f"trained tokenizer has {token} at {tok.token_to_id(token)}, expected {idx}")
    logger.info(
        "trained %s tokenizer: %d entries on %d texts in %.2f s",
        kind,
        tok.get_vocab_size(),
        len(texts),
        time.perf_counter() - start,
    )
    return tok


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a user's tokenizer: a ``tokenizer.json`` file or a directory that holds one.

    Args:
        path: file or directory.

    Returns:
        The tokenizer.

    Raises:
        FileNotFoundError: nothing there, or a directory without ``tokenizer.json``.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json: give a directory saved by a fast (Rust) Hugging Face "
                "tokenizer, or a tokenizer.json file"
            )
    elif not p.is_file():
        raise FileNotFoundError(
            f"tokenizer not found: {path} (give a tokenizer.json or a directory holding one)"
        )
    return Tokenizer.from_file(str(p))


def load_tokenizer_and_ids(path: str | os.PathLike[str]) -> tuple[Tokenizer, SpecialIds]:
    """Load a tokenizer with the special ids it is used with.

    * A directory saved by a Hugging Face tokenizer (``tokenizer_config.json``, or an older model's
      ``vocab.json`` / ``spiece.model`` without ``tokenizer.json``; a pretrained model's directory, or a
      ``tokenizer.json`` inside one): loaded with transformers' ``AutoTokenizer``
      (offline), whose configuration names pad / eos / bos / unk. Its fast backend, the
      ``tokenizers.Tokenizer`` that ``AutoTokenizer`` encodes with, is returned. A tokenizer without
      a pad token pads with its eos (labels of padding are -100 either way), as transformers does.
    * A bare ``tokenizer.json``: its ids come from a model ``config.json`` beside it where there is one
      (``eos_token_id``, ``pad_token_id``, ``bos_token_id``), else by the usual names (:func:`special_ids`).

    Padding and truncation saved in the tokenizer are switched off: the data pipeline pads and
    truncates itself.

    Args:
        path: a tokenizer directory or a ``tokenizer.json``.

    Returns:
        ``(tokenizer, special ids)``.

    Raises:
        FileNotFoundError: no tokenizer there.
        ValueError: transformers cannot load it, it has no fast (``tokenizers``) backend, or it
            names no end-of-sequence token.
    """
    p = Path(path).expanduser()
    directory = p if p.is_dir() else p.parent
    if saved_by_transformers(directory) and (p.is_dir() or p.name == "tokenizer.json"):
        tok, ids = _transformers_tokenizer(directory)
    else:
        tok = load_tokenizer(p)
        ids = _ids_from_model_config(tok, directory / "config.json") or special_ids(tok)
    tok.no_padding()
    tok.no_truncation()
    return tok, ids


def saved_by_transformers(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a tokenizer saved by transformers: a ``tokenizer_config.json``, or, without a
    ``tokenizer.json``, a slow tokenizer's vocabulary (``vocab.json``, ``spiece.model``, ``tokenizer.model``)."""
    d = Path(directory)
    if (d / "tokenizer_config.json").is_file():
        return True
    return not (d / "tokenizer.json").is_file() and any((d / f).is_file() for f in _SLOW_TOKENIZER_FILES)


def holds_tokenizer(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a tokenizer :func:`load_tokenizer_and_ids` can load."""
    return (Path(directory) / "tokenizer.json").is_file() or saved_by_transformers(directory)


def _transformers_tokenizer(directory: Path) -> tuple[Tokenizer, SpecialIds]:
    """A saved Hugging Face tokenizer's fast backend and the special ids its configuration names."""
    # Imported here: transformers takes seconds to import, and only saved HF tokenizers need it.
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; say which directory, keep the cause
        raise ValueError(f"transformers could not load the tokenizer in {directory}: {exc}") from exc
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(
            f"the tokenizer in {directory} ({type(hf).__name__}) has no fast backend (tokenizer.json); "
            "convert it once with AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) on a machine "
            "with sentencepiece installed"
        )
    eos = hf.eos_token_id
    if eos is None:
        eos = _config_value(directory / "config.json", "eos_token_id")
    if eos is None:
        raise ValueError(
            f"the tokenizer in {directory} names no end-of-sequence token (eos_token in tokenizer_config.json), "
            "and its config.json has no eos_token_id; lowband ends every document with one: set eos_token in "
            "tokenizer_config.json"
        )
    pad = hf.pad_token_id
    return backend, SpecialIds(pad=eos if pad is None else pad, eos=eos, unk=hf.unk_token_id, bos=hf.bos_token_id)


def _config_value(config_json: Path, key: str) -> int | None:
    """An id from a model ``config.json`` (the first of a list, as ``eos_token_id`` may be), or None."""
    if not config_json.is_file():
        return None
    try:
        value = json.loads(config_json.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError):
        return None
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _ids_from_model_config(tok: Tokenizer, config_json: Path) -> SpecialIds | None:
    """Special ids from the model ``config.json`` beside a bare ``tokenizer.json``, or None when it names no eos."""
    eos = _config_value(config_json, "eos_token_id")
    if eos is None or tok.id_to_token(eos) is None:
        return None
    pad = _config_value(config_json, "pad_token_id")
    unk = next((tok.token_to_id(n) for n in _UNK_NAMES if tok.token_to_id(n) is not None), None)
    return SpecialIds(pad=eos if pad is None else pad, eos=eos, unk=unk, bos=_config_value(config_json, "bos_token_id"))


def tokenizer_size(tok: Tokenizer) -> int:
    """Entries of a tokenizer, added tokens included: the ids it can produce are ``0 .. size - 1``."""
    return tok.get_vocab_size(with_added_tokens=True)


def _cached_train(texts: Sequence[str], vocab_size: int, kind: str, cache_dir: Path) -> Tokenizer:
    """Train or reuse the tokenizer cached for (texts, vocab_size, kind)."""
    key = hashlib.sha256(
        f"v{_RECIPE_VERSION}|{kind}|{vocab_size}|{'|'.join(SPECIAL_TOKENS)}|{texts_fingerprint(texts)}".encode()
    ).hexdigest()[:24]
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{kind}-{vocab_size}-{key}.json"
    if target.is_file():
        logger.debug("reusing cached tokenizer %s", target)
        return Tokenizer.from_file(str(target))

    # One process trains; the others wait on the lock, then find the file. filelock ships with
    # datasets / transformers / huggingface_hub, so it is present wherever they are.
    from filelock import FileLock

    with FileLock(str(target) + ".lock", timeout=_LOCK_TIMEOUT_S):
        if target.is_file():
            return Tokenizer.from_file(str(target))
        tok = train_tokenizer(texts, vocab_size, kind=kind)
        with atomic_path(target) as tmp:  # readers without the lock never see a partial file
            tok.save(str(tmp))
        logger.info("cached tokenizer at %s", target)
    return tok


def get_tokenizer(
    source: str | os.PathLike[str] | Sequence[str],
    vocab_size: int = 8192,
    *,
    kind: str = "bpe",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Get the tokenizer for some text: from the cache, trained now, or a user's own.

    Args:
        source: one of
            * a sequence of texts: train on them (cached by content, vocab size and kind);
            * the path of a ``tokenizer.json`` or of a directory holding one: load it as is
              (``vocab_size`` and ``kind`` are then ignored).
        vocab_size: vocabulary size of a trained tokenizer, special tokens included.
        kind: ``"bpe"`` (byte-level BPE, default) or ``"unigram"``.
        cache_dir: where trained tokenizers are cached; default ``$LOWBAND_CACHE/tokenizers``.

    Returns:
        A ``tokenizers.Tokenizer``. Trained ones have ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2;
        use :func:`special_ids` to find them in any tokenizer.

    Raises:
        ValueError: a string that is not an existing path, an
            unknown ``kind``, or a ``vocab_size`` that is too small.
        FileNotFoundError: a directory without ``tokenizer.json``.
    """
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(TOKENIZER_KINDS)}")
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "tokenizers"
    if isinstance(source, (str, os.PathLike)):
        if Path(source).expanduser().exists():
            return load_tokenizer(source)
        raise ValueError(
            f"tokenizer source {str(source)!r} is not an existing tokenizer.json or directory holding one "
            "(nothing is downloaded); to train on texts, pass the texts (the default corpus's: "
            "lowband.train.data.default_corpus_texts())"
        )
    texts = list(source)
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("get_tokenizer expects a sequence of str texts")
    return _cached_train(texts, vocab_size, kind, cdir)


def for_transformers(tokenizer: Tokenizer, *, seq2seq: bool):
    """``tokenizer`` as a transformers tokenizer (``PreTrainedTokenizerFast``), its special tokens named.

    Its special tokens are those of :func:`special_ids` (pad, eos, unk; a causal model's bos is its eos,
    as the GPT-2 configs of :mod:`lowband.train.models` say). A seq2seq model saw ``</s>`` after every
    source and target (lowband appends it when it tokenises): such a tokenizer without a post-processor
    of its own gets one that appends it, so ``tokenizer(text)`` gives the ids the model was trained on.
    lowband itself tokenises without special tokens, so the tokenizer read back (``--tokenizer DIR``)
    gives a run the same ids.

    Args:
        tokenizer: the tokenizer (left unchanged: the result wraps a copy).
        seq2seq: whether the model is an encoder-decoder.

    Returns:
        A ``transformers.PreTrainedTokenizerFast``; its ``save_pretrained(DIR)`` writes ``tokenizer.json``
        and ``tokenizer_config.json``, which ``AutoTokenizer.from_pretrained(DIR)`` loads.

    Raises:
        ValueError: the tokenizer has no end-of-sequence token.
    """
    # transformers only here: a run imports it with its models anyway, and this module stays light without.
    from transformers import PreTrainedTokenizerFast

    ids = special_ids(tokenizer)
    tok = Tokenizer.from_str(tokenizer.to_str())  # a copy: the token cache keys on the run's tokenizer's text
    eos = tok.id_to_token(ids.eos)
    if seq2seq and tok.post_processor is None:
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                                           special_tokens=[(eos, ids.eos)])
    named = {"eos_token": eos, "pad_token": tok.id_to_token(ids.pad)}
    if ids.unk is not None:
        named["unk_token"] = tok.id_to_token(ids.unk)
    if not seq2seq:
        named["bos_token"] = eos
    return PreTrainedTokenizerFast(tokenizer_object=tok, **named)


def save_for_transformers(tokenizer: Tokenizer, directory: str | os.PathLike[str], *, seq2seq: bool) -> Path:
    """Write ``tokenizer`` to ``directory`` as a transformers tokenizer directory (:func:`for_transformers`).

    The directory appears whole or not at all (:func:`lowband.util.atomic_dir`); an existing one is
    replaced.

    Returns:
        The directory.
    """
    fast = for_transformers(tokenizer, seq2seq=seq2seq)
    with atomic_dir(directory) as tmp:
        fast.save_pretrained(str(tmp))
    return Path(directory)
