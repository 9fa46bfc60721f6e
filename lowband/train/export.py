"""``lowband export``: a run's checkpoint as a transformers model directory that ``from_pretrained`` loads.

The directory holds ``config.json`` and ``model.safetensors`` (``save_pretrained``), the run's
tokenizer (``tokenizer.json``, ``tokenizer_config.json``: :func:`~lowband.train.tokenizer.for_transformers`),
``generation_config.json`` (pad, eos and bos ids, a seq2seq model's decoder start) and ``lowband_export.json``
(which checkpoint, step, method and parameters it holds).

Which parameters are "the model" of a checkpoint:

- methods whose replicas hold the same parameters (AdamW, Muon, Deto-Full, FlexDeMo, DeMo): the
  model's own state (``model.*``), gathered from its shards;
- DiLoCo, NoLoCo, SparseLoCo: the outer (slow) parameters φ (``optim.state.<name>.slow``), what the
  replicas last agreed on at an outer step. The inner steps each replica took since are not in it: at
  the end of an outer window (steps a multiple of H) φ is the model every replica evaluates, before
  it, the outer step that would merge those steps has not happened. DiLoCo's replicas hold the same
  φ; NoLoCo's differ (each averages within its group): replica 0's is taken, the one rank 0 validates
  (``replica`` picks another, or ``"mean"`` their average).

The checkpoint is read in this one process without a process group, whatever topology wrote it
(replicas × shards): DCP reads every shard into full plain tensors, through lowband's reader, which
runs no code from the files (:mod:`lowband.checkpoint.signatures`); the manifest is checked first,
with the job's secret, as a resume checks it. Everything that can be checked is, before anything is
read or written: the source, the tokenizer, the output directory. The directory is written under a
temporary name beside ``out`` and renamed into place at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import tomllib
import torch
import torch.distributed.checkpoint as dcp

from lowband.checkpoint.dcp import latest_checkpoint
from lowband.checkpoint.signatures import SafePlanner, SafeReader, read_metadata, verify_manifest
from lowband.train.methods import METHODS
from lowband.train.models import MODEL_SIZES, build_model
from lowband.train.tokenizer import for_transformers, load_tokenizer, special_ids
from lowband.util import atomic_dir

__all__ = ["EXPORT_RECORD", "ExportSource", "check_out", "export_checkpoint", "find_source", "parse_replica"]

log = logging.getLogger(__name__)

_EXTRA = "lowband_extra.json"
#: What ``lowband_export.json`` records (which checkpoint, which parameters).
EXPORT_RECORD = "lowband_export.json"
# Per-replica state is read in batches of at most this many bytes: R copies of every parameter at once
# would need R times the model's memory.
_READ_BATCH_BYTES = 1 << 30
_SOURCE_HINT = ("give a run's directory (its --out, holding checkpoints/step_*) or one of its checkpoints "
                "(RUN/checkpoints/step_NNNNNN)")


@dataclass(frozen=True, kw_only=True)
class ExportSource:
    """What an export reads: a checkpoint and what it needs beside it.

    Args:
        checkpoint: the DCP checkpoint directory.
        run: the run directory it belongs to (``RUN/checkpoints/step_*``), or None.
        tokenizer: the tokenizer directory or ``tokenizer.json`` the run used.
        method: the method that trained it (a key of :data:`~lowband.train.methods.METHODS`).
        model: the model's name or local directory, as the run had it.
        extra: the checkpoint's ``lowband_extra.json`` (step, topology, ...).
    """

    checkpoint: Path
    run: Path | None
    tokenizer: Path
    method: str
    model: str
    extra: dict


def parse_replica(text: str | int | None) -> int | str | None:
    """``--replica``: None, a replica's index (>= 0) or ``"mean"``; anything else is a ValueError."""
    if text is None or text == "mean":
        return text
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = -1
    if value < 0:
        raise ValueError(f"--replica {text!r}: give a replica's index (0, 1, ...) or 'mean'")
    return value


