"""Optimizers of the local-update methods (DiLoCo, NoLoCo) from the method registry's hyper-parameters."""

from __future__ import annotations

import functools
from typing import Any

import torch

from lowband.link import Link

__all__ = ["build_local_optimizer"]


def build_local_optimizer(method: str, params: list, *, link: Link, hp: dict[str, Any], model=None):
    """DiLoCo (inner AdamW) or NoLoCo (inner Adam with clipping) with ``hp`` from METHODS."""
    from lowband.optim import DiLoCo, NoLoCo

    clip = hp.get("clip")
    if method == "diloco":
        inner = functools.partial(torch.optim.AdamW, lr=hp["lr"], weight_decay=hp["weight_decay"])
        return DiLoCo(params, inner, link=link, sync_every=int(hp["H"]), outer_lr=hp["outer_lr"],
                      outer_momentum=hp["outer_momentum"], nesterov=bool(hp["nesterov"]), max_grad_norm=clip,
                      values=hp.get("values", "fp32"))
    if method == "noloco":
        inner = functools.partial(torch.optim.AdamW, lr=hp["lr"], weight_decay=hp["weight_decay"])
        return NoLoCo(params, inner, link=link, sync_every=int(hp["H"]), alpha=hp["alpha"], beta=hp["beta"],
                      gamma=hp["gamma"], group_size=int(hp["n"]), seed=int(hp.get("seed", 0)),
                      max_grad_norm=clip, values=hp.get("values", "fp32"))
    raise ValueError(f"{method!r} is not a local-update method (diloco, noloco)")
