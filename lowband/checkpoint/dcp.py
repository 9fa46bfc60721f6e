"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer state, and small extras.

Every rank writes its own shards; state that differs between replicas (momentum, error feedback,
slow weights) is stored as DTensors over the 2-D mesh with a leading replica dimension, so DCP
keeps every replica's copy. A checkpoint is written to ``PATH.tmp`` and renamed into place only
once every rank has finished, so a crash while saving never destroys the previous checkpoint.

Resuming on a different topology. A checkpoint written with R replicas × S shards loads on
R′ × S′ (e.g. a job that lost a node goes on with the nodes it has):

- The model and replicated optimizer state (AdamW's moments, ...) are FSDP2 DTensors: DCP reads
  each rank's new shard out of the saved shards, whatever S and S′ are.
- Per-replica state (a DTensor of global shape (R, *shape) on the ("replicate", "shard") mesh)
  is read in full replica rows for this rank's new shard, then merged or split by
  :func:`replica_sources`: with R′ ≤ R, new replica j takes the **mean** over the old replicas
  r with ⌊r·R′/R⌋ = j (a contiguous block: 2 → 1 averages both); with R′ > R, new replica j
  **copies** old replica ⌊j·R/R′⌋. The mean is what the methods' own next exchange would do:
  DiLoCo's outer step averages the replicas' θ (its pseudo-gradients) and their outer state is
  equal on all replicas anyway; NoLoCo's gossip averages slow weights inside a group; FlexDeMo
  applies the mean over replicas of what their momenta send, and the mean momentum keeps the
  unsent part of every old replica's gradient at the weight the mean update gave it. The merged
  inner state (Adam moments, error feedback) is the replicas' mean as well: a merged replica
  has seen, on average, what they saw. Scalars (step counts) are equal on every replica and
  are kept.
- What cannot be resumed is refused with a ValueError before any training step: a different
  method than the checkpoint's, a model whose parameters differ in name or shape, optimizer
  state of another layout (other hyper-parameters that shape the state, e.g. ``values``); NoLoCo
  refuses a group size above the new replica count in its ``load_state_dict``.
- The step, lr schedule and training clock are in ``extra`` and go on; what a changed global
  batch does to the data order is the loop's (it warns, docs/architecture.md explains).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from lowband.checkpoint.signatures import (
    SafePlanner,
    SafeReader,
    read_metadata,
    verify_manifest,
    write_manifest,
)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "replica_sources", "topology_record"]

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


def topology_record(topology) -> dict[str, int]:
    """What a checkpoint keeps of a :class:`~lowband.distributed.topology.Topology` (for the resume's log)."""
    return {"nodes": topology.num_nodes, "ranks_per_node": topology.ranks_per_node, "shards": topology.shards,
            "replicas": topology.replicas, "world_size": topology.world_size}


def save_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None,
                    extra: dict | None = None, secret: bytes | None = None, fingerprint: str | None = None) -> Path:
    """Save model and optimizer to directory ``path`` (collective: every rank calls it).

    Rank 0 then writes the manifest (:func:`lowband.checkpoint.signatures.write_manifest`: every file's
    SHA-256, signed with the job's ``secret`` when there is one) that :func:`load_checkpoint` checks.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=str(tmp))
    if _rank() == 0:
        (tmp / _EXTRA).write_text(json.dumps(extra or {}, indent=1))
        write_manifest(tmp, secret=secret, step=(extra or {}).get("step"), fingerprint=fingerprint)
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


def replica_sources(*, saved: int, new: int, replica: int) -> list[int]:
    """The old replicas whose state new replica ``replica`` takes (their mean), of ``saved`` → ``new``.

    ``new`` ≤ ``saved``: the contiguous block of old replicas r with ⌊r·new/saved⌋ = replica
    (4 → 2: {0, 1} and {2, 3}; 2 → 1: {0, 1}). ``new`` > ``saved``: the one old replica
    ⌊replica·saved/new⌋ (1 → 2: {0} and {0}; 2 → 4: 0, 0, 1, 1).
    """
    if saved < 1 or new < 1 or not 0 <= replica < new:
        raise ValueError(f"replica_sources needs saved, new >= 1 and 0 <= replica < new; got {saved}, {new}, {replica}")
    if new <= saved:
        return [r for r in range(saved) if r * new // saved == replica]
    return [replica * saved // new]


def _tensors(tree: Any, prefix: str = "") -> dict[str, tuple[dict, Any, torch.Tensor]]:
    """Every tensor of a nested state dict by its DCP key (path joined by dots), with (parent, key)."""
    found: dict[str, tuple[dict, Any, torch.Tensor]] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            name = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, torch.Tensor):
                found[name] = (tree, k, v)
            else:
                found.update(_tensors(v, name))
    return found


def _is_replica_state(t: torch.Tensor) -> bool:
    """A per-replica state tensor: a DTensor sharded over the mesh's "replicate" dimension by its dim 0."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names
    return bool(names) and names[0] == "replicate" and t.placements[0] == Shard(0)


