"""Fault tolerance: nodes that die or join while the job goes on, on torchft.

A fault-tolerant job is one torchrun per node (``--nnodes 1``, the node's ranks shard one model
copy with FSDP2 as always) plus one torchft *Lighthouse* that every node can reach
(``lowband lighthouse``). Each rank runs a torchft :class:`~torchft.manager.Manager` for its
node (the node is torchft's *replica group*) and talks to the ranks holding the same shard on
the other nodes through a reconfigurable gloo process group that the Manager owns. So:

- **membership** is the Lighthouse's quorum, formed again at the start of every step that
  communicates (every step for AdamW, Deto-Full, FlexDeMo/DeMo; the outer steps of DiLoCo and
  NoLoCo);
  a node that stops sending heartbeats (``heartbeat_timeout_s``) is dropped from the next quorum;
- **a failed exchange** (a peer vanished mid-collective, or did not answer within ``timeout_s``)
  is not an exception: the link reports it to the Manager, the optimizer asks
  :meth:`FaultTolerance.commit` before it changes any state, the node's ranks agree not to
  commit, and the step is dropped (its batch is lost, nothing else). The next step runs on the
  nodes that are left;
- **a node that joins** (a restarted one, or a new one) is behind the others: at its first quorum
  torchft fetches the live state of a peer that holds the newest step over HTTP (the peer's
  parameters, optimizer state, schedule, step and training clock; no shared disk) and loads it
  before the step's forward pass. The state travels as raw tensors and plain data, never a pickle,
  checked before use (:mod:`lowband.ft.transport`). What a replica must not copy is reset by the optimizer's
  ``reset_replica_state`` (FlexDeMo: δ = 0; DiLoCo, NoLoCo: the inner weights start from the outer
  ones).

This module and :mod:`lowband.ft.lighthouse` (which starts the Lighthouse) are the only ones that import
torchft (an optional dependency: ``pip install lowband[ft]``). The link, the optimizers and the trainer
see :class:`FaultTolerance` only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lowband.ft.gateway import accuse_at_gate, ask_gate
from lowband.ft.logs import quiet_torchft
from lowband.ft.managergate import listening_on
from lowband.ft.pins import PinKeeper
from lowband.ft.quorum import (  # noqa: F401  (callers' names)
    ForeignJob,
    NodeSlotTaken,
    QuorumRecorder,
    gate_refusal,
    wait_held_out,
)
from lowband.ft.transport import StateTransport, TransferError, member_source
from lowband.trust.admission import (  # noqa: F401  (admit, member_of, replica_id: the names tests and callers use)
    AdmissionRefused,
    admit,
    check_bind,
    free_port,
    gloo_interface,
    member_of,
    replica_id,
    screen,
    split_bind,
)
from lowband.trust.keys import MemberKey, Roster, check_member
from lowband.trust.secret import load_secret

log = logging.getLogger(__name__)

#: How often a node's Manager tells the Lighthouse it is alive (torchft's default: every 0.1 s). Half a second is
#: still six beats in the Lighthouse's 3 s heartbeat timeout, and a fifth of the calls through the Lighthouse's
#: gate, each of which costs the Lighthouse host CPU (benchmarks/README.md: protection_cost.py).
HEARTBEAT_INTERVAL_S = 0.5

__all__ = ["FaultToleranceConfig", "FaultTolerance", "check_heal", "local_state", "load_local_state",
           "require_torchft", "quorum_step", "committed_of"]


def require_torchft():
    """Import torchft, or say how to install it. Its logs are quieted first (:func:`lowband.ft.logs.quiet_torchft`:
    they would name every member's replica id at every step)."""
    quiet_torchft()
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "fault tolerance (--ft-lighthouse, --faults, lowband lighthouse) needs torchft: "
            "pip install 'lowband[ft]' (or pip install torchft==0.2.0)"
        ) from e
    import torchft  # optional dependency (the ft extra)

    return torchft


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """One node's place in a fault-tolerant job.

    Args:
        lighthouse: the Lighthouse's address, ``http://HOST:PORT`` (``lowband lighthouse`` prints it).
        node: this node's slot, 0 ≤ node < max_nodes. It names the node to the Lighthouse and fixes
            which slice of every step's global batch the node reads (the data rule: see
            :func:`data_slot`). A restarted node takes its old slot.
        max_nodes: the most nodes the job can have at once: the global batch is laid out for this
            many; a slot that is not live at a step leaves its slice of that step untrained.
        timeout_s: how long a collective between nodes, a commit vote or a state transfer may take
            before the peer counts as lost.
        quorum_timeout_s: how long a node waits for a quorum (joining nodes wait for the others to
            reach a step that communicates: at most one outer step for DiLoCo).
        advertise: the host name or address the other nodes reach this node's Manager and state
            server at (default: $LOWBAND_FT_ADVERTISE, else 127.0.0.1).
        fingerprint: what must be equal on every node for them to train together (method,
            hyper-parameters, model, data, shards); a node whose fingerprint differs is refused.
        async_quorum: form each step's quorum in the background while the step's forward and
            backward run (torchft's async quorum), instead of before them. A node that must heal
            then computes its step on stale weights: it sends nothing that counts (zeros, or a
            message flagged as not taking part), loads the peer's state before its commit vote,
            and applies the live nodes' mean like the others. Only for methods that communicate
            every step; every node of a job must agree (it is in the fingerprint).
        start_nodes: a job's first step waits until this many nodes are in one quorum (a node at step 0
            that is not behind anyone asks for quorums again, every ``start_poll_s``), so that the
            nodes of a new job start together instead of the first one up training alone and the
            others healing into it; after ``quorum_timeout_s`` it starts with the nodes there are.
            A node that joins a running job (someone in its quorum is ahead) does not wait.
        window_quorum: (with ``async_quorum``) the quorum spans an outer window: started in the
            background when the window starts, waited for before its outer step, so a node waits for
            the others only when one of them is a whole window behind. A node that must heal loads the
            peer's state when it waits (:meth:`FaultTolerance.heal_now`), jumps to the peer's step and
            takes part in the outer step with the inner steps it trained from there. For NoLoCo,
            whose exchange waits only for its group.
    """

    lighthouse: str
    node: int
    max_nodes: int
    timeout_s: float = 10.0
    quorum_timeout_s: float = 120.0
    advertise: str | None = None
    fingerprint: str = ""
    async_quorum: bool = False
    window_quorum: bool = False
    start_nodes: int = 1
    start_poll_s: float = 0.5
    secret: bytes | None = field(default=None, repr=False)  # the job's secret (lowband.trust.secret); never printed
    bind: str | None = None  # the job's network address the node's listeners bind (default: advertise)
    trusted_network: bool = False  # bind a public address all the same (every host that reaches it is trusted)
    steps: int | None = None  # the job's steps: a healing source at a step outside [0, steps] is refused
    roster: Roster | None = field(default=None, repr=False)  # the job's roster of keys (lowband.trust.keys)
    key: MemberKey | None = field(default=None, repr=False)  # this node's own private key

    def __post_init__(self) -> None:
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(f"--ft-lighthouse must be an address like http://HOST:PORT, got {self.lighthouse!r} "
                             "(`lowband lighthouse` prints it)")
        if self.max_nodes < 1:
            raise ValueError(f"--ft-max-nodes must be >= 1, got {self.max_nodes}")
        if not 0 <= self.node < self.max_nodes:
            raise ValueError(f"--ft-node must be in [0, {self.max_nodes}) (--ft-max-nodes {self.max_nodes}), "
                             f"got {self.node}")
        if not self.timeout_s > 0 or not self.quorum_timeout_s > 0:
            raise ValueError("--ft-timeout and the quorum timeout must be > 0 s")
        if not self.start_poll_s > 0:
            raise ValueError(f"start_poll_s must be > 0 s, got {self.start_poll_s}")
        if not 1 <= self.start_nodes <= self.max_nodes:
            raise ValueError(f"--ft-start-nodes must be in [1, --ft-max-nodes = {self.max_nodes}], got {self.start_nodes}")
        if self.window_quorum and not self.async_quorum:
            raise ValueError("window_quorum needs async_quorum (the window's quorum forms in the background)")
        check_member(self.node, key=self.key, roster=self.roster, secret=self.secret)

    @property
    def poll_rounds(self) -> int:
        """Quorums a node asks for, ``start_poll_s`` apart, before it gives up waiting (for the others to
        start, or for a foreign node to leave). Counted, not timed, so that every rank of a node stops
        at the same quorum."""
        return max(1, math.ceil(self.quorum_timeout_s / self.start_poll_s))


