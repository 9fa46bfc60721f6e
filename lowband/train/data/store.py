"""The token store: a corpus's token ids, written once to disk and shared by every rank of a host.

A user's data (:mod:`~lowband.train.data.inputs`) is tokenised once into a folder under
``$LOWBAND_CACHE/stores`` (or ``--store-dir``), as nanoGPT's ``.bin`` files and Megatron's indexed
datasets hold it: per field (``text`` for causal data, ``source`` and ``target`` for seq2seq pairs)
a flat array of token ids, each document followed by the tokenizer's end-of-sequence id, in shards
of about :data:`SHARD_TOKENS` ids; beside each shard the ``int64`` offsets of its documents; and

* ``index.json``: the format and its version, the dtype (``uint16`` below 65,536 ids, else
  ``uint32``), the eos id, the tokenizer's digest, the input's files (path, size, modification
  time), the counts per shard, how the tokenizer was trained, and the **digest**: a SHA-256 of the
  token ids and the documents' lengths per field, the dtype and the tokenizer, computed while
  writing. It is path-free: two hosts that tokenise the same text with the same tokenizer agree, so
  the job's fingerprint takes it instead of re-reading the text;
* ``tokenizer.json``: the tokenizer the ids come from (a trained one learns from the first
  ``--tokenizer-sample`` bytes of documents: :func:`sample_documents`).

The folder's name is a key of what it was made from (the input's files with their sizes and
modification times, the columns, the tokenizer or how to train one): a changed file gets a new store.
It is written under a temporary name and renamed when complete, while a file lock keeps the other
ranks of the host waiting (one tokenises, the others open the result). Opening checks what is cheap
(the format version, every file's size against the index, the offsets' ends); a store that fails is
reported with how to rebuild it (delete the folder). Ids are read with positional reads
(``os.pread``), not a kept memory map: the pages of a map that training touches would count in every
rank's resident set, growing with the corpus; the kernel's page cache is shared by the ranks either way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lowband.train.data.inputs import DataInput, ReadStats, iter_documents
from lowband.train.tokenizer import SPECIAL_TOKENS, get_tokenizer, special_ids
from lowband.units import format_bytes

__all__ = ["FORMAT", "SHARD_TOKENS", "VERSION", "StoreError", "TokenStore", "TrainedTokenizer", "open_store",
           "prepare_store", "sample_documents", "store_key"]

logger = logging.getLogger(__name__)

FORMAT, VERSION = "lowband-token-store", 1
#: Ids per shard (about): 256 MiB of uint16.
SHARD_TOKENS = 1 << 27
INDEX, TOKENIZER = "index.json", "tokenizer.json"
_OFFSET = np.dtype("<i8")
_LOG_EVERY_S = 30.0
_LOCK_POLL_S = 60.0
_OPEN_FILES_MAX = 64

# How many stores this process has written (tests use it to see that a store is reused, not rebuilt).
build_count = 0


class StoreError(ValueError):
    """A token store that cannot be used as it is (corrupt, truncated, or of another format version)."""


@dataclass(frozen=True)
class TrainedTokenizer:
    """A tokenizer to train on the input's first ``sample_bytes`` of documents (no tokenizer was given)."""

    kind: str
    vocab_size: int
    sample_bytes: int


def _tokenizer_digest(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def store_key(inp: DataInput, columns: Sequence[tuple[str, str]], tokenizer: Tokenizer | TrainedTokenizer,
              eos: int | None = None) -> str:
    """The store's folder name: readable stem, then a hash of what the store is made from."""
    tok = (["trained", tokenizer.kind, tokenizer.vocab_size, tokenizer.sample_bytes, list(SPECIAL_TOKENS)]
           if isinstance(tokenizer, TrainedTokenizer) else ["given", _tokenizer_digest(tokenizer)])
    if eos is not None:  # a given tokenizer's end-of-document id, as its configuration names it
        tok.append(eos)
    text = json.dumps([FORMAT, VERSION, inp.identity(), [list(c) for c in columns], tok], default=str)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(inp.spec).name or "data").strip("._")[:40] or "data"
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


def _bad(path: Path, what: str) -> StoreError:
    return StoreError(
        f"the token store {path} is corrupt or truncated ({what}); delete it (rm -r '{path}') and start again: "
        "lowband tokenises the data anew")


