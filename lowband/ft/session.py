"""Fault tolerance as the trainer sees it: one interface, a no-op twin when it is off.

The trainer (:class:`lowband.train.loop.Trainer`) asks its membership the same questions with and
without fault tolerance and never asks whether it is on: which slice of each global batch this
rank reads, whether a step needs a quorum first, what to add to a step's record, what to do when
the run ends. :class:`Solo` answers for a job whose members never change (everything a no-op);
:class:`FaultTolerantSession` answers on torchft (:class:`~lowband.ft.node.FaultTolerance`): a
quorum before each step that communicates, healing from a live peer, the window quorum of NoLoCo,
and ``ft_rank{R}.json`` at the end.

The session works on the trainer it is attached to (its model shards, optimizer, scheduler, clock,
metrics and progress bar) and imports nothing of the training layer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lowband.ft.completion import report_done
from lowband.ft.node import FaultTolerance, FaultToleranceConfig, data_slot, load_local_state, local_state
from lowband.ft.state import check_peer_state, load_optimizer_local_state, local_tensor, optimizer_local_state
from lowband.trust.admission import member_of

__all__ = ["FaultTolerantSession", "Solo", "membership_for"]

log = logging.getLogger("lowband.train.loop")


class Solo:
    """A job whose members never change: the trainer's membership without fault tolerance (every answer a no-op)."""

    config = None
    fingerprint = None
    secret = None
    torchft = None  # what the link gets for torchft's process group: none

    def data_slot(self, *, rank: int, world: int, topology: Any) -> tuple[int, int]:
        return rank, world

    def attach(self, trainer: Any) -> None:
        """Nothing to start."""

    def appends_metrics(self, trainer: Any) -> bool:
        return False

    def train(self, trainer: Any) -> None:
        trainer._run_steps()

    def before_step(self, step: int, *, first: bool) -> int:
        return step

    def after_step(self, step: int) -> int:
        return step

    def report_bad(self, optimizer: Any) -> None:
        """No gate to report to."""

    def step_record(self, step: int, *, dropped: bool) -> tuple[int, dict]:
        return step, {}

    def finish(self) -> None:
        """Nothing to record."""

    def shutdown(self) -> None:
        """Nothing to shut down."""


def membership_for(config: FaultToleranceConfig | None) -> Solo | FaultTolerantSession:
    """The trainer's membership: :class:`FaultTolerantSession` under ``--ft-lighthouse``, else :class:`Solo`."""
    return Solo() if config is None else FaultTolerantSession(config)


