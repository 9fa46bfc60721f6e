"""The one door for traffic between nodes.

Every byte an optimizer sends to another node goes through a :class:`Link`. The link

- runs the collective (all-reduce, all-gather, point-to-point exchange) on the replicate group
  (or on explicit peers), on the tensors' own device: gloo on CPU, NCCL on GPUs;
- counts, for this rank and per step, the bytes sent and received and each operation's kind and
  group size (:mod:`lowband.comm.traffic`: the records and the ring model's counts). Counts follow the
  ring algorithm, with each rank sending to the next rank of the group; only a hop whose two ends
  are on different nodes counts as inter-node;
- can shape the traffic in-process when no real link limit is in place (:mod:`lowband.comm.shaping`):
  the node's uplink carries ``bandwidth_bps`` shared by all ranks of the node, and each sequential
  message costs ``latency_s``. An operation then takes at least the time the link would take; the
  modelled time is reported separately from the measured one;
- runs every operation blocking or, with ``async_op=True``, in the background: the call returns a
  :class:`LinkHandle` to ``wait()`` on later, with the same byte accounting. In shaped mode the
  uplink is a resource with its own clock, so operations in flight together queue on it. Each
  step's record says how long the rank was blocked in the link (``exposed_comm_time_s``): the
  communication that computation did not hide.

Counts are a model of the algorithm (the ring). Where real links exist (network namespaces, a real
cluster) the bench compares them with the interface's byte counters.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions

from lowband.comm.shaping import UplinkClock
from lowband.comm.tags import TAG_BYTES, MessageTags
from lowband.comm.traffic import (
    OpRecord,
    StepTraffic,
    exchange_inter_node_bytes,
    nbytes,
    ring_inter_node_bytes,
)
from lowband.distributed.topology import Topology

__all__ = ["Link", "LinkHandle", "OpRecord", "PeerLostError", "PeerTimeoutError", "StepTraffic"]

log = logging.getLogger(__name__)

class PeerTimeoutError(RuntimeError):
    """A peer did not answer within the link's timeout."""