def find_source(path: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None) -> ExportSource:
    """The checkpoint of a run directory (its newest) or a checkpoint directory, with its tokenizer and model.

    The tokenizer is ``tokenizer`` when given, else the run's ``tokenizer/`` (beside ``checkpoints/``);
    the method and model are the checkpoint's own record, else the run's ``config.toml``.

    Raises:
        FileNotFoundError: nothing at ``path``, no checkpoint in a run directory, no tokenizer.
        ValueError: ``path`` is a file, or the checkpoint does not say what trained it.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{path} does not exist: {_SOURCE_HINT}")
    if not p.is_dir():
        raise ValueError(f"{path} is a file, not a directory: {_SOURCE_HINT}")
    if (p / ".metadata").is_file():
        checkpoint = p
        run = p.parent.parent if p.parent.name == "checkpoints" else None
    else:
        checkpoint = latest_checkpoint(p / "checkpoints")
        if checkpoint is None:
            what = "run directory" if (p / "config.toml").is_file() else "directory"
            raise FileNotFoundError(
                f"{path} is a {what} without a checkpoint (no checkpoints/step_* holding DCP metadata): train with "
                "--ckpt-at-end or --ckpt-every N (or --export-hf DIR, which exports at the end of the run), or "
                f"{_SOURCE_HINT}"
            )
        run = p
    extra_file = checkpoint / _EXTRA
    extra = json.loads(extra_file.read_text()) if extra_file.is_file() else {}
    method, model = extra.get("method"), extra.get("model")
    if (method is None or model is None) and run is not None and (run / "config.toml").is_file():
        # Read as TOML, not through lowband.train.jobfile: the job's config validates --export-hf with this module.
        try:
            tables = tomllib.loads((run / "config.toml").read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{run / 'config.toml'} is not a valid TOML file: {e}") from None
        method = method or tables.get("method", {}).get("name")
        model = model or tables.get("model", {}).get("name")
    if method is None or model is None:
        raise ValueError(f"checkpoint {checkpoint} does not say which method and model trained it (no "
                         f"{_EXTRA} with them, and no config.toml of its run above it): not a lowband run's checkpoint")
    if method not in METHODS:
        raise ValueError(f"checkpoint {checkpoint} was written by method {method!r}, which this lowband does not "
                         f"know (it knows {', '.join(METHODS)})")
    return ExportSource(checkpoint=checkpoint, run=run, tokenizer=_find_tokenizer(checkpoint, run, tokenizer),
                        method=method, model=str(model), extra=extra)


def _find_tokenizer(checkpoint: Path, run: Path | None, given: str | os.PathLike | None) -> Path:
    if given is not None:
        load_tokenizer(given)  # a FileNotFoundError that names it
        return Path(given).expanduser()
    places = [d / "tokenizer" for d in dict.fromkeys([*([run] if run else []), checkpoint.parent,
                                                      checkpoint.parent.parent])]
    for place in places:
        if (place / "tokenizer.json").is_file():
            return place
    raise FileNotFoundError(
        f"no tokenizer for checkpoint {checkpoint} (looked for {', '.join(str(p) for p in places)}); a run writes "
        "the tokenizer it used to OUT/tokenizer (runs of older lowband did not): pass --tokenizer with the "
        "tokenizer.json the run used (its --tokenizer, or the one it trained, cached under "
        "$LOWBAND_CACHE/tokenizers)"
    )


def check_out(out: str | os.PathLike, *, force: bool, keep: tuple[Path, ...] = ()) -> Path:
    """Check an export's output directory before anything is written: absent or empty, or ``force``.

    Args:
        out: the directory.
        force: replace an existing non-empty directory (only once the new one is complete).
        keep: directories ``out`` must not be, hold or lie inside (the run and its checkpoint).

    Raises:
        ValueError: ``out`` is a file, a non-empty directory without ``force``, or one of ``keep``, holds one
            or lies inside a checkpoint.
    """
    target = Path(out).expanduser()
    resolved = target.resolve()
    for k in keep:
        k = k.resolve()
        if resolved == k or resolved in k.parents:
            raise ValueError(f"--out {out} is or holds {k}, which the export reads: give another directory")
        if (k / ".metadata").is_file() and k in resolved.parents:
            raise ValueError(f"--out {out} lies inside checkpoint {k} (its manifest would no longer match): "
                             "give a directory outside it")
    if target.exists() and not target.is_dir():
        raise ValueError(f"--out {out} is a file: give a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty: give a new directory, or --force to replace it "
                         "(it is replaced only once the export is complete)")
    return target


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
                      replica: int | str | None = None, tokenizer: str | os.PathLike | None = None,
                      secret: bytes | None = None, trust: bool = False) -> Path:
    """Write the model of a run or checkpoint ``path`` to ``out`` as a transformers directory.

    See the module's docstring for what is written and which parameters. ``replica``: DiLoCo-family
    methods only, which replica's outer parameters (default 0) or ``"mean"``. ``secret`` and ``trust``:
    as for a resume (:func:`lowband.checkpoint.signatures.verify_manifest`).

    Returns:
        ``out``.

    Raises:
        FileNotFoundError, ValueError (:class:`~lowband.checkpoint.signatures.CheckpointRefused` among them):
            bad input, named with its fix, before anything is written.
    """
    source = find_source(path, tokenizer=tokenizer)
    local_family = METHODS[source.method].family == "local"
    if replica is not None and not local_family:
        raise ValueError(f"--replica applies to DiLoCo, NoLoCo and SparseLoCo, whose replicas' outer parameters may "
                         f"differ; the replicas of {source.method} hold the same parameters: leave --replica out")
    target = check_out(out, force=force, keep=tuple(p for p in (source.checkpoint, source.run) if p is not None))
    verify_manifest(source.checkpoint, secret=secret, trust=trust)
    tok = load_tokenizer(source.tokenizer)
    model, kind = _build(source, vocab_size=tok.get_vocab_size())
    md = read_metadata(source.checkpoint)
    which = _load_weights(model, source, md, replica=0 if replica is None and local_family else replica)
    ids = special_ids(tok)
    with atomic_dir(target) as tmp:
        model.save_pretrained(str(tmp))
        for_transformers(tok, seq2seq=kind == "seq2seq").save_pretrained(str(tmp))
        _save_generation_config(model, tmp, pad=ids.pad, eos=ids.eos, seq2seq=kind == "seq2seq")
        record = {"checkpoint": str(source.checkpoint.resolve()), "step": source.extra.get("step"),
                  "method": source.method, "model": source.model, "parameters": which,
                  "topology": source.extra.get("topology")}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    log.info("exported %s (%s, step %s: %s) to %s", source.checkpoint, source.method, source.extra.get("step"), which,
             target)
    return target


def _build(source: ExportSource, *, vocab_size: int) -> tuple[torch.nn.Module, str]:
    """The run's model, built as the run built it (its weights are then overwritten by the checkpoint's)."""
    name = source.model
    if name not in MODEL_SIZES and not Path(name).expanduser().is_dir():
        raise ValueError(f"checkpoint {source.checkpoint} was trained from the local model directory {name}, "
                         "which is not there now: run the export where the run was launched, or put it back")
    spec = build_model(name, vocab_size=vocab_size, seed=0)
    spec.model.eval()
    return spec.model, spec.kind


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state by name: its parameters (a tied one once) and persistent buffers."""
    names = set(model.state_dict())
    found = dict(model.named_parameters())
    found.update((n, b) for n, b in model.named_buffers() if n in names)
    return found


