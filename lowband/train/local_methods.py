"""Optimizers of the local-update methods (DiLoCo, NoLoCo) from the method registry's hyper-parameters."""

from __future__ import annotations

import functools
from typing import Any

import torch

from lowband.link import Link

__all__ = ["build_local_optimizer", "outer_delay"]


def outer_delay(hp: dict[str, Any]) -> int:
    """τ of DiLoCo/NoLoCo from ``hp``: ``delay`` when it is > 0, else 1 with ``overlap=true``, else 0.

    Raises ValueError unless 0 <= τ < H (e.g. ``overlap=true`` with H = 1).
    """
    from lowband.optim.local_sgd import check_delay

    delay = hp.get("delay") or 0
    if isinstance(delay, float) and delay.is_integer():
        delay = int(delay)
    tau = delay if delay != 0 else (1 if hp.get("overlap") else 0)
    return check_delay(tau, int(hp["H"]))


def build_local_optimizer(method: str, params: list, *, link: Link, hp: dict[str, Any], model=None):
    """DiLoCo (inner AdamW) or NoLoCo (inner Adam with clipping) with ``hp`` from METHODS."""
    from lowband.optim import DiLoCo, NoLoCo

    clip = hp.get("clip")
    if method == "diloco":
        inner = functools.partial(torch.optim.AdamW, lr=hp["lr"], weight_decay=hp["weight_decay"])
        return DiLoCo(params, inner, link=link, sync_every=int(hp["H"]), outer_lr=hp["outer_lr"],
                      outer_momentum=hp["outer_momentum"], nesterov=bool(hp["nesterov"]), max_grad_norm=clip,
                      values=hp.get("values", "fp32"), delay=outer_delay(hp))
    if method == "noloco":
        inner = functools.partial(torch.optim.AdamW, lr=hp["lr"], weight_decay=hp["weight_decay"])
        return NoLoCo(params, inner, link=link, sync_every=int(hp["H"]), alpha=hp["alpha"], beta=hp["beta"],
                      gamma=hp["gamma"], group_size=int(hp["n"]), seed=int(hp.get("seed", 0)),
                      max_grad_norm=clip, values=hp.get("values", "fp32"), delay=outer_delay(hp))
    raise ValueError(f"{method!r} is not a local-update method (diloco, noloco)")
