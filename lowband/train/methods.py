"""The training methods by name, their typed hyper-parameter configs, and how each builds its optimizer.

One config dataclass per optimizer is the single source of a method's hyper-parameters: its
fields are the optimizer's keyword names, with their defaults and a help text each. Everything
else is derived from it:

- ``lowband train``'s flags (``--sync-every``, ``--nonfinite``, ...; :func:`hp_flag`),
- the bench's method specs (``diloco:H=10``; :mod:`lowband.bench.methods`), value parsing by the
  field's type (:func:`parse_hp_value`),
- validation (:meth:`MethodConfig.__post_init__`: type, choices, range, run before any process
  starts), help texts and report labels (a field's short ``alias``).

Defaults live once. Where a config's default is the optimizer's own, the field reads it from the
optimizer's signature (:func:`_signature_default`); the few defaults that ``lowband train`` sets
differently say so in their field, with the reason (:data:`TRAINER_DEFAULTS` lists them).

Adding a hyper-parameter is one field in the method's config (see docs/architecture.md).

Short aliases (spec keys, ``--hp`` keys and report labels; :data:`ALIASES`)::

    H       sync_every       DiLoCo, NoLoCo, SparseLoCo: inner steps per outer step
    n       group_size       NoLoCo: replicas per gossip group
    clip    max_grad_norm    DiLoCo, NoLoCo, SparseLoCo: inner gradient clipping (flag --clip kept too)

One command-line spelling differs from its field: NoLoCo's ``seed`` is ``--gossip-seed``
(``--seed`` is the run's seed).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lowband.comm.link import Link
from lowband.compress.quant import OUTER_VALUE_FORMATS
from lowband.compress.sparse import SPARSE_VALUE_FORMATS
from lowband.compress.wire import VALUE_FORMATS
from lowband.optim import AdamWFullSync, DetoFull, DiLoCo, FlexDeMo, MuonFullSync, NoLoCo, SparseLoCo
from lowband.optim._common import NONFINITE_POLICIES
from lowband.optim.flexdemo.optimizer import BLOCK_LAYOUTS, OVERLAP_APPLY
from lowband.optim.muon import (
    INNER_OPTIMIZERS,
    MuonAdamW,
    has_torch_muon,
    hidden_matrices,
    muon_missing_message,
)
from lowband.optim.outer.diloco import DILOCO_INNER_DEFAULTS
from lowband.optim.outer.noloco import NOLOCO_INNER_DEFAULTS
from lowband.optim.outer.schedule import check_delay, unmerged_tail_note
from lowband.optim.outer.sparseloco import SPARSELOCO_INNER_DEFAULTS, SPARSELOCO_TRANSFORMS
from lowband.optim.robust import AGGREGATES
from lowband.util import parse_bool

__all__ = [
    "ALIASES",
    "METHODS",
    "TRAINER_DEFAULTS",
    "AdamWConfig",
    "DetoFullConfig",
    "DiLoCoConfig",
    "FlexDeMoConfig",
    "MethodConfig",
    "MethodSpec",
    "MuonConfig",
    "NoLoCoConfig",
    "SparseLoCoConfig",
    "build_optimizer",
    "check_hyperparameters",
    "demo_method",
    "display_name",
    "family_of",
    "hp_fields",
    "hp_flag",
    "method_config",
    "method_shards",
    "parse_hp_value",
    "reference_method",
]


def _signature_default(fn: Any, name: str) -> Any:
    """The default of keyword ``name`` in ``fn``'s signature (a class: its ``__init__``)."""
    target = fn.__init__ if isinstance(fn, type) else fn
    default = inspect.signature(target).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{fn.__qualname__}({name}) has no default")
    return default


def option(
    default: Any,
    help: str,
    *,
    alias: str | None = None,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    exclusive: bool = False,
    below_one: bool = False,
    flag: str | None = None,
) -> Any:
    """A config field: its default, help text and the checks :class:`MethodConfig` runs.

    Args:
        default: the default (read it from the optimizer with :func:`_signature_default`).
        help: one line for ``--help`` and the docs.
        alias: a short spelling accepted in specs and ``--hp`` and used in report labels.
        choices: the accepted values of a string field.
        minimum: the lowest accepted value (``exclusive``: the value must exceed it).
        below_one: the value must be below 1.
        flag: the ``lowband train`` flag when ``--<name>`` is taken by a run option.
    """
    meta = dict(help=help, alias=alias, choices=choices, minimum=minimum, exclusive=exclusive,
                below_one=below_one, flag=flag)
    return field(default=default, metadata=meta)


