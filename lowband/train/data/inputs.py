"""A user's data, streamed: files, globs and directories of shards, and ``datasets`` saved with ``save_to_disk``.

``--data`` names one of

* a file: ``.txt`` (one document per non-empty line, as lowband always read it), ``.jsonl`` (one JSON
  object per line; ``.json`` too, or a JSON array, which is read whole), ``.csv`` / ``.tsv`` (a header
  row), ``.parquet``, ``.arrow`` (Arrow IPC, file or stream format: a ``datasets`` cache file);
* a glob of such files (``'data/*.parquet'``, ``**`` descends), read in sorted order;
* a directory: a ``datasets`` dataset saved with ``save_to_disk`` (read with ``datasets.load_from_disk``),
  or else every accepted file under it (recursively, hidden ones skipped), in sorted order.

:func:`resolve_input` turns that into a :class:`DataInput` by listing and stat-ing the files only;
:func:`iter_documents` streams its documents in batches (the columns asked for, each value stripped,
rows with an empty one skipped), so the corpus is never held whole in memory. Parquet and Arrow are
read a record batch at a time, never as a whole table.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ACCEPTED_EXTENSIONS", "DataInput", "InputFile", "iter_documents", "resolve_input"]

logger = logging.getLogger(__name__)

ACCEPTED_EXTENSIONS: tuple[str, ...] = (".txt", ".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow")
#: The column of a ``.txt`` file: each line is one document.
TXT_COLUMN = "text"
# Text is read in pieces of about this many bytes, and Arrow in record batches of this many rows:
# big enough for the tokenizer's threads, small enough that memory stays flat.
_CHUNK_BYTES = 4 << 20
_BATCH_ROWS = 4096
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class InputFile:
    """One file of an input, as it stood when it was listed."""

    path: Path
    size_bytes: int
    mtime_ns: int


@dataclass(frozen=True)
class DataInput:
    """What ``--data`` names, resolved to files (not read).

    Args:
        spec: the path, glob or directory as given.
        files: the files, in the order their documents are read (a saved dataset: its Arrow files).
        saved_dataset: the folder of a ``datasets`` dataset saved with ``save_to_disk``, or None.
    """

    spec: str
    files: tuple[InputFile, ...]
    saved_dataset: Path | None = None
    extensions: frozenset[str] = field(default=frozenset())

    @property
    def total_bytes(self) -> int:
        """Bytes on disk of all the files (the progress bar's total)."""
        return sum(f.size_bytes for f in self.files)

    def identity(self) -> tuple[Any, ...]:
        """What changes when the input does: every file's resolved path, size and modification time."""
        return (str(self.saved_dataset) if self.saved_dataset else None,
                tuple((str(f.path), f.size_bytes, f.mtime_ns) for f in self.files))

    def describe(self) -> str:
        """The input in words, for logs and errors."""
        if self.saved_dataset is not None:
            return f"the dataset saved at {self.saved_dataset}"
        if len(self.files) == 1 and str(self.files[0].path) == str(Path(self.spec).expanduser().resolve()):
            return self.spec
        return f"{self.spec} ({len(self.files)} file(s))"


def _stat(path: Path) -> InputFile:
    p = path.resolve()
    st = p.stat()
    return InputFile(path=p, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns)


def _accepted(paths: Sequence[Path]) -> list[Path]:
    return [p for p in paths if p.is_file() and p.suffix.lower() in ACCEPTED_EXTENSIONS
            and not any(part.startswith(".") for part in p.parts[-1:])]


def resolve_input(spec: str | os.PathLike[str]) -> DataInput:
    """The files a ``--data`` value names, listed and stat-ed (nothing read).

    Args:
        spec: a file, a glob, a directory of files, or a ``save_to_disk`` folder.

    Returns:
        The input.

    Raises:
        FileNotFoundError: nothing there, a glob that matches no file, or a directory without data files.
        ValueError: an extension lowband does not read, or a ``DatasetDict`` folder (give one split's).
    """
    text = str(spec)
    accepted = ", ".join(ACCEPTED_EXTENSIONS)
    p = Path(text).expanduser()
    if not p.exists() and _GLOB_CHARS & set(text):
        matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True))
        files = _accepted(matches)
        if not files:
            seen = f"; it matches {len(matches)} path(s), none a {accepted} file" if matches else ""
            raise FileNotFoundError(
                f"--data {text!r} matches no data file{seen}. Check the pattern (quote it so that the shell "
                f"does not expand it; '**' descends into folders), or give a file or a directory")
        return _make(text, files)
    if not p.exists():
        raise FileNotFoundError(
            f"data path {text!r} does not exist; give an existing file ({accepted}), a glob of them, a directory of "
            "them or of a dataset saved with save_to_disk, or leave --data out for the embedded default corpus")
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
            raise ValueError(
                f"{text} is a DatasetDict saved with save_to_disk (splits: {', '.join(splits) or 'none'}); give one "
                f"split's folder, e.g. --data {p / (splits[0] if splits else 'train')}")
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            state = json.loads((p / "state.json").read_text(encoding="utf-8"))
            arrows = [p / f["filename"] for f in state.get("_data_files", [])]
            return DataInput(spec=text, files=tuple(_stat(a) for a in arrows), saved_dataset=p.resolve(),
                             extensions=frozenset({".arrow"}))
        files = _accepted(sorted(p.rglob("*")))
        if not files:
            raise FileNotFoundError(
                f"the directory {text} holds no data file ({accepted}) and is not a dataset saved with "
                "save_to_disk; give a directory of data files, or one file")
        return _make(text, files)
    ext = p.suffix.lower()
    if ext not in ACCEPTED_EXTENSIONS:
        raise ValueError(f"data file {text} has extension {ext or '(none)'!r}; accepted: {accepted}, "
                         "a glob of them or a directory")
    return _make(text, [p])


