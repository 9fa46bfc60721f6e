"""Fault plans for ``lowband bench --faults``: which node is killed or started, and when.

Syntax: events separated by commas, each ``node<I>:<action>@<when>``:

- ``action``: ``kill`` (SIGKILL to every process of the node: its torchrun and all its ranks, as a
  machine that dies), ``start`` (start the node again; it rejoins and heals from a live peer), or a
  fault of malice: ``poison`` (from that step on the node sends its updates times 1,000: finite,
  well-formed, huge), ``poison-flip`` (sign-flipped), ``poison-nan`` (NaN values with a clean flag)
  or ``poison-index`` (indices out of range; FlexDeMo, DeMo, SparseLoCo), through ``lowband train --poison``
  (:mod:`lowband.testing.poison`; at a step only, one per plan; not for AdamW and Deto-Full, whose gradients
  are all-reduced); or ``intrude`` (a process with the job's command line but not its secret starts
  in node I's slot, as an outsider on the job's network would: it must be refused before any process
  group includes it, and the job drops no step; the run fails if it is admitted. The bench gives every
  fault-tolerant run a job secret of its own, :mod:`lowband.trust.secret`);
- ``when``: a training step of the job (``@60``: once a live node has finished step 60) or a time
  since the run started (``@45s``, ``@1.5m``).

Example: ``--faults "node1:kill@30,node1:start@60"``. Events run in the order given; a node must
be alive to be killed and dead to be started, and at least one node stays alive. An intruder takes
any slot, a live node's (a copy of that node without the secret) or a dead one's (the slot is free).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lowband.units import split_list

__all__ = ["POISON_ACTIONS", "FaultEvent", "format_faults", "parse_faults", "poison_of"]

_EVENT = re.compile(r"node(\d+):(kill|start|intrude|poison|poison-flip|poison-nan|poison-index)@(\d+(?:\.\d+)?)(s|m)?")
#: --faults' poison actions -> lowband.testing.poison's kinds.
POISON_ACTIONS = {"poison": "scale", "poison-flip": "flip", "poison-nan": "nan", "poison-index": "index"}


@dataclass(frozen=True, kw_only=True)
class FaultEvent:
    """One planned fault: ``action`` on ``node`` at ``step`` (job steps) or ``at_s`` (seconds after the start)."""

    node: int
    action: str  # kill | start | intrude | poison[-flip|-nan|-index]
    step: int | None = None
    at_s: float | None = None

    def __str__(self) -> str:
        when = f"{self.step}" if self.step is not None else f"{self.at_s:g}s"
        return f"node{self.node}:{self.action}@{when}"

    @property
    def poison(self) -> str | None:
        """``lowband train --poison``'s value for a poison event, else None."""
        kind = POISON_ACTIONS.get(self.action)
        return None if kind is None else f"node{self.node}:{kind}@{self.step}"

    def as_dict(self) -> dict:
        return {"node": self.node, "action": self.action, "step": self.step, "at_s": self.at_s}


def parse_faults(text: str, *, nodes: int, steps: int | None = None) -> tuple[FaultEvent, ...]:
    """Parse and check a fault plan against ``nodes`` nodes (and ``steps`` training steps).

    Raises:
        ValueError: naming the bad event and what is accepted.
    """
    events: list[FaultEvent] = []
    alive = set(range(nodes))
    last_step = -1
    for raw in split_list(text):
        m = _EVENT.fullmatch(raw.lower())
        if m is None:
            raise ValueError(f"--faults: cannot read {raw!r}; write node<I>:kill@<step>, node<I>:start@<step> or "
                             "node<I>:intrude@<step> (or @<seconds>s), or node<I>:poison@<step> (or poison-flip, "
                             "poison-nan, poison-index), separated by commas, e.g. 'node1:kill@30,node1:start@60'")
        node, action, value, unit = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if not 0 <= node < nodes:
            raise ValueError(f"--faults: {raw!r} names node {node}, but the bench has nodes 0..{nodes - 1}")
        if unit is None:
            if "." in value:
                raise ValueError(f"--faults: {raw!r}: a step is a whole number (or give seconds: @{value}s)")
            event = FaultEvent(node=node, action=action, step=int(value))
            if steps is not None and event.step >= steps:
                raise ValueError(f"--faults: {raw!r} is at step {event.step}, but runs have {steps} steps; "
                                 "put it before the last step")
            if event.step < last_step:
                raise ValueError(f"--faults: {raw!r} comes before the step of the event ahead of it; "
                                 "list events in the order they happen")
            last_step = event.step
        else:
            event = FaultEvent(node=node, action=action, at_s=float(value) * (60.0 if unit == "m" else 1.0))
        if action in POISON_ACTIONS:
            if event.step is None:
                raise ValueError(f"--faults: {raw!r}: a node poisons from a step on; give a step (@30), not a time")
            if any(e.action in POISON_ACTIONS for e in events):
                raise ValueError(f"--faults: {raw!r} is a second poison event; a plan holds at most one")
        elif action == "intrude":
            pass  # any slot, live or free: the node's own state does not change
        elif action == "kill":
            if node not in alive:
                raise ValueError(f"--faults: {raw!r} kills node {node}, which is not running then; start it first")
            if len(alive) == 1:
                raise ValueError(f"--faults: {raw!r} would kill the last live node; keep one node alive")
            alive.discard(node)
        else:
            if node in alive:
                raise ValueError(f"--faults: {raw!r} starts node {node}, which is running then; kill it first")
            alive.add(node)
        events.append(event)
    if not events:
        raise ValueError("--faults: no event given; e.g. --faults 'node1:kill@30,node1:start@60'")
    return tuple(events)


def poison_of(events: tuple[FaultEvent, ...]) -> str | None:
    """The plan's ``--poison`` value for ``lowband train`` (at most one poison event), or None."""
    return next((e.poison for e in events if e.poison is not None), None)


def format_faults(events: tuple[FaultEvent, ...]) -> str:
    return ",".join(str(e) for e in events)
