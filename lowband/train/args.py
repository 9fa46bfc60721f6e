"""The flags of ``lowband train``: derived from the job configuration's tables, parsed into a :class:`TrainConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import typing
from typing import Any

from lowband.train import jobfile
from lowband.train.config import RunMethod, TrainConfig
from lowband.train.methods import ALIASES, METHODS, canonical_names, hp_flag, parse_hp_value
from lowband.util import format_value

__all__ = ["add_arguments", "config_from_args", "given_values", "parse_train_args", "train_overrides"]

log = logging.getLogger(__name__)


def _hp_arguments(g) -> None:
    """One flag per hyper-parameter of any method, derived from the method configs (their help, type
    and choices), also spelled ``--method.<field>``; ``dest`` is ``hp_<field>``, so a hyper-parameter
    never collides with a run option. (Defaults: the method's own; each flag applies to the methods
    named in its help.)"""
    uses: dict[str, list[tuple[str, dataclasses.Field]]] = {}  # field -> (methods, field) per config
    configs: dict[type, list[str]] = {}
    for method, spec in METHODS.items():
        configs.setdefault(spec.config, []).append(method)
    for config, methods in configs.items():
        for f in dataclasses.fields(config):
            uses.setdefault(f.name, []).append(("/".join(methods), f))
    for name, per_config in uses.items():
        methods, f = per_config[0]
        helps = "; ".join(f"{m}: {fl.metadata['help']} (default {format_value(fl.default)})"
                          for m, fl in per_config).replace("%", "%%")
        choices = list(dict.fromkeys(c for _, fl in per_config for c in (fl.metadata["choices"] or ()))) or None
        flags = [hp_flag(name), f"--method.{name}"]
        alias = f.metadata["alias"]
        if alias and len(alias) > 1:
            flags.append("--" + alias)  # --clip: the flag's old name
        # SUPPRESS: an option not given is absent, so "--max-grad-norm none" can set None.
        g.add_argument(*flags, dest=f"hp_{name}", default=argparse.SUPPRESS, choices=choices, help=helps,
                       metavar=None if choices else name.upper(),
                       type=functools.partial(_hp_value, methods.split("/")[0], name))
    g.add_argument("--hp", default=None, help="hyper-parameters as JSON, field names or aliases "
                   f"({', '.join(f'{a}={n}' for a, n in ALIASES.items())}), e.g. '{{\"beta1\": 0.9}}'")


def _hp_value(method: str, name: str, text: str) -> Any:
    try:
        return parse_hp_value(method, name, text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``lowband train``'s flags: one per key of the job's tables, from its field's metadata
    (:func:`lowband.train.fields.option`), grouped by table; one per hyper-parameter of any method; ``--config``.
    A flag's dest is ``table.key``; every non-boolean key is also spelled ``--table.key``."""
    d = TrainConfig()
    for table, cls in jobfile.sections().items():
        hints = jobfile.field_types(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        g = p.add_argument_group(jobfile.TITLES[table])
        for name in jobfile.job_fields(cls):
            meta, default = fields[name].metadata, getattr(getattr(d, table), name)
            flags = [meta["flag"] or "--" + name.replace("_", "-")]
            text = meta["help"].replace("%", "%%")
            if default is not None and not isinstance(default, bool) and "default" not in text:
                text += f" (default {format_value(default)})".replace("%", "%%")
            kwargs: dict[str, Any] = dict(dest=f"{table}.{name}", default=argparse.SUPPRESS, help=text)
            if hints[name] is bool:
                kwargs["action"] = "store_false" if default else "store_true"
            else:
                flags.append(f"--{table}.{name}")
                kwargs.update(type=meta["type"] or _base_type(hints[name]), choices=meta["choices"],
                              metavar=meta["metavar"] or (None if meta["choices"] else name.upper()))
            g.add_argument(*flags, **kwargs)
        if table == "method":
            _hp_arguments(g)
    p.add_argument("--config", metavar="FILE.toml", default=None, help="the job as a TOML file (a run writes its own to "
                   "OUT/config.toml); flags given beside it win. See docs/configuration.md")


def _base_type(hint: Any) -> type:
    """int, float or str: the type a flag's text is parsed to (``int | None`` -> int)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's TrainConfig: its defaults, then ``--config``'s file, then the flags given."""
    return TrainConfig.from_tables(given_values(args))


def given_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The job's tables as ``--config``'s file and the flags given set them (``method``: its name and the
    hyper-parameters set); the keys neither sets are absent."""
    given = vars(args)
    tables: dict[str, dict[str, Any]] = jobfile.load(given["config"]) if given.get("config") else {}
    file_method = tables.setdefault("method", {})
    flag_name = given.get("method.name")
    if flag_name is not None and file_method.get("name", flag_name) != flag_name:
        file_hp = [k for k in file_method if k != "name"]
        if file_hp:
            log.warning("--method %s replaces the file's %s: the file's hyper-parameters (%s) are dropped",
                        flag_name, file_method["name"], ", ".join(file_hp))
        tables["method"] = {}
    for dest, value in given.items():
        if "." in dest:
            table, key = dest.split(".", 1)
            tables.setdefault(table, {})[key] = value
    hp = {k.removeprefix("hp_"): v for k, v in given.items() if k.startswith("hp_")}
    if given.get("hp"):
        try:
            extra = json.loads(given["hp"])
        except json.JSONDecodeError as e:
            raise ValueError(f"--hp must be a JSON object, e.g. '{{\"beta1\": 0.9}}': {e}") from e
        if not isinstance(extra, dict):
            raise ValueError("--hp must be a JSON object")
        extra = canonical_names(tables["method"].get("name", RunMethod.name), extra)
        twice = sorted(set(extra) & set(hp))
        if twice:
            raise ValueError(f"{', '.join(twice)} given both as a flag and in --hp; give each once")
        hp.update(extra)
    tables["method"].update(hp)
    return tables


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and exit
        raise ValueError(message)


def parse_train_args(argv: list[str] | tuple[str, ...], *, known_only: bool = False) -> TrainConfig:
    """``lowband train`` arguments as the TrainConfig they give; a bad one is a ValueError that names it
    (``known_only``: arguments lowband does not know are ignored, as another entry's may be)."""
    return TrainConfig.from_tables(train_overrides(argv, known_only=known_only))


def train_overrides(argv: list[str] | tuple[str, ...], *, known_only: bool = False) -> dict[str, dict[str, Any]]:
    """:func:`given_values` of ``lowband train`` arguments: what they set, on top of what else sets it."""
    p = _RaisingParser(prog="lowband train", add_help=False)
    add_arguments(p)
    args = p.parse_known_args(list(argv))[0] if known_only else p.parse_args(list(argv))
    return given_values(args)
