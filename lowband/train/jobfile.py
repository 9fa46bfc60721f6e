"""A training job as a TOML file: ``lowband train --config job.toml``, flags on top.

The file has one table per concern; each key is a :class:`~lowband.train.loop.TrainConfig` field
(the method's hyper-parameters are the fields of its config, :mod:`lowband.train.methods`)::

    [method]
    name = "diloco"
    sync_every = 10          # any hyper-parameter of the method, by field name or alias (H)

    [model]
    model = "t5-mini"

    [schedule]
    steps = 500

Precedence: ``TrainConfig``'s defaults, then the file, then the flags given on the command line.
Every run writes its complete configuration to ``OUT/config.toml`` (every hyper-parameter of its
method spelled out, so that a later change of a default does not change what it re-runs), and
``lowband train --config OUT/config.toml --out AGAIN`` runs it again.

Left out of the written file: where the run writes (``out``) and what it resumes from
(``resume``): a re-run must not write over the run it repeats.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

__all__ = ["SECTIONS", "KEYS", "TITLES", "dumps", "load", "loads", "check_value", "option"]


def option(default: Any, help: str, *, flag: str | None = None, type: Any = None, choices: tuple | None = None,
           metavar: str | None = None) -> Any:
    """A TrainConfig field with what its ``lowband train`` flag needs: its help, and where they are not
    the field's own, its flag (default ``--field-name``; a bool field that defaults to True gets a
    ``--no-...`` flag that turns it off), the type that parses it (default: the field's) and its metavar."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "type": type,
                                                        "choices": choices, "metavar": metavar})

#: table -> the TrainConfig fields it holds (``method``'s table also holds the hyper-parameters).
SECTIONS: dict[str, tuple[str, ...]] = {
    "method": ("method",),
    "model": ("model", "precision", "activation_checkpointing", "shards"),
    "data": ("data", "val_data", "tokenizer", "source_column", "target_column", "text_column", "max_source_len",
             "max_target_len", "max_len", "vocab_size", "val_size", "max_examples"),
    "schedule": ("steps", "batch_size", "grad_accum", "schedule", "warmup_steps", "min_lr_ratio"),
    "link": ("link_bandwidth_bps", "link_latency_s"),
    "checkpoint": ("ckpt_every", "ckpt_at_end", "resume"),
    "run": ("seed", "val_every", "val_batches", "out", "tensorboard", "progress", "memory_profile"),
    "fault_tolerance": ("ft_lighthouse", "ft_node", "ft_max_nodes", "ft_timeout_s", "ft_quorum", "ft_start_nodes"),
}

#: each table's title in ``lowband train --help``
TITLES = {
    "method": "method", "model": "model", "data": "data", "schedule": "schedule and batches",
    "link": "link shaping (emulated slow links; real links need none)", "checkpoint": "checkpoints",
    "run": "run", "fault_tolerance": "fault tolerance (torchft: one torchrun per node, nodes may die and join; "
                                     "see docs/fault-tolerance.md)",
}

#: the key of a field in its table where it is not the field's name (the table says the prefix).
_RENAMED = {"method": "name", "link_bandwidth_bps": "bandwidth_bps", "link_latency_s": "latency_s",
            "ckpt_every": "every", "ckpt_at_end": "at_end", "ft_lighthouse": "lighthouse", "ft_node": "node",
            "ft_max_nodes": "max_nodes", "ft_timeout_s": "timeout_s", "ft_quorum": "quorum",
            "ft_start_nodes": "start_nodes"}

#: field -> (table, key)
KEYS: dict[str, tuple[str, str]] = {f: (s, _RENAMED.get(f, f)) for s, fields in SECTIONS.items() for f in fields}

#: fields a written file leaves out (see the module's docstring)
_NOT_WRITTEN = ("out", "resume")


@functools.cache
def field_types() -> dict[str, Any]:
    """TrainConfig's field types (resolved annotations)."""
    from lowband.train.loop import TrainConfig

    return typing.get_type_hints(TrainConfig)


def check_value(field: str, value: Any, *, where: str = "") -> Any:
    """``value`` for TrainConfig field ``field`` if its type fits (an int where a float goes becomes a
    float); else a ValueError that names the key, the type wanted and the type given."""
    hint = field_types()[field]
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
    table, key = KEYS[field]
    raise ValueError(f"{where}[{table}] {key} must be {wanted}, got {type(value).__name__} {value!r}")


def loads(text: str, *, where: str = "") -> dict[str, Any]:
    """TrainConfig keyword arguments from a job file's text (``hp``: the method table's other keys).
    Unknown tables and keys, wrong types and bad hyper-parameters are ValueErrors that name them."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}not a valid TOML file: {e}") from None
    out: dict[str, Any] = {}
    hp: dict[str, Any] = {}
    for table, body in doc.items():
        if table not in SECTIONS:
            raise ValueError(f"{where}unknown table [{table}]; the tables are: {', '.join(f'[{s}]' for s in SECTIONS)}")
        if not isinstance(body, Mapping):
            raise ValueError(f"{where}{table} must be a table ([{table}] followed by key = value lines)")
        by_key = {KEYS[f][1]: f for f in SECTIONS[table]}
        for key, value in body.items():
            if key in by_key:
                out[by_key[key]] = check_value(by_key[key], value, where=where)
            elif table == "method":
                hp[key] = value
            else:
                raise ValueError(f"{where}[{table}] has no key {key!r}; its keys are: {', '.join(by_key)}")
    if hp:
        from lowband.train.methods import canonical_names, method_config, parse_hp_value

        method = out.get("method")
        if method is None:
            raise ValueError(f"{where}[method] gives hyper-parameters ({', '.join(hp)}) but no name = \"...\"")
        try:
            hp = canonical_names(method, hp)
            # text is read as a flag's value: "none" (TOML has no null) for an optional one
            hp = {k: parse_hp_value(method, k, v) if isinstance(v, str) else v for k, v in hp.items()}
            method_config(method, hp)  # names, types and ranges, checked now
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}[method] {e}") from None
        out["hp"] = hp
    return out


def load(path: str | Path) -> dict[str, Any]:
    """:func:`loads` of the file at ``path`` (a missing file is a FileNotFoundError saying so)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {path}: no such file (a job file is TOML, e.g. a run's OUT/config.toml)")
    return loads(p.read_text(), where=f"{path}: ")


def dumps(cfg) -> str:
    """``cfg`` (a TrainConfig) as a job file: every field but ``out`` and ``resume`` that is not None,
    and every hyper-parameter of the method, defaults included."""
    import tomli_w

    from lowband.train.methods import hp_fields, method_config

    doc: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for f in dataclasses.fields(cfg):
        if f.name == "hp" or f.name in _NOT_WRITTEN:
            continue
        value = getattr(cfg, f.name)
        if value is not None:
            table, key = KEYS[f.name]
            doc[table][key] = value
    fields = hp_fields(cfg.method)
    for name, value in method_config(cfg.method, cfg.hp).as_dict().items():
        if value is not None:
            doc["method"][name] = value
        elif fields[name].default is not None:  # TOML has no null: "none", as on the command line
            doc["method"][name] = "none"
    head = ("# lowband train --config THIS_FILE --out DIR: this run again (flags given beside --config win).\n"
            "# Written by the run; `out` and `resume` are left out.\n")
    return head + tomli_w.dumps({s: body for s, body in doc.items() if body})