class TokenStore:
    """An opened token store (checked: sizes and version). Ids are read on demand, nothing is loaded.

    Attributes:
        path: the folder.
        index: ``index.json``'s content.
        fields: the fields (``("text",)`` or ``("source", "target")``).
        dtype: the ids' dtype.
        eos: the id after every document.
        documents: how many documents.
        digest: the content digest (path-free; the job's fingerprint takes it).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            index = json.loads((path / INDEX).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise _bad(path, f"no {INDEX}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _bad(path, f"{INDEX} is unreadable: {e}") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise _bad(path, f"{INDEX} is not a {FORMAT} index")
        if index.get("version") != VERSION:
            raise StoreError(f"the token store {path} has format version {index.get('version')}; this lowband reads "
                             f"version {VERSION}: delete it (rm -r '{path}') and start again to rebuild it")
        try:
            self.fields: tuple[str, ...] = tuple(index["fields"])
            self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
            self.eos = int(index["eos"])
            self.documents = int(index["documents"])
            self.digest = str(index["digest"])
            shards = index["shards"]
            docs = [int(s["documents"]) for s in shards]
            tokens = [{f: int(s["tokens"][f]) for f in self.fields} for s in shards]
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(path, f"{INDEX} lacks or garbles {e}") from None
        if sum(docs) != self.documents:
            raise _bad(path, f"its shards hold {sum(docs)} documents, the index says {self.documents}")
        if not (path / TOKENIZER).is_file():
            raise _bad(path, f"no {TOKENIZER}")
        self.index = index
        self.shard_docs = np.concatenate([[0], np.cumsum(docs)]).astype(np.int64)
        self.shard_tokens = tokens
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._lock = threading.Lock()
        for k in range(len(shards)):
            for f in self.fields:
                self._check_file(self._tokens_file(f, k), tokens[k][f] * self.dtype.itemsize)
                self._check_file(self._offsets_file(f, k), (docs[k] + 1) * _OFFSET.itemsize)
                ends = self._pread(self._offsets_file(f, k), _OFFSET, 0, 1), \
                    self._pread(self._offsets_file(f, k), _OFFSET, docs[k], 1)
                if int(ends[0][0]) != 0 or int(ends[1][0]) != tokens[k][f]:
                    raise _bad(path, f"{self._offsets_file(f, k).name} does not end at its {tokens[k][f]} ids")

    # ------------------------------------------------------------------ files
    @property
    def num_shards(self) -> int:
        """Shards (each a tokens and an offsets file per field)."""
        return len(self.shard_tokens)

    def _tokens_file(self, field: str, shard: int) -> Path:
        return self.path / f"{field}-{shard:05d}.tokens"

    def _offsets_file(self, field: str, shard: int) -> Path:
        return self.path / f"{field}-{shard:05d}.offsets"

    def _check_file(self, file: Path, expected: int) -> None:
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise _bad(self.path, f"{file.name} is missing") from None
        if size != expected:
            raise _bad(self.path, f"{file.name} has {size:,} bytes, the index says {expected:,}")

    def _pread(self, file: Path, dtype: np.dtype, start: int, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        with self._lock:  # another thread must not close the descriptor between lookup and read
            fd = self._fds.get(file)
            if fd is None:
                if len(self._fds) >= _OPEN_FILES_MAX:  # a corpus of many shards: keep the recently read ones open
                    os.close(self._fds.popitem(last=False)[1])
                fd = self._fds[file] = os.open(file, os.O_RDONLY)
            else:
                self._fds.move_to_end(file)
            raw = os.pread(fd, nbytes, start * dtype.itemsize)
        if len(raw) != nbytes:
            raise _bad(self.path, f"{file.name} ends before {start + count} items: it shrank after it was opened")
        return np.frombuffer(raw, dtype=dtype)

    def close(self) -> None:
        """Close the open files (reads reopen them)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # ------------------------------------------------------------------ reads
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the ids come from."""
        return Tokenizer.from_file(str(self.path / TOKENIZER))

    def ids(self, field: str, shard: int, start: int, stop: int) -> np.ndarray:
        """Ids ``[start, stop)`` of a shard's field (read-only)."""
        return self._pread(self._tokens_file(field, shard), self.dtype, start, stop - start)

    def offsets(self, field: str, shard: int, positions: np.ndarray | None = None) -> np.ndarray:
        """A shard's document offsets (``documents + 1`` of them), or those at ``positions``."""
        n = int(self.shard_docs[shard + 1] - self.shard_docs[shard]) + 1
        file = self._offsets_file(field, shard)
        if positions is None or len(positions) * 64 > n:
            whole = self._pread(file, _OFFSET, 0, n)
            return whole if positions is None else whole[positions]
        return np.array([self._pread(file, _OFFSET, int(p), 1)[0] for p in positions], dtype=np.int64)

    def locate(self, doc: int) -> tuple[int, int]:
        """(shard, document within the shard) of document ``doc``."""
        if not 0 <= doc < self.documents:
            raise IndexError(f"document {doc} is outside [0, {self.documents})")
        shard = int(np.searchsorted(self.shard_docs, doc, side="right")) - 1
        return shard, doc - int(self.shard_docs[shard])

    def span(self, field: str, doc: int) -> tuple[int, int, int]:
        """(shard, start, stop) of document ``doc``'s ids in ``field``, its eos included."""
        shard, local = self.locate(doc)
        a, b = self._pread(self._offsets_file(field, shard), _OFFSET, local, 2)
        return shard, int(a), int(b)

    def document(self, field: str, doc: int) -> np.ndarray:
        """Document ``doc``'s ids in ``field``, ending with eos."""
        return self.ids(field, *self.span(field, doc))


