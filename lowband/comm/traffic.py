"""What crosses the link: one record per operation, one tally per step, and the ring model's byte counts.

Counts follow the ring algorithm (all-gather: (G−1)·b sent per rank; all-reduce: 2·(G−1)/G·n),
with each rank sending to the next rank of the group. Only a hop whose two ends are on different
nodes counts as inter-node: with DeMo on nodes of several ranks, the replicate group holds ranks of
the same node and their hops are free. :class:`lowband.comm.link.Link` fills these records; the trainer
and the bench read them. :class:`OpTally` is the one per-kind tally of operations: a step's
(:meth:`StepTraffic.by_kind`), a rank's run (the trainer's summary) and a whole run over all ranks
(the bench's run record) add up the same four numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "OpRecord",
    "OpTally",
    "StepTraffic",
    "exchange_inter_node_bytes",
    "merge_tallies",
    "nbytes",
    "ring_inter_node_bytes",
]


@dataclass(slots=True)
class OpRecord:
    """One operation through the link, as seen by this rank."""

    kind: str  # all_reduce | all_gather | exchange
    group_size: int
    payload_bytes: int  # this rank's input
    bytes_sent: int  # everything this rank sends (ring model), intra-node hops included
    bytes_recv: int
    inter_node_bytes_sent: int  # the part that crosses to another node
    inter_node_bytes_recv: int
    node_inter_node_bytes_sent: int  # all ranks of this node together (concurrent groups)
    messages: int  # sequential rounds
    time_s: float  # wall time from start to result, shaping included (hidden part included)
    modelled_link_time_s: float  # what the shaped link needs, queueing included (0 when not shaping)
    exposed_s: float = 0.0  # the part of it this rank spent blocked (starting it, waiting for it)


@dataclass(slots=True)
class OpTally:
    """Operations of one kind through the link, added up (over steps, over ranks).

    Attributes:
        count: operations.
        bytes: bytes sent (ring model, intra-node hops included).
        inter_node_bytes: the part of ``bytes`` that crossed to another node.
        largest_group: the largest group size among them (a maximum, not a sum).
    """

    count: int = 0
    bytes: int = 0
    inter_node_bytes: int = 0
    largest_group: int = 0

    def add_op(self, op: OpRecord) -> None:
        """Count one operation (as this rank saw it)."""
        self.count += 1
        self.bytes += op.bytes_sent
        self.inter_node_bytes += op.inter_node_bytes_sent
        self.largest_group = max(self.largest_group, op.group_size)

    def add(self, other: OpTally) -> None:
        """Add ``other``'s operations to these: counts and bytes sum, the largest group is the larger."""
        self.count += other.count
        self.bytes += other.bytes
        self.inter_node_bytes += other.inter_node_bytes
        self.largest_group = max(self.largest_group, other.largest_group)

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "bytes": self.bytes, "inter_node_bytes": self.inter_node_bytes,
                "largest_group": self.largest_group}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpTally:
        """The tally in ``data`` (:meth:`to_dict`'s keys, all four); another key or a missing one: ValueError."""
        names = {"count", "bytes", "inter_node_bytes", "largest_group"}
        if set(data) != names:
            raise ValueError(f"not an operation tally {sorted(names)}: {sorted(data)}")
        return cls(**{k: int(v) for k, v in data.items()})


def merge_tallies(into: dict[str, OpTally], more: Mapping[str, OpTally]) -> dict[str, OpTally]:
    """Add the per-kind tallies ``more`` into ``into`` (kinds new to it are copied); returns ``into``."""
    for kind, tally in more.items():
        into.setdefault(kind, OpTally()).add(tally)
    return into


@dataclass
class StepTraffic:
    """What crossed the link during one optimizer step on this rank."""

    step: int
    ops: list[OpRecord] = field(default_factory=list)
    #: Time this rank spent blocked in the link during the step (blocking calls, starts, waits),
    #: also for operations started in an earlier step: the communication not hidden behind compute.
    exposed_comm_time_s: float = 0.0

    @property
    def inter_node_bytes_sent(self) -> int:
        return sum(o.inter_node_bytes_sent for o in self.ops)

    @property
    def inter_node_bytes_recv(self) -> int:
        return sum(o.inter_node_bytes_recv for o in self.ops)

    @property
    def node_inter_node_bytes_sent(self) -> int:
        return sum(o.node_inter_node_bytes_sent for o in self.ops)

    @property
    def bytes_sent(self) -> int:
        return sum(o.bytes_sent for o in self.ops)

    @property
    def comm_time_s(self) -> float:
        return sum(o.time_s for o in self.ops)

    def by_kind(self) -> dict[str, OpTally]:
        """The step's operations tallied per kind, in the order the kinds first occurred."""
        out: dict[str, OpTally] = {}
        for o in self.ops:
            out.setdefault(o.kind, OpTally()).add_op(o)
        return out

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "inter_node_bytes_sent": self.inter_node_bytes_sent,
            "inter_node_bytes_recv": self.inter_node_bytes_recv,
            "node_inter_node_bytes_sent": self.node_inter_node_bytes_sent,
            "bytes_sent": self.bytes_sent,
            "comm_time_s": self.comm_time_s,
            "exposed_comm_time_s": self.exposed_comm_time_s,
            "ops": [asdict(o) for o in self.ops],
        }


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def ring_inter_node_bytes(ranks: Sequence[int], me_rank: int, node_of: Callable[[int], int], sent_per_rank: int,
                          shards: int) -> tuple[int, int, int]:
    """Inter-node bytes (sent, received) of ``me_rank`` and sent by its node, in a ring in the order of ``ranks``.

    Each rank sends ``sent_per_rank`` bytes to the next rank of the ring and receives as much from
    the previous one; a hop counts when its two ends are on different nodes (``node_of``). All ranks
    of a node run the same operation for their own shard at the same time (``shards`` concurrent
    groups), so the node's uplink carries the crossing hops of its members, ``shards`` times.
    """
    g = len(ranks)
    me = ranks.index(me_rank)
    nxt, prv = ranks[(me + 1) % g], ranks[(me - 1) % g]
    inter_sent = sent_per_rank if node_of(nxt) != node_of(me_rank) else 0
    inter_recv = sent_per_rank if node_of(prv) != node_of(me_rank) else 0
    my_node = node_of(me_rank)
    members_crossing = sum(
        1 for i, r in enumerate(ranks) if node_of(r) == my_node and node_of(ranks[(i + 1) % g]) != my_node
    )
    return inter_sent, inter_recv, members_crossing * sent_per_rank * shards


def exchange_inter_node_bytes(peers: Sequence[int], me_rank: int, node_of: Callable[[int], int], payload: int,
                              shards: int) -> tuple[int, int]:
    """Inter-node bytes (each way) of ``me_rank`` and sent by its node when it sends ``payload`` bytes to each peer.

    A peer on another node is one message across; the node's other shards run the same exchange
    at the same time and share the uplink.
    """
    me = node_of(me_rank)
    inter = sum(1 for p in peers if node_of(p) != me) * payload
    return inter, inter * shards