# --------------------------------------------------------------------------- state for healing
def local_state(obj: Any) -> Any:
    """A copy of a (nested) state with every DTensor replaced by its local part, detached."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(local_state(v) for v in obj)
    return obj


def load_local_state(target: Any, source: Any, *, what: str = "state") -> Any:
    """Copy ``source`` (from :func:`local_state` on a peer) into ``target``'s tensors in place.

    Tensors are copied into the existing storage (DTensors into their local part), so optimizers,
    FSDP2 and schedulers keep their references. Returns the updated non-tensor values.
    """
    if isinstance(target, DTensor | torch.Tensor):
        dst = target.to_local() if isinstance(target, DTensor) else target
        if not isinstance(source, torch.Tensor) or source.shape != dst.shape:
            raise ValueError(f"healing: {what} has shape {tuple(dst.shape)} here but "
                             f"{None if not isinstance(source, torch.Tensor) else tuple(source.shape)} on the peer: "
                             "the nodes run different models or shardings")
        with torch.no_grad():
            dst.copy_(source.to(dst.device, dst.dtype))
        return target
    if isinstance(target, dict):
        missing = set(target) ^ set(source) if isinstance(source, dict) else {"(not a dict)"}
        if missing:
            raise ValueError(f"healing: {what} differs between this node and the peer in {sorted(map(str, missing))}")
        for k in target:
            target[k] = load_local_state(target[k], source[k], what=f"{what}.{k}")
        return target
    if isinstance(target, list):
        if not isinstance(source, list | tuple) or len(source) != len(target):
            raise ValueError(f"healing: {what} has {len(target)} entries here and another count on the peer")
        for i in range(len(target)):
            target[i] = load_local_state(target[i], source[i], what=f"{what}[{i}]")
        return target
    return source


def check_heal(step: int, state: Any, *, fingerprint: str, steps: int | None) -> None:
    """Refuse (ValueError) a heal this node must not load: the quorum's step (``step``: torchft's, a
    :func:`quorum_step`) outside the job's (training step and committed steps in [0, ``steps``]); with ``state``
    (what the source sent: torchft's ``{"user": {"default": ...}, "torchft": ...}``), another layout, torchft's
    own step other than the quorum's or its committed batches not a count, or another job's fingerprint."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"the quorum's step {str(step)[:40]} is not a step")
    training, committed = divmod(step, _STEP_SCALE)
    if steps is not None and (training > steps or committed > steps):
        raise ValueError(f"the source is at step {training} with {committed} committed, outside the job's "
                         f"[0, {steps}] (its own report to the quorum)")
    if state is None:
        return
    user = state.get("user") if isinstance(state, dict) else None
    ours = state.get("torchft") if isinstance(state, dict) else None
    if not (isinstance(user, dict) and isinstance(user.get("default"), dict) and isinstance(ours, dict)):
        raise ValueError("the source's state is not laid out as torchft's (user, torchft)")
    theirs, batches = ours.get("step"), ours.get("batches_committed")
    if theirs != step or not isinstance(batches, int) or isinstance(batches, bool) or not 0 <= batches < 1 << 62:
        raise ValueError(f"the source's torchft state (step {str(theirs)[:40]}, batches {str(batches)[:40]}) is not "
                         f"the quorum's step {step} with a count of batches")
    fp = user["default"].get("fingerprint")
    if fp != fingerprint:
        raise ValueError("the node this one heals from runs another job, model, method or hyper-parameters "
                         f"(fingerprint {str(fp)[:40]!r} there, {fingerprint!r} here)")


def state_transport(cfg: FaultToleranceConfig, *, advertise: str, timeout: timedelta, rank: int,
                    state_dict: Callable[[], dict], secret: bytes | None = None, bind: str | None = None, **checks):
    """The node's state server and client (:class:`lowband.ft.transport.StateTransport`), listening on ``bind`` (the
    checked ``--ft-bind``; default ``advertise``) and reached at ``advertise``; its healer checks what it receives
    against this rank's own state (``state_dict``), as torchft wraps it, and with ``checks`` (``check``,
    ``refuse_source``, ``on_poisoned``: see StateTransport). ``secret``: the job's secret (default:
    :func:`lowband.trust.secret.load_secret` from the environment)."""

    if secret is None:
        secret = getattr(cfg, "secret", None) or load_secret()
    return StateTransport(advertise=advertise, timeout=timeout, fingerprint=cfg.fingerprint, secret=secret,
                          template=lambda: {"user": {"default": state_dict()}}, node=cfg.node, rank=rank,
                          bind=bind, **checks)


class FaultTolerance:
    """This rank's membership in a fault-tolerant job: a torchft Manager and its process group.

    Args:
        cfg: the node's configuration.
        rank, world_size: this rank in its node, and the node's ranks (torchrun's RANK/WORLD_SIZE
            of a per-node job).
        state_dict, load_state_dict: what a joining node fetches from a live peer, and how it is
            loaded here (the trainer passes its model, optimizer, schedule and step);
            ``load_state_dict`` may return the step the node goes on from (recorded in ``healed_at``).
        store_addr, store_port: the node's TCPStore (default: torchrun's MASTER_ADDR/PORT).
    """

    def __init__(self, cfg: FaultToleranceConfig, *, rank: int, world_size: int,
                 state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None],
                 store_addr: str | None = None, store_port: int | None = None,
                 check_state: Callable[[dict, dict], None] | None = None) -> None:
        require_torchft()
        from torchft.manager import Manager  # optional dependency (the ft extra)
        from torchft.process_group import ProcessGroupGloo  # optional dependency (the ft extra)

        self.cfg = cfg
        self.rank, self.local_ranks = rank, world_size
        self._load_user = load_state_dict
        self._check_user = check_state
        self.bad_sources: dict[str, str] = {}  # members whose state this node refused (replica id -> why)
        self.replica_ids: list[str] = []  # the last quorum's members (torchft replica ids)
        self.healed_at: list[dict] = []  # one record per state transfer into this node
        self.quorum_s = 0.0  # time spent forming quorums (and healing), summed
        self.commit_s = 0.0
        self.last_quorum_s = 0.0
        self.last_members = 0
        self.quorum_heals = False  # whether the last quorum heals this node (torchft's result)
        self.quorum_max_step = 0  # the newest step in the last quorum (torchft's, see quorum_step)
        self._errored_this_step = False
        self.pins: PinKeeper | None = None  # rank 0 of a job with a roster: names its connections to the gate
        advertise = cfg.advertise or os.environ.get("LOWBAND_FT_ADVERTISE") or "127.0.0.1"
        # The job's network: every listener of this node binds this checked address (an IP literal), and none
        # starts elsewhere (the advertised address may be another: a NAT's).
        bind_host = check_bind(cfg.bind or advertise, what=f"node {cfg.node}'s Manager, state server and gloo",
                               flag="--ft-bind", secret=cfg.secret is not None, trusted_network=cfg.trusted_network)
        if "GLOO_SOCKET_IFNAME" not in os.environ and gloo_interface(bind_host):
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface(bind_host)
        timeout = timedelta(seconds=cfg.timeout_s)
        self.pg = ProcessGroupGloo(timeout=timeout)
        # Healing copies a peer's state over HTTP as tensors and plain data, never a pickle (lowband.ft.transport:
        # torchft's own transport unpickles what the peer sends); torchft checks the step, we the fingerprint.
        transport = state_transport(cfg, advertise=advertise, timeout=timeout, rank=rank, state_dict=state_dict,
                                    secret=cfg.secret, bind=bind_host, check=self._check_heal,
                                    refuse_source=self._known_bad, on_poisoned=self._poisoned_source, key=cfg.key,
                                    source_of=self._source_of if cfg.secret is not None else None)
        self.quorums = 0  # quorums this node took part in
        # Whether a quorum this node accepted ever held another member: until then the node is new to the job
        # (admission.screen), also after quorums of its own (a node that came up alone while the others had not
        # started, or an intruder in a free slot: the first quorum with the job's nodes must still refuse it).
        self.had_peers = False
        self.replica_rank: int | None = None  # this node's place among them
        self._pending: float | None = None  # perf_counter when an async quorum was started, until it is waited for
        store_host = store_addr or advertise
        store_port = store_port if store_port is not None else int(os.environ.get("MASTER_PORT", "0") or 0)
        # The id names the store and Manager this node registers, under the secret's tag (admission.screen);
        # the Manager's port is chosen here so that the id can name it (rank 0 runs the node's Manager).
        port = free_port(bind_host) if rank == 0 and cfg.secret is not None else None
        rid = replica_id(cfg.fingerprint, cfg.node, secret=cfg.secret, store=f"{store_host}:{store_port}",
                         manager=f"{advertise}:{port}", last_step=cfg.steps)
        # Before torchft's Manager starts (it would retry a refused quorum until its timeout): may this node pass?
        # Every rank asks, so that each learns a job is complete (JobComplete) and leaves; rank 0 acts on a refusal.
        def ask() -> str | None:
            return ask_gate(cfg.lighthouse, rid, f"http://{advertise}:{port}", f"{store_host}:{store_port}",
                            timeout_s=min(10.0, cfg.quorum_timeout_s)) if cfg.secret is not None or rank == 0 else None
        why = wait_held_out(cfg, ask(), ask)  # a node the gate holds out for a while waits, then joins
        if why is not None and rank == 0:
            raise gate_refusal(cfg, why)

        def register(full_id: str, pins: str | None = None) -> str | None:  # a roster's job: this process
            why = ask_gate(cfg.lighthouse, full_id, f"http://{advertise}:{port}", f"{store_host}:{store_port}",
                           timeout_s=min(10.0, cfg.quorum_timeout_s), key=cfg.key, pins=pins or "")
            if pins is None:  # (torchft's id:uuid) claims its slot, signed; then names its connections to the gate
                if why is not None:
                    raise gate_refusal(cfg, why)
                self.pins = PinKeeper(*split_bind(cfg.lighthouse.split("://", 1)[-1].rstrip("/")),
                                      lambda named: register(full_id, named))
            return why

        with listening_on(bind_host, register=register if cfg.key is not None else None):
            self.manager = Manager(
                pg=self.pg, load_state_dict=self._load, state_dict=state_dict, min_replica_size=1,
                use_async_quorum=cfg.async_quorum, timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timedelta(seconds=cfg.quorum_timeout_s), rank=rank, world_size=world_size,
                # The node's store must be reachable from other nodes (they configure the quorum's process
                # group through the first member's store): advertise it at the node's address.
                store_addr=store_host, store_port=store_port or None, lighthouse_addr=cfg.lighthouse,
                replica_id=rid, hostname=advertise, init_sync=False, port=port,
                checkpoint_transport=transport, heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
            )
        self.replica_id = self.manager._store.get("replica_id").decode()  # rank 0's, with torchft's :uuid
        self.reported: dict[str, str | None] = {}  # members reported to the gate for bad messages: the gate's answer
        self.removed = False  # the gate removed this node from the job, or told it the job is complete (ft.quorum)
        self.manager._client = QuorumRecorder(self.manager._client, self)
        watch_agent()

    # ------------------------------------------------------------------ healing, checked
    def _check_heal(self, step: int, state: Any, own: Any = None) -> None:
        """The transport's check of a heal (:func:`check_heal`, then the trainer's ``check_state``)."""
        check_heal(step, state, fingerprint=self.cfg.fingerprint, steps=self.cfg.steps)
        if state is not None and self._check_user is not None:
            mine = own["user"]["default"] if isinstance(own, dict) else None
            if mine is not None:
                self._check_user(state["user"]["default"], mine)

    def _source(self, src_rank: int) -> str | None:
        ids = self.replica_ids
        return ids[src_rank] if isinstance(src_rank, int) and 0 <= src_rank < len(ids) else None

    def _source_of(self, src_rank: int):
        """:func:`lowband.ft.transport.member_source` of the quorum's member ``src_rank``."""
        rid = self._source(src_rank)
        return member_source(rid, self.cfg.roster) if rid is not None else None

    def _known_bad(self, src_rank: int) -> str | None:
        """Why this node does not fetch from the quorum's member ``src_rank`` (it served a poisoned state before)."""
        rid = self._source(src_rank)
        return self.bad_sources.get(rid) if rid is not None else None

    def _poisoned_source(self, src_rank: int, why: str) -> None:
        """A healing source's state failed its checks: remember it (never fetched from again while it is this
        process) and report it to the Lighthouse's gate like a member that sends bad messages."""
        rid = self._source(src_rank)
        log.warning("rank %d: the state of node %s was refused and nothing of it loaded: %s; this node does not heal "
                    "from it again, and waits for another source", self.rank,
                    member_of(rid)[1] if rid is not None else "?", why)
        if rid is not None and rid != getattr(self, "replica_id", None):
            self.bad_sources[rid] = why
            self.report_bad({rid: why}, what="served a state that failed its checks when this node healed from it")

    @property
    def heal_refused(self) -> bool:
        """Whether this step's heal was refused or abandoned (:class:`lowband.ft.transport.TransferError`): the
        node's process group is configured, but its state is stale. It takes part in the step's exchange with
        nothing that counts (:attr:`participating`) and does not commit it (torchft's error stands)."""
        err = self.manager.errored()
        return isinstance(getattr(err, "original_exception", err), TransferError)

    # ------------------------------------------------------------------ membership
    def _load(self, state: dict) -> None:
        fp = state.get("fingerprint")
        if fp != self.cfg.fingerprint:
            raise ValueError("the node this one heals from runs another job, model, method or hyper-parameters "
                             f"(fingerprint {fp!r} there, {self.cfg.fingerprint!r} here)")
        step = self._load_user(state)  # the step this node goes on from (None: the peer's)
        if step is None:
            step = int(state.get("trainer", {}).get("step", -1))
        self.healed_at.append({"step": int(step), "unix_s": time.time(), "bytes": state_bytes(state)})

    def start_step(self, step: int) -> None:
        """Form the quorum for training step ``step`` (a communicating one); heal this node first if it is behind.

        torchft heals a node whose step is below the quorum's newest and takes any node at the newest
        step as a source, choosing it per rank (the ranks of a node may copy different peers). So the
        step torchft compares is :func:`quorum_step` (the training step, then the committed steps),
        not the commit count alone: two nodes with equal commit counts may be at different training
        steps (one that started late forms its first quorum at step 0 while the others, which have not
        committed yet either, are at their first outer step), and a node whose ranks copied those two
        would hold shards of different steps.
        """
        t0 = time.perf_counter()
        self._errored_this_step = False
        self.manager.load_state_dict({"step": quorum_step(step, self.committed_steps),
                                      "batches_committed": self.manager.batches_committed()})
        self.manager.start_quorum()
        self._pending = t0
        if not self.cfg.async_quorum:
            self.finish_quorum()

    def finish_quorum(self) -> None:
        """Wait for the quorum started by :meth:`start_step` (at once when it is synchronous; with
        ``async_quorum``, before the step's first exchange). Only the wait counts in ``quorum_s``:
        with the async quorum that is what the quorum costs the step."""
        if self._pending is None:
            return
        t0 = time.perf_counter()
        started, self._pending = self._pending, None
        self.manager.wait_quorum()
        self.last_members = len(self.replica_ids) if self.replica_ids else self.manager.num_participants()
        self.last_quorum_s = time.perf_counter() - (t0 if self.cfg.async_quorum else started)
        self.quorum_s += self.last_quorum_s
        self.quorums += 1
        self._check_slot()

    def gather(self, step: int) -> int:
        """At a new job's start: the quorum started by :meth:`start_step` for ``step``, then again until
        ``cfg.start_nodes`` nodes are in it. Stops early when this node is behind someone in the quorum
        (it joins a running job: that quorum is its first, and heals it) and after ``quorum_timeout_s``
        (counted in attempts, so that every rank of the node stops at the same quorum). Returns the
        members of the last quorum."""
        attempts = self.cfg.poll_rounds
        mine = quorum_step(step, self.committed_steps)
        for attempt in range(attempts):
            self.finish_quorum()
            if (self.last_members >= self.cfg.start_nodes or self.quorum_heals or self.quorum_max_step > mine
                    or attempt == attempts - 1):
                break
            if attempt == 0:
                log.info("node %d: %d of %d nodes live; waiting for the others to start (--ft-start-nodes)",
                         self.cfg.node, self.last_members, self.cfg.start_nodes)
            time.sleep(self.cfg.start_poll_s)
            self.start_step(step)
        if self.last_members < self.cfg.start_nodes and not self.quorum_heals and self.quorum_max_step <= mine:
            log.warning("node %d: only %d of %d nodes started within %.0f s; training with them (the others join "
                        "when they start)", self.cfg.node, self.last_members, self.cfg.start_nodes,
                        self.cfg.quorum_timeout_s)
        return self.last_members

    @property
    def quorum_pending(self) -> bool:
        """A quorum was started and not waited for yet."""
        return self._pending is not None

    def heal_now(self) -> bool:
        """With the window quorum: wait for it and, if it heals this node, load the peer's state now.

        torchft's async quorum loads it at the commit vote (the step has then run on stale weights
        and sends nothing that counts); a window's quorum is waited for before the outer step, so
        the node can load the state at once, go on from the peer's step and take part in the outer
        step like the others. Returns whether this node healed (False also when the transfer failed:
        the step is then dropped, as after any failed exchange).
        """
        self.finish_quorum()
        m = self.manager
        if not getattr(m, "_healing", False):  # torchft (0.2) sets it when the quorum heals this node
            return False
        before = len(self.healed_at)
        m._apply_pending_state_dict()  # what torchft's commit vote would do; our _load runs here
        m._healing = False  # healed now: the commit vote must not load it again, and the node takes part
        return len(self.healed_at) > before

    def _check_slot(self) -> None:
        """Refuse a second live process for this node slot (``--ft-node`` given twice, or a node started
        again while its old ranks still run): the one joining leaves with an error, the live one goes on."""
        twins = [r for r in self.replica_ids if member_of(r)[1] == self.cfg.node]
        if len(twins) > 1 and self.quorums == 1:
            raise NodeSlotTaken(
                f"node slot {self.cfg.node} is already live in this job ({len(twins)} processes joined the quorum "
                f"as --ft-node {self.cfg.node}): stop the other one, or start this one with a free slot "
                f"(0..{self.cfg.max_nodes - 1}, one per node). The running job goes on.")

    @property
    def members(self) -> int:
        """Live nodes in the current quorum (this one included; a node healing under the async quorum too:
        it takes part in the collectives, with nothing that counts)."""
        self.finish_quorum()
        return self.last_members

    @property
    def member_rank(self) -> int:
        """This node's place in the current quorum, 0 ≤ member_rank < members."""
        self.finish_quorum()
        if self.replica_rank is None:
            raise RuntimeError("this node is not in the current quorum")
        return int(self.replica_rank)

    @property
    def participants(self) -> int:
        """Nodes whose contribution counts this step: the members, less any healing under the async quorum."""
        self.finish_quorum()
        return self.manager.num_participants()

    @property
    def participating(self) -> bool:
        """False on a node that heals during this step (async quorum), or whose heal was refused: what it sends
        must not count."""
        self.finish_quorum()
        return self.manager.is_participating() and not self.heal_refused

    def report_bad(self, evicted: dict[str, str], *, what: str = "evicted from the exchange") -> None:
        """Report the members this rank evicted from the exchange ({replica id: what was wrong with its messages};
        :meth:`lowband.optim._common.BadMessageTally.evicted_members`) to the Lighthouse's gate, once each, in the
        background: with most of the others' reports the gate removes the member from the quorum
        (:meth:`lowband.ft.gateway.StallBreaker.accuse`; a report about a member no longer in the quorum is not
        counted)."""
        if self.cfg.secret is None:
            return  # no gate without a secret
        for rid, why in evicted.items():
            if rid == self.replica_id or rid in self.reported:
                continue
            self.reported[rid] = "pending"

            def report(rid: str = rid, why: str = f"{why}; {what}") -> None:
                self.reported[rid] = accuse_at_gate(self.cfg.lighthouse, self.replica_id, rid, why, key=self.cfg.key,
                                                  secret=self.cfg.secret)
                log.warning("rank %d: node %s reported to the Lighthouse's gate for %s: %s", self.rank,
                            member_of(rid)[1], why, self.reported[rid] or "counted")
            threading.Thread(target=report, daemon=True, name="lowband-report").start()

    def report_error(self, e: BaseException) -> None:
        """A collective between nodes failed: this step will not commit anywhere in the node."""
        self._errored_this_step = True
        self.manager.report_error(e if isinstance(e, Exception) else RuntimeError(str(e)))

    @property
    def errored(self) -> bool:
        """An exchange of this step failed: the link sends nothing more (a heal that was refused is not such a
        failure: the process group is sound, and the node takes part with nothing that counts)."""
        return self._errored_this_step or (self.manager.errored() is not None and not self.heal_refused)

    def commit(self) -> bool:
        """The node's vote: True when every rank of the node may apply the step (call once per step).

        The vote waits for every rank of the node, and a rank may first wait out a collective's timeout
        (a peer that died mid-exchange): so the vote allows three collective timeouts. A vote that fails
        even so (the node's Manager server unreachable) is a failed step, not a crash: False.
        """
        if self.quorums == 0 and self._pending is None:
            # No quorum yet, so no exchange either (the link acts as a group of one): e.g. the zero-lr step
            # that torch.distributed.checkpoint runs to create optimizer state before a resume.
            return True
        t0 = time.perf_counter()
        try:
            return self.manager.should_commit(timeout=timedelta(seconds=3 * self.cfg.timeout_s + 5.0))
        except (TimeoutError, RuntimeError) as e:
            log.warning("rank %d: the node's commit vote failed (%s); the step is dropped", self.rank, e)
            self.report_error(e)
            return False
        finally:
            self.commit_s += time.perf_counter() - t0

    @property
    def committed_steps(self) -> int:
        """Steps this node committed (those copied from a peer when it healed included)."""
        return committed_of(self.manager.current_step())

    def shutdown(self) -> None:
        if self.pins is not None:
            self.pins.stop()
        if self.removed:  # torchft's Manager server would wait out its last quorum request (refused at the gate,
            return  # retried until its timeout, 2 min); the process leaves now (lowband.cli), which frees it all
        self.manager.shutdown(wait=False)


