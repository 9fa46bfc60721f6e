"""What the trainer asks of every lowband optimizer: one small protocol instead of attribute probes.

AdamW-HSDP, Deto-Full, FlexDeMo/DeMo and the outer-step methods (DiLoCo, NoLoCo, SparseLoCo) all
implement :class:`LowbandOptimizer`; a training loop of one's own needs only ``step()`` and, with
fault tolerance or an overlapped exchange, these few methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["LowbandOptimizer", "OptimizerStats", "OutgoingHook"]


@dataclass(frozen=True)
class OptimizerStats:
    """Counts an optimizer keeps over a run.

    Attributes:
        dropped_steps: steps whose exchange between nodes failed and were applied nowhere (fault
            tolerance; the outer-step methods count outer steps).
        skipped_steps: steps refused because a gradient (or pseudo-gradient) held NaN or Inf
            (``nonfinite='skip'``).
        outer_steps: outer steps taken (the outer-step methods), None for the others.
        bad_messages: received messages that failed their check (:mod:`lowband.compress.check`), by
            sender (its replica index in the exchange's group; −1: a sum that cannot be attributed).
        bad_in_a_row: per sender, how many of its last exchanges in a row were bad (0 not listed):
            a sender is evicted after :data:`lowband.optim._common.EVICT_AFTER`.
        clipped: per member, how many of its updates robust aggregation (``aggregate='clip'``, or
            ``'trimmed'`` with 2 members) scaled down to the members' median norm.
        left_out: per member, how many of its updates ``aggregate='agree'`` left out (pointing against
            most of the others').
        evicted: the senders evicted from the exchange over the run (:data:`lowband.optim._common.EVICT_AFTER`
            bad messages in a row; nothing they send is used until the membership changes), by their place then.
        aggregations: how many times robust aggregation (``aggregate`` other than ``'mean'``) decided:
            per step and bucket of parameters (FlexDeMo), per outer step (per group: NoLoCo); 0 under ``'mean'``.
    """

    dropped_steps: int = 0
    skipped_steps: int = 0
    outer_steps: int | None = None
    bad_messages: dict[int, int] = field(default_factory=dict)
    bad_in_a_row: dict[int, int] = field(default_factory=dict)
    clipped: dict[int, int] = field(default_factory=dict)
    left_out: dict[int, int] = field(default_factory=dict)
    evicted: list[int] = field(default_factory=list)
    aggregations: int = 0

    def screened(self) -> dict[str, Any]:
        """What the exchange refused or weakened, as plain data (member indices as strings, as JSON keys are).

        ``{"bad_messages", "clipped", "left_out": {member: count}, "evicted": [member, ...], "aggregations": n}``
        (clipped and left out are out of the ``aggregations``); all empty when every message passed and no
        robust rule acted.
        """
        def by_member(counts: dict[int, int]) -> dict[str, int]:
            return {str(k): int(v) for k, v in sorted(counts.items()) if v}

        return {"bad_messages": by_member(self.bad_messages), "clipped": by_member(self.clipped),
                "left_out": by_member(self.left_out), "evicted": sorted(int(m) for m in self.evicted),
                "aggregations": int(self.aggregations)}


@runtime_checkable
class LowbandOptimizer(Protocol):
    def communicates_next(self) -> bool:
        """Whether the next ``step()`` exchanges between nodes (fault tolerance forms a quorum first)."""

    def reset_replica_state(self) -> None:
        """After this replica copied a live peer's state: reset what is this replica's own (the method's rule)."""

    def flush(self) -> None:
        """Apply an exchange still in flight (an overlapped step); nothing to do otherwise."""

    def stats(self) -> OptimizerStats:
        """The run's counts so far."""

    def state_owners(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose ``state`` a joining replica copies: this one, and its inner optimizer if any."""


class OutgoingHook(Protocol):
    """What may change a node's outgoing message, installed from outside as ``optimizer.outgoing_hook``.

    The optimizers call it where a message leaves and know nothing of what it does; fault injection
    (:mod:`lowband.testing.poison`: a poisoning member on purpose) is the one user. Each method changes
    only what is sent: the node's own state goes on from the honest message.
    """

    def update_(self, tensors: list[torch.Tensor], step: int) -> bool:
        """Change the update in place before the sender's own checks; True when it changed it."""

    def sparse(self, idx: torch.Tensor, vals: torch.Tensor, step: int, *, chunk: int,
               index_max: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sparse message's (indices, values) as sent, after the sender's check: new tensors, or the same ones."""

    def dense(self, message: torch.Tensor, lo: int, hi: int, *, step: int, numel: int,
              codec: Any = None) -> torch.Tensor:
        """A sealed dense message (values, then the flag) as sent: a new tensor, or ``message`` itself."""