def _load_weights(model: torch.nn.Module, source: ExportSource, md, *, replica: int | str | None) -> str:
    """Read the checkpoint's parameters into ``model`` (in place); returns which, in words."""
    saved = md.state_dict_metadata
    targets = _targets(model)
    slow = dict.fromkeys(dict(model.named_parameters())) if replica is not None else {}  # ordered, quick to test
    problems = []
    for name, t in targets.items():
        key = f"optim.state.{name}.slow" if name in slow else f"model.{name}"
        meta = saved.get(key)
        if meta is None or not hasattr(meta, "size"):
            problems.append(f"{key!r} is not in it")
            continue
        shape, want = tuple(meta.size), tuple(t.shape)
        if name in slow:
            ok = shape == want or (shape[1:] == want and len(shape) == len(want) + 1)
            if ok and isinstance(replica, int) and replica >= (shape[0] if shape != want else 1):
                raise ValueError(f"--replica {replica}: checkpoint {source.checkpoint} holds "
                                 f"{shape[0] if shape != want else 1} replica(s), 0 to "
                                 f"{(shape[0] if shape != want else 1) - 1}")
        else:
            ok = shape == want
        if not ok:
            problems.append(f"{key!r} is {shape} in it and {want} in the model")
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(
            f"checkpoint {source.checkpoint} does not fit model {source.model} with the tokenizer {source.tokenizer}: "
            f"{'; '.join(problems[:3])}{more}. Export with the run's own tokenizer (--tokenizer), or a checkpoint "
            "of a lowband run"
        )
    def reader(state: dict[str, torch.Tensor]) -> None:
        with warnings.catch_warnings():  # one process without a process group is what is meant here
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(str(source.checkpoint)), planner=SafePlanner(), no_dist=True)

    with torch.no_grad():
        # Replicated state straight into the model's tensors: DCP gathers every shard in place.
        reader({f"model.{n}": t for n, t in targets.items() if n not in slow})
        batch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        size = 0
        for name in slow:
            meta = saved[f"optim.state.{name}.slow"]
            buf = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            batch[name] = (buf, targets[name])
            size += buf.numel() * buf.element_size()
            if size >= _READ_BATCH_BYTES:
                _read_rows(reader, batch, replica)
                batch, size = {}, 0
        if batch:
            _read_rows(reader, batch, replica)
    if replica is None:
        return "model"
    return f"outer (slow) parameters of replica {replica}" if isinstance(replica, int) else \
        "outer (slow) parameters, mean over the replicas"


def _read_rows(reader, batch: dict[str, tuple[torch.Tensor, torch.Tensor]], replica: int | str) -> None:
    """Read each per-replica tensor in full, then copy the chosen replica's row (or their mean) into the model."""
    reader({f"optim.state.{n}.slow": buf for n, (buf, _) in batch.items()})
    for buf, t in batch.values():
        if buf.shape == t.shape:  # a one-process checkpoint: one replica, no replica dimension
            t.copy_(buf)
        elif replica == "mean":
            t.copy_(buf.double().mean(0).to(t.dtype))
        else:
            t.copy_(buf[replica])


def _save_generation_config(model: torch.nn.Module, directory: Path, *, pad: int, eos: int, seq2seq: bool) -> None:
    """``generation_config.json`` with the tokenizer's ids: what ``generate`` pads with and stops at."""
    from transformers import GenerationConfig  # heavy: only when a model is built

    gen = GenerationConfig(pad_token_id=pad, eos_token_id=eos)
    if seq2seq:
        gen.decoder_start_token_id = getattr(model.config, "decoder_start_token_id", pad)
    else:
        gen.bos_token_id = eos
    gen.save_pretrained(str(directory))

