"""How a run ends before ``--steps``: a training-time budget (``--time-budget``) or a stop file (``--stop-file``).

The training clock (``train_time_s``, :mod:`lowband.train.loop`) counts only training steps:
start-up, validation and checkpoints are left out. With a budget the run stops after the first
step at which the clock has passed the budget, validates, and records the steps it ran;
``schedule.steps`` is then the most steps it may take.

- **One decision for every rank.** Each rank's clock differs a little, and ranks that stop at
  different steps would hang in a collective. After every step the ranks agree on the largest clock
  (a one-number all-reduce over the default process group: 4 bytes per step, not counted by the link).
- **The lr schedule** runs to the budget: its progress is the further of ``step / steps`` and
  ``clock / budget``, so a cosine schedule has decayed when the run stops, whichever of the two
  limits stops it (the agreed clock: every rank sets the same lr). Warm-up stays in steps.
- **Local-step methods** (DiLoCo, NoLoCo, SparseLoCo) stop at the end of the outer window in which
  the budget ran out: their model is merged only by an outer step.

A **stop file** ends a running job cleanly, on every node at the same step, without a restart: the
file holds a step number N; once it is there, the run ends after step N (for a local-step method,
after the outer step that ends N's window), validates, checkpoints as at its end and records the steps
it ran, as if ``--steps`` had been N. Write the same N on every node, ahead of where the job is (a
node that reads it after N has passed ignores it and says so: its ranks could otherwise stop at
different steps). Each rank reads the file once per step (one ``stat``).
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist

from lowband.train.schedule import warmup_cosine_factor

__all__ = ["StopFile", "TimeBudget"]

log = logging.getLogger(__name__)


class StopFile:
    """``--stop-file PATH``: the run ends after the step number that PATH holds, once it is there."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.step: int | None = None  # the step to end after, once read
        self._seen: float | None = None  # the file's mtime when last read

    def reached(self, step: int) -> bool:
        """After ``step`` steps: True when the file names a step at or before ``step`` that was read in time."""
        try:
            mtime = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return False
        if mtime != self._seen:
            self._seen = mtime
            text = open(self.path).read().strip()
            if not text.isdigit():
                log.warning("--stop-file %s holds %r, not a step number: ignored (write e.g. 500)", self.path, text)
            elif int(text) < step:
                log.warning("--stop-file %s names step %s, already passed (at step %d): ignored; write a step "
                            "ahead of the job", self.path, text, step)
            else:
                self.step = int(text)
                log.info("--stop-file %s: the run ends after step %d (or the outer step that ends its window)",
                         self.path, self.step)
        return self.step is not None and step >= self.step


class TimeBudget:
    """The stop condition and the time-aware lr schedule of a run with ``schedule.time_budget_s``.

    Args:
        budget_s: the budget in seconds of training clock.
        steps: ``schedule.steps``, the most steps.
        warmup_steps, min_ratio: the schedule's (``min_ratio`` 1: constant after warm-up).
        device: where the all-reduced number lives (the process group's device).
    """

    def __init__(self, budget_s: float, *, steps: int, warmup_steps: int, min_ratio: float,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        if not (math.isfinite(budget_s) and budget_s > 0):
            raise ValueError(f"time budget must be a positive number of seconds, got {budget_s!r}")
        self.budget_s = float(budget_s)
        self.steps = steps
        self.warmup_steps = warmup_steps
        self.min_ratio = min_ratio
        self.device = torch.device(device)
        self.clock_s = 0.0  # the agreed (largest) training clock after the last step
        self.spent = False

    def lr_factor(self, step: int) -> float:
        """The lr multiplier at ``step``: the schedule at the further of the step's and the clock's progress."""
        at = step if step < self.warmup_steps else max(float(step), self.clock_s / self.budget_s * self.steps)
        return warmup_cosine_factor(at, warmup_steps=self.warmup_steps, total_steps=self.steps,
                                    min_ratio=self.min_ratio)

    def agree(self, clock_s: float) -> float:
        """The largest training clock over all ranks (this rank's alone without a process group)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([float(clock_s)], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())
        return float(clock_s)

    @classmethod
    def of(cls, schedule, device: torch.device | str = "cpu") -> TimeBudget | None:
        """The budget of a :class:`~lowband.train.config.ScheduleConfig`, or None when it has none."""
        if schedule.time_budget_s is None:
            return None
        min_ratio = 1.0 if schedule.lr_schedule == "constant" else schedule.min_lr_ratio
        return cls(schedule.time_budget_s, steps=schedule.steps, warmup_steps=schedule.warmup_steps,
                   min_ratio=min_ratio, device=device)

    def stops(self, clock_s: float, scheduler: torch.optim.lr_scheduler.LRScheduler, *, window_end: bool) -> bool:
        """After a step: agree on the clock and set the next step's lr; True when the run stops here (the budget
        is spent and, for a local-step method, the step just taken was an outer step: ``window_end``)."""
        return self.after_step(clock_s, scheduler) and window_end

    def after_step(self, clock_s: float, scheduler: torch.optim.lr_scheduler.LRScheduler) -> bool:
        """After a step: agree on the clock, set the next step's lr from it; True once the budget is spent."""
        self.clock_s = self.agree(clock_s)
        nxt = scheduler.last_epoch  # LambdaLR has already counted the step: the next step's index
        lrs = [base * self.lr_factor(nxt) for base in scheduler.base_lrs]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs  # what get_last_lr() reports (metrics.jsonl's lr)
        self.spent = self.clock_s > self.budget_s
        return self.spent