class FaultTolerantSession:
    """A node of a fault-tolerant job, as its trainer sees it (torchft: :class:`~lowband.ft.node.FaultTolerance`)."""

    def __init__(self, config: FaultToleranceConfig) -> None:
        self.config = config
        self.fingerprint = config.fingerprint
        self.secret = config.secret
        self.torchft: FaultTolerance | None = None
        self.trainer: Any = None
        self.healed_to: int | None = None  # the peer's step after a heal, until the loop goes on from it
        self.next_step = 0  # the step boundary a peer copying this node's state sees
        # Window quorum (NoLoCo): a peer may copy this node's state at any moment of an outer window, from
        # torchft's quorum thread; it takes this lock, which each inner step holds while it changes the
        # weights, the optimizer, the schedule and the step.
        self.state_lock = threading.Lock()
        self.earlier_life = False
        self._quorum = False  # the step being trained had a quorum before it
        self._members_before = 0
        self._healed_before = 0

    # ------------------------------------------------------------------ set-up
    def data_slot(self, *, rank: int, world: int, topology: Any) -> tuple[int, int]:
        """Which slice of each step's global batch this rank reads: by node slot, whoever is alive."""
        if topology.num_nodes != 1:
            raise ValueError("fault tolerance runs one torchrun per node (--nnodes 1 --nproc-per-node S, each node "
                             f"with its own --ft-node), but this job spans {topology.num_nodes} nodes")
        return data_slot(self.config, local_rank=rank, ranks_per_node=topology.ranks_per_node)

    def attach(self, trainer: Any) -> None:
        """Start torchft's Manager for ``trainer``'s rank (before its link and optimizer are built)."""
        self.trainer = trainer
        self.torchft = FaultTolerance(self.config, rank=trainer.rank, world_size=trainer.world,
                                      state_dict=self.state, load_state_dict=self.load, check_state=self.check_state)

    def appends_metrics(self, trainer: Any) -> bool:
        """A node appends to its record: it may rejoin the job after an earlier life. Whether it did is kept.

        Rank 0 looks before it creates the file and tells the node's other ranks: each looking for itself
        would race with rank 0 creating it, and the ranks of a node must decide alike (a new job's first
        step waits for its nodes; a node that lived before does not)."""
        earlier = [(trainer.out / "metrics.jsonl").exists()]
        if dist.is_initialized() and trainer.world > 1:
            dist.broadcast_object_list(earlier, src=0)
        self.earlier_life = bool(earlier[0])
        return True

    # ------------------------------------------------------------------ the loop
    def train(self, trainer: Any) -> None:
        if self.config.window_quorum:
            self._run_windows(trainer)
        else:
            trainer._run_steps()

    def before_step(self, step: int, *, first: bool) -> int:
        """A quorum before the first step and each step that communicates; returns the step to run (a joining
        node may jump ahead to the live step)."""
        self._quorum = first or self.trainer.optimizer.communicates_next()
        return self._membership(step) if self._quorum else step

    def after_step(self, step: int) -> int:
        """After the step: with the async quorum, what its quorum changed (a node that healed during the step
        goes on from the peer's)."""
        if self._quorum and self.config.async_quorum:
            return self._membership_done(step, trained=True)
        return step

    def report_bad(self, optimizer: Any) -> None:
        """Members this rank evicted from its exchange for bad messages, reported to the Lighthouse's gate (which
        removes them from the quorum when most members report them)."""
        tally = getattr(optimizer, "bad_messages", None)
        if tally is not None and tally.evicted:
            self.torchft.report_bad(tally.evicted_members())

    def step_record(self, step: int, *, dropped: bool) -> tuple[int, dict]:
        """The step a record names (healed at this step's commit vote: the peer's) and membership fields."""
        if self.healed_to is not None:
            step = self.healed_to
        return step, {"replicas": self.torchft.last_members, "dropped": dropped}

    def finish(self) -> None:
        """``ft_rank{R}.json`` (before the job's last barrier); a node that trained the job's last step tells the
        Lighthouse's gate, which then tells a node that comes back that the job is complete (lowband.ft.completion)."""
        self._record()
        t, steps = self.trainer, self.config.steps
        stop = getattr(t, "stop", None)  # --stop-file: the step every node of the job ends after, as the user wrote it
        ended = steps is not None and (t.steps_done >= steps or (stop is not None and stop.step is not None
                                                                  and t.steps_done >= stop.step))
        if self.secret is None or t.rank != 0 or not ended:
            return  # no gate; not the node's rank 0; or the run did not reach the job's end
        final = t.out / "checkpoints" / f"step_{t.steps_done:06d}"
        where = str((final if final.exists() else t.out).resolve())
        why = report_done(self.config.lighthouse, self.torchft.replica_id, t.steps_done, where, key=self.config.key,
                          secret=self.config.secret)
        if why is None:
            log.info("node %d: told the Lighthouse's gate that the job is complete at step %d (%s)", self.config.node,
                     t.steps_done, where)
        else:
            log.warning("node %d: the Lighthouse's gate did not record the job's end at step %d: %s", self.config.node,
                        t.steps_done, why[:300])

    def shutdown(self) -> None:
        self.torchft.shutdown()

    def _run_windows(self, t: Any) -> None:
        """The loop with the window quorum (NoLoCo under fault tolerance): one quorum per outer window.

        It is started when a window starts and forms in the background while the inner steps run
        (they exchange nothing between nodes); the outer step waits for it. So a node waits for the
        others' quorum only when one of them is a whole window behind, and otherwise only for its
        group, in the exchange. A node that heals loads the peer's state before the outer step and
        goes on from the peer's step, inner weights restarted from the outer ones (the method's
        rule), taking part in the outer step with the inner steps it trained from there. A peer copies
        this node's state whenever its quorum forms: between two inner steps (``state_lock``).
        """
        steps = t.cfg.schedule.steps
        step, start, first = t.start_step, True, True
        while step < steps:
            if start:
                self.next_step = step
                self._membership(step)
                start = False
                if first:  # wait for the first quorum at once: a joining node heals before it trains
                    first = False
                    step = self._membership_done(step, trained=False)
                    continue
            if t.optimizer.communicates_next() and self.torchft.quorum_pending:
                before = step
                step = self._membership_done(step, trained=False)
                if step != before:  # healed: on from the peer's step, in the window of the quorum just formed
                    continue
            outer = t.optimizer.communicates_next()
            if outer:  # the window's quorum has formed: nothing copies this node's state until the next one
                t.train_step(step)
            else:
                with self.state_lock:
                    t.train_step(step)
                    self.next_step = step + 1
            step += 1
            start = outer
            if t._ends(step, outer):
                break
            t._after_step(step)
        t.steps_done = step

    # ------------------------------------------------------------------ quorums
    def _membership(self, step: int) -> int:
        """Form the quorum for ``step``; heal from a live peer if this node is behind. Returns the step to run.

        With the async quorum this only starts it: the step's first exchange waits for it, a heal is
        loaded at the step's commit vote, and :meth:`_membership_done` follows the step."""
        t, ft = self.trainer, self.torchft
        self.next_step = step
        _reshard(t.model)
        self._members_before = ft.last_members
        self._healed_before = len(ft.healed_at)
        first = ft.quorums == 0 and ft.quorum_pending is False
        ft.start_step(step)
        # A new job, or one whose nodes resume from their checkpoints (every node died and was started again),
        # waits for its nodes; a node joining a running job stops waiting at once (it is behind: it heals).
        # Without the wait, resumed nodes that came up seconds apart each trained on alone and diverged.
        if first and ((step == 0 and not self.earlier_life) or (t.start_step > 0 and step == t.start_step)):
            ft.gather(step)
        if self.config.async_quorum:
            return step
        return self._membership_done(step, trained=False)

    def _membership_done(self, step: int, *, trained: bool) -> int:
        """Log what the quorum changed; after a heal, the step to go on from (the peer's, +1 if this node
        has trained it since: the async quorum heals at the step's commit vote; the window quorum here)."""
        t, ft = self.trainer, self.torchft
        if self.config.window_quorum:
            ft.heal_now()
        else:
            ft.finish_quorum()
        before = self._members_before
        if self.healed_to is not None:
            ft.healed_at[-1]["quorum_s"] = ft.last_quorum_s  # the quorum with the transfer in it
            log.warning("node %d joined at step %d: model and optimizer state copied from a live peer "
                        "(quorum %.2f s; %s)", self.config.node, self.healed_to, ft.last_quorum_s,
                        "per-replica state reset as the method's rule says")
            step, self.healed_to = self.healed_to + (1 if trained else 0), None
            if t.bar is not None:
                t.bar.n = step
                t.bar.refresh()
        members = ft.last_members
        healed = len(ft.healed_at) != self._healed_before
        if before == 0 and members == 1 and not healed and self.earlier_life and t.start_step == 0:
            log.warning("node %d was started again but no other node is live: it trains alone from step 0, not on "
                        "from the job's progress. If the job has finished or every node died, stop this node and "
                        "start the job again (checkpoints: --ckpt-every N with --resume if-any); a Lighthouse with "
                        "--min-nodes 2 makes a lone node wait for a peer instead", self.config.node)
        if members != before or healed:
            log.warning("step %d: %d live node(s) (was %d); quorum took %.2f s", step, members, before,
                        ft.last_quorum_s)
            t.metrics.write({"type": "membership", "step": step, "replicas": members, "was": before,
                             "healed": healed, "quorum_s": ft.last_quorum_s,
                             "wall_s": time.perf_counter() - t.wall0, "unix_s": time.time()})
        return step

    # ------------------------------------------------------------------ healing
    def state(self) -> dict:
        """What a joining node copies from this one (called on torchft's thread while this rank waits for the
        quorum, so the state is that of the step boundary ``next_step``; with the window quorum while this
        rank trains, between two of its inner steps)."""
        if self.config.window_quorum:
            with self.state_lock:
                return self.state_now()
        return self.state_now()

    def state_now(self) -> dict:
        t = self.trainer
        return {
            "fingerprint": self.fingerprint,
            "trainer": {"step": self.next_step, **t.clock},
            "scheduler": t.scheduler.state_dict(),
            "params": {n: local_state(p) for n, p in t._shards.items()},
            "buffers": {n: local_state(b) for n, b in t.model.named_buffers()},
            "optimizer": [optimizer_local_state(o) for o in t.optimizer.state_owners()],
        }

    def check_state(self, peer: dict, own: dict) -> None:
        """Refuse (ValueError) a peer's state that :meth:`load` must not load (:func:`lowband.ft.state.check_peer_state`:
        a step outside the job's, a layout other than this trainer's): called on torchft's thread before anything of
        it is loaded, with this rank's own state (``own``, from :meth:`state`)."""
        shapes = [[tuple(local_tensor(p).shape) for g in o.param_groups for p in g["params"]]
                  for o in self.trainer.optimizer.state_owners()]
        check_peer_state(peer, own, steps=self.config.steps, param_shapes=shapes)

    def load(self, state: dict) -> int:
        """Load a live peer's state (the heal); returns the step this node goes on from."""
        t = self.trainer
        load_local_state(dict(t._shards), state["params"], what="parameters")
        load_local_state(dict(t.model.named_buffers()), state["buffers"], what="buffers")
        for owner, peer in zip(t.optimizer.state_owners(), state["optimizer"], strict=True):
            load_optimizer_local_state(owner, peer, t.topology)
        t.scheduler.load_state_dict(state["scheduler"])
        t.optimizer.reset_replica_state()
        t.clock = {"train_time_s": float(state["trainer"]["train_time_s"]), "tokens": int(state["trainer"]["tokens"])}
        self.healed_to = int(state["trainer"]["step"])
        if self.config.window_quorum:
            # The peer's state is from some moment of its window (each rank's from its own peer, at
            # its own moment): every rank goes on at the window's last inner step.
            skip = t.optimizer.skip_to_outer_step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()" on a new node
                for _ in range(skip):
                    t.scheduler.step()
            self.healed_to += skip
        return self.healed_to

    def _record(self) -> None:
        """``ft_rank{R}.json``: membership, healing and dropped steps of this rank, a digest of its shards, and the
        members it reported to the Lighthouse's gate for bad messages (by slot: the gate's answer)."""
        t, ft = self.trainer, self.torchft
        h = hashlib.sha256()
        for name, p in t.model.named_parameters():
            h.update(name.encode())
            h.update(local_tensor(p).detach().cpu().contiguous().numpy().tobytes())
        record = {"rank": t.rank, "node": self.config.node, "replicas": ft.last_members,
                  "committed_steps": ft.committed_steps, "dropped_steps": t.optimizer.stats().dropped_steps,
                  "healed": ft.healed_at, "quorum_s": ft.quorum_s, "commit_s": ft.commit_s,
                  "param_sha256": h.hexdigest(), "steps": t.steps_done,
                  "reported": {str(member_of(r)[1]): why or "counted" for r, why in ft.reported.items()}}
        (t.out / f"ft_rank{t.rank}.json").write_text(json.dumps(record, indent=1))


def _reshard(model: torch.nn.Module) -> None:
    """Put every FSDP2 unit in its sharded state (after a forward pass the root may hold full parameters)."""

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