def _make(spec: str, files: Sequence[Path]) -> DataInput:
    return DataInput(spec=spec, files=tuple(_stat(f) for f in files),
                     extensions=frozenset(f.suffix.lower() for f in files))


def _missing(where: str, role_columns: Sequence[tuple[str, str]], present: Sequence[str]) -> ValueError:
    role, col = next((r, c) for r, c in role_columns if c not in present)
    return ValueError(
        f"{where} has no {role} column {col!r}; columns present: {', '.join(map(str, present)) or '(none)'}. "
        f"Name the right one with --{role}-column (DataConfig.{role}_column)")


def _text_pieces(path: Path) -> Iterator[tuple[str, int]]:
    """A UTF-8 file in pieces of whole lines: (text, bytes it covers)."""
    with path.open("rb") as f:
        rest, pos = b"", 0
        if f.read(3) != b"\xef\xbb\xbf":  # a byte-order mark is not text
            f.seek(0)
        while True:
            raw = f.read(_CHUNK_BYTES)
            data = rest + raw
            if not raw:
                if data:
                    yield _decode(data, path, pos), len(data)
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # one long line: read on
                rest = data
                continue
            piece, rest = data[:cut], data[cut:]
            yield _decode(piece, path, pos), len(piece)
            pos += len(piece)


def _decode(data: bytes, path: Path, pos: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (a bad byte at offset {pos + e.start}); convert it to UTF-8") \
            from None


def _rows_txt(path: Path, columns: Sequence[tuple[str, str]]) -> Iterator[tuple[list[list[Any]], int]]:
    for text, nbytes in _text_pieces(path):
        yield [text.splitlines()], nbytes


def _rows_jsonl(path: Path, columns: Sequence[tuple[str, str]]) -> Iterator[tuple[list[list[Any]], int]]:
    names = [c for _, c in columns]
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):  # a JSON array: there is no streaming it
        logger.warning("%s is one JSON array, read whole; for large data use JSON lines (.jsonl)", path)
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"could not read {path} as JSON: {e}") from None
        if rows and isinstance(rows[0], dict) and not all(c in rows[0] for c in names):
            raise _missing(str(path), columns, list(rows[0]))
        for i in range(0, len(rows), _BATCH_ROWS):
            part = [r if isinstance(r, dict) else {} for r in rows[i:i + _BATCH_ROWS]]
            yield [[r.get(c) for r in part] for c in names], 0
        return
    line_no, checked = 0, False
    for text, nbytes in _text_pieces(path):
        out: list[list[Any]] = [[] for _ in names]
        for line in text.split("\n"):
            line_no += 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no} is not JSON ({e}); give one JSON object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {line_no} is not a JSON object; give one object per line")
            if not checked:
                if not all(c in row for c in names):
                    raise _missing(str(path), columns, list(row))
                checked = True
            for values, c in zip(out, names, strict=True):
                values.append(row.get(c))
        line_no -= 1  # the piece ends with a newline: its last "line" is empty
        yield out, nbytes


def _rows_csv(path: Path, columns: Sequence[tuple[str, str]]) -> Iterator[tuple[list[list[Any]], int]]:
    import pyarrow as pa  # heavy: only when such data is read
    from pyarrow import csv as pacsv  # heavy: only when such data is read

    names = [c for _, c in columns]
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with path.open(encoding="utf-8-sig", newline="") as f:
        header = next(csv.reader(f, delimiter=delimiter), [])
    if not all(c in header for c in names):
        raise _missing(str(path), columns, header)
    try:
        reader = pacsv.open_csv(
            str(path), read_options=pacsv.ReadOptions(block_size=_CHUNK_BYTES),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(include_columns=names, column_types={c: pa.string() for c in names}))
        for batch in reader:
            yield [batch.column(c).to_pylist() for c in names], batch.nbytes
    except pa.ArrowInvalid as e:
        raise ValueError(f"could not read {path} as {delimiter!r}-separated values: {e}") from None


def _check_schema(path: Path, schema_names: Sequence[str], columns: Sequence[tuple[str, str]]) -> None:
    if not all(c in schema_names for _, c in columns):
        raise _missing(str(path), columns, list(schema_names))


