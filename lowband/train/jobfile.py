"""A training job as a TOML file: ``lowband train --config job.toml``, flags on top.

The file has one table per field of :class:`~lowband.train.config.TrainConfig`, and each key of a
table is a field of that table's class (the method's hyper-parameters are the fields of its config,
:mod:`lowband.train.methods`)::

    [method]
    name = "diloco"
    sync_every = 10          # any hyper-parameter of the method, by field name or alias (H)

    [model]
    name = "t5-mini"

    [schedule]
    steps = 500

Precedence: the classes' defaults, then the file, then the flags given on the command line.
Every run writes its complete configuration to ``OUT/config.toml`` (every hyper-parameter of its
method spelled out, so that a later change of a default does not change what it re-runs), and
``lowband train --config OUT/config.toml --out AGAIN`` runs it again.

Left out of the written file: where the run writes (``[run] out``), what it resumes from
(``[checkpoint] resume``) and where it exports its model (``[run] export_hf``): a re-run must not
write over the run it repeats.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from lowband.train.config import sections
from lowband.train.fields import field_types, job_fields, option
from lowband.train.methods import canonical_names, hp_fields, method_config, parse_hp_value

# job_fields, option (lowband.train.fields) and sections (lowband.train.config) are re-exported: the job
# file's tables are those of TrainConfig, and its keys the fields declared with option.
__all__ = ["TITLES", "check_value", "dumps", "field_types", "job_fields", "load", "loads", "option", "sections"]


#: each table's title in ``lowband train --help``
TITLES = {
    "method": "method", "model": "model", "data": "data", "schedule": "schedule and batches",
    "link": "link shaping (emulated slow links; real links need none)", "checkpoint": "checkpoints",
    "run": "run", "fault_tolerance": "fault tolerance (torchft: one torchrun per node, nodes may die and join; "
                                     "see docs/fault-tolerance.md)",
}

#: (table, key) a written file leaves out (see the module's docstring)
_NOT_WRITTEN = (("run", "out"), ("checkpoint", "resume"), ("run", "export_hf"))


def check_value(table: str, key: str, value: Any, *, where: str = "") -> Any:
    """``value`` for key ``key`` of table ``table`` if its type fits (an int where a float goes becomes a
    float); else a ValueError that names the key, the type wanted and the type given."""
    hint = field_types(sections()[table])[key]
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for a in allowed:
        if a is type(None):
            continue
        if a is float and isinstance(value, int | float) and not isinstance(value, bool):
            return value if int in allowed else float(value)
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if a in (str, bool) and isinstance(value, a):
            return value
    wanted = " or ".join(getattr(a, "__name__", str(a)) for a in allowed if a is not type(None))
    raise ValueError(f"{where}[{table}] {key} must be {wanted}, got {type(value).__name__} {value!r}")


def loads(text: str, *, where: str = "") -> dict[str, dict[str, Any]]:
    """A job file's tables, checked (:meth:`TrainConfig.from_tables` builds the config from them): unknown
    tables and keys, wrong types and bad hyper-parameters are ValueErrors that name them."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}not a valid TOML file: {e}") from None
    out: dict[str, dict[str, Any]] = {}
    for table, body in doc.items():
        if table not in sections():
            raise ValueError(f"{where}unknown table [{table}]; the tables are: {', '.join(f'[{s}]' for s in sections())}")
        if not isinstance(body, Mapping):
            raise ValueError(f"{where}{table} must be a table ([{table}] followed by key = value lines)")
        keys = job_fields(sections()[table])
        out[table] = {}
        for key, value in body.items():
            if key in keys:
                out[table][key] = check_value(table, key, value, where=where)
            elif table == "method":
                out[table][key] = value  # a hyper-parameter: checked below, against the method
            else:
                raise ValueError(f"{where}[{table}] has no key {key!r}; its keys are: {', '.join(keys)}")
    method = out.get("method", {})
    hp = {k: v for k, v in method.items() if k != "name"}
    if hp:
        name = method.get("name")
        if name is None:
            raise ValueError(f"{where}[method] gives hyper-parameters ({', '.join(hp)}) but no name = \"...\"")
        try:
            hp = canonical_names(name, hp)
            # text is read as a flag's value: "none" (TOML has no null) for an optional one
            hp = {k: parse_hp_value(name, k, v) if isinstance(v, str) else v for k, v in hp.items()}
            method_config(name, hp)  # names, types and ranges, checked now
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}[method] {e}") from None
        out["method"] = {"name": name, **hp}
    return out


def load(path: str | Path) -> dict[str, dict[str, Any]]:
    """:func:`loads` of the file at ``path`` (a missing file is a FileNotFoundError saying so)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {path}: no such file (a job file is TOML, e.g. a run's OUT/config.toml)")
    return loads(p.read_text(), where=f"{path}: ")


def dumps(cfg) -> str:
    """``cfg`` (a TrainConfig) as a job file: every key but ``out``, ``resume`` and ``export_hf`` that is not None, and
    every hyper-parameter of the method, defaults included."""

    doc = cfg.tables()
    fields = hp_fields(cfg.method.name)
    for name, value in list(doc["method"].items()):
        if value is None:
            if name in fields and fields[name].default is not None:
                doc["method"][name] = "none"  # TOML has no null: "none", as on the command line
            else:
                del doc["method"][name]
    for table, key in _NOT_WRITTEN:
        doc[table].pop(key, None)
    doc = {t: {k: v for k, v in body.items() if v is not None} for t, body in doc.items()}
    head = ("# lowband train --config THIS_FILE --out DIR: this run again (flags given beside --config win).\n"
            "# Written by the run; `out`, `resume` and `export_hf` are left out.\n")
    return head + tomli_w.dumps({t: body for t, body in doc.items() if body})