def _shape(s) -> tuple[int, ...]:
    return tuple(int(x) for x in s)


def _check_compatible(path: Path, state: dict, md, extra: dict, method: str | None) -> None:
    saved_method = extra.get("method")
    if method is not None and saved_method is not None and method != saved_method:
        raise ValueError(
            f"checkpoint {path} was written by method {saved_method!r}, this run uses {method!r}: its optimizer "
            f"state cannot continue another method. Resume with --method {saved_method}, or start afresh "
            "(drop --resume or pass another --out)"
        )
    saved = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    mine = _tensors(state)
    bad: dict[str, list[str]] = {"model": [], "optim": []}
    for key, (_, _, t) in mine.items():
        part = bad["model" if key.startswith("model.") else "optim"]
        if key not in saved:
            part.append(f"{key!r} (shape {_shape(t.shape)}) is not in the checkpoint")
            continue
        old, new = _shape(saved[key].size), _shape(t.shape)
        if old == new:
            continue
        if not key.startswith("model.") and _replica_resizable(t, old):
            continue
        part.append(f"{key!r} is {old} in the checkpoint and {new} here")
    for key in saved:
        if key not in mine and (key.startswith("model.") or key.startswith("optim.state.")):
            bad["model" if key.startswith("model.") else "optim"].append(f"{key!r} is only in the checkpoint")
    model_hint = f" (it was written with --model {extra['model']})" if extra.get("model") else ""
    if bad["model"]:
        raise ValueError(
            f"the model does not match checkpoint {path}{model_hint}: {_listing(bad['model'])}. Resume with the "
            "checkpoint's model (--model, --vocab-size and the same data/tokenizer), or start afresh"
        )
    if bad["optim"]:
        raise ValueError(
            f"the optimizer state does not match checkpoint {path} (another method, or a hyper-parameter "
            f"that shapes the state such as --values or --overlap): {_listing(bad['optim'])}. Resume with the "
            "checkpoint's method and hyper-parameters, or start afresh"
        )


def _listing(problems: list[str], shown: int = 3) -> str:
    more = f" and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def _replica_resizable(t: torch.Tensor, saved_shape: tuple[int, ...]) -> bool:
    """Whether a saved per-replica tensor of ``saved_shape`` can be merged into template ``t``."""
    if _is_replica_state(t):
        # (R, *shape) saved -> (R', *shape); or a one-process checkpoint (no replica dim) -> (R', *shape).
        return saved_shape[1:] == _shape(t.shape[1:]) or saved_shape == _shape(t.shape[1:])
    # One-process run: a plain tensor of p's shape; the checkpoint holds (R, *shape).
    one_process = not dist.is_initialized() or dist.get_world_size() == 1
    return one_process and len(saved_shape) == t.dim() + 1 and saved_shape[1:] == _shape(t.shape)