class PeerLostError(RuntimeError):
    """A collective between nodes failed: a peer vanished or the link dropped."""


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
        ft: fault tolerance (:class:`lowband.ft.node.FaultTolerance`): the replicate group is then the
            live nodes of the current quorum, reached through torchft's reconfigurable process group;
            a failed collective is reported to it instead of raised (its result is zeros), and
            :meth:`commit` is the node's vote on whether the step may be applied.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        bandwidth_bps: float | None = None,
        latency_s: float = 0.0,
        timeout_s: float = 300.0,
        ft=None,
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
        self.ft = ft
        if ft is not None and topology.replicas != 1:
            raise ValueError(
                f"fault tolerance runs one torchrun per node, each node one model copy; this node holds "
                f"{topology.replicas} copies ({topology.describe()}). Shard over all ranks of the node "
                "(DeMo under fault tolerance: one rank per node)."
            )
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._group = topology.replicate_group() if self.distributed and ft is None else None
        self._group_ranks = topology.replicate_group_ranks(self.rank)
        self._step = 0
        self._current = StepTraffic(step=0)
        self.history: list[StepTraffic] = []
        self.keep_history = True
        self._uplink = UplinkClock()  # the shaped uplink's clock
        self._in_flight: list[LinkHandle] = []
        self.counted: int | None = None  # with fault tolerance: members whose values the last mean counted
        secret = getattr(getattr(ft, "cfg", None), "secret", None)
        # With the job's secret, what a node gathers or exchanges is tagged (lowband.comm.tags): a message put on the
        # wire in a member's place by someone else is then told apart, and never counted against the member.
        self.tags = MessageTags(secret) if ft is not None and secret else None

    # ---------------------------------------------------------------- properties
    @property
    def group_size(self) -> int:
        """Replicas in this rank's replicate group (with fault tolerance: the live nodes of the quorum)."""
        if self.ft is not None:
            return max(self.ft.members, 1)
        return len(self._group_ranks)

    @property
    def group_ranks(self) -> list[int]:
        """The members of the replicate group: global ranks; with fault tolerance the quorum's replica
        ranks 0 .. group_size − 1 (the same order on every node)."""
        if self.ft is not None:
            return list(range(self.group_size))
        return list(self._group_ranks)

    @property
    def group_rank(self) -> int:
        """This rank's index in its replicate group, 0 ≤ group_rank < group_size: ``group_ranks[group_rank]``
        is this rank. With fault tolerance its node's place in the current quorum (0 while alone)."""
        if self.ft is not None:
            return self.ft.member_rank if self.group_size > 1 else 0
        return self._group_ranks.index(self.rank)

    @property
    def participants(self) -> int:
        """Members whose contribution counts this step: ``group_size``, less a node that heals during the
        step under fault tolerance's async quorum (it takes part in the collectives with nothing that
        counts). The divisor of a mean over replicas."""
        if self.ft is not None and self.group_size > 1:
            return max(self.ft.participants, 1)
        return self.group_size

    @property
    def participating(self) -> bool:
        """Whether this rank's contribution counts this step (False only on a node healing under the async
        quorum: :meth:`all_reduce` then sends zeros; an optimizer that all-gathers marks its message)."""
        return self.ft is None or self.group_size == 1 or self.ft.participating

    @property
    def max_group_size(self) -> int:
        """The most replicas the replicate group can hold: ``group_size``; with fault tolerance the node
        slots (``--ft-max-nodes``), since the live nodes change from quorum to quorum."""
        if self.ft is not None:
            return int(self.ft.cfg.max_nodes)
        return len(self._group_ranks)

    def commit(self) -> bool:
        """May this step's exchanges be applied? Optimizers ask once per communicating step, before
        they change any state. Without fault tolerance always True (a failed collective raises);
        with it, the node's vote: False when any collective of any rank of the node failed this step
        (then every rank of the node drops the step)."""
        if self.ft is None:
            return True
        return self.ft.commit()

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
        if self.ft is not None:  # members of a quorum are nodes: every hop crosses
            return ring_inter_node_bytes(self.group_ranks, self.group_rank, lambda r: r, sent_per_rank,
                                         self.topology.shards)  # type: ignore[arg-type]
        return ring_inter_node_bytes(self._group_ranks, self.rank, self.topology.node_of, sent_per_rank,
                                     self.topology.shards)  # type: ignore[arg-type]

    def _launch(self, rec_kwargs: dict, start: float, works: list, result, *, timeout_what: list[int] | None = None,
                async_op: bool) -> torch.Tensor | list[torch.Tensor] | LinkHandle:
        """Record the operation (in the step it starts in), place it on the link's clock, return a handle.

        Shaped mode: the node's uplink is one resource with its own clock (:class:`UplinkClock`),
        so operations in flight together queue on it, and a blocking call or a wait returns no
        earlier than the real link would deliver.
        """
        crosses = rec_kwargs["inter_node_bytes_sent"] > 0 or rec_kwargs["inter_node_bytes_recv"] > 0 or (
            rec_kwargs["node_inter_node_bytes_sent"] > 0)
        latency = self.latency_s * rec_kwargs["messages"] if crosses else 0.0
        ready_at = start
        modelled = 0.0
        if self.shaping:
            ready_at = self._uplink.schedule(start, rec_kwargs["node_inter_node_bytes_sent"], self.bandwidth_bps,
                                             latency)
            modelled = ready_at - start  # includes queueing behind operations still in flight
        elif latency > 0:
            # A real (rate-limited) link without propagation delay: the delay comes on top.
            modelled = latency
        rec = OpRecord(**rec_kwargs, time_s=0.0, modelled_link_time_s=modelled)
        self._current.ops.append(rec)
        handle = LinkHandle(self, rec, works, result, start=start, ready_at=ready_at,
                            extra_delay_s=0.0 if self.shaping else latency, timeout_peers=timeout_what)
        handle._exposed(time.perf_counter() - start)
        if async_op:
            self._in_flight.append(handle)
            return handle
        return handle.wait()

    @property
    def in_flight(self) -> int:
        """Operations started with ``async_op=True`` and not yet waited on."""
        return sum(1 for h in self._in_flight if not h.done)

    def drain(self) -> None:
        """Wait for every operation still in flight (before a checkpoint or the end of a run)."""
        for h in list(self._in_flight):
            h.wait()

    # ---------------------------------------------------------------- collectives
    @contextlib.contextmanager
    def _peers_guard(self, kind: str):
        """Turn a collective's transport error into one that names the group and the way out.

        With fault tolerance the error is reported to the Manager instead (the step will not commit)."""
        try:
            yield
        except RuntimeError as e:
            if self.ft is not None:
                log.warning("rank %d: %s between nodes failed (%s); this step will be dropped", self.rank, kind, e)
                self.ft.report_error(e)
                return
            nodes = sorted({self.topology.node_of(r) for r in self._group_ranks} - {self.topology.node_of(self.rank)})
            raise PeerLostError(
                f"rank {self.rank}: {kind} over ranks {self._group_ranks} failed: a peer on node(s) {nodes} "
                "vanished or the link between nodes dropped. Restart the job; with checkpoints "
                f"(--ckpt-every), `--resume auto` continues from the last one. Underlying error: {e}"
            ) from e

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "avg", async_op: bool = False):
        """In-place all-reduce (``avg``, ``sum`` or ``max``) of ``tensor`` over the replicate group.

        Returns ``tensor``; with ``async_op=True`` a :class:`LinkHandle` whose ``wait()`` returns it.
        """
        if op not in ("avg", "sum", "max"):
            raise ValueError(f"op must be 'avg', 'sum' or 'max', got {op!r}")
        g = self.group_size
        start = time.perf_counter()
        payload = nbytes(tensor)
        works: list = []
        result = tensor
        if g > 1 and self.ft is not None:
            if op == "avg" and not tensor.is_floating_point():
                raise ValueError("avg all-reduce needs a floating-point tensor")
            opts = AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
            counts = self.participating
            buf = tensor
            if op == "avg":
                # The divisor rides along (1 from each member whose values count): torchft counts a node whose
                # heal was refused as a participant, and it sends zeros, so its count would dilute the mean.
                buf = torch.cat([tensor.reshape(-1), tensor.new_ones(1)])
                payload = nbytes(buf)
            if not counts:  # healing this step, or its heal refused: its stale values must not count
                buf.zero_()
            if not self.ft.errored:  # after a failure the step is dropped: send nothing more
                with self._peers_guard("all_reduce"):
                    works.append(self.ft.pg.allreduce([buf], opts))
            if op == "avg":
                def result():
                    return self._counted_mean(tensor, buf, g)
        elif g > 1:
            if op == "avg" and not tensor.is_floating_point():
                raise ValueError("avg all-reduce needs a floating-point tensor")
            if op == "avg" and dist.get_backend(self._group) == "gloo":
                # gloo lacks ReduceOp.AVG: sum, then divide (when the result is taken).
                with self._peers_guard("all_reduce"):
                    works.append(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group, async_op=True))

                def result():
                    return tensor.div_(g)
            else:
                rop = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
                with self._peers_guard("all_reduce"):
                    works.append(dist.all_reduce(tensor, op=rop, group=self._group, async_op=True))
        sent = (2 * (g - 1) * payload) // g if g > 1 else 0
        inter_sent, inter_recv, node_sent = self._ring_record(sent)
        return self._launch(
            dict(kind="all_reduce", group_size=g, payload_bytes=payload, bytes_sent=sent, bytes_recv=sent,
                 inter_node_bytes_sent=inter_sent, inter_node_bytes_recv=inter_recv,
                 node_inter_node_bytes_sent=node_sent, messages=2 * (g - 1)),
            start, works, result, async_op=async_op,
        )

    def _counted_mean(self, tensor: torch.Tensor, summed: torch.Tensor, g: int) -> torch.Tensor:
        """``tensor`` ← the sum in ``summed`` (values, then the count of members whose values count) over that
        count, which :attr:`counted` keeps. A count that is no whole number of members (a sum someone else
        wrote into) gives NaN, which the caller's check of the mean drops."""
        if self.ft.errored:  # the step is dropped (its exchange failed): the sum is not all there
            self.counted = None
            return tensor
        n = float(summed[-1].item())
        k = round(n) if math.isfinite(n) else 0
        self.counted = k
        if abs(n - k) > 1e-3 or not 1 <= k <= g:
            log.warning("the all-reduce's count of contributing members is %r, not a whole number in 1..%d; its "
                        "mean is dropped", n, g)
            return tensor.fill_(float("nan"))
        return tensor.copy_(summed[:-1].view_as(tensor)).div_(k)

    def all_gather(self, tensor: torch.Tensor, *, async_op: bool = False):
        """Gather equal-sized ``tensor`` from every member: returns shape (G, *tensor.shape).

        With ``async_op=True`` a :class:`LinkHandle` whose ``wait()`` returns that tensor.
        """
        g = self.group_size
        start = time.perf_counter()
        payload = nbytes(tensor)
        works: list = []
        if g > 1 and self.ft is not None:
            send = tensor.contiguous() if self.tags is None else self.tags.seal(
                tensor, sender=self.group_rank, context=self._tag_context())
            payload = nbytes(send)
            out = sealed = torch.zeros((g, *send.shape), dtype=send.dtype, device=send.device)
            if not self.ft.errored:
                with self._peers_guard("all_gather"):
                    works.append(self.ft.pg.allgather([list(sealed.unbind(0))], [send], AllgatherOptions()))
            if self.tags is not None:
                def out():
                    return self._opened(sealed, list(range(g)), tensor)
        elif g > 1:
            out = torch.empty((g, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
            with self._peers_guard("all_gather"):
                works.append(dist.all_gather_into_tensor(out.view(-1), tensor.contiguous().view(-1),
                                                         group=self._group, async_op=True))
        else:
            out = tensor.unsqueeze(0).clone()
        sent = (g - 1) * payload
        inter_sent, inter_recv, node_sent = self._ring_record(sent)
        return self._launch(
            dict(kind="all_gather", group_size=g, payload_bytes=payload, bytes_sent=sent, bytes_recv=sent,
                 inter_node_bytes_sent=inter_sent, inter_node_bytes_recv=inter_recv,
                 node_inter_node_bytes_sent=node_sent, messages=g - 1),
            start, works, out, async_op=async_op,
        )

    def _tag_context(self) -> tuple[int, int]:
        """What a message's tag binds it to, the same on every member: the current quorum's id (torchft's) and its
        step (the quorum's newest: a quorum id lasts as long as its members, so a message of an earlier step would
        pass again without it)."""
        quorum_id = int(getattr(getattr(self.ft, "manager", None), "_quorum_id", 0) or 0)
        return quorum_id, int(getattr(self.ft, "quorum_max_step", 0) or 0)

    def _opened(self, sealed: torch.Tensor, senders: list[int], like: torch.Tensor) -> torch.Tensor:
        """Tagged rows -> the messages; a row whose tag fails is someone else's in its sender's place (left out,
        marked not counted, counted against no one; :mod:`lowband.comm.tags`)."""
        if self.ft.errored:  # the step is dropped: what arrived is not all there, and nothing of it is used
            return sealed[:, :-TAG_BYTES].contiguous().view(like.dtype).reshape(len(senders), *like.shape)
        rows, forged = self.tags.open(sealed, senders=senders, context=self._tag_context(), like=like)
        for i in forged:
            log.warning("rank %d: a message in quorum member %d's place failed the job's tag: someone else put it on "
                        "the wire, not that member; it is left out and counted against no one", self.rank, senders[i])
        return rows

    def _received(self, received: list[torch.Tensor], peers: list[int], like: torch.Tensor) -> list[torch.Tensor]:
        """What arrived from ``peers`` (host buffers, tagged with the job's secret) as messages like ``like``, on its
        device."""
        if self.tags is not None and received:
            received = list(self._opened(torch.stack(received), list(peers), like).unbind(0))
        return [b.to(like.device) for b in received]

    def exchange(self, tensor: torch.Tensor, peers: Sequence[int], *, async_op: bool = False):
        """Send ``tensor`` to every peer (global ranks) and receive theirs (same shape and dtype).

        Symmetric point-to-point (batch_isend_irecv); the group of the operation is the peers plus
        this rank. Raises :class:`PeerTimeoutError` naming the peers if they don't answer within
        ``timeout_s`` (on ``wait()`` when ``async_op=True``; the handle's result is the list).

        With fault tolerance ``peers`` are replica ranks of the current quorum (``group_ranks``,
        0 .. group_size − 1), reached through torchft's process group (send/recv): a peer that
        vanishes or stays silent for ``--ft-timeout`` is reported to the Manager, not raised, and
        the received tensors are zeros (the step will not commit on this node).
        """
        if self.ft is not None:
            return self._exchange_ft(tensor, peers, async_op=async_op)
        peers = [int(p) for p in peers if int(p) != self.rank]
        start = time.perf_counter()
        payload = nbytes(tensor)
        received = [torch.empty_like(tensor) for _ in peers]
        works: list = []
        if peers:
            if not self.distributed:
                raise RuntimeError("exchange with peers needs an initialised process group")
            t = tensor.contiguous()
            # Receives first: gloo sends only once the receiver has announced its receive, and that
            # announcement queues behind data already going to the same peer. Sends first often
            # serialise the two directions (measured: twice the link time on emulated links).
            ops = [dist.P2POp(dist.irecv, buf, p) for p, buf in zip(peers, received, strict=True)]
            ops += [dist.P2POp(dist.isend, t, p) for p in peers]
            works = list(dist.batch_isend_irecv(ops))
        inter, node_sent = exchange_inter_node_bytes(peers, self.rank, self.topology.node_of, payload,
                                                     self.topology.shards)  # type: ignore[arg-type]
        return self._launch(
            dict(kind="exchange", group_size=len(peers) + 1, payload_bytes=payload,
                 bytes_sent=len(peers) * payload, bytes_recv=len(peers) * payload,
                 inter_node_bytes_sent=inter, inter_node_bytes_recv=inter,
                 node_inter_node_bytes_sent=node_sent, messages=1 if peers else 0),
            start, works, received, timeout_what=peers, async_op=async_op,
        )

    def _exchange_ft(self, tensor: torch.Tensor, peers: Sequence[int], *, async_op: bool):
        """:meth:`exchange` under fault tolerance: peers are replica ranks of the quorum, every one another node."""
        g, me = self.group_size, self.group_rank
        peers = [int(p) for p in peers if int(p) != me]
        outside = [p for p in peers if not 0 <= p < g]
        if outside:
            raise ValueError(f"exchange: peers {outside} are not replica ranks of the current quorum (0..{g - 1}); "
                             "with fault tolerance peers are indices into Link.group_ranks, not global ranks")
        start = time.perf_counter()
        # gloo's send/recv take the tensor's memory as host memory (no device staging, unlike its
        # collectives): tensors on an accelerator travel through CPU copies.
        device = tensor.device
        staged = device.type != "cpu"
        t = tensor.detach().to("cpu").contiguous() if staged else tensor.contiguous()
        if self.tags is not None:
            t = self.tags.seal(t, sender=me, context=self._tag_context())
        payload = nbytes(t)
        received = [torch.zeros_like(t) for _ in peers]
        works: list = []
        if peers and not self.ft.errored:  # after a failure the step is dropped: send nothing more
            with self._peers_guard("exchange"):
                # Receives first, as in the plain exchange (gloo sends once the receiver has announced).
                posted = [self.ft.pg.recv([buf], p, _EXCHANGE_TAG) for p, buf in zip(peers, received, strict=True)]
                posted += [self.ft.pg.send([t], p, _EXCHANGE_TAG) for p in peers]
                works = posted
        # Every member of a quorum is another node: each peer is one message across.
        inter = len(peers) * payload
        return self._launch(
            dict(kind="exchange", group_size=len(peers) + 1, payload_bytes=payload,
                 bytes_sent=inter, bytes_recv=inter, inter_node_bytes_sent=inter, inter_node_bytes_recv=inter,
                 node_inter_node_bytes_sent=inter * self.topology.shards,  # type: ignore[operator]
                 messages=1 if peers else 0),
            start, works, (lambda: self._received(received, peers, tensor)) if staged or self.tags is not None
            else received, timeout_what=None, async_op=async_op,
        )


#: The tag of the point-to-point messages of an exchange under fault tolerance. One tag is enough:
#: between two ranks messages of one tag arrive in order, and torchft gives every new quorum (also
#: the one after a failed step) a freshly configured process group, so nothing of a failed exchange
#: is left to be received by the next one.
_EXCHANGE_TAG = 0


class LinkHandle:
    """An operation through the :class:`Link` in flight: ``wait()`` returns its result.

    ``wait()`` blocks until the collective has finished *and*, in shaped mode, until the link's
    clock says the data would have arrived (unshaped with latency: until the latency has passed
    since the data arrived, so an operation left in flight longer than the latency waits no more);
    the time blocked (and the time the start took) is this
    rank's *exposed* communication time, added to the record of the step in which it is spent.
    Waiting twice returns the same result.
    """

    def __init__(self, link: Link, record: OpRecord, works: list, result, *, start: float, ready_at: float,
                 extra_delay_s: float, timeout_peers: list[int] | None) -> None:
        self._link = link
        self.record = record
        self._works = works
        self._result = result
        self._start = start
        self._ready_at = ready_at
        self._extra_delay_s = extra_delay_s
        self._timeout_peers = timeout_peers
        self.done = False
        # Unshaped links with latency: the delay runs from when the data arrived, which for an
        # operation left in flight is long before the wait. The works' futures stamp that moment
        # (where the backend has futures; else the wait's return time is used, the full delay).
        self._arrived: list[float] = []
        self._stampable = extra_delay_s > 0 and bool(works)
        if self._stampable:
            for w in works:
                try:
                    w.get_future().add_done_callback(lambda _f: self._arrived.append(time.perf_counter()))
                except (RuntimeError, AttributeError):
                    self._stampable = False
                    break

    def _exposed(self, seconds: float) -> None:
        self.record.exposed_s += seconds
        self._link._current.exposed_comm_time_s += seconds

    def wait(self):
        if self.done:
            return self._value
        link = self._link
        t0 = time.perf_counter()
        for w in self._works:
            if self._timeout_peers is not None:
                peers = self._timeout_peers
                try:
                    ok = w.wait(timeout=timedelta(seconds=link.timeout_s))
                except RuntimeError as e:
                    raise PeerTimeoutError(
                        f"rank {link.rank}: peer rank(s) {peers} did not answer within {link.timeout_s:g} s "
                        f"(node(s) {sorted({link.topology.node_of(p) for p in peers})}); the peer may have "
                        f"died or its link is down. Underlying error: {e}"
                    ) from e
                if ok is False:
                    raise PeerTimeoutError(
                        f"rank {link.rank}: peer rank(s) {peers} did not answer within {link.timeout_s:g} s"
                    )
            else:
                with link._peers_guard(self.record.kind):
                    w.wait()
        self._value = self._result() if callable(self._result) else self._result
        if link.ft is not None and link.ft.errored:
            # A failed operation leaves partial data: the step is dropped anyway.
            for t in self._value if isinstance(self._value, list) else [self._value]:
                if isinstance(t, torch.Tensor):
                    t.zero_()
        remaining = self._ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        if self._extra_delay_s > 0:
            now = time.perf_counter()
            arrived = max(self._arrived) if self._stampable and len(self._arrived) == len(self._works) else now
            delay = arrived + self._extra_delay_s - now
            if delay > 0:
                time.sleep(delay)
        t1 = time.perf_counter()
        self.record.time_s = t1 - self._start
        self._exposed(t1 - t0)
        self.done = True
        if self in link._in_flight:
            link._in_flight.remove(self)
        return self._value
