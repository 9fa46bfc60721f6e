"""FlexDeMo's overlapped exchange (``overlap=True``): the all-gather of step t runs while step t+1 computes.

:class:`OverlapMixin` holds that path of :class:`~lowband.optim.flexdemo.optimizer.FlexDeMo` (whose docstring
describes the two rules, ``overlap_apply="local"`` and ``"stale"``): starting a step's exchange
(:meth:`OverlapMixin._start_overlapped`), settling it at the next step or at :meth:`flush`, and
draining it into the state for a checkpoint. It uses the optimizer's own phases (``_commit``,
``_apply``, ``_refused``) and state; it imports nothing of FlexDeMo.
"""

from __future__ import annotations

import torch

from lowband.optim._common import local, replica_state_like, state_view

__all__ = ["OverlapMixin"]


class OverlapMixin:
    """The overlap path of :class:`~lowband.optim.flexdemo.optimizer.FlexDeMo` (a mixin: it runs on its state)."""

    def _start_overlapped(self, work: list, grads: list[list[torch.Tensor]], picks: list | None,
                          message: torch.Tensor) -> None:
        """overlap: commit this step (kept until every replica accepted it), start its all-gather and
        keep it in flight; with ``overlap_apply="local"`` step with the own update meanwhile.

        The own verdict is not read here: a refused message (zeros, flag 1) is committed too, and the
        settle that sees its flag rolls δ back (every refusal refuses the step under overlap), so the
        sender never waits for the device."""
        # Keep δ as it was until every replica accepted this step (known at the next step).
        params = [p for w in work for p in w.params]
        held = [p for p in params if self.state.get(p)]
        deltas = _copies([state_view(self.state[p]["delta"]) for p in held])
        steps = _copies([self.state[p]["step"] for p in held])
        kept = {p: (d, s) for p, d, s in zip(held, deltas, steps, strict=True)}
        backups = [(p, *kept.get(p, (None, None))) for p in params]
        if picks is not None:
            self._commit(work, grads, picks)
        handle = self.link.all_gather(message, async_op=True) if self.link is not None else message.unsqueeze(0)
        agreed = lrs = None
        if self.overlap_apply == "local":
            # The parameters every replica agrees on, to step with the mean once it arrives; until
            # then this replica steps with its own update, decoded from its message as the mean of
            # one replica would be (a copy: the all-gather is reading the message).
            agreed = dict(zip(params, _copies([local(p) for p in params]), strict=True))
            lrs = [w.group["lr"] for w in work]  # the mean is applied with them, as the blocking step
            if picks is not None:
                self._apply(work, message.unsqueeze(0).clone())
        self._flight = (handle, work, backups, agreed, lrs)

    def _settle(self) -> None:
        """overlap: finish the step in flight (or the one a checkpoint drained): apply or refuse it."""
        if self._flight is not None:
            handle, work, backups, agreed, lrs = self._flight
            self._flight = None
            gathered = handle if isinstance(handle, torch.Tensor) else handle.wait()
            if agreed is not None:  # "local": back to the agreed parameters, then the blocking step from there
                torch._foreach_copy_([local(p) for p in agreed], list(agreed.values()))
            screened = self._screen(work, gathered)  # bad messages left out, named and counted
            if not screened.flags or any(screened.flags):
                self._roll_back(backups)
                if not screened.flags:
                    self.dropped_steps += 1
                else:
                    self._refused(screened.flags)  # raises, or counts the skip
                return
            self._apply(work, screened, lrs=lrs)
            return
        status = self._drained_status()
        params = [p for p, st in self.state.items() if "pending_status" in st]
        if status == 1:
            for group in self.param_groups:
                pending = [p for p in group["params"] if "pending_status" in self.state.get(p, {})]
                if pending:
                    self._apply_update(group, [local(p) for p in pending],
                                       [state_view(self.state[p]["pending"]) for p in pending])
        for p in params:
            self.state[p].pop("pending", None)
            self.state[p].pop("pending_status", None)
        if status == 2:
            self._refused([1])

    def _drained_status(self) -> int:
        for st in self.state.values():
            if "pending_status" in st:
                return int(round(float(st["pending_status"].item())))
        return 0

    def _roll_back(self, backups: list) -> None:
        kept = [(p, delta, step) for p, delta, step in backups if delta is not None]
        for p, delta, _ in backups:
            if delta is None:
                self.state.pop(p, None)
        if kept:
            torch._foreach_copy_([state_view(self.state[p]["delta"]) for p, _, _ in kept], [d for _, d, _ in kept])
            torch._foreach_copy_([self.state[p]["step"] for p, _, _ in kept], [s for _, _, s in kept])

    def _drain(self) -> None:
        """overlap: wait for the step in flight and keep its outcome in the state (for a checkpoint).

        Accepted: every parameter's decoded update (sign applied, as :meth:`_apply` would add it)
        goes to ``state["pending"]`` (per replica, like δ) with ``pending_status`` 1; refused: δ is
        rolled back and ``pending_status`` is 2. The next :meth:`step` applies (or refuses) it.
        """
        if self._flight is None:
            # Nothing in flight: the same keys (status 0), so that every checkpoint has one layout.
            for p, st in self.state.items():
                if st and "pending_status" not in st:
                    st["pending"] = replica_state_like(p, self._topology)
                    st["pending_status"] = torch.tensor(0.0)
            return
        handle, work, backups, agreed, lrs = self._flight
        self._flight = None
        gathered = self._screen(work, handle if isinstance(handle, torch.Tensor) else handle.wait())
        refused = not gathered.flags or any(gathered.flags)
        if refused:
            self._roll_back(backups)
        if agreed is not None:
            # "local": settled now, so that the parameters (which the checkpoint keeps once, not per
            # replica) are the agreed ones on every replica; only a refusal is left for the next step.
            torch._foreach_copy_([local(p) for p in agreed], list(agreed.values()))
            if not refused:
                self._apply(work, gathered, lrs=lrs)
        for p, st in self.state.items():
            if st:
                st["pending"] = replica_state_like(p, self._topology)
                st["pending_status"] = torch.tensor(2.0 if refused else 0.0 if agreed is not None else 1.0)
        if agreed is None and not refused:
            self._apply(work, gathered, into={p: state_view(self.state[p]["pending"]) for w in work
                                              for p in w.params if self.state.get(p)})

    def _apply_update(self, group: dict, xs: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        """x ← x − lr·u (element-wise, as :meth:`_apply` adds it), then weight decay: a drained update."""
        lr = group["lr"]
        torch._foreach_add_([x.view(-1) for x in xs], [u.reshape(-1) for u in updates], alpha=-lr)
        if group["weight_decay"] > 0:
            torch._foreach_mul_(xs, 1.0 - lr * group["weight_decay"])


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors``, made by one multi-tensor copy (not a kernel per tensor)."""
    out = [torch.empty_like(t) for t in tensors]
    if out:
        torch._foreach_copy_(out, tensors)
    return out
