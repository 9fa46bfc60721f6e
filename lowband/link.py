"""The one door for traffic between nodes.

Every byte an optimizer sends to another node goes through a :class:`Link`. The link

- runs the collective (all-reduce, all-gather, point-to-point exchange) on the replicate group
  (or on explicit peers), on the tensors' own device: gloo on CPU, NCCL on GPUs;
- counts, for this rank and per step, the bytes sent and received and each operation's kind and
  group size. Counts follow the ring algorithm (all-gather: (G−1)·b sent per rank; all-reduce:
  2·(G−1)/G·n), with each rank sending to the next rank of the group. Only a hop whose two ends are
  on different nodes counts as inter-node: with DeMo on nodes of several ranks, the replicate group
  holds ranks of the same node and their hops are free;
- can shape the traffic in-process when no real link limit is in place: the node's uplink carries
  ``bandwidth_bps`` shared by all ranks of the node, and each sequential message costs
  ``latency_s``. An operation then takes at least the time the link would take; the modelled time
  is reported separately from the measured one.

Counts are a model of the algorithm (the ring). Where real links exist (network namespaces, a real
cluster) the bench compares them with the interface's byte counters.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lowband.topology import Topology

__all__ = ["Link", "OpRecord", "PeerLostError", "PeerTimeoutError", "StepTraffic", "parse_bandwidth"]

log = logging.getLogger(__name__)

_UNITS = {"": 1, "bit": 1, "bps": 1, "k": 1e3, "kbit": 1e3, "m": 1e6, "mbit": 1e6, "mbps": 1e6,
          "g": 1e9, "gbit": 1e9, "gbps": 1e9}


def parse_bandwidth(text: str | float | int) -> float:
    """Parse '100mbit', '1gbit', '500Mbps', '2.5e8' into bits per second."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        s = text.strip().lower().replace(" ", "").removesuffix("/s")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        if unit not in _UNITS or not num:
            raise ValueError(
                f"cannot parse bandwidth {text!r}: use a number with a unit, e.g. 100mbit, 500mbit, "
                f"1gbit, 2.5gbit (units: {', '.join(u for u in _UNITS if u)}) or plain bits per second"
            )
        try:
            value = float(num) * _UNITS[unit]
        except ValueError as e:
            raise ValueError(f"cannot parse bandwidth {text!r}: {num!r} is not a number") from e
    if not value > 0:
        raise ValueError(f"bandwidth must be > 0 bit/s, got {text!r}")
    return value


class PeerTimeoutError(RuntimeError):
    """A peer did not answer within the link's timeout."""


class PeerLostError(RuntimeError):
    """A collective between nodes failed: a peer vanished or the link dropped."""


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
    time_s: float  # wall time of the operation, shaping included
    modelled_link_time_s: float  # what the shaped link needs (0 when not shaping)