_OPEN: dict[tuple[str, int], TokenStore] = {}


def open_store(path: str | os.PathLike[str]) -> TokenStore:
    """Open (and check) the store at ``path``; memoised in the process by its index's modification time.

    Raises:
        StoreError: corrupt, truncated, or of another format version (the message says how to rebuild it).
    """
    p = Path(path)
    try:
        key = (str(p.resolve()), (p / INDEX).stat().st_mtime_ns)
    except FileNotFoundError:
        raise _bad(p, f"no {INDEX}") from None
    store = _OPEN.get(key)
    if store is None:
        store = _OPEN[key] = TokenStore(p)
    return store


def sample_documents(inp: DataInput, columns: Sequence[tuple[str, str]], sample_bytes: int) -> tuple[list[str], int]:
    """The texts a tokenizer learns from: the input's first documents, in order, up to ``sample_bytes``
    of UTF-8 text (all of every field: sources and targets of seq2seq pairs), so that training it costs
    the same whatever the corpus's size.

    Returns:
        (texts, documents sampled).
    """
    texts: list[str] = []
    taken = docs = 0
    for values, _ in iter_documents(inp, columns):
        for row in zip(*values, strict=True):
            texts.extend(row)
            taken += sum(len(t.encode("utf-8")) for t in row)
            docs += 1
            if taken >= sample_bytes:
                return texts, docs
    return texts, docs


