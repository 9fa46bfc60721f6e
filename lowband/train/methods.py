"""The training methods by name, their hyper-parameters, and how each builds its optimizer.

One registry serves ``lowband train``, ``lowband bench`` (validation before any process starts)
and the docs. Every method runs through the same pipeline: FSDP2 inside a node, the link between
nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lowband.link import Link

__all__ = ["METHODS", "MethodSpec", "build_optimizer", "method_shards", "check_hyperparameters"]


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """A training method.

    Args:
        name: the name on the command line.
        description: one line for --help and reports.
        hyperparameters: accepted hyper-parameters with their defaults.
        shards_per_node: "all" (shard a copy over all ranks of a node) or 1 (every rank a replica).
        family: "demo" for the decoupled-momentum family, "full" for full sync, "local" for
            DiLoCo/NoLoCo.
    """

    name: str
    description: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    shards_per_node: int | str = "all"
    family: str = "demo"


_DEMO_HP = dict(lr=1e-3, topk=1, chunk=128, decay=0.999, sign=True, weight_decay=0.0, values="bf16", overlap=False)
_LOCAL_HP = dict(lr=4e-4, weight_decay=0.1, H=50, clip=1.0, overlap=False, delay=0)

METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec(
            name="adamw",
            family="full",
            description="AdamW, gradients all-reduced between nodes every step (HSDP-equivalent)",
            hyperparameters=dict(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8),
        ),
        MethodSpec(
            name="deto-full",
            family="full",
            description="sign-SGD on gradients all-reduced between nodes every step (the paper's Deto-Full)",
            hyperparameters=dict(lr=1e-3, sign=True, weight_decay=0.0),
        ),
        MethodSpec(
            name="flexdemo",
            family="demo",
            description="FlexDeMo: copy sharded over a node's ranks; top-k DCT of the momentum between nodes",
            hyperparameters=dict(_DEMO_HP),
        ),
        MethodSpec(
            name="demo",
            family="demo",
            shards_per_node=1,
            description="DeMo: FlexDeMo with one shard (every rank a replica)",
            hyperparameters=dict(_DEMO_HP),
        ),
        MethodSpec(
            name="diloco",
            family="local",
            description="DiLoCo: H local AdamW steps, then an all-reduced Nesterov outer step",
            hyperparameters=dict(_LOCAL_HP, outer_lr=0.7, outer_momentum=0.9, nesterov=True, values="fp32"),
        ),
        MethodSpec(
            name="noloco",
            family="local",
            description="NoLoCo: H local Adam steps, then gossip averaging in random groups of n",
            hyperparameters=dict(_LOCAL_HP, weight_decay=0.0, n=2, alpha=0.5, beta=0.7, gamma=None, seed=0,
                                 values="fp32"),
        ),
    )
}


def check_hyperparameters(method: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge overrides into the method's defaults; unknown names or methods are a ValueError."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    spec = METHODS[method]
    unknown = sorted(set(overrides) - set(spec.hyperparameters))
    if unknown:
        raise ValueError(
            f"method {method!r} has no hyper-parameter {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(spec.hyperparameters)}"
        )
    hp = dict(spec.hyperparameters)
    hp.update(overrides)
    return hp


def method_shards(method: str, ranks_per_node: int, shards: int | None) -> int:
    """Shards per model copy for ``method`` (an explicit ``shards`` wins, but DeMo is always 1)."""
    spec = METHODS[method]
    if spec.shards_per_node == 1:
        if shards not in (None, 1):
            raise ValueError(f"method 'demo' uses one shard per copy (got shards={shards}); use flexdemo")
        return 1
    return ranks_per_node if shards is None else shards


def build_optimizer(method: str, named_params: Iterable, *, link: Link, hp: dict[str, Any], model=None):
    """The optimizer for ``method`` with hyper-parameters ``hp`` (see :func:`check_hyperparameters`)."""
    hp = check_hyperparameters(method, hp)
    params = list(named_params)
    if method == "adamw":
        from lowband.optim import AdamWFullSync

        return AdamWFullSync(
            params,
            lr=hp["lr"],
            link=link,
            weight_decay=hp["weight_decay"],
            betas=(hp["beta1"], hp["beta2"]),
            eps=hp["eps"],
        )
    if method == "deto-full":
        from lowband.optim import DetoFull

        return DetoFull(params, lr=hp["lr"], sign=hp["sign"], weight_decay=hp["weight_decay"], link=link)
    if method in ("flexdemo", "demo"):
        from lowband.optim import FlexDeMo

        return FlexDeMo(
            params,
            lr=hp["lr"],
            topk=int(hp["topk"]),
            chunk=int(hp["chunk"]),
            decay=hp["decay"],
            sign=bool(hp["sign"]),
            weight_decay=hp["weight_decay"],
            values=hp["values"],
            link=link,
            overlap=bool(hp["overlap"]),
        )
    from lowband.train.local_methods import build_local_optimizer

    return build_local_optimizer(method, params, link=link, hp=hp, model=model)
