"""The fields of the job configuration's tables: declared with :func:`option`, read back with
:func:`job_fields` and :func:`field_types`.

A table class (:mod:`lowband.train.config`, :class:`~lowband.train.data.DataConfig`, the bench's
``BenchTable``) declares each field once with :func:`option`; the job file (:mod:`lowband.train.jobfile`),
the flags and ``--help`` (:mod:`lowband.train.args`) are derived from those fields. This module knows no table:
the classes import it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

__all__ = ["field_types", "job_fields", "option"]


def option(default: Any, help: str, *, flag: str | None = None, type: Any = None, choices: tuple | None = None,
           metavar: str | None = None, aliases: tuple[str, ...] = (), nargs: str | None = None) -> Any:
    """A job configuration field (:mod:`lowband.train.config`, :mod:`lowband.bench.job`) with what its flag
    needs: its help, and where they are not the field's own, its flag (default ``--field-name``; a bool
    field that defaults to True gets a ``--no-...`` flag that turns it off), the type that parses it
    (default: the field's), its metavar, other spellings of the flag (``aliases``) and argparse's
    ``nargs`` (a list field given as several arguments)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "type": type,
                                                        "choices": choices, "metavar": metavar,
                                                        "aliases": aliases, "nargs": nargs})


@functools.cache
def job_fields(cls: type) -> tuple[str, ...]:
    """The keys of a table: its class's fields that have a help text (the others are set by the trainer)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("help"))


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A table class's field types (resolved annotations)."""
    return typing.get_type_hints(cls)