class _Progress:
    """Tokenisation progress in bytes of input: a tqdm bar (with its ETA) where stderr is a terminal,
    else a log line every :data:`_LOG_EVERY_S` seconds."""

    def __init__(self, total_bytes: int, what: str) -> None:
        self.total, self.what, self.done = max(1, total_bytes), what, 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm  # only on a terminal

            self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc=f"tokenizing {what}", file=sys.stderr,
                            dynamic_ncols=True, mininterval=1.0)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            return
        now = time.monotonic()
        if now - self.last >= _LOG_EVERY_S:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            logger.info("tokenizing %s: %.0f%% (%s of %s), %.2f MB/s, about %.0f s left", self.what,
                        100 * self.done / self.total, format_bytes(self.done), format_bytes(self.total), rate / 1e6,
                        left)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _encode(tokenizer: Tokenizer, batch: list[list[str]], eos: int, dtype: np.dtype) -> list[tuple[np.ndarray,
                                                                                                     np.ndarray]]:
    """Per field: (flat ids, each document followed by eos; documents' lengths). ``encode_batch``
    runs on all cores in Rust, without the GIL."""
    out = []
    for texts in batch:
        ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        for doc in ids:
            doc.append(eos)
        lengths = np.fromiter(map(len, ids), dtype=_OFFSET, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
        out.append((flat, lengths))
    return out


class _Writer:
    """Appends encoded batches to shards in a folder; hashes what it writes."""

    def __init__(self, folder: Path, fields: Sequence[str], dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.fields, self.dtype, self.shard_tokens = folder, tuple(fields), dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.hashes = {f: (hashlib.sha256(), hashlib.sha256()) for f in self.fields}
        self.documents = 0
        self.tokens = dict.fromkeys(self.fields, 0)
        self._files: dict[str, Any] = {}
        self._lengths: dict[str, list[np.ndarray]] = {}
        self._shard: dict[str, Any] | None = None

    def add(self, encoded: list[tuple[np.ndarray, np.ndarray]]) -> None:
        n = len(encoded[0][1])
        if n == 0:
            return
        if self._shard is None:
            k = len(self.shards)
            self._shard = {"documents": 0, "tokens": dict.fromkeys(self.fields, 0)}
            self._files = {f: open(self.folder / f"{f}-{k:05d}.tokens", "wb") for f in self.fields}  # noqa: SIM115
            self._lengths = {f: [] for f in self.fields}
        for f, (flat, lengths) in zip(self.fields, encoded, strict=True):
            data = flat.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self._files[f].write(data)
            self.hashes[f][0].update(data)
            lens = lengths.astype(_OFFSET, copy=False)
            self.hashes[f][1].update(lens.tobytes())
            self._lengths[f].append(lens)
            self._shard["tokens"][f] += len(flat)
            self.tokens[f] += len(flat)
        self._shard["documents"] += n
        self.documents += n
        if self._shard["tokens"][self.fields[0]] >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._shard is None:
            return
        k = len(self.shards)
        for f in self.fields:
            fh = self._files[f]
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            lengths = np.concatenate(self._lengths[f])
            offsets = np.zeros(len(lengths) + 1, dtype=_OFFSET)
            np.cumsum(lengths, out=offsets[1:])
            with open(self.folder / f"{f}-{k:05d}.offsets", "wb") as fh:
                fh.write(offsets.tobytes())
                fh.flush()
                os.fsync(fh.fileno())
        self.shards.append(self._shard)
        self._shard, self._files, self._lengths = None, {}, {}

    def abort(self) -> None:
        for fh in self._files.values():
            fh.close()

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
        self._close_shard()
        return self.shards, {f: [h[0].hexdigest(), h[1].hexdigest()] for f, h in self.hashes.items()}


def _build(path: Path, inp: DataInput, columns: Sequence[tuple[str, str]], choice: Tokenizer | TrainedTokenizer,
           shard_tokens: int, eos: int | None = None) -> None:
    """Tokenise ``inp`` into a new store at ``path`` (the caller holds the lock)."""
    global build_count
    t0 = time.perf_counter()
    sample: dict[str, Any] | None = None
    if isinstance(choice, TrainedTokenizer):
        texts, docs = sample_documents(inp, columns, choice.sample_bytes)
        if not texts:
            raise ValueError(f"{inp.describe()} holds no usable example (every row has an empty "
                             f"{' or '.join(c for _, c in columns)})")
        logger.info("training a %s tokenizer of %d entries on the first %s (%d documents) of %s", choice.kind,
                    choice.vocab_size, format_bytes(sum(len(t.encode()) for t in texts)), docs, inp.describe())
        tokenizer = get_tokenizer(texts, choice.vocab_size, kind=choice.kind)
        sample = {"kind": choice.kind, "vocab_size": choice.vocab_size, "sample_bytes": choice.sample_bytes,
                  "documents": docs}
        del texts
    else:
        tokenizer = choice
    t_tok = time.perf_counter()
    eos = special_ids(tokenizer).eos if eos is None else eos
    dtype = np.dtype(np.uint16 if tokenizer.get_vocab_size(with_added_tokens=True) <= 1 << 16 else np.uint32)
    fields = [role for role, _ in columns]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = _Writer(tmp, fields, dtype, shard_tokens)
    stats = ReadStats()
    progress = _Progress(inp.total_bytes, inp.describe())
    try:
        # Two batches in flight: while the tokenizer's threads encode one, this thread reads the next
        # and writes the one before.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize") as pool:
            pending: deque = deque()
            for values, nbytes in iter_documents(inp, columns, stats=stats):
                pending.append((pool.submit(_encode, tokenizer, values, eos, dtype), nbytes))
                while len(pending) > 2:
                    fut, done = pending.popleft()
                    writer.add(fut.result())
                    progress.update(done)
            while pending:
                fut, done = pending.popleft()
                writer.add(fut.result())
                progress.update(done)
        if writer.documents == 0:
            raise ValueError(f"{inp.describe()} holds no usable example (every row has an empty "
                             f"{' or '.join(c for _, c in columns)})")
        shards, hashes = writer.finish()
        tok_digest = _tokenizer_digest(tokenizer)
        digest = hashlib.sha256(json.dumps({"format": FORMAT, "version": VERSION, "dtype": dtype.name, "eos": eos,
                                            "tokenizer": tok_digest, "fields": hashes,
                                            "documents": writer.documents}, sort_keys=True).encode()).hexdigest()
        tokenizer.save(str(tmp / TOKENIZER))
        done_s = time.perf_counter()
        index = {
            "format": FORMAT, "version": VERSION, "digest": digest, "fields": fields,
            "columns": {role: col for role, col in columns}, "dtype": dtype.name, "eos": eos,
            "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "tokenizer_sha256": tok_digest,
            "tokenizer_trained": sample, "documents": writer.documents, "tokens": writer.tokens,
            "rows": stats.rows, "skipped_rows": stats.skipped, "input": inp.spec,
            "input_files": [{"path": str(f.path), "bytes": f.size_bytes, "mtime_ns": f.mtime_ns} for f in inp.files],
            "input_bytes": inp.total_bytes, "tokenizer_s": round(t_tok - t0, 3), "encode_s": round(done_s - t_tok, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "shards": shards,
        }
        with open(tmp / INDEX, "w", encoding="utf-8") as fh:
            json.dump(index, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, path)  # the store appears whole, or not at all
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        progress.close()
    build_count += 1
    if stats.skipped:
        logger.info("%s: skipped %d of %d rows with an empty field", inp.describe(), stats.skipped, stats.rows)
    logger.info("tokenized %s (%s) into %s: %d documents, %s ids in %.1f s (%.2f MB/s)", inp.describe(),
                format_bytes(inp.total_bytes), path, writer.documents,
                ", ".join(f"{f} {n:,}" for f, n in writer.tokens.items()), done_s - t_tok,
                inp.total_bytes / 1e6 / max(done_s - t_tok, 1e-9))


def _acquire(lock: Any, path: Path) -> None:
    """Wait for the lock as long as it takes (another rank may be tokenising a large corpus), saying so."""
    from filelock import Timeout  # only while waiting for another writer

    waited = 0.0
    while True:
        try:
            lock.acquire(timeout=_LOCK_POLL_S if waited else 1.0)
            return
        except Timeout:
            waited += _LOCK_POLL_S if waited else 1.0
            logger.info("waiting for another process to finish writing the token store %s (%.0f s so far)", path,
                        waited)


def prepare_store(inp: DataInput, columns: Sequence[tuple[str, str]], tokenizer: Tokenizer | TrainedTokenizer, *,
                  root: str | os.PathLike[str], shard_tokens: int | None = None, eos: int | None = None) -> TokenStore:
    """The store of ``inp``'s documents: opened if it exists, else written first (once per host: the
    other processes wait on a file lock, then open it).

    Args:
        inp: the input (:func:`~lowband.train.data.inputs.resolve_input`).
        columns: ``(field, column)`` pairs: ``[("text", col)]`` or ``[("source", col), ("target", col)]``.
        tokenizer: the tokenizer to use, or how to train one (on the first documents).
        root: the folder of stores.
        shard_tokens: ids per shard (about; default :data:`SHARD_TOKENS`).
        eos: the id after every document; None: the tokenizer's by its usual names (a given tokenizer's
            configuration may name another: :func:`~lowband.train.tokenizer.load_tokenizer_and_ids`).

    Returns:
        The opened store.

    Raises:
        ValueError: a missing column, an unreadable file, or no usable document (nothing is left behind).
        StoreError: an existing store that is corrupt or truncated.
    """
    root_path = Path(root).expanduser()
    path = root_path / store_key(inp, columns, tokenizer, eos)
    if path.exists():
        return open_store(path)
    root_path.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock  # a dependency of lowband (and of datasets, transformers)

    lock = FileLock(str(path) + ".lock")
    _acquire(lock, path)
    try:
        if not path.exists():
            for stale in root_path.glob(f".{path.name}.tmp-*"):  # left by a writer that died (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            _build(path, inp, columns, tokenizer, shard_tokens or SHARD_TOKENS, eos)
    finally:
        lock.release()
    return open_store(path)
