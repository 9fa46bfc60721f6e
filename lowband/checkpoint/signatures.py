"""What a resumed run trusts of a checkpoint: a signed manifest, and a reader that runs no code.

A DCP checkpoint directory holds pickles: ``.metadata`` (read by ``pickle.load``) and, for its
non-tensor items, ``torch.save`` blobs that DCP's default planner reads with
``torch.load(weights_only=False)``. Loading a checkpoint someone else wrote could therefore run their
code. lowband closes both:

- :class:`SafeReader` reads ``.metadata`` with an unpickler that resolves only DCP's metadata classes,
  ``torch.Size``, dtypes, layouts and paths (nothing that runs code), and :class:`SafePlanner` reads the
  non-tensor items with ``torch.load(weights_only=True)`` (DCP already reads tensors that way);
- :func:`write_manifest` records, at save, the SHA-256 and size of every file of the checkpoint, its step
  and the job's fingerprint, and with a job secret (:mod:`lowband.trust.secret`) an HMAC of all that;
  :func:`verify_manifest` checks it before DCP reads anything and refuses, with
  :class:`CheckpointRefused`, a checkpoint without a manifest (older than this check, or not lowband's),
  one whose files changed, one signed with another secret, and with a secret set, an unsigned one,
  unless the user passes ``--trust-checkpoint``.

Without a job secret a manifest is not authenticated (anyone can rewrite it with the files); it still
catches damage, and the loading runs no code either way.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lowband.trust.secret import tag, verify

log = logging.getLogger(__name__)

__all__ = ["MANIFEST", "CheckpointRefused", "SafePlanner", "SafeReader", "read_metadata", "verify_manifest",
           "write_manifest"]

MANIFEST = "lowband_manifest.json"
FORMAT = "lowband-checkpoint/1"
TRUST_HINT = ("If you know where it came from and trust it, resume with --trust-checkpoint "
              "(the files are then loaded without this check; still without running code from them)")


class CheckpointRefused(ValueError):
    """A checkpoint that this job cannot vouch for (see the module docstring)."""


# --------------------------------------------------------------------------- the manifest
def _files(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            h = hashlib.sha256()
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            out[p.relative_to(path).as_posix()] = {"sha256": h.hexdigest(), "bytes": p.stat().st_size}
    return out


def _canonical(body: dict) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def write_manifest(path: str | os.PathLike, *, secret: bytes | None, step: int | None = None,
                   fingerprint: str | None = None) -> Path:
    """Write ``MANIFEST`` into checkpoint directory ``path`` (after every other file of it is written)."""
    path = Path(path)
    body = {"format": FORMAT, "step": step, "fingerprint": fingerprint, "files": _files(path)}
    mac = tag(secret, "lowband-checkpoint", _canonical(body)) if secret is not None else None
    out = path / MANIFEST
    out.write_text(json.dumps({"body": body, "tag": mac}, indent=1))
    return out


def verify_manifest(path: str | os.PathLike, *, secret: bytes | None, trust: bool = False) -> dict | None:
    """Check checkpoint ``path`` against its manifest; returns the manifest's body (None when trusted without one).

    Raises :class:`CheckpointRefused` naming what is wrong and ``--trust-checkpoint``; with ``trust``
    only logs it. The error never contains the secret.
    """
    path = Path(path)
    try:
        problem, body = _check(path, secret)
    except CheckpointRefused as e:
        if not trust:
            raise
        problem, body = str(e), None
    if problem is None:
        return body
    if trust:
        log.warning("checkpoint %s: %s; loading it anyway (--trust-checkpoint)", path, problem.rstrip("."))
        return body
    raise CheckpointRefused(f"checkpoint {path}: {problem}. {TRUST_HINT}")


def _check(path: Path, secret: bytes | None) -> tuple[str | None, dict | None]:
    """(what is wrong or None, the manifest's body)."""
    mf = path / MANIFEST
    if not mf.exists():
        return ("it has no lowband manifest (it was written before lowband signed its checkpoints, or not by "
                "lowband), so this job cannot check that its files are the ones a run of it wrote"), None
    try:
        doc = json.loads(mf.read_text())
        body, mac = doc["body"], doc.get("tag")
        if body.get("format") != FORMAT or not isinstance(body.get("files"), dict):
            raise ValueError(body.get("format"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its manifest {MANIFEST} is not one lowband reads (damaged, or of another version)", None
    if secret is not None and mac is None:
        return ("it was written without a job secret (unsigned), and this job has one: it cannot tell it from a "
                "checkpoint made elsewhere"), body
    if secret is not None and not verify(secret, mac, "lowband-checkpoint", _canonical(body)):
        return ("it is signed with another secret than this job's (a checkpoint of another job, or its manifest "
                "was changed)"), body
    if secret is None and mac is not None:
        return ("it is signed with a job secret and none is set here (set LOWBAND_SECRET_FILE or LOWBAND_SECRET "
                "to the job's secret)"), body
    have = _files(path)
    want = body["files"]
    changed = sorted(n for n in want if n in have and have[n] != want[n])
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if changed or missing or extra:
        parts = [f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("changed:", changed), ("missing:", missing), ("not written by the run:", extra))
                 if names]
        return f"its files differ from those its manifest records ({'; '.join(parts)})", body
    return None, body


# --------------------------------------------------------------------------- reading without running code
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes a DCP ``.metadata`` holds (plain data, no callable that runs code)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise CheckpointRefused(f"the checkpoint's DCP metadata names {module}.{name}, which lowband does not load "
                                "(only DCP's metadata classes, tensor sizes, dtypes and paths): not a checkpoint "
                                "of this torch version, or crafted")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` of ``path``, read without running code from it."""
    return SafeReader(str(path)).read_metadata()


class SafeReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` is read by :class:`_MetadataUnpickler`, not ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except CheckpointRefused:
                raise
            except Exception as e:  # a damaged pickle: any error of the unpickler
                raise CheckpointRefused(f"the checkpoint's DCP metadata {path} cannot be read "
                                        f"({type(e).__name__}): damaged") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointRefused(f"the checkpoint's DCP metadata {path} holds a {type(metadata).__name__}, "
                                    "not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with its non-tensor items read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointRefused(f"checkpoint item {read_item.dest_index.fqn} is not plain data or tensors "
                                    f"(torch.load weights_only refused it: {str(e).splitlines()[0][:200]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
