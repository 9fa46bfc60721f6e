"""A node's view of each quorum under fault tolerance (:mod:`lowband.ft.node`): who is in it, whether they are all
of this node's job (:func:`lowband.trust.admission.screen`, :func:`lowband.trust.admission.admit`), and what the
Lighthouse's gate says of this node (:mod:`lowband.ft.gateway`): refused at admission, removed from the job, or
told that the job is complete (:mod:`lowband.ft.completion`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lowband.ft.completion import JobComplete, complete_reason, job_complete
from lowband.ft.gateway import HELD_OUT, KEPT_OUT, PINNED, UNREGISTERED, ask_gate, gate_reason, gate_status
from lowband.trust.admission import AdmissionRefused, RemovedFromJob, admit, claim_of, member_of, screen

__all__ = ["GATE_POLL_S", "HELD_POLL_S", "QuorumLost", "ForeignJob", "NodeSlotTaken", "QuorumRecorder", "gate_refusal", "wait_held_out"]

log = logging.getLogger("lowband.ft.node")

#: While a quorum takes longer than this, a node with the job's secret asks the Lighthouse's gate (every this many
#: seconds) whether it is still a member.
GATE_POLL_S = 2.0
#: How many times in a row a node with the job's secret asks again for a quorum whose request timed out while the gate
#: admits it (torchft's Manager does not retry a failed request to the Lighthouse: its ranks wait out the timeout). A
#: request the gate saw end without a quorum (:class:`QuorumLost`) is asked again for up to the quorum timeout.
QUORUM_RETRIES = 3
#: After this many polls in a row at which the gate held no quorum call of a one-rank node whose call waits, its
#: request never reached the gate (its connection broke before it was sent): it asks again. A node of several ranks
#: waits there legitimately while its other ranks have not asked yet (torchft's Manager asks once all have).
ABSENT_POLLS = 3
#: How often a node that the gate holds out asks whether it may join again.
HELD_POLL_S = 10.0


#: What a node refused for want of the job's secret is told to do (after the reason).
SAME_SECRET = ("Start every node of a job with the same secret: --secret-file PATH or LOWBAND_SECRET_FILE=PATH (one "
               "file, copied to every node; `lowband secret PATH` makes one). This node leaves before any process "
               "group includes it; the running job goes on.")


def gate_refusal(cfg: Any, why: str) -> AdmissionRefused:
    """The error of a node that the Lighthouse's gate refused (``cfg``: its :class:`lowband.ft.node.FaultToleranceConfig`;
    ``why``: the gate's reason)."""
    if KEPT_OUT in why:  # a member the gate removed from the job (it stalled it, or sent bad messages)
        return RemovedFromJob(f"node {cfg.node} is removed from the job at {cfg.lighthouse}: {why}. This node "
                              "leaves; the running job goes on without it.")
    if why.startswith(("not the process its member registered", "the call is not signed by its member's key",
                       "the call came from another address")):  # a job with a roster (lowband.trust.keys)
        return AdmissionRefused(f"node {cfg.node} is refused by the job at {cfg.lighthouse}: {why}. In a job with a "
                                "roster each node signs with its own key (--key-file, the roster's for its --ft-node) "
                                "and calls from the address it advertises; a node slot is held by the process that "
                                "registered last. This node leaves; the running job goes on.")
    return AdmissionRefused(f"node {cfg.node} is refused by the job at {cfg.lighthouse}: its Lighthouse admits only "
                            f"the job's members, and {why}. {SAME_SECRET}")


def wait_held_out(cfg: Any, why: str | None, ask: Callable[[], str | None]) -> str | None:
    """While the gate holds this node out (:data:`HELD_OUT` in ``why``: the job's steps failed while it was in the
    quorum, which proves nothing of its own), wait, asking again (``ask``: the gate's answer) every
    :data:`HELD_POLL_S`; then the gate's last answer (None: it may join, and heals like a node that was away)."""
    if why is not None and HELD_OUT in why:
        log.warning("node %d: %s. This node waits (it asks the gate every %.0f s), then joins again and heals.",
                    cfg.node, why, HELD_POLL_S)
    while why is not None and HELD_OUT in why:
        time.sleep(HELD_POLL_S)
        why = ask()
    return why


class QuorumLost(TimeoutError):
    """This node's quorum request ended at the gate without a quorum, and torchft's Manager will not retry it."""


class NodeSlotTaken(ValueError):
    """Another live process already holds this node's ``--ft-node`` slot."""


class ForeignJob(ValueError):
    """A node of another job (another fingerprint) is in this node's quorum and this node is the one to leave."""


