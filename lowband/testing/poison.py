"""A poisoning member, on purpose: fault injection for tests and ``lowband bench --faults nodeN:poison@S``.

A node given ``--poison nodeN:KIND@STEP`` (every node of the job gets the same flag; the node whose
index is N acts on it) sends, from training step STEP on, updates that pass every check of
:mod:`lowband.compress.check` but are wrong:

- ``scale``: its update (DiLoCo's and SparseLoCo's pseudo-gradient, NoLoCo's whole message: φ and
  θ − φ, FlexDeMo's momentum components) times 1,000: finite, well-formed, huge;
- ``flip``: its update with the sign flipped: finite, of honest size, pointing the wrong way.

Against those two only robust aggregation (``aggregate=clip|trimmed|agree``, :mod:`lowband.optim.robust`)
helps: ``clip`` bounds the huge update, ``trimmed`` (dense) and ``agree`` leave the flipped one out. Two more kinds send what the message checks (:mod:`lowband.compress.check`) must refuse,
after the node's own check has passed (a lying sender; its own state stays honest):

- ``nan``: the values NaN, the flag clean (every method with an update of its own; in DiLoCo's and
  NoLoCo's all-reduce of fp32 values no check can name the sender: every replica drops the step);
- ``index``: every index of the message at the chunk size, one past the last valid one (the
  methods that send indices: FlexDeMo, DeMo, SparseLoCo).

Wrong sizes and bad flags are crafted directly in the message checks' tests
(``tests/compress/test_check.py``, ``tests/optim/test_trust.py``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["POISON_KINDS", "Poison", "arm_poison", "lying_message", "parse_poison"]

log = logging.getLogger(__name__)

POISON_KINDS = {"scale": 1000.0, "flip": -1.0, "nan": math.nan, "index": 1.0}
#: The kinds that make the message malformed after the sender's own check (the others change the update before).
MALFORMED = ("nan", "index")
_SAYS = {"scale": "1000x", "flip": "sign-flipped", "nan": "NaN (with a clean flag)",
         "index": "out-of-range indices in its"}
_SPEC = re.compile(r"node(\d+):(\w+)@(\d+)")


@dataclass(frozen=True)
class Poison:
    """Node ``node`` multiplies its outgoing update by ``factor`` from training step ``start`` on.

    An :class:`~lowband.optim.protocol.OutgoingHook`: installed as the optimizer's ``outgoing_hook``.
    """

    node: int
    kind: str
    start: int

    @property
    def factor(self) -> float:
        return POISON_KINDS[self.kind]

    def active(self, step: int) -> bool:
        return step >= self.start

    @property
    def malformed(self) -> bool:
        return self.kind in MALFORMED

    @torch.no_grad()
    def update_(self, tensors: Iterable[torch.Tensor], step: int) -> bool:
        """Multiply ``tensors`` (the update, before the sender's checks) in place by the factor if this step is
        poisoned (``scale``, ``flip``; the malformed kinds act on the message instead). True when it did."""
        if not self.active(step) or self.malformed:
            return False
        for t in tensors:
            t.mul_(self.factor)
        return True

    @torch.no_grad()
    def sparse(self, idx: torch.Tensor, vals: torch.Tensor, step: int, *, chunk: int,
                index_max: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sparse message's (indices, values) as the poisoning node sends them, after its own check passed:
        new tensors (the node keeps its honest ones), or the same when this step is not poisoned this way.
        ``index_max``: the largest index the wire format can carry (an index of ``chunk`` must fit)."""
        if not self.active(step) or not self.malformed:
            return idx, vals
        if self.kind == "nan":
            return idx, torch.full_like(vals, math.nan)
        if chunk > index_max:
            raise ValueError(f"--poison {self}: chunks of {chunk} fill the {index_max + 1} indices the wire "
                             "format carries, so no index can be out of range; use a smaller chunk")
        return torch.full_like(idx, chunk), vals

    @torch.no_grad()
    def corrupt_dense_(self, values: torch.Tensor, step: int) -> None:
        """A dense message's values after its flag was sealed clean: NaN in place for ``nan``."""
        if self.active(step) and self.kind == "nan":
            values.fill_(math.nan)

    def __str__(self) -> str:
        return f"node{self.node}:{self.kind}@{self.start}"


    def dense(self, message: torch.Tensor, lo: int, hi: int, *, step: int, numel: int, codec=None) -> torch.Tensor:
        return lying_message(self, message, lo, hi, step=step, numel=numel, codec=codec)


@torch.no_grad()
def lying_message(poison: Poison | None, message: torch.Tensor, lo: int, hi: int, *, step: int, numel: int,
                  codec=None) -> torch.Tensor:
    """What a lying node (``kind`` nan) sends instead of its sealed dense ``message`` (``numel`` values, then the
    flag; fp values, or the bytes of the lossy ``codec``): values ``lo:hi`` NaN, the flag left clean. A new
    tensor, so that the node's own state goes on from the honest message; ``message`` itself when this node
    does not lie at ``step`` (no poison, another kind, not yet, or a message its own check flagged)."""
    if poison is None or poison.kind != "nan" or not poison.active(step) or message[-1].item() > 0:
        return message
    sent = message.clone()
    if message.dtype != torch.uint8:  # fp values, then the flag
        poison.corrupt_dense_(sent[lo:hi], step)
    else:  # a lossy codec's bytes: the values re-encoded with NaN in them
        values = codec.decode(message[:-1], numel).clone()
        poison.corrupt_dense_(values[lo:hi], step)
        sent[:-1] = codec.encode(values)
    return sent


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
    the poison as its :attr:`outgoing_hook` (:class:`~lowband.optim.protocol.OutgoingHook`) and a warning is logged. Returns the poison armed here, or None.
    """
    text, method = cfg.run.poison, cfg.method.name
    if not text:
        return None
    node = ft.node if ft is not None else topology.node_of(rank)
    poison = parse_poison(text, nodes=ft.max_nodes if ft is not None else topology.num_nodes)
    if not hasattr(optimizer, "outgoing_hook"):
        raise ValueError(f"--poison {text}: {method} has no update of its own to poison (its gradients are "
                         "all-reduced); use flexdemo, demo, diloco, noloco or sparseloco")
    if poison.kind == "index" and not getattr(optimizer, "sends_indices", False):
        raise ValueError(f"--poison {text}: {method} sends no indices (its messages are dense); use flexdemo, demo "
                         "or sparseloco, or another kind (scale, flip, nan)")
    if node != poison.node:
        return None
    optimizer.outgoing_hook = poison
    log.warning("--poison %s: this node (%d) sends %s updates from step %d on (fault injection)", text, node,
                _SAYS[poison.kind], poison.start)
    return poison