def _reading_target(t: torch.Tensor, saved_shape: tuple[int, ...]) -> tuple[torch.Tensor, Callable]:
    """A tensor to load the saved rows into, and a function that merges them into ``t``'s rows."""
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        inner = list(t.placements[1:])
        local_rest = tuple(t.to_local().shape[1:])
        if len(saved_shape) == t.dim():  # (R, *shape): every old replica's row of this rank's shard
            placements = [Replicate(), *inner]
            local_shape = (saved_shape[0], *local_rest)
        else:  # a one-process checkpoint: one replica, no replica dimension
            placements = [Replicate(), *[Shard(p.dim - 1) if isinstance(p, Shard) else p for p in inner]]
            local_shape = local_rest
        buf = torch.zeros(local_shape, dtype=t.dtype, device=t.to_local().device)
        stride = torch.empty(saved_shape, device="meta").stride()
        target = DTensor.from_local(buf, mesh, placements, run_check=False, shape=torch.Size(saved_shape),
                                    stride=stride)
        new_r = int(t.shape[0])
        replica = mesh.get_local_rank("replicate")

        def merge_dtensor() -> None:
            rows = buf if len(saved_shape) == t.dim() else buf.unsqueeze(0)
            src = replica_sources(saved=rows.shape[0], new=new_r, replica=replica)
            t.to_local()[0].copy_(rows[src].double().mean(0).to(t.dtype))

        return target, merge_dtensor
    buf = torch.zeros(saved_shape, dtype=t.dtype, device=t.device)

    def merge_plain() -> None:
        t.copy_(buf[replica_sources(saved=buf.shape[0], new=1, replica=0)].double().mean(0).to(t.dtype))

    return buf, merge_plain


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None,
                    method: str | None = None, secret: bytes | None = None, trust: bool = False) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` in place; return its ``extra`` dict.

    The checkpoint may come from another topology (see the module docstring): the model and
    replicated state are resharded by DCP; per-replica state is merged (R′ < R: the mean of
    :func:`replica_sources`) or copied (R′ > R). ``method``: this run's method name, refused with
    a ValueError if the checkpoint's ``extra["method"]`` names another. Everything that cannot be
    loaded (another method, model or optimizer-state layout) is a ValueError raised on every rank
    before anything is read into the model or the optimizer (an optimizer may refuse the loaded
    hyper-parameters later, e.g. NoLoCo's group size: still before any training step).

    Before that, the checkpoint's manifest is checked against its files and ``secret`` (the job's:
    :func:`lowband.checkpoint.signatures.verify_manifest`; a checkpoint it cannot vouch for is a
    :class:`~lowband.checkpoint.signatures.CheckpointRefused` unless ``trust``), and nothing is unpickled
    beyond DCP's metadata classes and ``torch.load(weights_only=True)``.
    """
    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(
            f"no checkpoint at {path} (expected a DCP directory with a .metadata file); "
            "pass a directory written by lowband (e.g. RUN/checkpoints/step_000100) or drop --resume"
        )
    verify_manifest(path, secret=secret, trust=trust)
    extra_file = path / _EXTRA
    extra = json.loads(extra_file.read_text()) if extra_file.exists() else {}
    state = _state(model, optimizer)
    md = read_metadata(path)
    _check_compatible(path, state, md, extra, method)
    merges: list[Callable[[], None]] = []
    resized: set[tuple[int, int]] = set()
    for key, (parent, k, t) in _tensors(state).items():
        meta = md.state_dict_metadata[key]
        old = _shape(meta.size)
        if key.startswith("model.") or old == _shape(t.shape):
            continue
        target, merge = _reading_target(t, old)
        parent[k] = target  # DCP loads into it; the merge then fills the template ``t``
        merges.append(merge)
        merges.append(functools.partial(parent.__setitem__, k, t))  # the template goes back for set_state_dict
        resized.add((old[0] if len(old) == t.dim() else 1, int(t.shape[0]) if _is_replica_state(t) else 1))
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner())
    for merge in merges:
        merge()
    if resized:
        (saved_r, new_r), *_ = sorted(resized)
        rule = "mean over old replicas" if new_r < saved_r else "copies of old replicas"
        log.info("checkpoint %s: per-replica state of %d replica(s) onto %d (%s); model resharded by DCP",
                 path, saved_r, new_r, rule)
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
    return extra


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (``step_*`` with DCP metadata) under ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    done = [p for p in directory.glob("step_*") if not p.name.endswith((".tmp", ".old")) and (p / ".metadata").exists()]
    return max(done, key=lambda p: p.name) if done else None