@dataclass
class StepTraffic:
    """What crossed the link during one optimizer step on this rank."""

    step: int
    ops: list[OpRecord] = field(default_factory=list)

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

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for o in self.ops:
            d = out.setdefault(o.kind, {"count": 0, "bytes": 0, "inter_node_bytes": 0, "largest_group": 0})
            d["count"] += 1
            d["bytes"] += o.bytes_sent
            d["inter_node_bytes"] += o.inter_node_bytes_sent
            d["largest_group"] = max(d["largest_group"], o.group_size)
        return out

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "inter_node_bytes_sent": self.inter_node_bytes_sent,
            "inter_node_bytes_recv": self.inter_node_bytes_recv,
            "node_inter_node_bytes_sent": self.node_inter_node_bytes_sent,
            "bytes_sent": self.bytes_sent,
            "comm_time_s": self.comm_time_s,
            "ops": [asdict(o) for o in self.ops],
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Link:
    """Traffic between nodes for one rank: collectives, byte counts, optional shaping.

    Args:
        topology: the job's topology; the link uses its replicate group.
        bandwidth_bps: if set, shape traffic in-process: a node's uplink carries this many bit/s,
            shared by the node's ranks. None: no shaping (a real limit, or none, is in place).
        latency_s: per sequential message of an operation that crosses nodes. With
            ``bandwidth_bps`` it is part of the modelled link time; without (a real rate limit such
            as tbf, which has no delay) it is slept on top of the measured transfer.
        timeout_s: how long point-to-point exchanges wait for a peer before raising
            :class:`PeerTimeoutError`.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        bandwidth_bps: float | None = None,
        latency_s: float = 0.0,
        timeout_s: float = 300.0,
    ) -> None:
        if bandwidth_bps is not None and not bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.topology = topology
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self.timeout_s = timeout_s
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._group = topology.replicate_group() if self.distributed else None
        self._group_ranks = topology.replicate_group_ranks(self.rank)
        self._step = 0
        self._current = StepTraffic(step=0)
        self.history: list[StepTraffic] = []
        self.keep_history = True

    # ---------------------------------------------------------------- properties
    @property
    def group_size(self) -> int:
        return len(self._group_ranks)

    @property
    def group_ranks(self) -> list[int]:
        return list(self._group_ranks)

    @property
    def shaping(self) -> bool:
        return self.bandwidth_bps is not None

    @property
    def current(self) -> StepTraffic:
        return self._current

    def end_step(self) -> StepTraffic:
        """Close the traffic record of this step and start the next one."""
        done = self._current
        if self.keep_history:
            self.history.append(done)
        self._step += 1
        self._current = StepTraffic(step=self._step)
        return done

    # ---------------------------------------------------------------- accounting
    def _ring_record(self, sent_per_rank: int) -> tuple[int, int, int]:
        """Inter-node bytes (sent, received) for this rank and for its node, ring order = group order."""
        ranks = self._group_ranks
        g = len(ranks)
        me = ranks.index(self.rank)
        node = self.topology.node_of
        nxt, prv = ranks[(me + 1) % g], ranks[(me - 1) % g]
        inter_sent = sent_per_rank if node(nxt) != node(self.rank) else 0
        inter_recv = sent_per_rank if node(prv) != node(self.rank) else 0
        # All ranks of my node run the same operation for their own shard at the same time
        # (S concurrent replicate groups): the node's uplink carries all of it.
        my_node = node(self.rank)
        members_crossing = sum(
            1 for i, r in enumerate(ranks) if node(r) == my_node and node(ranks[(i + 1) % g]) != my_node
        )
        node_sent = members_crossing * sent_per_rank * self.topology.shards  # type: ignore[operator]
        return inter_sent, inter_recv, node_sent

    def _finish(self, rec_kwargs: dict, start: float) -> OpRecord:
        modelled = 0.0
        crosses = rec_kwargs["inter_node_bytes_sent"] > 0 or rec_kwargs["inter_node_bytes_recv"] > 0 or (
            rec_kwargs["node_inter_node_bytes_sent"] > 0)
        latency = self.latency_s * rec_kwargs["messages"] if crosses else 0.0
        if self.shaping:
            # The whole link is emulated: the operation takes at least what the link would take.
            modelled = rec_kwargs["node_inter_node_bytes_sent"] * 8.0 / self.bandwidth_bps + latency
            remaining = modelled - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)
        elif latency > 0:
            # A real (rate-limited) link without propagation delay: add the delay on top.
            modelled = latency
            time.sleep(latency)
        rec = OpRecord(**rec_kwargs, time_s=time.perf_counter() - start, modelled_link_time_s=modelled)
        self._current.ops.append(rec)
        return rec

    # ---------------------------------------------------------------- collectives
    @contextlib.contextmanager
    def _peers_guard(self, kind: str):
        """Turn a collective's transport error into one that names the group and the way out."""
        try:
            yield
        except RuntimeError as e:
            nodes = sorted({self.topology.node_of(r) for r in self._group_ranks} - {self.topology.node_of(self.rank)})
            raise PeerLostError(
                f"rank {self.rank}: {kind} over ranks {self._group_ranks} failed: a peer on node(s) {nodes} "
                "vanished or the link between nodes dropped. Restart the job; with checkpoints "
                f"(--ckpt-every), `--resume auto` continues from the last one. Underlying error: {e}"
            ) from e

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "avg") -> torch.Tensor:
        """In-place all-reduce (``avg``, ``sum`` or ``max``) of ``tensor`` over the replicate group."""
        if op not in ("avg", "sum", "max"):
            raise ValueError(f"op must be 'avg', 'sum' or 'max', got {op!r}")
        g = self.group_size
        start = time.perf_counter()
        payload = _nbytes(tensor)
        if g > 1:
            if op == "avg" and not tensor.is_floating_point():
                raise ValueError("avg all-reduce needs a floating-point tensor")
            if op == "avg" and dist.get_backend(self._group) == "gloo":
                # gloo lacks ReduceOp.AVG: sum, then divide.
                with self._peers_guard("all_reduce"):
                    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group)
                tensor.div_(g)
            else:
                rop = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
                with self._peers_guard("all_reduce"):
                    dist.all_reduce(tensor, op=rop, group=self._group)
        sent = (2 * (g - 1) * payload) // g if g > 1 else 0
        inter_sent, inter_recv, node_sent = self._ring_record(sent)
        self._finish(
            dict(kind="all_reduce", group_size=g, payload_bytes=payload, bytes_sent=sent, bytes_recv=sent,
                 inter_node_bytes_sent=inter_sent, inter_node_bytes_recv=inter_recv,
                 node_inter_node_bytes_sent=node_sent, messages=2 * (g - 1)),
            start,
        )
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather equal-sized ``tensor`` from every member: returns shape (G, *tensor.shape)."""
        g = self.group_size
        start = time.perf_counter()
        payload = _nbytes(tensor)
        if g > 1:
            out = torch.empty((g, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
            with self._peers_guard("all_gather"):
                dist.all_gather_into_tensor(out.view(-1), tensor.contiguous().view(-1), group=self._group)
        else:
            out = tensor.unsqueeze(0).clone()
        sent = (g - 1) * payload
        inter_sent, inter_recv, node_sent = self._ring_record(sent)
        self._finish(
            dict(kind="all_gather", group_size=g, payload_bytes=payload, bytes_sent=sent, bytes_recv=sent,
                 inter_node_bytes_sent=inter_sent, inter_node_bytes_recv=inter_recv,
                 node_inter_node_bytes_sent=node_sent, messages=g - 1),
            start,
        )
        return out

    def exchange(self, tensor: torch.Tensor, peers: Sequence[int]) -> list[torch.Tensor]:
        """Send ``tensor`` to every peer (global ranks) and receive theirs (same shape and dtype).

        Symmetric point-to-point (batch_isend_irecv); the group of the operation is the peers plus
        this rank. Raises :class:`PeerTimeoutError` naming the peers if they don't answer within
        ``timeout_s``.
        """
        peers = [int(p) for p in peers if int(p) != self.rank]
        start = time.perf_counter()
        payload = _nbytes(tensor)
        received = [torch.empty_like(tensor) for _ in peers]
        if peers:
            if not self.distributed:
                raise RuntimeError("exchange with peers needs an initialised process group")
            t = tensor.contiguous()
            # Receives first: gloo sends only once the receiver has announced its receive, and that
            # announcement queues behind data already going to the same peer. Sends first often
            # serialise the two directions (measured: twice the link time on emulated links).
            ops = [dist.P2POp(dist.irecv, buf, p) for p, buf in zip(peers, received, strict=True)]
            ops += [dist.P2POp(dist.isend, t, p) for p in peers]
            works = dist.batch_isend_irecv(ops)
            for w in works:
                try:
                    ok = w.wait(timeout=timedelta(seconds=self.timeout_s))
                except RuntimeError as e:
                    raise PeerTimeoutError(
                        f"rank {self.rank}: peer rank(s) {peers} did not answer within {self.timeout_s:g} s "
                        f"(node(s) {sorted({self.topology.node_of(p) for p in peers})}); the peer may have "
                        f"died or its link is down. Underlying error: {e}"
                    ) from e
                if ok is False:
                    raise PeerTimeoutError(
                        f"rank {self.rank}: peer rank(s) {peers} did not answer within {self.timeout_s:g} s"
                    )
        node = self.topology.node_of
        me = node(self.rank)
        crossing = [p for p in peers if node(p) != me]
        inter = len(crossing) * payload
        # Concurrent exchanges of the other shards of this node share the uplink.
        node_sent = inter * self.topology.shards  # type: ignore[operator]
        self._finish(
            dict(kind="exchange", group_size=len(peers) + 1, payload_bytes=payload,
                 bytes_sent=len(peers) * payload, bytes_recv=len(peers) * payload,
                 inter_node_bytes_sent=inter, inter_node_bytes_recv=inter,
                 node_inter_node_bytes_sent=node_sent, messages=1 if peers else 0),
            start,
        )
        return received
