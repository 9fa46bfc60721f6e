"""Method specs for the bench: ``name[:key=value,key=value...]``.

A *method spec* names a training method of :data:`lowband.train.methods.METHODS` and overrides
some of its hyper-parameters::

    adamw                         AdamW, gradients all-reduced between nodes every step (HSDP)
    muon                          Muon on the hidden matrices, AdamW on the rest, all-reduced likewise
    deto-full                     FlexDeMo's pipeline with the gradient fully all-reduced
    demo                          FlexDeMo with shards=1 (every rank a replica)
    flexdemo:topk=8               FlexDeMo, top-8 of every chunk of 128 DCT coefficients
    flexdemo:topk=8,chunk=64      ... of every chunk of 64
    diloco:H=100                  DiLoCo, 100 inner steps per outer step
    noloco:H=10,n=2               NoLoCo, pairs of replicas average every 10 steps
    sparseloco:H=30,topk=2        SparseLoCo, top-2 of every chunk of 128, 2-bit values, every 30 steps

The methods, their hyper-parameters, types, defaults and checks come from the method configs
(:mod:`lowband.train.methods`, one per optimizer, for ``lowband train`` and ``lowband bench``
alike). Keys are the configs' field names or their short aliases (``H`` = ``sync_every``, ``n`` =
``group_size``, ``clip`` = ``max_grad_norm``). A parsed spec holds the method's typed config
(:class:`BenchMethod`, ``hp``), which is what the trainer gets (``TrainConfig.method.hp``) and builds
the optimizer from: a hyper-parameter goes spec -> typed config -> the optimizer's keyword. It
prints and labels with the aliases. ``shards`` is accepted too (ranks of a node that shard one model copy),
except by ``demo``, which is defined with one. Values are checked here, by building the config,
before any process starts.

``demo`` and ``flexdemo`` are one algorithm: a FlexDeMo run with ``shards=1`` *is* DeMo, and is
recorded under the name ``demo`` (:func:`canonical_method`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lowband.bench.record import RunRecord
from lowband.train.methods import (
    ALIASES,
    METHODS,
    MethodConfig,
    canonical_names,
    demo_method,
    display_name,
    family_of,
    hp_fields,
    hp_flag,
    method_config,
    parse_hp_value,
)
from lowband.util import format_value

__all__ = [
    "DISPLAY_NAMES",
    "METHODS",
    "SHARD_SWEEP",
    "BENCH_KEYS",
    "BenchMethod",
    "accepted_params",
    "canonical_method",
    "column_labels",
    "format_value",
    "method_label",
    "parse_method_list",
    "parse_method_spec",
    "shown_params",
    "train_hp_args",
]

#: Names in tables and plots (the papers' spelling; each method's ``display``); other methods show their own name.
DISPLAY_NAMES: dict[str, str] = {name: m.display for name, m in METHODS.items()}
#: Methods that run at every ``--shards`` value (the rows of the FlexDeMo paper's Table 2; ``shard_sweep``).
SHARD_SWEEP: tuple[str, ...] = tuple(name for name, m in METHODS.items() if m.shard_sweep)
#: Hyper-parameters that define a run: always passed to the trainer (its default when not set)
#: and shown in table labels.
RUN_DEFINING: tuple[str, ...] = ("topk", "chunk")
#: The default chunk: labels leave it out ("FlexDeMo Top8", not "FlexDeMo Top8 c128").
_LABEL_CHUNK = 128
_SHORT: dict[str, str] = {name: alias for alias, name in ALIASES.items()}
#: Keys of the bench itself, not hyper-parameters: ``shards`` (FlexDeMo-family methods other than
#: DeMo) and ``nseeds`` (run at the first N of the bench's seeds only, e.g. a reference variant
#: that needs no spread).
BENCH_KEYS: tuple[str, ...] = ("shards", "nseeds")


def accepted_params(method: str) -> dict[str, str]:
    """Keys ``method`` accepts in a spec with their types, e.g. ``{"sync_every (H)": "int"}``.

    The fields of the method's config (with their short aliases) and the bench's own keys
    (:data:`BENCH_KEYS`; DeMo takes no ``shards``).
    """
    out: dict[str, str] = {}
    for name, f in hp_fields(method).items():
        key = name + (f" ({f.metadata['alias']})" if f.metadata["alias"] else "")
        out[key] = f.type
    if METHODS[method].shards_per_node != 1:
        out["shards"] = "int"
    out["nseeds"] = "int"
    return out


@dataclass(frozen=True, slots=True)
class BenchMethod:
    """A parsed method spec: the method's name, its typed hyper-parameters (the spec's values on the
    method's defaults, checked), which of them the spec set (field names, in its order: labels name
    them), and the bench's own keys (:data:`BENCH_KEYS`)."""

    name: str
    hp: MethodConfig
    given: tuple[str, ...] = ()
    shards: int | None = None
    nseeds: int | None = None

    def given_values(self) -> dict[str, Any]:
        """The hyper-parameters the spec set, by field name."""
        return {k: getattr(self.hp, k) for k in self.given}

    def __str__(self) -> str:
        items = [*self.given_values().items(), *((k, getattr(self, k)) for k in BENCH_KEYS if getattr(self, k))]
        if not items:
            return self.name
        return self.name + ":" + ",".join(f"{_SHORT.get(k, k)}={format_value(v)}" for k, v in items)


def _listing() -> str:
    return "; ".join(f"{name} ({', '.join(accepted_params(name))})" for name in METHODS)


