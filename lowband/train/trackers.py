"""The trackers that get a run's scalars besides ``metrics.jsonl`` (``--report-to tensorboard,wandb``).

Both are optional dependencies, imported only when a run asks for them, and checked before the run
starts (:func:`check_trackers`: a missing one is a ValueError naming its ``pip install``). Rank 0 of a
run (each node's under fault tolerance) opens them (:func:`open_trackers`); :class:`~lowband.train.metrics.MetricsFile`
hands every record's numbers to each, by ``<record type>/<key>`` at the record's step, and the progress
lines' numbers (:mod:`lowband.train.progress`) under ``progress/``.

- **tensorboard**: event files in ``OUT/tensorboard`` (``tensorboard --logdir OUT``).
- **wandb**: one W&B run, its config the job's ``config.toml`` (as a dict of tables), its name
  ``--run-name`` or the out directory's name, its project ``--wandb-project``, ``$WANDB_PROJECT`` or
  ``lowband``; files under ``$WANDB_DIR``, else ``OUT``. ``WANDB_MODE=offline`` keeps it on disk
  (``wandb sync`` uploads it later), as on a cluster without internet.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = ["TRACKERS", "TensorBoardTracker", "Tracker", "WandbTracker", "check_trackers", "open_trackers"]

log = logging.getLogger(__name__)

#: tracker -> (the module it needs, what installs it)
TRACKERS = {"tensorboard": ("tensorboard", "pip install 'lowband[tensorboard]'"),
            "wandb": ("wandb", "pip install 'lowband[wandb]'")}


class Tracker(Protocol):
    """Something that records named scalars at a step."""

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: Iterable[str]) -> None:
    """A ValueError naming the fix when a tracker is unknown or its package is not installed (nothing imported)."""
    names = list(names)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"--report-to: unknown tracker {', '.join(map(repr, unknown))}; give a comma list of "
                         f"{', '.join(TRACKERS)} (e.g. --report-to tensorboard,wandb)")
    for name in names:
        module, install = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"--report-to {name} needs the {module} package, which is not installed: {install}")


class TensorBoardTracker:
    """TensorBoard event files in ``log_dir`` (torch's SummaryWriter)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional dependency: only when asked for

        self.writer = SummaryWriter(str(log_dir))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One Weights & Biases run (see the module's docstring for its name, project, config and files)."""

    def __init__(self, *, name: str, config: Mapping[str, Any], out: Path, project: str | None = None,
                 group: str | None = None) -> None:
        import wandb  # optional dependency: only when asked for

        self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "lowband", name=name, group=group,
                              config=dict(config), dir=os.environ.get("WANDB_DIR") or str(out), job_type="train")
        # Records carry their own step (a resumed run's or a healed node's go on from where it is), and a step's
        # train, val and progress numbers come in separate calls: the x-axis is that step, not W&B's call count.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step", step_sync=True)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log({"step": step, **scalars})

    def close(self) -> None:
        self.run.finish()


def open_trackers(names: Iterable[str], *, out: Path, config: Mapping[str, Any], name: str,
                  project: str | None = None, group: str | None = None) -> list[Tracker]:
    """The trackers ``names`` (checked with :func:`check_trackers`), opened for a run writing to ``out``."""
    names = list(names)
    check_trackers(names)
    trackers: list[Tracker] = []
    for tracker in names:
        if tracker == "tensorboard":
            trackers.append(TensorBoardTracker(out / "tensorboard"))
        else:
            trackers.append(WandbTracker(name=name, config=config, out=out, project=project, group=group))
        log.info("--report-to %s: the run's scalars go there too", tracker)
    return trackers
