"""The flags of ``lowband bench``: derived from the job's tables (:mod:`lowband.bench.job`), parsed into
a :class:`~lowband.bench.config.BenchConfig`.

One flag per key of ``[bench]`` (its field's help, type, choices and metavar; also spelled
``--bench.KEY``, but for the switches), ``--model`` and ``--data`` (``[model] name`` and ``[data]
path``, declared by lowband train), and the flags of the invocation that are not part of the job:
``--config``, ``--out``, ``--no-progress``. A flag's dest is its key (``table.key`` for the train
tables'); a flag not given is None, so the file's value, the preset's or the default applies.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any

from lowband.bench import jobfile
from lowband.bench.config import BenchConfig
from lowband.bench.defaults import DEFAULT_TRAIN
from lowband.bench.job import BenchTable, check_tables, flag_of, merge
from lowband.bench.presets import PRESETS
from lowband.train.config import sections
from lowband.train.fields import field_types, job_fields
from lowband.util import format_value

__all__ = ["add_arguments", "config_from_args", "given_values"]

#: lowband train's keys that are flags of ``lowband bench`` too: (table, key) -> its flag there.
TRAIN_KEYS = {("model", "name"): "--model", ("data", "path"): "--data"}


def _base_type(hint: Any) -> type:
    """int, float or str: the type a flag's text is parsed to (``float | None`` -> float)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``lowband bench`` options to ``parser``."""
    fields = {f.name: f for f in dataclasses.fields(BenchTable)}
    hints = field_types(BenchTable)
    g = parser.add_argument_group("bench (the [bench] table of a --config file)")
    for name in job_fields(BenchTable):
        meta = fields[name].metadata
        text = meta["help"]
        default = fields[name].default
        if default is not None and not isinstance(default, bool | tuple) and "default" not in text.lower():
            text += f" (default {format_value(default)})"
        kwargs: dict[str, Any] = dict(dest=name, default=None)
        flags = [flag_of(name), *meta["aliases"]]
        if hints[name] is bool:
            kwargs["action"] = "store_true"
        else:
            flags.append(f"--bench.{name}")
            # A field with a parser gets the flag's text: the job's tables parse it (errors name the flag).
            kwargs.update(type=None if meta["type"] else _base_type(hints[name]), choices=meta["choices"],
                          nargs=meta["nargs"], metavar=meta["metavar"] or (None if meta["choices"] else name.upper()))
        if name == "preset":  # the presets are built from these tables: their names are known only here
            kwargs.update(choices=sorted(PRESETS), metavar=None)
            text += ". " + "; ".join(f"{p.name}: {p.description}" for p in PRESETS.values())
        g.add_argument(*flags, help=text.replace("%", "%%"), **kwargs)
    _train_arguments(parser.add_argument_group(
        "model and data ([model] name and [data] path; a --config file may set any key of lowband train's "
        "[model], [data], [schedule], [checkpoint] and [run])"))
    r = parser.add_argument_group("this invocation (not part of the job)")
    r.add_argument("--config", metavar="FILE.toml", default=None,
                   help=f"the bench as a TOML job file (a bench writes its own to OUT/{jobfile.FILE_NAME}); flags "
                        "given beside it win. See docs/configuration.md")
    r.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="run directory (default: a new runs/bench-YYYYmmdd-HHMMSS/)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def _train_arguments(g) -> None:
    for (table, key), flag in TRAIN_KEYS.items():
        cls = sections()[table]
        meta = {f.name: f for f in dataclasses.fields(cls)}[key].metadata
        default = DEFAULT_TRAIN.get(table, {}).get(key)
        text = meta["help"] + (f" (default {default})" if default is not None else "")
        g.add_argument(flag, f"--{table}.{key}", dest=f"{table}.{key}", default=None, metavar=key.upper(),
                       help=text.replace("%", "%%"))


def given_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The job's tables as ``--config``'s file and the flags given set them (the flags' over the file's;
    ``train_args`` given both ways: the file's, then the flags'); keys neither sets are absent."""
    given = vars(args)
    file_tables = jobfile.load(given["config"]) if given.get("config") else {}
    flags: dict[str, dict[str, Any]] = {}
    bench_keys = set(job_fields(BenchTable))
    for dest, value in given.items():
        if value is None:
            continue
        if dest in bench_keys:
            flags.setdefault("bench", {})[dest] = value
        elif "." in dest:
            table, key = dest.split(".", 1)
            flags.setdefault(table, {})[key] = value
    flags = check_tables(flags)
    tables = merge(file_tables, flags)
    from_file = file_tables.get("bench", {}).get("train_args")
    if from_file and "train_args" in flags.get("bench", {}):
        tables["bench"]["train_args"] = (*from_file, *flags["bench"]["train_args"])
    return tables


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Build and validate the bench configuration from parsed ``lowband bench`` options: the defaults, a
    preset's tables, ``--config``'s file, then the flags given (:func:`given_values`)."""
    return BenchConfig.from_tables(given_values(args))
