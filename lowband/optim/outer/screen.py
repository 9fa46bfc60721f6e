"""The screen of the outer step's messages (:class:`~lowband.optim.outer.base.OuterStepOptimizer`, a mixin: it runs
on the optimizer's state): which senders' messages are left out of the mean, and what a replica whose state is stale
sends instead of its values."""

from __future__ import annotations

import torch

from lowband.compress.check import (
    NOT_COUNTED,
    UNATTRIBUTED,
    BadMessage,
    PayloadCheck,
    check_messages,
    mean_flag_problem,
)
from lowband.optim._common import all_finite, membership_key, outvoted_refusals

__all__ = ["ScreenMixin"]


class ScreenMixin:
    """The checks of the outer step's messages (:mod:`lowband.compress.check`), on the optimizer's ``link``,
    ``aggregate``, ``bad_messages`` and ``outer_steps``."""

    def _screen(self, messages: torch.Tensor | list[torch.Tensor], senders: list[int], *, nbytes: int,
                dtype: torch.dtype, payload: PayloadCheck | None, flags: list | None = None) -> set[int]:
        """The senders whose message is left out of the mean: it fails its check (:mod:`lowband.compress.check`:
        size, flag in {0, 1, :data:`NOT_COUNTED`}, payload), named in a warning and counted, or it is marked
        :data:`NOT_COUNTED` (its sender's state is stale: it takes part with nothing that counts; not counted as
        bad). ``flags``: the messages' flags already read on the host."""
        rows = list(messages.unbind(0)) if isinstance(messages, torch.Tensor) else list(messages)
        if flags is None:  # read once, here, for the check and for the marks
            ends = [m[-1:].float() if m.dim() == 1 and m.numel() else torch.full((1,), float("nan"), device=m.device)
                    for m in rows]
            flags = torch.cat(ends).tolist() if ends else []
        bad = check_messages(messages, nbytes=nbytes, dtype=dtype, allowed_flags=(0, 1, NOT_COUNTED),
                             payload=payload, senders=senders, flags=flags)
        self.bad_messages.membership(membership_key(self.link))
        bad += self.bad_messages.evicted_among(senders, bad)
        named = {b.sender for b in bad}
        uncounted = {s for s, f in zip(senders, flags, strict=True) if f == NOT_COUNTED and s not in named}
        if self.aggregate != "mean":  # a minority's refusals are left out (mean: every refusal refuses the step)
            own = getattr(self.link, "group_rank", None) if self.link is not None else 0  # None: a stand-in link
            votes = {s: float(flags[i]) for i, s in enumerate(senders) if s not in named and s not in uncounted}
            bad += outvoted_refusals(votes, self.aggregate, own=own)[0]  # its own refusal raises as before
        self.bad_messages.record(bad, senders, f"{type(self).__name__} outer step {self.outer_steps}",
                                 "its message is left out of this outer step")
        return {b.sender for b in bad} | uncounted

    def _counting(self, sent: torch.Tensor) -> torch.Tensor:
        """What this replica sends: ``sent``, or, while its state is stale (it heals, or its heal was refused, under
        fault tolerance), zeros marked :data:`NOT_COUNTED`, which the others leave out of their mean."""
        if self.link is None or getattr(self.link, "participating", True):
            return sent
        out = torch.zeros_like(sent)
        out[-1] = NOT_COUNTED
        return out

    def _check_mean(self, flat: torch.Tensor) -> bool:
        """An all-reduced mean (values and a 0/1 flag): False, warned and counted under sender −1, if no
        count of 0/1 flags gives its flag or its values are not finite without a flag (a sum cannot
        name its sender: the outer step is dropped)."""
        link = self.link
        if link is None or link.group_size <= 1:
            return True
        counted = getattr(link, "counted", None)  # with fault tolerance: the members the mean counted
        problem = mean_flag_problem(flat, counted or getattr(link, "participants", link.group_size))
        if problem is None:
            self.bad_messages.record([], [UNATTRIBUTED], "", "")
            return True
        self.bad_messages.record([BadMessage(UNATTRIBUTED, problem)], [UNATTRIBUTED],
                                 f"{type(self).__name__} outer step {self.outer_steps}",
                                 "the outer step is dropped (state unchanged)")
        return False

    def _mean_finite(self, mean: torch.Tensor) -> bool:
        """The mean of messages that each passed their check is finite, or (values each finite but too
        large to add up) warned and counted under sender −1: no single sender is to blame by the rules."""
        if all_finite([mean]):
            return True
        self.bad_messages.record([BadMessage(UNATTRIBUTED, "the mean of messages that passed their checks is "
                                             "not finite (finite values too large to add up)")], [],
                                 f"{type(self).__name__} outer step {self.outer_steps}",
                                 "the outer step is dropped (state unchanged)")
        return False

    def _kept_senders(self, result: torch.Tensor, *, nbytes: int, payload: PayloadCheck,
                      flags: list | None = None) -> list[int]:
        """The replicas of an all-gather whose message passed its check (every rank holds the same bytes:
        the same verdict); the others are named, counted and left out. ``flags``: read already."""
        senders = list(range(result.shape[0]))
        bad = self._screen(result, senders, nbytes=nbytes, dtype=torch.uint8, payload=payload, flags=flags)
        return [r for r in senders if r not in bad]
