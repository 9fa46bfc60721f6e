"""FlexDeMo's screen of what an exchange brings: every gathered message checked before use.

:class:`ScreenMixin` holds that part of :class:`~lowband.optim.flexdemo.optimizer.FlexDeMo`: the messages that
fail their check (:mod:`lowband.compress.check`), come from an evicted member, or refuse their step
while most members did not (under a robust ``aggregate``) are left out, named and counted; a refusal
that stands refuses the step for every replica (``nonfinite``). It runs on the optimizer's state and
imports nothing of FlexDeMo.
"""

from __future__ import annotations

import logging

import torch

from lowband.compress.check import check_messages, wire_problems
from lowband.optim._common import NonFiniteGradientError, membership_key, outvoted_refusals

__all__ = ["ScreenMixin"]

log = logging.getLogger("lowband.optim.flexdemo.optimizer")

#: A message's flag byte: 0 counts, 1 refuses the step (non-finite), 2 does not count (a node healing
#: under fault tolerance's async quorum computed it on stale weights).
_NOT_COUNTED = 2


class ScreenMixin:
    """The screen of :class:`~lowband.optim.flexdemo.optimizer.FlexDeMo`'s exchange (a mixin: it runs on its state)."""

    def _screen(self, work: list, gathered: torch.Tensor) -> torch.Tensor:
        """The gathered messages that pass their check (:mod:`lowband.compress.check`): size, flag in
        {0, 1, 2}, indices below the chunk (t² for tiles), finite values and sign scales. A bad one is
        left out of the mean (every rank holds the same bytes: the same verdict), named and counted."""
        def payload(rows: torch.Tensor) -> list:
            reasons: list = [None] * rows.shape[0]
            offset = 0
            for w in work:
                part = wire_problems(w.plan.wire, w.plan.rows)(rows[:, offset:offset + w.plan.nbytes])
                reasons = [a or b for a, b in zip(reasons, part, strict=True)]
                offset += w.plan.nbytes
            return reasons

        bad = check_messages(gathered, nbytes=sum(w.plan.nbytes for w in work) + 1, dtype=torch.uint8,
                             allowed_flags=(0, 1, _NOT_COUNTED), payload=payload)
        self.bad_messages.membership(membership_key(self.link))
        self.agreement.membership(membership_key(self.link))
        bad += self.bad_messages.evicted_among(range(gathered.shape[0]), bad)
        named, own = {b.sender for b in bad}, getattr(self.link, "group_rank", None) if self.link is not None else 0
        out, own_out = [], False
        if self.aggregate != "mean" and not self.overlap:  # else every refusal refuses the step: no flags read here
            flags = {r: f for r, f in enumerate(gathered[:, -1].tolist()) if r not in named and f != _NOT_COUNTED}
            out, own_out = outvoted_refusals(flags, self.aggregate, own=own)
        self.bad_messages.record(bad := bad + out, range(gathered.shape[0]), "FlexDeMo exchange",
                                 "its message is left out of this step's mean")
        skip_own = own_out and self.nonfinite == "skip"  # its refusal outvoted: it steps with the others' mean
        self.skipped_steps += int(skip_own)
        senders = {b.sender for b in bad} | ({own} if skip_own else set())
        self._senders = [r for r in range(gathered.shape[0]) if r not in senders]
        return gathered[self._senders] if len(self._senders) < gathered.shape[0] else gathered

    def _refused(self, gathered: torch.Tensor) -> bool:
        """True if any replica flagged its step; every rank sees the same flags, so all agree."""
        if not bool(gathered[:, -1].any()):
            return False
        if self.nonfinite == "raise":
            raise NonFiniteGradientError("a gradient holds NaN or Inf on at least one rank; the step was refused before "
                                         "anything non-finite was sent or anything was changed. Lower the learning rate, "
                                         "clip gradients, or pass nonfinite='skip' (lowband train: --nonfinite skip) to "
                                         "skip such steps.")
        self.skipped_steps += 1
        log.warning("non-finite gradient: step skipped (%d skipped so far)", self.skipped_steps)
        return True
