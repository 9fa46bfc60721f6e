"""A run that reports itself: a log line every ``--log-every`` steps, and when a progress bar is shown.

:class:`ProgressLog` gathers the steps between two lines (the trainer hands it each step's numbers at
one place, after the step's record) and every ``--log-every`` steps gives a :class:`ProgressReport`:
its :meth:`~ProgressReport.line` is logged, its :meth:`~ProgressReport.scalars` go to the trackers
(``--report-to``)::

    step 120/1000 | loss 3.412 | val 3.501 | 5.21k tok/s/rank | 4.19 MB/step out of the node | comm 23% | ETA 5m07s

- **loss**: the mean training loss of the steps since the last line; **val**: the last validation loss.
- **tok/s/rank**: this rank's tokens (source and target, padding excluded) per second of training clock
  over those steps (the job's rate is about this times the ranks); the training clock leaves out
  validation and checkpoints (:mod:`lowband.train.loop`).
- **MB/step out of the node**: the bytes all ranks of this node sent to other nodes per step, 1 MB = 10^6 B.
- **comm**: the share of the step time spent blocked in the link (exposed communication / step time).
- **ETA**: the mean training-clock time of those steps × the steps left; with ``--time-budget``, at most
  the budget left. Validations and checkpoints still to come are not in it.

The progress bar (tqdm) is drawn only where someone watches: rank 0, ``--progress`` on, stderr a
terminal (:func:`show_progress_bar`). On a cluster stderr is a log file, and the lines above say the same.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["ProgressLog", "ProgressReport", "format_duration", "show_progress_bar"]


def show_progress_bar(*, enabled: bool, rank: int, stream: TextIO | None = None) -> bool:
    """Whether this rank draws tqdm's bar: rank 0, the ``progress`` option on, and ``stream`` (default
    stderr) a terminal; a bar written into a log file is one line rewritten thousands of times."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return enabled and rank == 0 and bool(isatty and isatty())


def format_duration(seconds: float | None) -> str:
    """``3725`` -> ``"1h02m"``, ``307`` -> ``"5m07s"``, ``42.4`` -> ``"42s"``; None or not finite -> ``"?"``."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(int(round(seconds)), 0)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _format_rate(per_s: float) -> str:
    """``5213.4`` -> ``"5.21k"``, ``812.0`` -> ``"812"``."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{unit}"
    return f"{per_s:.3g}"


@dataclass(frozen=True)
class ProgressReport:
    """What one progress line says (see the module's docstring for each number)."""

    step: int
    total_steps: int
    loss: float
    val_loss: float | None
    tokens_per_s: float
    node_mb_per_step: float
    comm_share: float
    eta_s: float | None

    def line(self) -> str:
        """The log line: ``step 120/1000 | loss 3.412 | val 3.501 | 5.21k tok/s/rank | ... | ETA 5m07s``."""
        val = "-" if self.val_loss is None else f"{self.val_loss:.4g}"
        return (f"step {self.step}/{self.total_steps} | loss {self.loss:.4g} | val {val} | "
                f"{_format_rate(self.tokens_per_s)} tok/s/rank | {self.node_mb_per_step:.3g} MB/step out of the node | "
                f"comm {self.comm_share:.0%} | ETA {format_duration(self.eta_s)}")

    def scalars(self) -> dict[str, float]:
        """The line's numbers for the trackers (``--report-to``), by name with its unit (the loss and the
        validation loss are in the train/val records already)."""
        out = {"progress/tokens_per_s_per_rank": self.tokens_per_s, "progress/node_mb_sent_per_step": self.node_mb_per_step,
               "progress/comm_share": self.comm_share}
        if self.eta_s is not None:
            out["progress/eta_s"] = self.eta_s
        return out


@dataclass
class _Window:
    """The steps since the last line."""

    steps: int = 0
    loss_sum: float = 0.0
    step_time_s: float = 0.0
    exposed_comm_time_s: float = 0.0
    node_bytes_sent: int = 0
    tokens0: int = 0  # the counters where the window began
    train_time0_s: float = 0.0


@dataclass
class ProgressLog:
    """Every ``every`` steps, a :class:`ProgressReport` of the steps since the last one.

    Args:
        every: steps between two reports (0: never).
        total_steps: the run's ``--steps``.
        budget_s: ``--time-budget`` in seconds of training clock, or None.
        tokens, train_time_s: the run's counters at its first step (a resumed run's go on from its checkpoint's).
    """

    every: int
    total_steps: int
    budget_s: float | None = None
    tokens: int = 0
    train_time_s: float = 0.0
    val_loss: float | None = None
    _window: _Window = field(default_factory=_Window, repr=False)
    _last_step: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"--log-every must be >= 0 (0: no progress lines), got {self.every}")
        self._window = _Window(tokens0=self.tokens, train_time0_s=self.train_time_s)

    def note_val(self, val_loss: float) -> None:
        """A validation's loss: the lines from now on show it."""
        self.val_loss = val_loss

    def after_step(self, *, step: int, loss: float, step_time_s: float, exposed_comm_time_s: float,
                   node_bytes_sent: int, tokens: int, train_time_s: float) -> ProgressReport | None:
        """Step ``step`` (1-based, as its record names it) is done; its loss, times, the bytes this node sent
        to other nodes, and the run's counters after it. A report when a multiple of ``every`` was reached
        since the last one (a node that healed may jump ahead), else None."""
        w = self._window
        w.steps += 1
        w.loss_sum += loss
        w.step_time_s += step_time_s
        w.exposed_comm_time_s += exposed_comm_time_s
        w.node_bytes_sent += node_bytes_sent
        last = step - 1 if self._last_step is None else self._last_step
        self._last_step = step
        if not self.every or step // self.every <= last // self.every:
            return None
        clock_s = train_time_s - w.train_time0_s
        mean_step_s = clock_s / w.steps
        eta_s = max(self.total_steps - step, 0) * mean_step_s
        if self.budget_s is not None:
            eta_s = min(eta_s, max(self.budget_s - train_time_s, 0.0))
        report = ProgressReport(
            step=step, total_steps=self.total_steps, loss=w.loss_sum / w.steps, val_loss=self.val_loss,
            tokens_per_s=(tokens - w.tokens0) / clock_s if clock_s > 0 else 0.0,
            node_mb_per_step=w.node_bytes_sent / w.steps / 1e6,
            comm_share=w.exposed_comm_time_s / w.step_time_s if w.step_time_s > 0 else 0.0,
            eta_s=eta_s if mean_step_s > 0 else None)  # fmt: skip
        self._window = _Window(tokens0=tokens, train_time0_s=train_time_s)
        return report