def watch_agent(poll_s: float = 1.0) -> None:
    """Under torchrun, end this rank when its torchrun agent dies.

    torchrun starts each rank in a session of its own, so a ``kill -9`` of the agent alone leaves the
    ranks training as an orphaned node, and a restart of that node would run beside them. A daemon
    thread notices the new parent and exits the process (the node is then dead, as the kill meant).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                log.error("the torchrun agent of this node (pid %d) died: this rank stops too", parent)
                os._exit(1)

    threading.Thread(target=watch, name="lowband-agent-watch", daemon=True).start()


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state (what a heal transfers, serialisation overhead aside)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


#: quorum_step = training step × _STEP_SCALE + committed steps: commits stay far below it.
_STEP_SCALE = 1 << 32


def quorum_step(step: int, committed: int) -> int:
    """The step a node reports to torchft's quorum: ordered by training step, then by committed steps.

    torchft heals every node below the newest and treats all nodes at the newest as equal sources. With
    this order a node behind in training steps (late at the start, restarted) heals forward, and
    among nodes at the same training step one that dropped a step the others committed heals too;
    nodes at the newest value are at the same step with the same commits. Each commit adds 1
    (torchft's own count), which keeps the order.
    """
    if not 0 <= committed < _STEP_SCALE or step < 0:
        raise ValueError(f"step {step} and committed steps {committed} must be >= 0 (committed < 2**32)")
    return step * _STEP_SCALE + committed


def committed_of(quorum_step_value: int) -> int:
    """The committed steps in a :func:`quorum_step` value."""
    return quorum_step_value % _STEP_SCALE


def fingerprint(*parts: Any) -> str:
    """A short digest of what must agree between nodes (method, hyper-parameters, model, data, shards)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def data_slot(cfg: FaultToleranceConfig, *, local_rank: int, ranks_per_node: int) -> tuple[int, int]:
    """(rank, world size) for :func:`lowband.train.data.train_batch` in a fault-tolerant job.

    The data rule: every step's global batch is laid out for ``max_nodes`` nodes; node slot i reads
    slice i, whoever else is alive. So no example is trained twice in an epoch across nodes, a
    dead node's slices are skipped (not given to others), and a node that rejoins continues with
    its own slice at the step it heals to. The global batch therefore shrinks with the live nodes.
    """
    return cfg.node * ranks_per_node + local_rank, cfg.max_nodes * ranks_per_node
