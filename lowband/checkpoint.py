"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer state, and small extras.

Every rank writes its own shards; state that differs between replicas (momentum, error feedback,
slow weights) is stored as DTensors over the 2-D mesh with a leading replica dimension, so DCP
keeps every replica's copy. A checkpoint is written to ``PATH.tmp`` and renamed into place only
once every rank has finished, so a crash while saving never destroys the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]

log = logging.getLogger(__name__)

_EXTRA = "lowband_extra.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        msd, _ = get_state_dict(model, [])
        return {"model": msd}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None,
                    extra: dict | None = None) -> Path:
    """Save model and optimizer to directory ``path`` (collective: every rank calls it)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=str(tmp))
    if _rank() == 0:
        (tmp / _EXTRA).write_text(json.dumps(extra or {}, indent=1))
        old = path.with_name(path.name + ".old")
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    log.info("saved checkpoint %s", path)
    return path


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` in place; return its ``extra`` dict."""
    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(
            f"no checkpoint at {path} (expected a DCP directory with a .metadata file); "
            "pass a directory written by lowband (e.g. RUN/checkpoints/step_000100) or drop --resume"
        )
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
    extra_file = path / _EXTRA
    return json.loads(extra_file.read_text()) if extra_file.exists() else {}


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (``step_*`` with DCP metadata) under ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    done = [p for p in directory.glob("step_*") if not p.name.endswith((".tmp", ".old")) and (p / ".metadata").exists()]
    return max(done, key=lambda p: p.name) if done else None
