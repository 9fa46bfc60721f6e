"""A poisoning member, on purpose: fault injection for tests and ``lowband bench --faults nodeN:poison@S``.

A node given ``--poison nodeN:KIND@STEP`` (every node of the job gets the same flag; the node whose
index is N acts on it) sends, from training step STEP on, updates that pass every check of
:mod:`lowband.compress.check` but are wrong:

- ``scale``: its update (DiLoCo's and SparseLoCo's pseudo-gradient, NoLoCo's θ − φ, FlexDeMo's
  momentum components) times 1,000: finite, well-formed, huge;
- ``flip``: its update with the sign flipped: finite, of honest size, pointing the wrong way.

Malformed messages (NaN with a clean flag, indices out of range, wrong sizes, bad flags) are what the
message checks refuse; their tests craft such messages directly (``tests/compress/test_check.py``,
``tests/optim/test_trust.py``). This injector is for what passes them, against which only
robust aggregation (``aggregate=clip|trimmed``, :mod:`lowband.optim.robust`) helps.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["POISON_KINDS", "Poison", "arm_poison", "parse_poison"]

log = logging.getLogger(__name__)

POISON_KINDS = {"scale": 1000.0, "flip": -1.0}
_SPEC = re.compile(r"node(\d+):(\w+)@(\d+)")


@dataclass(frozen=True)
class Poison:
    """Node ``node`` multiplies its outgoing update by ``factor`` from training step ``start`` on."""

    node: int
    kind: str
    start: int

    @property
    def factor(self) -> float:
        return POISON_KINDS[self.kind]

    def active(self, step: int) -> bool:
        return step >= self.start

    @torch.no_grad()
    def apply_(self, tensors: Iterable[torch.Tensor], step: int) -> None:
        """Multiply ``tensors`` in place by the factor if this step is poisoned."""
        if self.active(step):
            for t in tensors:
                t.mul_(self.factor)

    def __str__(self) -> str:
        return f"node{self.node}:{self.kind}@{self.start}"


def parse_poison(text: str, *, nodes: int | None = None) -> Poison:
    """``nodeN:KIND@STEP`` -> :class:`Poison`; a ValueError that shows the form otherwise."""
    m = _SPEC.fullmatch(text.strip())
    if m is None or m.group(2) not in POISON_KINDS:
        raise ValueError(f"--poison: cannot read {text!r}; write node<N>:<kind>@<step> with kind one of "
                         f"{', '.join(POISON_KINDS)}, e.g. 'node1:scale@30'")
    node, kind, start = int(m.group(1)), m.group(2), int(m.group(3))
    if nodes is not None and not 0 <= node < nodes:
        raise ValueError(f"--poison: node {node} does not exist; this job has nodes 0..{nodes - 1}")
    return Poison(node, kind, start)


def arm_poison(optimizer, cfg, *, ft=None, topology=None, rank: int = 0) -> Poison | None:
    """``--poison`` of the run config ``cfg`` (a :class:`~lowband.train.config.TrainConfig`) on this node.

    Nothing without the flag. Every node checks it (a clear error before the first step); on the node
    it names (its fault-tolerant slot ``ft.node``, else ``topology.node_of(rank)``) the optimizer gets
    :attr:`poison` set and a warning is logged. Returns the poison armed here, or None.
    """
    text, method = cfg.run.poison, cfg.method.name
    if not text:
        return None
    node = ft.node if ft is not None else topology.node_of(rank)
    poison = parse_poison(text, nodes=ft.max_nodes if ft is not None else topology.num_nodes)
    if not hasattr(optimizer, "poison"):
        raise ValueError(f"--poison {text}: {method} has no update of its own to poison (its gradients are "
                         "all-reduced); use flexdemo, demo, diloco, noloco or sparseloco")
    if node != poison.node:
        return None
    optimizer.poison = poison
    log.warning("--poison %s: this node (%d) sends %s updates from step %d on (fault injection)", text, node,
                "1000x" if poison.kind == "scale" else "sign-flipped", poison.start)
    return poison
