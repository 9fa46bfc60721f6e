"""The bench's job: typed tables, each key declared once, from which ``lowband bench``'s flags and
``--help`` (:mod:`lowband.bench.args`), its job file (``--config bench.toml``, :mod:`lowband.bench.jobfile`)
and the presets (:mod:`lowband.bench.presets`) are built.

A job is tables, as its TOML file has them::

    [bench]                      # BenchTable: what the bench runs, and how
    methods = ["adamw:lr=0.01", "flexdemo:topk=1,lr=0.03"]
    bandwidths = ["100mbit"]
    steps = 140
    seeds = [0, 1]

    [model]                      # lowband train's own tables (lowband.train.config): what every
    name = "t5-mini"             # run gets on top of lowband train's defaults

    [data]
    max_source_len = 64

    [schedule]
    lr_schedule = "cosine"

The bench sets some of lowband train's keys itself, run by run (the method, the steps, the seed,
the link, the shards, fault tolerance): a train table that gives one is refused, naming the
``[bench]`` key or flag to use instead (:data:`BENCH_SETS`). ``[model] name`` and ``[data] path``
are the bench's ``--model`` and ``--data``.

:func:`check_tables` checks one layer of tables (unknown tables and keys, types, choices) and types
its values; :func:`merge` stacks the layers (defaults, a preset, the file, the flags), and
:meth:`lowband.bench.config.BenchConfig.from_tables` checks the whole before any process starts.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lowband.bench.defaults import (
    DEFAULT_BANDWIDTHS,
    DEFAULT_ENTRY,
    DEFAULT_METHODS,
    DEFAULT_NODES,
    DEFAULT_RANKS_PER_NODE,
    DEFAULT_RUN_TIMEOUT_S,
    DEFAULT_SEED,
    DEFAULT_STEPS,
    EMULATION_MODES,
    FT_MODES,
)
from lowband.bench.methods import METHODS, accepted_params
from lowband.bench.timebudget import parse_time_budget
from lowband.train.config import sections
from lowband.train.fields import field_types, job_fields, option
from lowband.train.jobfile import check_value
from lowband.units import parse_duration, parse_int_list, split_list

__all__ = ["BENCH_SETS", "TABLES", "TRAIN_TABLES", "BenchTable", "check_tables", "coerce", "flag_of", "merge",
           "run_tables", "train_flags"]

#: lowband train's tables a bench job may hold (their keys: lowband.train.config's classes).
TRAIN_TABLES: tuple[str, ...] = ("model", "data", "schedule", "checkpoint", "run")
#: The tables of a bench job, in the order a written file has them.
TABLES: tuple[str, ...] = ("bench", *TRAIN_TABLES)

#: lowband train's keys (None: the whole table) the bench sets run by run, and what to give instead.
BENCH_SETS: dict[tuple[str, str | None], str] = {
    ("method", None): "[bench] methods (specs such as diloco:H=10,lr=0.003); a hyper-parameter every method "
                      "has may go in [bench] train_args",
    ("link", None): "[bench] bandwidths and latency_s (--bandwidth, --latency)",
    ("fault_tolerance", None): "[bench] ft and faults (--ft, --faults)",
    ("model", "shards"): "[bench] shards (--shards) or a spec's shards=N",
    ("schedule", "steps"): "[bench] steps (--steps)",
    ("schedule", "time_budget_s"): "[bench] time_budget (--time-budget)",
    ("run", "seed"): "[bench] seeds (--seeds)",
    ("run", "out"): "--out (the bench's run directory; each run writes under it)",
    ("run", "poison"): "[bench] faults (nodeN:poison@STEP)",
    ("checkpoint", "resume"): "nothing: every run of a bench starts afresh (under --ft a restarted node resumes "
                              "by itself)",
}


def _method_help() -> str:
    return "; ".join(f"{name}: {', '.join(accepted_params(name))}" for name in METHODS)


def _one_spec_or_more(text: str) -> tuple[str, ...]:
    # Kept whole: a spec holds commas of its own (flexdemo:topk=8,chunk=64); parse_method_list splits them.
    return (text,)


def _seeds(text: str) -> tuple[int, ...]:
    return tuple(parse_int_list(text, what="--seeds", example="0,1,2"))


def _shards(text: str) -> tuple[int, ...]:
    return tuple(parse_int_list(text, what="--shards", example="1,2"))


def _time_budget(value: str | float) -> str | float:
    # "off" stays a value (not None): None is "not given", which the default rule decides (BenchConfig).
    budget = parse_time_budget(value)
    return "off" if budget is None else budget


@dataclass(frozen=True, kw_only=True)
class BenchTable:
    """The ``[bench]`` table: what a bench runs and how. Each field is one key of the job file and one
    ``lowband bench`` flag (:func:`~lowband.train.fields.option`); values given as text (a flag's, or a
    string in the file) are parsed by the field's ``type``."""

    preset: str | None = option(None, "a named bench (lowband.bench.presets); options given beside it win",
                                metavar="NAME")
    methods: tuple[str, ...] = option(
        DEFAULT_METHODS, f"method specs NAME[:key=value,...], space- or comma-separated (default: "
        f"{' '.join(DEFAULT_METHODS)}). Methods and their hyper-parameters: {_method_help()}",
        type=_one_spec_or_more, nargs="+", metavar="SPEC")
    bandwidths: tuple[str | float, ...] = option(
        DEFAULT_BANDWIDTHS, "link rate(s) per node, comma-separated, e.g. 100mbit,500mbit,1gbit: every method "
        f"runs at each (Table 1's rows). Default: {','.join(DEFAULT_BANDWIDTHS)}", flag="--bandwidth",
        type=lambda text: tuple(split_list(text)), metavar="LIST")
    shards: tuple[int, ...] | None = option(
        None, "shard counts for FlexDeMo-family methods (deto-full, demo, flexdemo), e.g. 1,2: each runs at every "
        "count (Table 2's rows; shards=1 is DeMo). Default: each method's own (DeMo 1, others ranks per node)",
        type=_shards, metavar="LIST")
    steps: int = option(DEFAULT_STEPS, "training steps per run")
    seeds: tuple[int, ...] = option(
        (DEFAULT_SEED,), "seeds, comma-separated: every method runs at each (model init, data order, dropout), and "
        f"the report shows mean and min-max over them, e.g. --seeds 0,1,2. Default: {DEFAULT_SEED}",
        aliases=("--seed",), type=_seeds, metavar="LIST")
    nodes: int = option(DEFAULT_NODES, "emulated nodes")
    ranks_per_node: int = option(DEFAULT_RANKS_PER_NODE, "ranks per node")
    emulation: str = option(
        "auto", "netns: network namespaces with tbf-limited veth links (root); shaped: in-process shaping by each "
        "rank's link; auto: netns where possible (default)", choices=EMULATION_MODES)
    latency_s: float = option(
        0.0, "per-message latency of operations that cross nodes, added in-process by the link in both emulation "
        "modes (tbf has no delay), e.g. 20ms. Default: 0", flag="--latency", type=parse_duration, metavar="DURATION")
    target_loss: float | None = option(
        None, "validation loss to time every run to (default: AdamW's final validation loss in the bench)",
        metavar="LOSS")
    run_timeout_s: float = option(
        DEFAULT_RUN_TIMEOUT_S, f"wall-clock limit of one run; it is then recorded as failed (default: "
        f"{DEFAULT_RUN_TIMEOUT_S:g})", flag="--run-timeout", type=lambda t: parse_duration(t, what="--run-timeout"),
        metavar="SECONDS")
    time_budget: float | str | None = option(
        None, "equal wall-clock time: every method trains for the same training-clock time (start-up and "
        "validation excluded) on the given link, up to 4 x --steps steps. auto: the reference (adamw) runs "
        "--steps steps first, then every other method gets its measured training time. Default: auto for a "
        "plain bench whose --methods hold adamw (no --preset, --ft or --faults), else off (--steps steps each)",
        type=_time_budget, metavar="SECONDS|auto|off")
    ft: str = option(
        "off", "fault tolerance (torchft; one torchrun per node and a Lighthouse): off (default), on, or both "
        "(every method with and without it, side by side: what it costs when nothing fails)", choices=FT_MODES)
    faults: str | None = option(
        None, "kill and restart nodes during every run, e.g. 'node1:kill@30,node1:start@60' (steps of the job, "
        "or @45s: seconds after the start); also node1:intrude@40 (the job's command line without its "
        "secret, in node 1's slot: it must be refused) and node1:poison@30 (or poison-flip, poison-nan, "
        "poison-index: from step 30 on node 1 sends updates x1000, sign-flipped, NaN or with out-of-range "
        "indices; the last two fail the message checks and, where the messages name their sender, the "
        "others report node 1 to the Lighthouse's gate, which removes it from the quorum); each method "
        "then also runs fault-free under fault tolerance, and the report sets the faulted run beside its "
        "twin. Implies --ft on", metavar="PLAN")
    tune: bool = option(
        False, "first a short lr search per method variant on this model and data (successive halving over "
        "lr x 1/3, 1, 3 around its preset or default lr, a quarter then half of --steps, one seed; cached "
        "under $LOWBAND_CACHE/tune), then the main runs at the chosen lrs. Its cost is printed before it "
        "starts. An lr given in a spec (adamw:lr=0.01) is kept, not searched, unless the spec is written as "
        "the --preset has it (the preset's lrs were tuned on its own data: they are searched)")
    entry: str = option(
        DEFAULT_ENTRY, f"what each node runs with `train ...` arguments (default: {DEFAULT_ENTRY}, i.e. "
        "`python -m lowband train`); for tests and custom trainers", metavar="MODULE|SCRIPT.py")
    train_args: tuple[str, ...] = option(
        (), "extra `lowband train` arguments for every run, after the job's [model], [data], [schedule], "
        "[checkpoint] and [run] tables (they win), e.g. --train-args=\"--batch-size 4\"; given both in a "
        "--config file and as a flag, the flag's come after the file's", type=shlex.split, metavar="ARGS")

    def __post_init__(self) -> None:
        for key in job_fields(BenchTable):
            object.__setattr__(self, key, coerce(key, getattr(self, key)))

    def table(self) -> dict[str, Any]:
        """Every key by name, None included (for ``time_budget`` None is "not given": the default rule
        of :meth:`lowband.bench.config.BenchConfig.from_tables` decides)."""
        return {k: getattr(self, k) for k in job_fields(BenchTable)}


