"""A bench as a TOML file: ``lowband bench --config bench.toml``, flags on top.

The file holds the job's tables (:mod:`lowband.bench.job`): ``[bench]`` (each key one of
``lowband bench``'s flags) and lowband train's ``[model]``, ``[data]``, ``[schedule]``,
``[checkpoint]`` and ``[run]``, whose keys are those of ``lowband train``'s own job file::

    [bench]
    preset = "quality"       # a preset's tables first; the file's keys over them
    methods = ["adamw:lr=0.03", "flexdemo:topk=1,lr=0.03"]
    steps = 60

    [data]
    path = "pairs.jsonl"
    max_source_len = 64

Precedence: the defaults, then the preset (``[bench] preset`` or ``--preset``), then the file,
then the flags given on the command line (``--train-args`` given both ways: the flag's after the
file's). Every bench writes its complete job to ``OUT/bench.toml`` (every ``[bench]`` key spelled
out, so that a later change of a default does not change what it re-runs), and
``lowband bench --config OUT/bench.toml --out AGAIN`` runs it again. Where the bench writes
(``--out``) is not part of the job.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from lowband.bench.job import check_tables

__all__ = ["FILE_NAME", "dumps", "load", "loads", "write"]

#: The job file a bench's run directory keeps.
FILE_NAME = "bench.toml"


def loads(text: str, *, where: str = "") -> dict[str, dict[str, Any]]:
    """A bench job file's tables, checked and typed (:func:`lowband.bench.job.check_tables`): an unknown
    table or key, a key the bench sets itself or a value of the wrong type is a ValueError naming it."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}not a valid TOML file: {e}") from None
    return check_tables(doc, where=where)


def load(path: str | Path) -> dict[str, dict[str, Any]]:
    """:func:`loads` of the file at ``path`` (a missing file is a FileNotFoundError saying so)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {path}: no such file (a bench job is TOML, e.g. a bench's OUT/{FILE_NAME})")
    return loads(p.read_text(), where=f"{path}: ")


def dumps(config) -> str:
    """``config`` (a :class:`~lowband.bench.config.BenchConfig`) as a job file: its complete tables
    (:meth:`~lowband.bench.config.BenchConfig.tables`)."""
    head = ("# lowband bench --config THIS_FILE --out DIR: this bench again (flags given beside --config win).\n"
            "# Written by the bench: every [bench] key, and lowband train's tables its runs got on top of "
            "lowband train's defaults.\n")
    return head + tomli_w.dumps(config.tables())


def write(config, out_dir: str | Path) -> Path:
    """Write ``OUT_DIR/bench.toml`` (through a temporary file and a rename: never half-written)."""
    path = Path(out_dir) / FILE_NAME
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{FILE_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(config))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