def parse_method_spec(text: str) -> BenchMethod:
    """Parse ``"flexdemo:topk=8,chunk=64"`` into a :class:`BenchMethod`.

    Raises:
        ValueError: an unknown method (the message lists the methods with their
            hyper-parameters), an unknown hyper-parameter (it lists the method's), a value of
            the wrong type or range, a key given twice, or ``topk`` above ``chunk``.
    """
    raw = text.strip()
    name, sep, rest = raw.partition(":")
    name = name.strip().lower()
    if name not in METHODS:
        raise ValueError(
            f"unknown method {name or raw!r}; accepted methods (with their hyper-parameters): {_listing()}. "
            "Write a spec as NAME or NAME:key=value,key=value, e.g. flexdemo:topk=8,chunk=64"
        )
    accepted = ", ".join(accepted_params(name))
    fields = hp_fields(name)
    values: dict[str, Any] = {}
    if sep:
        items = [item.strip() for item in rest.split(",")]
        if not any(items):
            raise ValueError(f"spec {text!r} has a ':' but no key=value after it; e.g. {name}:lr=0.001")
        for item in items:
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or not key or not value:
                raise ValueError(f"spec {text!r}: {item!r} is not key=value; accepted keys for {name}: {accepted}")
            if key in BENCH_KEYS and (key != "shards" or METHODS[name].shards_per_node != 1):
                field_name = key
            else:
                hint = " (demo is FlexDeMo with shards=1; write flexdemo:shards=N for others)" if key == "shards" else ""
                if ALIASES.get(key, key) not in fields and key not in fields:
                    raise ValueError(f"method {name!r} has no hyper-parameter {key!r}{hint}; accepted: "
                                     + ", ".join(f"{k} ({t})" for k, t in accepted_params(name).items()))
                field_name = next(iter(canonical_names(name, {key: None})))
            if field_name in values:
                raise ValueError(f"spec {text!r} sets {key} twice")
            try:
                if field_name in BENCH_KEYS:
                    values[field_name] = _parse_count(field_name, value)
                else:
                    values[field_name] = parse_hp_value(name, field_name, value)
            except ValueError as e:
                raise ValueError(f"{name}:{key}={value}: {e}") from None
    hp = {k: v for k, v in values.items() if k not in BENCH_KEYS}
    try:
        config = method_config(name, hp)
    except ValueError as e:
        raise ValueError(f"spec {text!r}: {e}") from None
    return BenchMethod(name, config, tuple(hp), shards=values.get("shards"), nseeds=values.get("nseeds"))


def _parse_count(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{key} must be an integer") from None
    if value < 1:
        raise ValueError(f"{key} must be >= 1")
    return value


def parse_method_list(items: str | Sequence[str]) -> list[BenchMethod]:
    """Parse method specs given as one comma-separated string and/or several arguments.

    Specs hold commas themselves (``flexdemo:topk=8,chunk=64``), so a comma-separated piece
    that is ``key=value`` belongs to the spec before it::

        "adamw,flexdemo:topk=8,chunk=64,demo" -> adamw | flexdemo:topk=8,chunk=64 | demo
    """
    pieces: list[str] = []
    for item in [items] if isinstance(items, str) else items:
        for piece in item.split(","):
            piece = piece.strip()
            if not piece:
                continue
            if "=" in piece and ":" not in piece:
                if not pieces:
                    raise ValueError(f"{piece!r} has no method before it; write e.g. flexdemo:{piece}")
                pieces[-1] += "," + piece
            else:
                pieces.append(piece)
    if not pieces:
        raise ValueError(f"no method given; accepted methods: {', '.join(METHODS)}")
    return [parse_method_spec(p) for p in pieces]


def canonical_method(name: str, shards: int) -> str:
    """The name a run is recorded under: FlexDeMo with shards=1 is DeMo, DeMo with more is FlexDeMo."""
    return demo_method(shards) if family_of(name) == "demo" else name


def shown_params(hp: MethodConfig, given: Sequence[str]) -> dict[str, Any]:
    """The hyper-parameters a run's label and record name: the run-defining ones the method has
    (FlexDeMo's topk and chunk, always) and those its spec set, by field name."""
    names = [k for k in RUN_DEFINING if hasattr(hp, k)] + [k for k in given if k not in RUN_DEFINING]
    return {k: getattr(hp, k) for k in names}


def method_label(name: str, params: Mapping[str, Any]) -> str:
    """A short label for tables and plots: ``FlexDeMo Top8``, ``DeMo Top1 c64``, ``NoLoCo H=10 n=2``.

    The label names the method and every hyper-parameter in ``params`` (by its short alias where
    it has one: ``H``, ``n``) except ``shards`` (tables show it in a column of its own) and the
    default chunk.
    """
    parts = [display_name(name)]
    rest = {k: v for k, v in params.items() if k != "shards"}
    if "topk" in rest:
        parts[0] += f" Top{rest.pop('topk')}"
    if rest.get("chunk") == _LABEL_CHUNK:
        rest.pop("chunk")
    parts += [f"c{v}" if k == "chunk" else f"{_SHORT.get(k, k)}={format_value(v)}" for k, v in rest.items()]
    return " ".join(parts)


def train_hp_args(params: Mapping[str, Any]) -> list[str]:
    """``lowband train`` arguments for ``params`` (field names): a flag each (``--topk 8``,
    ``--sign false``, ``--sync-every 10``, ``--shards 2``); every hyper-parameter has one."""
    argv: list[str] = []
    for key, value in params.items():
        argv += ["--shards" if key == "shards" else hp_flag(key), format_value(value)]
    return argv


def column_labels(runs: Sequence[RunRecord]) -> list[str]:
    """Each run's method column: its label, plus ``S=<shards>`` where a label ran at several shard counts."""
    shards_of: dict[str, set] = {}
    for r in runs:
        shards_of.setdefault(r.label, set()).add(r.shards)
    return [r.label + (f" S={r.shards}" if len(shards_of[r.label]) > 1 else "") for r in runs]
