"""FlexDeMo's screen of what an exchange brings: every gathered message checked before use.

:class:`ScreenMixin` holds that part of :class:`~lowband.optim.flexdemo.optimizer.FlexDeMo`: the messages that
fail their check (:mod:`lowband.compress.check`), come from an evicted member, or refuse their step
while most members did not (under a robust ``aggregate``) are left out, named and counted; a refusal
that stands refuses the step for every replica (``nonfinite``). It runs on the optimizer's state and
imports nothing of FlexDeMo.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from lowband.compress.check import (
    NOT_COUNTED,
    BadMessage,
    check_messages,
    index_and_value_problems,
    payload_faults,
)
from lowband.optim._common import NonFiniteGradientError, membership_key, outvoted_refusals

__all__ = ["ScreenMixin", "Screened"]

log = logging.getLogger("lowband.optim.flexdemo.optimizer")

#: A message's flag byte: 0 counts, 1 refuses the step (non-finite), 2 does not count (a node healing
#: under fault tolerance's async quorum computed it on stale weights).
_NOT_COUNTED = NOT_COUNTED
_FLAGS = (0, 1, _NOT_COUNTED)


class Screened(NamedTuple):
    """What passed the screen: the kept messages (rows of the gather), their flags, read on the host,
    each work's decoded (indices, values) of those rows (None where the messages could not be decoded),
    and whether this rank's own message was a refusal (its local verdict, read in the same host read)."""

    rows: torch.Tensor
    flags: list[int]
    decoded: list | None
    own_refused: bool

    def without(self, flag: int) -> Screened:
        """The same, less the rows with ``flag``."""
        return self.select([i for i, f in enumerate(self.flags) if f != flag])

    def select(self, keep: list[int]) -> Screened:
        """The same, only the rows ``keep`` (in that order)."""
        if len(keep) == len(self.flags):
            return self
        index = torch.tensor(keep, dtype=torch.long, device=self.rows.device)
        decoded = None if self.decoded is None else [(i.index_select(0, index), v.index_select(0, index))
                                                     for i, v in self.decoded]
        return Screened(self.rows.index_select(0, index), [self.flags[i] for i in keep], decoded, self.own_refused)


class ScreenMixin:
    """The screen of :class:`~lowband.optim.flexdemo.optimizer.FlexDeMo`'s exchange (a mixin: it runs on its state)."""

    def _screen(self, work: list, gathered: torch.Tensor, own_refused: torch.Tensor | None = None) -> Screened:
        """The gathered messages that pass their check (:mod:`lowband.compress.check`): size, flag in
        {0, 1, 2}, indices below the chunk (t² for tiles), finite values and sign scales. A bad one is
        left out of the mean (every rank holds the same bytes: the same verdict), named and counted.

        The messages are decoded once, here, and the decoded rows go on to the step. What the checks
        found, the flags and this rank's own verdict (``own_refused``, a one-element tensor on the
        device, as :meth:`_compress` left it) are read back from the device together: one host
        synchronisation for the whole exchange; a bad message costs one more, to name what is wrong."""
        nbytes = sum(w.plan.nbytes for w in work) + 1
        replicas = gathered.shape[0]
        decoded = None
        if gathered.dim() == 2 and gathered.dtype == torch.uint8 and gathered.shape[1] == nbytes:
            decoded, faults, offset = [], [], 0
            for w in work:
                idx, vals = w.plan.wire.unpack_many(gathered[:, offset:offset + w.plan.nbytes], w.plan.rows)
                decoded.append((idx, vals))
                faults.append(payload_faults(idx, vals, w.plan.wire.chunk))
                offset += w.plan.nbytes
            parts = [gathered[:, -1].long(), *(f.long() for f in faults)]
            if own_refused is not None:
                parts.append(own_refused.reshape(1).long())
            host = torch.cat(parts).tolist()  # the exchange's one read of the device
            flags = host[:replicas]
            own = bool(host[-1]) if own_refused is not None else False
            bad = [BadMessage(r, f"flag {f!r} not in {list(_FLAGS)}") for r, f in enumerate(flags) if f not in _FLAGS]
            for j, w in enumerate(work):
                for r in range(replicas):
                    if flags[r] == 0 and host[replicas * (j + 1) + r] and r not in {b.sender for b in bad}:
                        idx, vals = decoded[j]
                        reason = index_and_value_problems(idx[r:r + 1], vals[r:r + 1], w.plan.wire.chunk)[0]
                        bad.append(BadMessage(r, reason))
            bad.sort(key=lambda b: b.sender)
        else:  # not this step's layout: every message is bad, and nothing is decoded
            bad = check_messages(gathered, nbytes=nbytes, dtype=torch.uint8, allowed_flags=_FLAGS, payload=None)
            flags = [0] * replicas
            own = bool(own_refused.item()) if own_refused is not None else False
        self.bad_messages.membership(membership_key(self.link))
        self.agreement.membership(membership_key(self.link))
        bad += self.bad_messages.evicted_among(range(replicas), bad)
        named, mine = {b.sender for b in bad}, getattr(self.link, "group_rank", None) if self.link is not None else 0
        out, own_out = [], False
        if self.aggregate != "mean" and not self.overlap:  # else every refusal refuses the step: no flags read here
            votes = {r: f for r, f in enumerate(flags) if r not in named and f != _NOT_COUNTED}
            out, own_out = outvoted_refusals(votes, self.aggregate, own=mine)
        self.bad_messages.record(bad := bad + out, range(replicas), "FlexDeMo exchange",
                                 "its message is left out of this step's mean")
        skip_own = own_out and self.nonfinite == "skip"  # its refusal outvoted: it steps with the others' mean
        self.skipped_steps += int(skip_own)
        senders = {b.sender for b in bad} | ({mine} if skip_own else set())
        self._senders = [r for r in range(replicas) if r not in senders]
        return Screened(gathered, flags, decoded, own).select(self._senders)

    def _refused(self, flags: list[int]) -> bool:
        """True if any replica flagged its step; every rank sees the same flags, so all agree."""
        if not any(flags):
            return False
        if self.nonfinite == "raise":
            raise NonFiniteGradientError("a gradient holds NaN or Inf on at least one rank; the step was refused before "
                                         "anything non-finite was sent or anything was changed. Lower the learning rate, "
                                         "clip gradients, or pass nonfinite='skip' (lowband train: --nonfinite skip) to "
                                         "skip such steps.")
        self.skipped_steps += 1
        log.warning("non-finite gradient: step skipped (%d skipped so far)", self.skipped_steps)
        return True