@functools.cache
def _bench_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(BenchTable)}


def flag_of(key: str) -> str:
    """The ``lowband bench`` flag of a ``[bench]`` key."""
    return _bench_fields()[key].metadata["flag"] or "--" + key.replace("_", "-")


def _typed(value: Any, hint: Any) -> tuple[bool, Any]:
    """``(True, value as hint has it)`` when ``value`` fits the type ``hint`` (an int where a float goes
    becomes a float; a list where a tuple goes, a tuple), else ``(False, None)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None:
            return (True, None) if type(None) in args else (False, None)
        if float in args and int not in args and isinstance(value, int) and not isinstance(value, bool):
            return True, float(value)
        for a in args:
            ok, typed = _typed(value, a)
            if ok and a is not type(None):
                return True, typed
        return False, None
    if typing.get_origin(hint) is tuple:
        (item, _) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            return False, None
        out = [_typed(v, item) for v in value]
        return (True, tuple(v for _, v in out)) if all(ok for ok, _ in out) else (False, None)
    if isinstance(value, bool):
        return (True, value) if hint is bool else (False, None)
    if hint is float and isinstance(value, int | float):
        return True, float(value)
    if hint in (int, str) and isinstance(value, hint):
        return True, value
    return False, None


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def coerce(key: str, value: Any, *, where: str = "") -> Any:
    """``value`` of ``[bench] key``, typed: text is parsed by the field's ``type`` (as its flag's is), a
    list becomes a tuple; a value of another type or outside the field's choices is a ValueError that
    names the key, its flag and what it accepts."""
    meta = _bench_fields()[key].metadata
    hint = field_types(BenchTable)[key]
    if isinstance(value, str) and meta["type"] is not None:
        try:
            value = meta["type"](value)
        except ValueError as e:
            raise ValueError(f"{where}[bench] {key}: {e}" if where else str(e)) from None
    ok, typed = _typed(value, hint)
    if not ok:
        raise ValueError(f"{where}[bench] {key} ({flag_of(key)}) must be {_type_name(hint)}, got "
                         f"{type(value).__name__} {value!r}")
    if meta["choices"] and typed not in meta["choices"]:
        raise ValueError(f"{where}{flag_of(key)} {typed!r} ([bench] {key}): accepted: {', '.join(meta['choices'])}")
    return typed


def check_tables(tables: Mapping[str, Mapping[str, Any]], *, where: str = "") -> dict[str, dict[str, Any]]:
    """One layer of a job's tables (a file's, the flags', a preset's), checked and typed: an unknown table or
    key, a key the bench sets itself, a value of the wrong type or out of its choices is a ValueError that
    names it (``where``: the file, as a prefix) and the fix."""
    out: dict[str, dict[str, Any]] = {}
    for table, body in tables.items():
        if (table, None) in BENCH_SETS:
            raise ValueError(f"{where}[{table}] is set by the bench, run by run: give {BENCH_SETS[table, None]}")
        if table not in TABLES:
            raise ValueError(f"{where}unknown table [{table}]; the tables of a bench job are: "
                             f"{', '.join(f'[{t}]' for t in TABLES)}")
        if not isinstance(body, Mapping):
            raise ValueError(f"{where}{table} must be a table ([{table}] followed by key = value lines)")
        keys = job_fields(BenchTable if table == "bench" else sections()[table])
        out[table] = {}
        for key, value in body.items():
            if (table, key) in BENCH_SETS:
                raise ValueError(f"{where}[{table}] {key} is set by the bench, run by run: give {BENCH_SETS[table, key]}")
            if key not in keys:
                raise ValueError(f"{where}[{table}] has no key {key!r}; its keys are: "
                                 f"{', '.join(k for k in keys if (table, k) not in BENCH_SETS)}")
            if table == "bench":
                out[table][key] = coerce(key, value, where=where)
            else:
                out[table][key] = check_value(table, key, value, where=where)
    return out


def merge(*layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The layers' tables, a later layer's key over an earlier one's (copies: no layer is changed)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for table, body in layer.items():
            out.setdefault(table, {}).update(body)
    return out


def run_tables(tables: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """lowband train's tables of a job as every run of the bench gets them: without ``[bench]``, without
    ``[model] name`` and ``[data] path`` (the bench's model and data, which it checks and passes itself)
    and without the empty ones."""
    out = {t: {k: v for k, v in body.items() if (t, k) not in (("model", "name"), ("data", "path"))}
           for t, body in tables.items() if t != "bench"}
    return {t: body for t, body in out.items() if body}


def train_flags(tables: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """lowband train's tables as its flags (``{"run": {"val_every": 20}}`` -> ``--val-every 20``), in the
    tables' and fields' order: what another entry than lowband's trainer is given, and what results.json
    records. A switch equal to lowband train's default and a None are left out (they change nothing)."""
    argv: list[str] = []
    for table, cls in sections().items():
        body = tables.get(table) or {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in job_fields(cls):
            if key not in body or body[key] is None:
                continue
            value, meta = body[key], fields[key].metadata
            flag = meta["flag"] or "--" + key.replace("_", "-")
            if isinstance(value, bool):
                if value != fields[key].default:
                    argv.append(flag)
            else:
                argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv
