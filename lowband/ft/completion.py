"""A job that knows when it is done: the Lighthouse's gate records the step at which a member committed the job's
last step, and a node that comes back after that is told so and leaves (exit 0) instead of training alone.

A node whose run trained and committed the job's last step reports :data:`DONE` to the gate (rank 0 of the node,
at the end of its run: :meth:`lowband.ft.session.FaultTolerantSession.finish`), with where its final checkpoint is.
The gate counts it only from a member of the current quorum round (its replica id proves the job's secret, and is
the round's member of its slot), from the address its tag vouches for, and for a step no earlier than the one the
member was at in that round. The job is complete at a step once more than half of the round's members reported it:
one member alone (a liar with the secret could claim any step: the gate does not know the job's steps) cannot end a
job of two or more, and a member of the last round that died after its commit does not hold the end back where the
others are a majority. In a round of two both must report; where one died after the last commit the job is not
marked complete, and a node that returns trains alone as it did before. Later reports of the same step add their
checkpoints to the answer.

After that the gate answers a node's admission question (and its quorum requests) with :data:`COMPLETE` and the
step and checkpoints; the node raises :class:`JobComplete`, which ``lowband train`` turns into exit 0 with that
message. A node alone *during* the job trains on, as before. Without a secret there is no gate and no record.
"""

from __future__ import annotations

import logging
import threading

from lowband.ft.protowire import call_gate, parse_fields, sign_request, string_field, string_of
from lowband.trust.admission import claim_of

__all__ = ["COMPLETE", "DONE", "MAX_WHERE_CHARS", "CompletionRecord", "JobComplete", "complete_reason", "done_fields",
           "done_request", "job_complete", "report_done"]

log = logging.getLogger(__name__)

#: The gate's own call (answered by the gate, never forwarded): this member committed the job's last step.
DONE = "/lowband.LighthouseGate/Done"
#: In the message of the gate's answer to a node that asks after the job is complete.
COMPLETE = "lowband gateway: the job is complete"
#: The longest checkpoint path the gate keeps of one report (it is the node's own text, shown to others).
MAX_WHERE_CHARS = 300


class JobComplete(Exception):  # noqa: N818 - not an error: the job this node would join has ended
    """The job this node would join is complete: it leaves without training (``lowband train`` exits 0)."""


def done_request(rid: str, address: str, store: str, step: int, where: str, *, key=None) -> bytes:
    """The bytes of a :data:`DONE` call: the reporting member as in :func:`lowband.ft.gateway.admission_request`
    (field 1), the job's last step it committed (field 2, decimal) and its final checkpoint's path (field 3); signed
    with the member's ``key`` (a :class:`lowband.trust.keys.MemberKey`) when given."""
    member = string_field(1, rid.encode()) + string_field(2, address.encode()) + string_field(3, store.encode())
    body = (string_field(1, member) + string_field(2, str(int(step)).encode())
            + string_field(3, where.encode()[:4 * MAX_WHERE_CHARS].decode("utf-8", "ignore").encode()))
    return body if key is None else sign_request(key, DONE, body)


def done_fields(request: bytes) -> tuple[str, int, str]:
    """(reporter's replica id, step, where) of a :data:`DONE` request; a ValueError when malformed."""
    try:
        fields = parse_fields(request)
        member = (fields.get(1) or [b""])[-1]
        if not isinstance(member, bytes):
            raise ValueError("the report names no reporter")
        rid, step, where = string_of(parse_fields(member), 1), string_of(fields, 2), string_of(fields, 3)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e})") from None
    if not step.isdigit() or len(step) > 12:
        raise ValueError(f"the step is not a number ({step[:20]!r})")
    return rid, int(step), "".join(c if c.isprintable() else "?" for c in where[:MAX_WHERE_CHARS])


class CompletionRecord:
    """The gate's record of the job's end: the step at which it is complete, and where each reporting node's final
    checkpoint is (slot -> path). Bounded: one report per slot of the round (a later one replaces it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step: int | None = None
        self.where: dict[int, str] = {}
        self._reports: dict[int, tuple[int, str]] = {}  # slot -> (step, where), before the job is complete

    def done(self, reporter: str, host: str, step: int, where: str, members: dict[int, tuple[str, int]]) -> str | None:
        """A member's report that it committed the job's last ``step`` (its final checkpoint at ``where``), from the
        address ``host``; ``members``: the current round, slot -> (replica id, training step in that round). None
        when it counts, else why it does not."""
        claim = claim_of(reporter)
        if claim is None or claim.node not in members or members[claim.node][0] != reporter:
            return "the reporting member is not in the current quorum"
        own = claim.manager.rsplit(":", 1)[0].strip("[]")
        if host != own:
            return f"the report came from {host}, not from the reporting member's address ({own})"
        at = members[claim.node][1]
        if step < max(at, 1):
            return f"it reports step {step}, but it was at step {at} in the current quorum"
        with self._lock:
            if self.step is not None:
                if step != self.step:
                    return f"the job is already complete at step {self.step}"
                self.where[claim.node] = where
                return None
            self._reports = {s: r for s, r in self._reports.items() if s in members}
            self._reports[claim.node] = (step, where)
            agree = {s: w for s, (at_step, w) in self._reports.items() if at_step == step}
            if 2 * len(agree) > len(members):
                self.step, self.where = step, agree
                log.warning("the Lighthouse's gate: the job is complete at step %d (%d of the round's %d members "
                            "reported it; final checkpoints %s); a node that comes back now is told so and leaves",
                            step, len(agree), len(members), agree)
        return None

    @property
    def complete(self) -> bool:
        return self.step is not None

    def answer(self) -> str:
        """What a node that asks after the job is complete is told: the step and the final checkpoints."""
        with self._lock:
            where = ", ".join(f"node{slot} at {path}" for slot, path in sorted(self.where.items()))
            return f"at step {self.step}; final checkpoints: {where}"


def complete_reason(message: str) -> str | None:
    """The gate's answer in an error's ``message`` when it says the job is complete, else None."""
    if COMPLETE not in message:
        return None
    return message.split(COMPLETE, 1)[1].split('", details', 1)[0].lstrip(": ")


def job_complete(lighthouse: str, answer: str) -> JobComplete:
    """The exception of a node told by the gate at ``lighthouse`` that the job is complete (``answer``: the gate's)."""
    return JobComplete(f"the job at {lighthouse} is complete {answer}. This node trains nothing: the job's result is "
                       "in those checkpoints (start a new job, with a new --out, to train on).")


def report_done(lighthouse: str, rid: str, step: int, where: str, *, timeout_s: float = 10.0, key=None) -> str | None:
    """Report to the gate at ``lighthouse`` that this member (replica id ``rid``, the node's rank 0) committed the
    job's last ``step``, its final checkpoint at ``where`` (signed with the member's ``key`` when given): None when
    the gate counted it, else why not (no gate: torchft's own Lighthouse; unreachable; or the report was refused)."""
    claim = claim_of(rid)
    if claim is None:
        return f"{rid[:80]!r} is not a lowband replica id"
    return call_gate(lighthouse, DONE, done_request(rid, f"http://{claim.manager}", claim.store, step, where, key=key),
                     timeout_s=timeout_s)
