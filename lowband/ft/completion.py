"""A job that knows when it is done: the Lighthouse's gate records the step at which a member committed the job's
last step, and a node that comes back after that is told so and leaves (exit 0) instead of training alone.

A node whose run trained and committed the job's last step reports :data:`DONE` to the gate (rank 0 of the node,
at the end of its run: :meth:`lowband.ft.session.FaultTolerantSession.finish`), with where its final checkpoint is.
The gate counts it only from a member of the current quorum round (its replica id proves the job's secret, and is
the round's member of its slot), from the address its tag vouches for, and for a step no earlier than the one the
member was at in that round. Each member's replica id names the job's last step (``--steps``), bound to the secret
by its tag (:func:`lowband.trust.admission.replica_id`; with a roster the id is the one its key registered). The job
is complete at a step once a member reported it and every member of the round named that step its last and was at
that step's quorum: the end is then each member's own word, and a round whose other members died after the last
commit ends on one report. A report of another step (``--stop-file``) counts once more than half of the round's
members reported it: one member alone (a liar with the secret could claim any step) cannot end a job of two or more.
Later reports of the same step add their checkpoints to the answer. With ``lowband lighthouse --completion-file PATH`` the record is kept in a file, and a
Lighthouse started again reads it back.

After that the gate answers a node's admission question (and its quorum requests) with :data:`COMPLETE` and the
step and checkpoints; the node raises :class:`JobComplete`, which ``lowband train`` turns into exit 0 with that
message. A node alone *during* the job trains on, as before. Without a secret there is no gate and no record.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from lowband.ft.protowire import call_gate, parse_fields, sign_request, string_field, string_of
from lowband.trust.admission import claim_of

__all__ = ["COMPLETE", "DONE", "MAX_WHERE_CHARS", "RECORD_FORMAT", "CompletionRecord", "JobComplete", "complete_reason", "done_fields",
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


def done_request(rid: str, address: str, store: str, step: int, where: str, *, key=None,
                 secret: bytes | None = None) -> bytes:
    """The bytes of a :data:`DONE` call: the reporting member as in :func:`lowband.ft.gateway.admission_request`
    (field 1), the job's last step it committed (field 2, decimal) and its final checkpoint's path (field 3); signed
    with the member's ``key`` (a :class:`lowband.trust.keys.MemberKey`) when given, else tagged with the job's
    ``secret`` when given."""
    member = string_field(1, rid.encode()) + string_field(2, address.encode()) + string_field(3, store.encode())
    body = (string_field(1, member) + string_field(2, str(int(step)).encode())
            + string_field(3, where.encode()[:4 * MAX_WHERE_CHARS].decode("utf-8", "ignore").encode()))
    return sign_request(key, DONE, body, secret=secret)


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


#: The format of a completion record kept in a file (``lowband lighthouse --completion-file``).
RECORD_FORMAT = "lowband-completion/1"
#: The largest record file read back: a step, a fingerprint and a path per slot fit in far less.
MAX_RECORD_BYTES = 1 << 20


class CompletionRecord:
    """The gate's record of the job's end: the step at which it is complete, and where each reporting node's final
    checkpoint is (slot -> path). Bounded: one report per slot of the round (a later one replaces it).

    ``path``: a file that keeps the record, so that a Lighthouse started again still knows the job ended (written
    when the job is complete, read back at start; the record then applies to the job's fingerprint only). A file
    that is not such a record is refused at start with what to do, never guessed at."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self.step: int | None = None
        self.where: dict[int, str] = {}
        self.fingerprint: str | None = None  # the job's, once it is complete
        self._reports: dict[int, tuple[int, str]] = {}  # slot -> (step, where), before the job is complete
        self.path = Path(path) if path is not None else None
        if self.path is not None and self.path.exists():
            self.step, self.where, self.fingerprint = _read_record(self.path)
            log.warning("the Lighthouse's gate: the job %s is complete at step %d (record %s): a node of it that "
                        "asks is told so and leaves; delete the file to run the job again", self.fingerprint,
                        self.step, self.path)

    def applies_to(self, fingerprint: str | None) -> bool:
        """Whether the job is complete for a node whose replica id claims the job ``fingerprint`` (the record read
        from a file is one job's: another job that shares the secret and the file is not told it is complete)."""
        return self.step is not None and (self.fingerprint is None or fingerprint == self.fingerprint)

    def _save(self) -> None:
        """Keep the record in :attr:`path` (a temporary file renamed over it, readable by its owner only)."""
        if self.path is None:
            return
        body = json.dumps({"format": RECORD_FORMAT, "fingerprint": self.fingerprint, "step": self.step,
                           "where": {str(s): w for s, w in sorted(self.where.items())}})
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
        os.replace(tmp, self.path)

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
        if claim.last_step is not None and step > claim.last_step:
            return f"it reports step {step}, after the job's last step ({claim.last_step})"
        with self._lock:
            if self.step is not None:
                if step != self.step:
                    return f"the job is already complete at step {self.step}"
                self.where[claim.node] = where
                self._save()
                return None
            self._reports = {s: r for s, r in self._reports.items() if s in members}
            self._reports[claim.node] = (step, where)
            agree = {s: w for s, (at_step, w) in self._reports.items() if at_step == step}
            last = all(_last_step(rid) == step and at >= step - 1 for rid, at in members.values())
            if 2 * len(agree) > len(members) or last:
                self.step, self.where, self.fingerprint = step, agree, claim.fingerprint
                self._save()
                log.warning("the Lighthouse's gate: the job is complete at step %d (%d of the round's %d members "
                            "reported it%s; final checkpoints %s); a node that comes back now is told so and leaves",
                            step, len(agree), len(members), ", each named it the job's last" if last else "", agree)
        return None

    @property
    def complete(self) -> bool:
        return self.step is not None

    def answer(self) -> str:
        """What a node that asks after the job is complete is told: the step and the final checkpoints."""
        with self._lock:
            where = ", ".join(f"node{slot} at {path}" for slot, path in sorted(self.where.items()))
            return f"at step {self.step}; final checkpoints: {where}"


def _last_step(rid: str) -> int | None:
    """The job's last step that a member's replica id names (None: it names none)."""
    claim = claim_of(rid)
    return None if claim is None else claim.last_step


def _read_record(path: Path) -> tuple[int, dict[int, str], str]:
    """(step, {slot: final checkpoint}, fingerprint) of a record file; a ValueError that names the file otherwise."""
    fix = f"delete {path} (or pass another --completion-file) to run the job again"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
        record = json.loads(raw.decode("utf-8"))
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
            raise ValueError(f"not a {RECORD_FORMAT} record")
        step, fp, where = record.get("step"), record.get("fingerprint"), record.get("where")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1 or not isinstance(fp, str) or not fp \
                or not isinstance(where, dict) or len(where) > 4096:
            raise ValueError("its step, fingerprint or checkpoints are not what a record holds")
        slots = {int(k): str(v)[:MAX_WHERE_CHARS] for k, v in where.items() if str(k).isdigit() and len(str(k)) <= 9}
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"the job's completion record {path} cannot be read: {e}; {fix}") from None
    return step, slots, fp


