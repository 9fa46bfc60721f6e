"""Method specs for the bench: ``name[:key=value,key=value...]``.

A *method spec* names a training method of :data:`lowband.train.methods.METHODS` and overrides
some of its hyper-parameters::

    adamw                         AdamW, gradients all-reduced between nodes every step (HSDP)
    deto-full                     FlexDeMo's pipeline with the gradient fully all-reduced
    demo                          FlexDeMo with shards=1 (every rank a replica)
    flexdemo:topk=8               FlexDeMo, top-8 of every chunk of 128 DCT coefficients
    flexdemo:topk=8,chunk=64      ... of every chunk of 64
    diloco:H=100                  DiLoCo, 100 inner steps per outer step
    noloco:H=10,n=2               NoLoCo, pairs of replicas average every 10 steps
    diloco:H=10,overlap=true      DiLoCo whose outer step is merged 1 inner step after it starts
    diloco:H=10,delay=3           ... 3 inner steps after it starts (delay=τ, 1 <= τ < H)

The methods, their hyper-parameters and their defaults come from the trainer's registry (one
registry for ``lowband train`` and ``lowband bench``); a value's type is its default's type.
``shards`` is accepted too (ranks of a node that shard one model copy), except by ``demo``,
which is defined with one. Values are checked here, before any process starts; the trainer
checks them again.

``demo`` and ``flexdemo`` are one algorithm: a FlexDeMo run with ``shards=1`` *is* DeMo, and is
recorded under the name ``demo`` (:func:`canonical_method`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lowband.train.cli import HP_FLAGS
from lowband.train.local_methods import outer_delay
from lowband.train.methods import METHODS
from lowband.util import parse_bool

__all__ = [
    "DISPLAY_NAMES",
    "METHODS",
    "SHARD_SWEEP",
    "BenchMethod",
    "accepted_params",
    "canonical_method",
    "column_labels",
    "format_value",
    "method_label",
    "parse_method_list",
    "parse_method_spec",
    "run_params",
    "train_hp_args",
]

#: Names in tables and plots (the papers' spelling); other methods show their own name.
DISPLAY_NAMES: dict[str, str] = {
    "adamw": "AdamW", "deto-full": "Deto-Full", "demo": "DeMo", "flexdemo": "FlexDeMo",
    "diloco": "DiLoCo", "noloco": "NoLoCo",
}  # fmt: skip
#: Methods that run at every ``--shards`` value (the rows of the FlexDeMo paper's Table 2).
SHARD_SWEEP: tuple[str, ...] = ("deto-full", "demo", "flexdemo")
#: Hyper-parameters that define a run: always passed to the trainer (its default when not set)
#: and shown in table labels.
RUN_DEFINING: tuple[str, ...] = ("topk", "chunk")
#: The default chunk: labels leave it out ("FlexDeMo Top8", not "FlexDeMo Top8 c128").
_LABEL_CHUNK = 128

# Range checks the bench can make before anything starts (the optimizers check everything).
_CHOICES: dict[str, tuple[str, ...]] = {"values": ("bf16", "fp32", "sign")}
#: Per family where it differs (DiLoCo/NoLoCo quantise dense outer messages).
_FAMILY_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {"local": {"values": ("fp32", "bf16", "int8", "int4")}}
_MINIMUM: dict[str, tuple[float, bool]] = {  # name -> (minimum, exclusive)
    "lr": (0.0, True), "outer_lr": (0.0, True), "weight_decay": (0.0, False), "topk": (1, False),
    "chunk": (1, False), "H": (1, False), "n": (2, False), "decay": (0.0, False), "clip": (0.0, True),
    "shards": (1, False), "eps": (0.0, True), "nseeds": (1, False), "delay": (0, False),
}  # fmt: skip
_BELOW_ONE = ("decay", "beta1", "beta2")


def format_value(value: Any) -> str:
    """A value as it is written in a spec or on a command line (floats round-trip exactly: repr)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def accepted_params(method: str) -> dict[str, type]:
    """Keys ``method`` accepts in a spec, with their types.

    The method's hyper-parameters, and two keys of the bench itself: ``shards`` (FlexDeMo-family
    methods other than DeMo) and ``nseeds`` (run at the first N of the bench's seeds only, e.g. a
    reference variant that needs no spread).
    """
    out: dict[str, type] = {}
    for name, default in METHODS[method].hyperparameters.items():
        out[name] = float if default is None else type(default)
    if METHODS[method].shards_per_node != 1:
        out["shards"] = int
    out["nseeds"] = int
    return out