def _rows_parquet(path: Path, columns: Sequence[tuple[str, str]]) -> Iterator[tuple[list[list[Any]], int]]:
    import pyarrow as pa  # heavy: only when such data is read
    import pyarrow.parquet as pq  # heavy: only when such data is read

    names = [c for _, c in columns]
    try:
        pf = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"could not read {path} as Parquet: {e}") from None
    _check_schema(path, pf.schema_arrow.names, columns)
    rows, size = max(1, pf.metadata.num_rows), path.stat().st_size
    for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=names):
        yield [batch.column(c).to_pylist() for c in names], size * batch.num_rows // rows


def _rows_arrow(path: Path, columns: Sequence[tuple[str, str]]) -> Iterator[tuple[list[list[Any]], int]]:
    import pyarrow as pa  # heavy: only when such data is read

    names = [c for _, c in columns]
    # Read, not memory-mapped: a mapped file's pages would stay in this process's resident set.
    with pa.OSFile(str(path), "rb") as source:
        try:
            reader: Any = pa.ipc.open_file(source)
            batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid as e:
                raise ValueError(f"could not read {path} as Arrow (an IPC file or stream): {e}") from None
            batches = iter(reader)
        _check_schema(path, reader.schema.names, columns)
        for batch in batches:
            yield [batch.column(c).to_pylist() for c in names], batch.nbytes


def _rows_saved(inp: DataInput, columns: Sequence[tuple[str, str]]) -> Iterator[tuple[list[list[Any]], int]]:
    import datasets  # heavy: only when such data is read

    assert inp.saved_dataset is not None
    ds = datasets.load_from_disk(str(inp.saved_dataset))
    if isinstance(ds, datasets.DatasetDict):  # pragma: no cover - resolve_input refuses these first
        raise ValueError(f"{inp.spec} is a DatasetDict; give one split's folder")
    _check_schema(inp.saved_dataset, ds.column_names, columns)
    names = [c for _, c in columns]
    rows, size = max(1, ds.num_rows), inp.total_bytes
    for batch in ds.select_columns(names).iter(batch_size=_BATCH_ROWS):
        n = len(batch[names[0]])
        yield [batch[c] for c in names], size * n // rows


_READERS = {".txt": _rows_txt, ".jsonl": _rows_jsonl, ".json": _rows_jsonl, ".csv": _rows_csv, ".tsv": _rows_csv,
            ".parquet": _rows_parquet, ".arrow": _rows_arrow}


def _clean(value: Any) -> str:
    return "" if value is None else (value if isinstance(value, str) else str(value)).strip()


@dataclass
class ReadStats:
    """What :func:`iter_documents` read: rows, documents kept, rows skipped for an empty field."""

    rows: int = 0
    documents: int = 0

    @property
    def skipped(self) -> int:
        """Rows dropped for an empty (or missing) field."""
        return self.rows - self.documents


def iter_documents(inp: DataInput, columns: Sequence[tuple[str, str]], *,
                   stats: ReadStats | None = None) -> Iterator[tuple[list[list[str]], int]]:
    """Stream the documents of ``inp`` in batches.

    Args:
        inp: the input (:func:`resolve_input`).
        columns: ``(role, column)`` pairs, e.g. ``[("text", "text")]`` or ``[("source", "doc"),
            ("target", "summary")]``. A ``.txt`` file has one column, its lines: it serves a single role.
        stats: filled in with the rows read and the documents kept.

    Yields:
        ``(values, bytes_read)``: one list of stripped strings per column (rows with an empty one
        dropped), and about how many bytes of the input this batch covers (for progress).

    Raises:
        ValueError: a missing column (naming the columns present), a ``.txt`` file asked for two
            columns, or a file that cannot be parsed.
    """
    stats = stats if stats is not None else ReadStats()
    # Each reader's byte counts are estimates: they are clipped to the file's size, and the rest is
    # counted when the file is done, so the progress ends at the input's size exactly.
    if inp.saved_dataset is not None:
        sources: list[tuple[Iterator[tuple[list[list[Any]], int]], int]] = [(_rows_saved(inp, columns),
                                                                              inp.total_bytes)]
    else:
        sources = []
        for f in inp.files:
            ext = f.path.suffix.lower()
            if ext == ".txt" and len(columns) > 1:
                raise ValueError(
                    f"{f.path} is a plain text file, which holds one text per line and suits kind='causal'; for "
                    f"seq2seq give a .jsonl, .csv or .parquet with columns "
                    f"{' and '.join(repr(c) for _, c in columns)}")
            sources.append((_READERS[ext](f.path, columns), f.size_bytes))
    for source, size in sources:
        left = size
        for values, nbytes in source:
            nbytes = min(max(0, nbytes), left)
            left -= nbytes
            cleaned = [[_clean(v) for v in col] for col in values]
            stats.rows += len(cleaned[0])
            if len(cleaned) == 1:
                kept = [[t for t in cleaned[0] if t]]
            else:
                keep = [i for i in range(len(cleaned[0])) if all(col[i] for col in cleaned)]
                kept = [[col[i] for i in keep] for col in cleaned]
            stats.documents += len(kept[0])
            yield kept, nbytes
        if left:
            yield [[] for _ in columns], left