@functools.cache
def _types(cls: type) -> dict[str, tuple[type, bool]]:
    """Field name -> (base type, accepts None) of a config class."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        args = typing.get_args(hint)
        if args:  # X | None
            base = next(a for a in args if a is not type(None))
            out[name] = (base, type(None) in args)
        else:
            out[name] = (hint, False)
    return out


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """Base of the per-method configs: checks every field on construction, builds the optimizer.

    A subclass lists the optimizer's keyword arguments as fields made with :func:`option` and
    implements :meth:`build`. Construction checks each value's type (an int is accepted for a
    float and converted), its choices and range, then :meth:`check` (relations between fields);
    a bad value is a ValueError that names the field and what it accepts.
    """

    def __post_init__(self) -> None:
        types = _types(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            base, optional = types[f.name]
            if value is None:
                if not optional:
                    raise ValueError(f"{f.name} must be {_TYPE_WORDS[base]}, got None")
                continue
            if base is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                object.__setattr__(self, f.name, value)
            if not isinstance(value, base) or (base is not bool and isinstance(value, bool)):
                raise ValueError(f"{f.name} must be {_TYPE_WORDS[base]}, got {value!r}")
            _check_range(f, value)
        self.check()

    def check(self) -> None:
        """Checks between fields (a subclass's); each field alone is checked already."""

    def tail_note(self, steps: int) -> str | None:
        """Why a run of ``steps`` would end in a state that misrepresents the method, or None (most never)."""
        return None

    def check_fault_tolerance(self) -> None:
        """ValueError if this configuration cannot run under fault tolerance (``--ft-lighthouse``)."""

    def build(self, params: list, *, link: Link, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        raise NotImplementedError

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_range(f: dataclasses.Field, value: Any) -> None:
    m = f.metadata
    if m["choices"] is not None and value not in m["choices"]:
        raise ValueError(f"{f.name} must be one of {', '.join(m['choices'])}, got {value!r}")
    low = m["minimum"]
    if low is not None and (value < low or (m["exclusive"] and value == low)):
        raise ValueError(f"{f.name} must be {'>' if m['exclusive'] else '>='} {low:g}, got {value!r}")
    if m["below_one"] and not value < 1.0:
        raise ValueError(f"{f.name} must be below 1, got {value!r}")


_AGGREGATE_HELP = ("how the replicas' updates are combined: mean (the paper's), clip (each bounded by the members' "
                   "median norm), trimmed (coordinate-wise, largest and smallest dropped; dense, 3+ members), agree "
                   "(3+ members: one whose update points against most of the others' is left out, then clip)")


def _lr(default: float) -> Any:
    return option(default, "learning rate", minimum=0.0, exclusive=True)


def _nonfinite(owner: Any) -> Any:
    return option(_signature_default(owner, "nonfinite"), "a gradient with NaN/Inf: raise (stop the run) or skip "
              "the step on every rank", choices=NONFINITE_POLICIES)


@dataclass(frozen=True, kw_only=True)
class AdamWConfig(MethodConfig):
    """AdamW on the all-reduced gradient (:class:`lowband.optim.AdamWFullSync`); beta1, beta2 are its ``betas``."""

    lr: float = _lr(_signature_default(AdamWFullSync, "lr"))
    # Trainer's choice: no weight decay, as the FlexDeMo paper's AdamW baseline (torch's default: 0.01).
    weight_decay: float = option(0.0, "decoupled weight decay", minimum=0.0)
    beta1: float = option(_signature_default(torch.optim.AdamW, "betas")[0], "Adam's first-moment decay",
                      minimum=0.0, below_one=True)
    beta2: float = option(_signature_default(torch.optim.AdamW, "betas")[1], "Adam's second-moment decay",
                      minimum=0.0, below_one=True)
    eps: float = option(_signature_default(torch.optim.AdamW, "eps"), "Adam's epsilon", minimum=0.0, exclusive=True)
    nonfinite: str = _nonfinite(AdamWFullSync)

    def build(self, params, *, link, model=None):
        kw = self.as_dict()
        return AdamWFullSync(params, link=link, betas=(kw.pop("beta1"), kw.pop("beta2")), **kw)


@dataclass(frozen=True, kw_only=True)
class MuonConfig(MethodConfig):
    """Muon on the hidden weight matrices, AdamW on the rest, on the all-reduced gradient
    (:class:`lowband.optim.MuonFullSync`): the full-sync reference for ``inner=muon``. Its defaults are
    :class:`~lowband.optim.muon.MuonAdamW`'s, the inner optimizer ``inner=muon`` builds."""

    lr: float = _lr(_signature_default(MuonAdamW, "lr"))
    weight_decay: float = option(_signature_default(MuonAdamW, "weight_decay"), "decoupled weight decay of both parts",
                                 minimum=0.0)
    nonfinite: str = _nonfinite(MuonFullSync)

    def check(self) -> None:
        super().check()
        if not has_torch_muon():
            raise ValueError(muon_missing_message("the method muon", "adamw"))

    def build(self, params, *, link, model=None):
        return MuonFullSync(params, link=link, muon_params=None if model is None else hidden_matrices(model),
                            **self.as_dict())


@dataclass(frozen=True, kw_only=True)
class DetoFullConfig(MethodConfig):
    """Sign-SGD on the all-reduced gradient (:class:`lowband.optim.DetoFull`)."""

    lr: float = _lr(_signature_default(DetoFull, "lr"))
    sign: bool = option(_signature_default(DetoFull, "sign"), "step with sign() of the update (true/false)")
    weight_decay: float = option(_signature_default(DetoFull, "weight_decay"), "decoupled weight decay", minimum=0.0)
    nonfinite: str = _nonfinite(DetoFull)

    def build(self, params, *, link, model=None):
        return DetoFull(params, link=link, **self.as_dict())


@dataclass(frozen=True, kw_only=True)
class FlexDeMoConfig(MethodConfig):
    """FlexDeMo / DeMo (:class:`lowband.optim.FlexDeMo`): top-k DCT of the momentum between nodes."""

    lr: float = _lr(_signature_default(FlexDeMo, "lr"))
    topk: int = option(_signature_default(FlexDeMo, "topk"), "DCT coefficients kept per chunk (1..chunk)", minimum=1)
    chunk: int = option(_signature_default(FlexDeMo, "chunk"), "DCT chunk size", minimum=1)
    decay: float = option(_signature_default(FlexDeMo, "decay"), "momentum decay beta, in [0, 1)", minimum=0.0,
                      below_one=True)
    sign: bool = option(_signature_default(FlexDeMo, "sign"), "step with sign() of the update (true/false)")
    weight_decay: float = option(_signature_default(FlexDeMo, "weight_decay"), "decoupled weight decay", minimum=0.0)
    values: str = option(_signature_default(FlexDeMo, "values"), "wire format of the kept values", choices=VALUE_FORMATS)
    nonfinite: str = _nonfinite(FlexDeMo)
    overlap: bool = option(_signature_default(FlexDeMo, "overlap"), "apply each exchange one step later, overlapped "
                       "with the next step's compute (true/false)")
    overlap_apply: str = option(_signature_default(FlexDeMo, "overlap_apply"), "with overlap=true: local (step "
                                "with the own update at once, corrected to the mean one step later) or stale "
                                "(step with the mean one step late)", choices=OVERLAP_APPLY)
    tile: int = option(_signature_default(FlexDeMo, "tile"), "t > 0: 2-D DCT over t x t tiles of each matrix "
                       "shard, topk per tile, chunk unused (1-D params: chunks of t^2); 0: 1-D chunks", minimum=0)
    aggregate: str = option("mean", _AGGREGATE_HELP + " (mean, clip, agree)", choices=("mean", "clip", "agree"))
    blocks: str = option(_signature_default(FlexDeMo, "blocks"), "how a step cuts a param group's chunk rows: group "
                         "(a few large kernels per step, for GPUs; temporaries about 3x the group's size), cache "
                         "(blocks of 2^20 elements that stay in a CPU's caches), auto (group on a GPU, cache on the "
                         "CPU); the same bytes either way", choices=BLOCK_LAYOUTS)

    def check(self) -> None:
        if self.tile:
            if self.topk > self.tile ** 2:
                raise ValueError(f"topk={self.topk} exceeds tile^2={self.tile ** 2}; with tile={self.tile} topk "
                                 "must lie in 1..tile^2")
        elif self.topk > self.chunk:
            raise ValueError(f"topk={self.topk} exceeds chunk={self.chunk}; topk must lie in 1..chunk")

    def check_fault_tolerance(self) -> None:
        if self.overlap:
            raise ValueError("overlap=true does not run under fault tolerance yet (a step applied one step later "
                             "cannot be dropped when its exchange fails); use the blocking variant (overlap=false)")

    def build(self, params, *, link, model=None):
        return FlexDeMo(params, link=link, **self.as_dict())


def _overlap_fields(owner: type) -> dict[str, Any]:
    """``overlap`` and ``delay``: the fields every outer-step method's config has."""
    return dict(
        overlap=option(False, "overlap the outer exchange with the next inner step: merge it 1 inner step after "
                       "it starts, i.e. delay 1 unless delay is given (true/false)"),
        delay=option(_signature_default(owner, "delay"), "inner steps tau (1 <= tau < H) between the start of an "
                     "outer exchange and its merge (0: blocking)", minimum=0),
    )


def _inner_field() -> Any:
    """``inner``: which inner optimizer DiLoCo, NoLoCo and SparseLoCo take their local steps with."""
    return option("adamw", "the inner optimizer: adamw, or muon (torch's Muon on the hidden layers' weight matrices, "
                  "AdamW on embeddings, output layer, norms and biases, one lr for both: MuLoCo)",
                  choices=INNER_OPTIMIZERS)


def _local_fields(owner: type, inner: Mapping[str, float]) -> dict[str, Any]:
    """DiLoCo's and NoLoCo's shared fields: the inner optimizer, the dense outer formats, overlap."""
    return dict(
        lr=_lr(inner["lr"]),
        weight_decay=option(inner["weight_decay"], "the inner optimizer's weight decay", minimum=0.0),
        inner=_inner_field(),
        values=option(_signature_default(owner, "values"), "wire format of the outer messages",
                  choices=OUTER_VALUE_FORMATS),
        quant_block=option(_signature_default(owner, "quant_block"), "elements per scale for int8/int4", minimum=1),
        **_overlap_fields(owner),
        aggregate=option("mean", _AGGREGATE_HELP + " (mean, clip, trimmed, agree)", choices=AGGREGATES),
    )


class _LocalConfig(MethodConfig):
    """What DiLoCo, NoLoCo and SparseLoCo share: ``overlap`` and ``delay`` become the optimizer's one ``delay`` (τ)."""

    def outer_delay(self) -> int:
        """τ: ``delay`` when it is > 0, else 1 with ``overlap=true``, else 0 (checked against H)."""
        tau = self.delay if self.delay else (1 if self.overlap else 0)  # type: ignore[attr-defined]
        return check_delay(tau, self.sync_every)  # type: ignore[attr-defined]

    def check(self) -> None:
        self.outer_delay()
        if self.inner == "muon" and not has_torch_muon():  # type: ignore[attr-defined]
            raise ValueError(muon_missing_message())

    def tail_note(self, steps: int) -> str | None:
        """Why a run of ``steps`` ends between outer steps (its last inner steps unmerged), or None."""
        return unmerged_tail_note(steps, self.sync_every)  # type: ignore[attr-defined]

    def check_fault_tolerance(self) -> None:
        if self.outer_delay():
            raise ValueError("an overlapped outer step (overlap/delay) does not run under fault tolerance yet; "
                             "use the blocking outer step (overlap=false, delay=0)")

    def _optimizer_kwargs(self, model: torch.nn.Module | None) -> tuple[Any, dict[str, Any]]:
        """The inner optimizer's factory (over the param groups) and the outer optimizer's keyword arguments.

        ``inner=muon``: :class:`~lowband.optim.muon.MuonAdamW`, Muon on ``model``'s hidden weight
        matrices (:func:`~lowband.optim.muon.hidden_matrices`; without a model, chosen by name).
        """
        kw = self.as_dict()
        lr, weight_decay = kw.pop("lr"), kw.pop("weight_decay")
        if kw.pop("inner") == "muon":
            inner = functools.partial(MuonAdamW, lr=lr, weight_decay=weight_decay,
                                      muon_params=None if model is None else hidden_matrices(model))
        else:
            inner = functools.partial(torch.optim.AdamW, lr=lr, weight_decay=weight_decay)
        kw.pop("overlap")
        kw["delay"] = self.outer_delay()
        return inner, kw


_DILOCO = _local_fields(DiLoCo, DILOCO_INNER_DEFAULTS)
_NOLOCO = _local_fields(NoLoCo, NOLOCO_INNER_DEFAULTS)
_SPARSELOCO = _overlap_fields(SparseLoCo)


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig(_LocalConfig):
    """DiLoCo (:class:`lowband.optim.DiLoCo`) with an inner AdamW(lr, weight_decay), or Muon + AdamW (inner=muon)."""

    lr: float = _DILOCO["lr"]
    weight_decay: float = _DILOCO["weight_decay"]
    inner: str = _DILOCO["inner"]
    # Trainer's choice: H = 50 (DiLoCo's own default is the paper's 500, longer than most runs here).
    sync_every: int = option(50, "inner steps H between outer steps", alias="H", minimum=1)
    outer_lr: float = option(_signature_default(DiLoCo, "outer_lr"), "outer learning rate", minimum=0.0,
                         exclusive=True)
    outer_momentum: float = option(_signature_default(DiLoCo, "outer_momentum"), "outer momentum", minimum=0.0,
                               below_one=True)
    nesterov: bool = option(_signature_default(DiLoCo, "nesterov"), "Nesterov outer momentum (true/false)")
    # Trainer's choice: clip the inner gradient at 1.0 as NoLoCo does (DiLoCo's own default: no clipping).
    max_grad_norm: float | None = option(1.0, "clip the inner gradient's norm to this (none: no clipping)",
                                     alias="clip", minimum=0.0, exclusive=True)
    values: str = _DILOCO["values"]
    quant_block: int = _DILOCO["quant_block"]
    overlap: bool = _DILOCO["overlap"]
    delay: int = _DILOCO["delay"]
    aggregate: str = _DILOCO["aggregate"]

    def build(self, params, *, link, model=None):
        inner, kw = self._optimizer_kwargs(model)
        return DiLoCo(params, inner, link=link, **kw)


@dataclass(frozen=True, kw_only=True)
class NoLoCoConfig(_LocalConfig):
    """NoLoCo (:class:`lowband.optim.NoLoCo`) with an inner AdamW(lr, weight_decay) (Adam at weight_decay 0).

    inner=muon: Muon + AdamW (:class:`lowband.optim.muon.MuonAdamW`).
    """

    lr: float = _NOLOCO["lr"]
    weight_decay: float = _NOLOCO["weight_decay"]
    inner: str = _NOLOCO["inner"]
    sync_every: int = option(_signature_default(NoLoCo, "sync_every"), "inner steps H between outer steps", alias="H",
                         minimum=1)
    alpha: float = option(_signature_default(NoLoCo, "alpha"), "momentum alpha, in [0, 1)", minimum=0.0, below_one=True)
    beta: float = option(_signature_default(NoLoCo, "beta"), "weight beta of the mean pseudo-gradient, in [0, 1)",
                     minimum=0.0, below_one=True)
    gamma: float | None = option(_signature_default(NoLoCo, "gamma"), "weight of the pull towards the group's mean "
                             "(none: beta)", minimum=0.0)
    group_size: int = option(_signature_default(NoLoCo, "group_size"), "replicas n per gossip group", alias="n",
                         minimum=2)
    seed: int = option(_signature_default(NoLoCo, "seed"), "seed of the gossip group draws", flag="gossip-seed")
    timeout_s: float | None = option(_signature_default(NoLoCo, "timeout_s"), "seconds to wait for a peer (none: the "
                                 "link's timeout)", minimum=0.0, exclusive=True)
    max_grad_norm: float | None = option(_signature_default(NoLoCo, "max_grad_norm"), "clip the inner gradient's norm "
                                     "to this (none: no clipping)", alias="clip", minimum=0.0, exclusive=True)
    values: str = _NOLOCO["values"]
    quant_block: int = _NOLOCO["quant_block"]
    overlap: bool = _NOLOCO["overlap"]
    delay: int = _NOLOCO["delay"]
    aggregate: str = _NOLOCO["aggregate"]

    def build(self, params, *, link, model=None):
        inner, kw = self._optimizer_kwargs(model)
        return NoLoCo(params, inner, link=link, **kw)


@dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig(_LocalConfig):
    """SparseLoCo (:class:`lowband.optim.SparseLoCo`) with an inner AdamW(lr, weight_decay), or inner=muon."""

    lr: float = _lr(SPARSELOCO_INNER_DEFAULTS["lr"])
    weight_decay: float = option(SPARSELOCO_INNER_DEFAULTS["weight_decay"], "the inner optimizer's weight decay",
                                 minimum=0.0)
    inner: str = _inner_field()
    sync_every: int = option(_signature_default(SparseLoCo, "sync_every"), "inner steps H between outer steps",
                             alias="H", minimum=1)
    outer_lr: float = option(_signature_default(SparseLoCo, "outer_lr"), "outer learning rate alpha", minimum=0.0,
                             exclusive=True)
    decay: float = option(_signature_default(SparseLoCo, "decay"), "decay beta of the error-feedback accumulator, "
                          "in [0, 1)", minimum=0.0, below_one=True)
    topk: int = option(_signature_default(SparseLoCo, "topk"), "values kept per chunk (1..chunk)", minimum=1)
    chunk: int = option(_signature_default(SparseLoCo, "chunk"), "chunk size of the top-k selection", minimum=1)
    values: str = option(_signature_default(SparseLoCo, "values"), "wire format of the kept values",
                         choices=SPARSE_VALUE_FORMATS)
    transform: str = option(_signature_default(SparseLoCo, "transform"), "none: top-k of the flat chunks; dct: of "
                            "each chunk's DCT (as DeMo)", choices=SPARSELOCO_TRANSFORMS)
    quant_block: int = option(_signature_default(SparseLoCo, "quant_block"), "kept values per scale for 2bit/1bit",
                              minimum=1)
    # Trainer's choice: clip the inner gradient at 1.0 as DiLoCo's config does (SparseLoCo's own default: none).
    max_grad_norm: float | None = option(1.0, "clip the inner gradient's norm to this (none: no clipping)",
                                         alias="clip", minimum=0.0, exclusive=True)
    overlap: bool = _SPARSELOCO["overlap"]
    delay: int = _SPARSELOCO["delay"]
    aggregate: str = option("mean", _AGGREGATE_HELP + " (mean, clip, agree)", choices=("mean", "clip", "agree"))

    def check(self) -> None:
        if self.topk > self.chunk:
            raise ValueError(f"topk={self.topk} exceeds chunk={self.chunk}; topk must lie in 1..chunk")
        super().check()

    def build(self, params, *, link, model=None):
        inner, kw = self._optimizer_kwargs(model)
        return SparseLoCo(params, inner, link=link, **kw)


#: Defaults that ``lowband train`` sets differently from the optimizer class: (config, field) -> why.
TRAINER_DEFAULTS: dict[tuple[str, str], str] = {
    ("AdamWConfig", "weight_decay"): "0.0 as the paper's AdamW baseline; torch.optim.AdamW's is 0.01",
    ("DiLoCoConfig", "sync_every"): "50 for runs of hundreds of steps; DiLoCo's own is the paper's 500",
    ("DiLoCoConfig", "max_grad_norm"): "1.0 as NoLoCo; DiLoCo's own is None (no clipping)",
    ("SparseLoCoConfig", "max_grad_norm"): "1.0 as DiLoCo's config; SparseLoCo's own is None (no clipping)",
}


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """A training method.

    Every question about a method outside this module and :mod:`lowband.optim` asks one of these
    traits, never its name (``tests/train/test_methods.py`` checks that no name is compared).

    Args:
        name: the name on the command line.
        display: the name in reports, tables and plots (the papers' spelling: ``FlexDeMo``).
        description: one line for --help and reports.
        config: its hyper-parameters' config class (a :class:`MethodConfig`).
        reference: the method every other is compared with: the bench's quality target is its
            final loss, and its time to the target is the speed-ups' numerator (exactly one method).
        shard_sweep: the bench runs it at every ``--shards`` value (the rows of the FlexDeMo
            paper's Table 2).
        gossip: it exchanges with a random group of ``group_size`` replicas, not with every one
            (NoLoCo; its config has ``group_size``, which must not exceed the replicas).
        shards_per_node: "all" (shard a copy over all ranks of a node) or 1 (every rank a replica).
        family: "demo" for the decoupled-momentum family, "full" for full sync, "local" for
            DiLoCo/NoLoCo/SparseLoCo.
        ft_quorum: where fault tolerance forms its quorum with ``--ft-quorum async`` (with ``sync``
            every method forms it right before each step that communicates and waits for it):

            - "step": before each communicating step, in the background during its forward and
              backward pass (the methods that exchange every step);
            - "outer": right before the outer step, waited for (DiLoCo, SparseLoCo: their all-reduce or
              all-gather waits for every live node anyway);
            - "window": at the start of each outer window, in the background during its inner steps,
              waited for before the outer step (NoLoCo: its exchange waits for its group only, so
              the quorum must not hold every node to the slowest one's pace).
    """

    name: str
    display: str
    description: str
    config: type[MethodConfig]
    reference: bool = False
    shard_sweep: bool = False
    gossip: bool = False
    shards_per_node: int | str = "all"
    family: str = "demo"
    ft_quorum: str = "step"

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The defaults, by field name."""
        return self.config().as_dict()


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec(name="adamw", display="AdamW", family="full", reference=True, config=AdamWConfig,
                   description="AdamW, gradients all-reduced between nodes every step (HSDP-equivalent)"),
        MethodSpec(name="muon", display="Muon", family="full", config=MuonConfig,
                   description="Muon on the hidden weight matrices and AdamW on the rest, gradients all-reduced "
                   "between nodes every step: the full-sync reference for inner=muon"),
        MethodSpec(name="deto-full", display="Deto-Full", family="full", shard_sweep=True, config=DetoFullConfig,
                   description="sign-SGD on gradients all-reduced between nodes every step (the paper's Deto-Full)"),
        MethodSpec(name="flexdemo", display="FlexDeMo", family="demo", shard_sweep=True, config=FlexDeMoConfig,
                   description="FlexDeMo: copy sharded over a node's ranks; top-k DCT of the momentum between nodes"),
        MethodSpec(name="demo", display="DeMo", family="demo", shard_sweep=True, shards_per_node=1,
                   config=FlexDeMoConfig, description="DeMo: FlexDeMo with one shard (every rank a replica)"),
        MethodSpec(name="diloco", display="DiLoCo", family="local", ft_quorum="outer", config=DiLoCoConfig,
                   description="DiLoCo: H local AdamW steps, then an all-reduced Nesterov outer step"),
        MethodSpec(name="noloco", display="NoLoCo", family="local", ft_quorum="window", gossip=True,
                   config=NoLoCoConfig,
                   description="NoLoCo: H local Adam steps, then gossip averaging in random groups of n"),
        MethodSpec(name="sparseloco", display="SparseLoCo", family="local", ft_quorum="outer",
                   config=SparseLoCoConfig,
                   description="SparseLoCo: H local AdamW steps, then an all-gather of each replica's top-k of its "
                   "error feedback, 2-bit"),
    )
}  # fmt: skip


def reference_method() -> str:
    """The method every other is compared with (the one spec with ``reference=True``)."""
    (name,) = (m.name for m in METHODS.values() if m.reference)
    return name


def display_name(method: str) -> str:
    """The report name of ``method`` (an unknown name, e.g. from an old results file, as it is)."""
    spec = METHODS.get(method)
    return spec.display if spec is not None else method


def family_of(method: str) -> str | None:
    """The ``family`` of ``method``, or None for a name not in :data:`METHODS`."""
    spec = METHODS.get(method)
    return spec.family if spec is not None else None


def demo_method(shards: int) -> str:
    """The decoupled-momentum method of a copy in ``shards`` shards: one shard is DeMo, more FlexDeMo."""
    (name,) = (m.name for m in METHODS.values()
               if m.family == "demo" and (m.shards_per_node == 1) == (shards == 1))
    return name


def hp_fields(method: str) -> dict[str, dataclasses.Field]:
    """The config fields of ``method`` by name."""
    return {f.name: f for f in dataclasses.fields(_spec(method).config)}


#: Short spelling -> field name (spec keys, ``--hp`` keys, labels); from the fields' ``alias``.
ALIASES: dict[str, str] = {
    f.metadata["alias"]: f.name
    for m in METHODS.values() for f in dataclasses.fields(m.config) if f.metadata["alias"]
}  # fmt: skip


def hp_flag(name: str) -> str:
    """The ``lowband train`` flag of hyper-parameter ``name`` (``sync_every`` -> ``--sync-every``)."""
    flags = {f.metadata["flag"] for m in METHODS.values() for f in dataclasses.fields(m.config)
             if f.name == name and f.metadata["flag"]}
    return "--" + (flags.pop() if flags else name.replace("_", "-"))


def parse_hp_value(method: str, name: str, text: str) -> Any:
    """``text`` as the type of ``method``'s field ``name`` (bool: true/false; optional: none)."""
    base, optional = _types(_spec(method).config)[name]
    raw = text.strip()
    if optional and raw.lower() in ("none", "null"):
        return None
    if base is bool:
        try:
            return parse_bool(raw)
        except ValueError:
            raise ValueError(f"{name} is a yes/no setting; use true or false") from None
    if base in (int, float):
        try:
            return base(raw)
        except ValueError:
            raise ValueError(f"{name} must be {_TYPE_WORDS[base]}" + (" (or none)" if optional else "")) from None
    return raw


def _spec(method: str) -> MethodSpec:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[method]


def canonical_names(method: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` with aliases (H, n, clip) replaced by field names; unknown names are a ValueError."""
    fields = hp_fields(method)
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        name = ALIASES.get(key, key) if key not in fields else key
        if name not in fields:
            raise ValueError(
                f"method {method!r} has no hyper-parameter {key!r}; accepted: "
                + ", ".join(f + (f" ({fields[f].metadata['alias']})" if fields[f].metadata["alias"] else "")
                            for f in fields)
            )
        if name in out:
            raise ValueError(f"{name} is given twice (as {name} and its alias {fields[name].metadata['alias']})")
        out[name] = value
    return out


def method_config(method: str, overrides: Mapping[str, Any] | MethodConfig | None = None) -> MethodConfig:
    """``method``'s config with ``overrides`` (field names or aliases); bad names or values are a ValueError."""
    spec = _spec(method)
    if isinstance(overrides, MethodConfig):
        if not isinstance(overrides, spec.config):
            raise ValueError(f"method {method!r} takes a {spec.config.__name__}, got {type(overrides).__name__}")
        return overrides
    return spec.config(**canonical_names(method, overrides or {}))


def check_hyperparameters(method: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Every hyper-parameter of ``method`` by field name: its defaults with ``overrides`` (checked)."""
    return method_config(method, overrides).as_dict()


def method_shards(method: str, ranks_per_node: int, shards: int | None) -> int:
    """Shards per model copy for ``method`` (an explicit ``shards`` wins, but DeMo is always 1)."""
    spec = METHODS[method]
    if spec.shards_per_node == 1:
        if shards not in (None, 1):
            raise ValueError(f"method 'demo' uses one shard per copy (got shards={shards}); use flexdemo")
        return 1
    return ranks_per_node if shards is None else shards


def build_optimizer(method: str, named_params: Iterable, *, link: Link,
                    hp: Mapping[str, Any] | MethodConfig, model=None):
    """The optimizer for ``method`` with hyper-parameters ``hp`` (overrides, or a config)."""
    return method_config(method, hp).build(list(named_params), link=link, model=model)