def _parse_value(method: str, key: str, kind: type, text: str) -> Any:
    where = f"{method}:{key}={text}"
    raw = text.strip()
    if kind is bool:
        try:
            return parse_bool(raw)
        except ValueError:
            raise ValueError(f"{where}: {key} is a yes/no setting; use true or false") from None
    if kind in (int, float):
        try:
            value: Any = kind(raw)
        except ValueError:
            raise ValueError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}") from None
    else:
        value = raw
    choices = _FAMILY_CHOICES.get(METHODS[method].family, {}).get(key, _CHOICES.get(key))
    if choices is not None and value not in choices:
        raise ValueError(f"{where}: {key} must be one of {', '.join(choices)}")
    if key in _MINIMUM:
        low, exclusive = _MINIMUM[key]
        if value < low or (exclusive and value == low):
            raise ValueError(f"{where}: {key} must be {'>' if exclusive else '>='} {low:g}")
    if key in _BELOW_ONE and not value < 1.0:
        raise ValueError(f"{where}: {key} must be below 1")
    return value


@dataclass(frozen=True, slots=True)
class BenchMethod:
    """A parsed method spec: the method's name and the hyper-parameters the user set, in order."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={format_value(v)}" for k, v in self.params)


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
    accepted = accepted_params(name)
    values: dict[str, Any] = {}
    if sep:
        items = [item.strip() for item in rest.split(",")]
        if not any(items):
            raise ValueError(f"spec {text!r} has a ':' but no key=value after it; e.g. {name}:lr=0.001")
        for item in items:
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or not key or not value:
                raise ValueError(
                    f"spec {text!r}: {item!r} is not key=value; accepted keys for {name}: {', '.join(accepted)}"
                )
            if key not in accepted:
                hint = " (demo is FlexDeMo with shards=1; write flexdemo:shards=N for others)" if key == "shards" else ""
                raise ValueError(
                    f"method {name!r} has no hyper-parameter {key!r}{hint}; accepted: "
                    + ", ".join(f"{k} ({t.__name__})" for k, t in accepted.items())
                )
            if key in values:
                raise ValueError(f"spec {text!r} sets {key} twice")
            values[key] = _parse_value(name, key, accepted[key], value)
    defaults = METHODS[name].hyperparameters
    topk, chunk = values.get("topk", defaults.get("topk")), values.get("chunk", defaults.get("chunk"))
    if topk is not None and chunk is not None and topk > chunk:
        raise ValueError(f"spec {text!r}: topk={topk} exceeds chunk={chunk}; topk must lie in 1..chunk")
    if METHODS[name].family == "local":
        try:
            outer_delay({**defaults, **values})
        except ValueError as e:
            raise ValueError(f"spec {text!r}: {e}") from None
    return BenchMethod(name, tuple(values.items()))


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
    if name in ("demo", "flexdemo"):
        return "demo" if shards == 1 else "flexdemo"
    return name


def run_params(method: str, given: Mapping[str, Any], shards: int) -> dict[str, Any]:
    """Everything passed to the trainer: the run-defining defaults, the spec's values, ``shards``."""
    defaults = METHODS[method].hyperparameters
    params = {k: defaults[k] for k in RUN_DEFINING if k in defaults}
    params.update(given)
    params["shards"] = shards
    return params


def method_label(name: str, params: Mapping[str, Any]) -> str:
    """A short label for tables and plots: ``FlexDeMo Top8``, ``DeMo Top1 c64``, ``NoLoCo H=10 n=2``.

    The label names the method and every hyper-parameter in ``params`` except ``shards`` (tables
    show it in a column of its own) and the default chunk.
    """
    parts = [DISPLAY_NAMES.get(name, name)]
    rest = {k: v for k, v in params.items() if k != "shards"}
    if "topk" in rest:
        parts[0] += f" Top{rest.pop('topk')}"
    if rest.get("chunk") == _LABEL_CHUNK:
        rest.pop("chunk")
    parts += [f"c{v}" if k == "chunk" else f"{k}={format_value(v)}" for k, v in rest.items()]
    return " ".join(parts)


_FLAG_OF: dict[str, str] = {hp: "--" + flag.replace("_", "-") for flag, hp in HP_FLAGS.items()}


def train_hp_args(params: Mapping[str, Any]) -> list[str]:
    """``lowband train`` arguments for ``params``: a flag each where the trainer has one
    (``--topk 8``, ``--sign false``, ``--shards 2``), the rest as ``--hp '{"beta1": 0.95}'``."""
    argv: list[str] = []
    extra: dict[str, Any] = {}
    for key, value in params.items():
        if key == "shards":
            argv += ["--shards", str(value)]
        elif key in _FLAG_OF:
            argv += [_FLAG_OF[key], format_value(value)]
        else:
            extra[key] = value
    if extra:
        argv += ["--hp", json.dumps(extra)]
    return argv


def column_labels(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each run's method column: its label, plus ``S=<shards>`` where a label ran at several shard counts."""
    shards_of: dict[str, set] = {}
    for r in runs:
        shards_of.setdefault(r["label"], set()).add(r.get("shards"))
    return [r["label"] + (f" S={r.get('shards')}" if len(shards_of[r["label"]]) > 1 else "") for r in runs]