class QuorumRecorder:
    """torchft's manager client with the members of each quorum noted (torchft keeps only their count),
    and only members of this node's job admitted (see :func:`admit`)."""

    def __init__(self, client, ft: Any) -> None:  # ft: the rank's lowband.ft.node.FaultTolerance
        self._client = client
        self._ft = ft

    def _refused(self, why: str) -> AdmissionRefused:
        err = gate_refusal(self._ft.cfg, why)
        self._ft.removed = isinstance(err, RemovedFromJob)
        return err

    def _ask(self, *, register: bool = False) -> str | None:
        """The gate's answer to this node's question, None when it may pass. Unsigned it registers nothing; with
        ``register`` (a job with a roster) it registers this process again, signed, and then names its connections
        to the gate again (the new registration named none)."""
        cfg, claim = self._ft.cfg, claim_of(self._ft.replica_id)
        signed = dict(key=cfg.key) if register else {}
        why = ask_gate(cfg.lighthouse, self._ft.replica_id, f"http://{claim.manager}", claim.store,
                       timeout_s=GATE_POLL_S, **signed)
        pins = getattr(self._ft, "pins", None)
        if register and why is None and pins is not None:
            pins.renew()
        return why

    def _asked(self, *args, **kwargs):
        """torchft's quorum call. With the job's secret, while it waits (more than :data:`GATE_POLL_S`) this node
        asks the Lighthouse's gate whether it is still a member: a node the gate removed learns why at once
        (torchft's Manager retries a quorum the gate refuses until its timeout, then reports only the timeout)."""
        cfg = self._ft.cfg
        claim = claim_of(self._ft.replica_id)
        if cfg.secret is None or claim is None:
            return self._client._quorum(*args, **kwargs)
        done, answer, told, absent = threading.Event(), {}, False, 0

        def call() -> None:
            try:
                answer["result"] = self._client._quorum(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                answer["error"] = e
            done.set()
        threading.Thread(target=call, daemon=True, name="lowband-quorum").start()  # daemon: a call left waiting
        started = time.monotonic()
        while not done.wait(GATE_POLL_S):  # after a refusal must not hold the process up until its timeout
            try:
                asked = time.monotonic()
                status = gate_status(cfg.lighthouse, self._ft.replica_id, f"http://{claim.manager}", claim.store,
                                     timeout_s=GATE_POLL_S)
                why = status.why
                # The gate dated the loss when it answered, after ``asked``: measured from there, a loss within the
                # call's age ended this call (a quorum call may have begun just before its connection broke).
                if (why is None and status.in_flight == 0 and status.lost_age_s is not None
                        and status.lost_age_s < asked - started):
                    # This node's request reached the gate after its call began and ended without a quorum (its
                    # connection broke, or it was refused): torchft's Manager does not retry it, and its ranks
                    # would wait out the whole timeout. The call is left behind (a daemon); the node asks again.
                    raise QuorumLost(f"node {cfg.node}'s quorum request ended at the Lighthouse's gate "
                                     f"{status.lost_age_s:.1f} s ago without a quorum")
                absent = absent + 1 if why is None and status.in_flight == 0 else 0
                if absent >= ABSENT_POLLS and getattr(self._ft, "local_ranks", 0) == 1:
                    raise QuorumLost(f"node {cfg.node}'s quorum request has not been at the Lighthouse's gate for "
                                     f"{absent * GATE_POLL_S:.0f} s")
                if why is not None and cfg.key is not None and UNREGISTERED in why:
                    # A gate that forgot this process (the Lighthouse was restarted): registered again, signed. A
                    # process that another one of the node replaced is told so and leaves (it does not take it back).
                    why = self._ask(register=True)
            except JobComplete:
                self._ft.removed = True  # leave now: torchft's Manager would wait out its refused quorum request
                raise
            if why is not None and HELD_OUT not in why:  # held out: the gate holds its quorum request, it waits
                raise self._refused(why)
            if why is not None and not told:
                told = log.warning("node %d: %s; its quorum request waits at the gate", cfg.node, why) or True
        if "error" in answer:
            raise answer["error"]
        return answer["result"]

    def _quorum(self, *args, **kwargs):
        cfg = self._ft.cfg
        me = self._ft.replica_id
        mine = member_of(me)[0]  # the fingerprint as the others see it
        max_rounds = cfg.poll_rounds
        rounds = failed = 0
        first_lost: float | None = None  # when a request of this quorum was first lost at the gate
        while True:
            try:
                result = self._asked(*args, **kwargs)
            except (RuntimeError, TimeoutError) as e:  # the Lighthouse's gate refused this node (lowband.ft.gateway)
                done = complete_reason(str(e))
                if done is not None:  # the job ended while this node waited for its quorum
                    self._ft.removed = True
                    raise job_complete(cfg.lighthouse, done) from None
                why = gate_reason(str(e))
                claim = claim_of(me)
                if why is None and cfg.secret is not None and claim is not None:  # a timeout: what says the gate?
                    why = self._ask()
                    lost = isinstance(e, QuorumLost)  # seen at the gate within seconds: asked again for a while
                    first_lost = first_lost if first_lost is not None or not lost else time.monotonic()
                    if why is None and ((lost and time.monotonic() - first_lost < cfg.quorum_timeout_s)
                                        or (not lost and failed < QUORUM_RETRIES)):
                        # torchft's Manager leaves its ranks waiting out their timeout when its request to the
                        # Lighthouse failed (a broken connection, a refusal): the gate has nothing against this node
                        failed += not lost
                        log.warning("node %d: its quorum request failed (%s); the gate admits it: it asks again",
                                    cfg.node, str(e)[:200])
                        continue
                if why is None:
                    raise
                if HELD_OUT in why:
                    why = wait_held_out(cfg, why, self._ask)
                    if why is None:
                        continue  # it may join again: the next quorum (it heals, like a node that was away)
                if ((UNREGISTERED in why or PINNED in why) and cfg.key is not None and claim is not None
                        and rounds < max_rounds):  # the gate forgot this process (a restarted Lighthouse), or its
                    why = self._ask(register=True)  # connection broke and another took it: registered again
                    if why is None:
                        rounds += 1
                        continue
                raise self._refused(why) from None
            step = kwargs.get("step")
            behind = bool(result.heal) or (step is not None and int(result.max_step) > int(step))
            new = not self._ft.had_peers
            # Before anything is configured, sent or fetched: does every member prove the job's secret?
            s = screen(result, secret=cfg.secret, me=me, new=new, behind=behind)
            if s.verdict == "twin":
                raise NodeSlotTaken(f"node slot {cfg.node} is already live in this job: stop the other process, or "
                                    f"start this one with a free slot (0..{cfg.max_nodes - 1}). The running job goes on.")
            if s.verdict == "refused" or (s.verdict == "retry" and new and s.peers == 0 and rounds >= max_rounds):
                raise AdmissionRefused(
                    f"node {cfg.node} is refused by the job at {cfg.lighthouse}: {s.why or 'no member proves its secret'} "
                    f"({len(s.outsiders)} member(s) do not prove this node's secret). {SAME_SECRET}")
            if s.verdict == "retry":
                if rounds % max_rounds == 0:
                    log.warning("node %d: %s (%d member(s) that do not prove the job's secret); the quorum is not "
                                "used and is asked for again (this node never trains with, heals from or sends "
                                "state to them; see docs/internet.md)", cfg.node, s.why, len(s.outsiders))
                rounds += 1
                time.sleep(cfg.start_poll_s)
                continue
            # A tie between jobs waits half the quorum timeout for more of their nodes before the fingerprint
            # decides (the job's other nodes may still be starting); the rest of it is for the losers to leave.
            verdict = admit(list(result.replica_ids), mine, behind=behind, rounds=rounds,
                            patience=max(1, max_rounds // 2))
            if verdict == "accept":
                break
            others = sorted({f"node{member_of(r)[1]} ({member_of(r)[0] or '?'})" for r in result.replica_ids
                             if member_of(r)[0] != mine})
            if verdict == "leave" or rounds >= max_rounds:
                raise ForeignJob(
                    f"node {cfg.node}: nodes of this Lighthouse's quorum run another job, model, method or "
                    f"hyper-parameters ({', '.join(others)}; this node's fingerprint is {mine}). Start every "
                    "node of a job with the same `lowband train` arguments, or give each job its own Lighthouse "
                    "(--ft-lighthouse). " + ("This node leaves; the running job goes on." if verdict == "leave"
                                               else "They did not leave within the quorum timeout."))
            if rounds == 0:
                log.warning("node %d: %s of another job joined the quorum; it is refused, and the quorum formed "
                            "again without it", cfg.node, ", ".join(others))
            rounds += 1
            time.sleep(cfg.start_poll_s)
        self._ft.replica_ids = list(result.replica_ids)
        self._ft.had_peers = self._ft.had_peers or len(self._ft.replica_ids) > 1
        self._ft.replica_rank = result.replica_rank
        self._ft.quorum_heals = bool(result.heal)
        self._ft.quorum_max_step = int(result.max_step)
        return result

    def __getattr__(self, name: str):
        return getattr(self._client, name)