def complete_reason(message: str) -> str | None:
    """The gate's answer in an error's ``message`` when it says the job is complete, else None."""
    if COMPLETE not in message:
        return None
    return message.split(COMPLETE, 1)[1].split('", details', 1)[0].lstrip(": ")


def job_complete(lighthouse: str, answer: str) -> JobComplete:
    """The exception of a node told by the gate at ``lighthouse`` that the job is complete (``answer``: the gate's)."""
    return JobComplete(f"the job at {lighthouse} is complete {answer}. This node trains nothing: the job's result is "
                       "in those checkpoints (start a new job, with a new --out, to train on).")


def report_done(lighthouse: str, rid: str, step: int, where: str, *, timeout_s: float = 10.0, key=None,
                secret: bytes | None = None) -> str | None:
    """Report to the gate at ``lighthouse`` that this member (replica id ``rid``, the node's rank 0) committed the
    job's last ``step``, its final checkpoint at ``where`` (signed with the member's ``key`` when given, else tagged
    with the job's ``secret``): None when
    the gate counted it, else why not (no gate: torchft's own Lighthouse; unreachable; or the report was refused)."""
    claim = claim_of(rid)
    if claim is None:
        return f"{rid[:80]!r} is not a lowband replica id"
    return call_gate(lighthouse, DONE, done_request(rid, f"http://{claim.manager}", claim.store, step, where, key=key,
                                                    secret=secret), timeout_s=timeout_s)
