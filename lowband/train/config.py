"""The job configuration: one typed, nested :class:`TrainConfig`, a table per concern.

::

    TrainConfig
      method           RunMethod: name, hp (the method's typed MethodConfig, lowband.train.methods)
      model            ModelConfig: name, precision, activation_checkpointing, compile, shards
      data             DataConfig (lowband.train.data): files, columns, token lengths, vocabulary, split
      schedule         ScheduleConfig: steps, batch_size, grad_accum, lr_schedule, warmup_steps, min_lr_ratio,
                       time_budget_s
      link             LinkConfig: bandwidth_bps, latency_s
      checkpoint       CheckpointConfig: every, at_end, resume, trust
      run              RunConfig: seed, val_every, val_batches, out, tensorboard, report_to, log_every,
                       run_name, wandb_project, progress, memory_profile, poison, stop_file,
                       export_hf
      fault_tolerance  FaultToleranceJob: lighthouse, node, max_nodes, timeout_s, quorum, start_nodes

Every field of a table is declared once, with :func:`lowband.train.fields.option`: its default, its
help and its ``lowband train`` flag; the job file's tables and keys (:mod:`lowband.train.jobfile`),
the flags and ``--help`` (:mod:`lowband.train.args`) are derived from these classes. A table's
fields without help (DataConfig's ``kind`` and ``seed``) are not part of the job: the trainer sets
them from the model and the run's seed.

Build one in code from its tables, as a job file has them::

    TrainConfig.from_tables({"method": {"name": "diloco", "H": 10}, "schedule": {"steps": 500}})
"""

from __future__ import annotations

import functools
import logging
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowband.distributed.compile import check_compile
from lowband.distributed.sharding import PRECISIONS
from lowband.ft.node import FaultToleranceConfig, fingerprint, require_torchft
from lowband.train.data import check_data_file, data_digest
from lowband.train.data.config import DataConfig
from lowband.train.export import check_out
from lowband.train.fields import job_fields, option
from lowband.train.methods import METHODS, MethodConfig, method_config
from lowband.train.models import resolve_model
from lowband.train.pretrained import data_config_for
from lowband.train.trackers import check_trackers
from lowband.trust.keys import load_key, load_roster
from lowband.trust.secret import load_secret
from lowband.units import parse_bandwidth, parse_duration, split_list
from lowband.util import file_digest

__all__ = ["CheckpointConfig", "DataConfig", "FaultToleranceJob", "LinkConfig", "ModelConfig", "RunConfig",
           "RunMethod", "ScheduleConfig", "TrainConfig", "sections"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RunMethod:
    """The method a run trains with: its name (a key of :data:`~lowband.train.methods.METHODS`) and its
    hyper-parameters, typed (a Mapping of field names or aliases is accepted and checked into the config)."""

    name: str = option("flexdemo", "; ".join(f"{m.name}: {m.description}" for m in METHODS.values()),
                       flag="--method", choices=tuple(METHODS))
    hp: MethodConfig = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.hp = method_config(self.name, self.hp)


@dataclass(kw_only=True)
class ModelConfig:
    """The model and how a copy of it is laid out and computed."""

    name: str = option("t5-mini", "named size (t5-tiny, t5-mini, t5-small, gpt-mini, llama-tiny, llama-small, ...), "
                       "a local model directory (config.json, optional weights), or a Hugging Face hub id (org/name) "
                       "already in the local Hugging Face cache (nothing is downloaded). A model with weights trains "
                       "with its own tokenizer", flag="--model")
    precision: str = option("fp32", "bf16: FSDP2 mixed precision (bf16 parameters and compute, fp32 gradient "
                            "reduction, fp32 optimizer state)", choices=("fp32", "bf16"))
    activation_checkpointing: bool = option(False, "recompute each transformer block's activations in backward "
                                            "(less memory, about one more forward)")
    compile: bool = option(False, "compile each transformer block with torch.compile (inductor, as torchtitan "
                           "does): fused kernels in each block, meant for GPUs (no gain measured on a CPU), after "
                           "a one-off compilation at the first step and the first validation (seconds to minutes, "
                           "counted in the training clock); needs a C++ compiler on the CPU, Triton on a GPU "
                           "(docs/configuration.md)")
    shards: int | None = option(None, "ranks sharding one model copy (default: all ranks of a node; demo: 1)")


@dataclass(kw_only=True)
class ScheduleConfig:
    """How long, on how much data per step, at which learning rate over the steps."""

    steps: int = option(100, "optimizer steps")
    batch_size: int = option(8, "examples per rank per micro-batch")
    grad_accum: int = option(1, "micro-batches per optimizer step (the step equals one on a grad-accum-times "
                             "larger batch; one intra-node reduce-scatter)")
    lr_schedule: str = option("constant", "learning-rate schedule (cosine: linear warm-up, then cosine to "
                              "--min-lr-ratio × lr)", flag="--schedule", choices=("constant", "cosine"))
    warmup_steps: int = option(0, "of the schedule")
    min_lr_ratio: float = option(0.1, "of the cosine schedule")
    time_budget_s: float | None = option(
        None, "stop at the first step whose training clock (start-up and validation excluded) exceeds this, e.g. "
        "90 or 90s; --steps is then the most steps, and the lr schedule runs to the budget: its progress is the "
        "further of step / --steps and training clock / budget (DiLoCo, NoLoCo, SparseLoCo: at the end of the "
        "outer window the budget ran out in). Default: none", flag="--time-budget",
        type=lambda t: parse_duration(t, what="--time-budget"), metavar="SECONDS")


@dataclass(kw_only=True)
class LinkConfig:
    """Emulated slow links between nodes, shaped in-process (real links need none)."""

    bandwidth_bps: float | None = option(
        None, "shape traffic between nodes in-process to this uplink rate per node, e.g. 100mbit (default: no "
        "shaping)", flag="--link-bandwidth", type=parse_bandwidth, metavar="RATE")
    latency_s: float = option(0.0, "add this latency per message between nodes, e.g. 20ms", flag="--link-latency",
                              type=parse_duration, metavar="DURATION")


@dataclass(kw_only=True)
class CheckpointConfig:
    """DCP checkpoints under ``OUT/checkpoints``, and what a run resumes from."""

    every: int = option(0, "DCP checkpoint every N steps (0: off)", flag="--ckpt-every")
    at_end: bool = option(False, "write a checkpoint after the last step", flag="--ckpt-at-end")
    resume: str | None = option(None, "checkpoint directory, 'auto' for the newest in OUT, or 'if-any': the "
                                "newest if there is one, else start afresh (a node's first start and restarts)")
    trust: bool = option(False, "resume from a checkpoint this job cannot vouch for (no lowband manifest, unsigned "
                         "while the job has a secret, or signed with another secret); it is still read without "
                         "running code from it", flag="--trust-checkpoint")


@dataclass(kw_only=True)
class RunConfig:
    """The run's seed, evaluation, outputs and progress."""

    seed: int = option(0, "model init, data order and everything random")
    val_every: int = option(0, "validate every N steps (0: per epoch)")
    val_batches: int = option(8, "validation batches per evaluation")
    out: str = option("runs/train", "run directory")
    tensorboard: bool = option(False, "the same as --report-to tensorboard (kept for the job files that set it)")
    report_to: str | None = option(
        None, "send the run's scalars (rank 0: every step's and validation's record, and the progress lines' numbers) "
        "to these trackers, a comma list: tensorboard (event files in OUT/tensorboard; pip install "
        "'lowband[tensorboard]'), wandb (Weights & Biases, with the job's config.toml as the run's config; pip "
        "install 'lowband[wandb]'; WANDB_MODE=offline keeps the run on disk). Default: none (metrics.jsonl only)",
        metavar="TRACKERS")
    log_every: int = option(10, "log a progress line every N steps on local rank 0 of each node: step, training "
                            "loss, last validation loss, tokens/s, MB sent between nodes per step, share of the "
                            "step spent communicating, ETA (0: no lines)", metavar="N")
    run_name: str | None = option(None, "the run's name in the trackers (default: the name of the --out directory; "
                                  "a fault-tolerant node adds -nodeN)", metavar="NAME")
    wandb_project: str | None = option(None, "the W&B project (default: $WANDB_PROJECT, else lowband)",
                                       metavar="NAME")
    progress: bool = option(True, "no progress bar (it is drawn on rank 0 only when stderr is a terminal; "
                            "elsewhere the --log-every lines say the same)", flag="--no-progress")
    memory_profile: bool = option(False, "CPU: make glibc return freed memory so the summary's per-phase peaks "
                                  "follow live memory (~25% more CPU time)")
    poison: str | None = option(None, "fault injection: node N sends wrong updates from STEP on (scale: x1000, "
                                "flip: sign-flipped, to measure robust aggregation, aggregate=clip|trimmed; nan: NaN "
                                "values, index: out-of-range indices, both with a clean flag, for the message checks "
                                "to refuse); every node gets the same flag", metavar="nodeN:KIND@STEP")
    stop_file: str | None = option(None, "end the run cleanly after the step number this file holds, once it appears "
                                   "(the same number on every node, ahead of the job; a local-step method ends with "
                                   "that window's outer step)", metavar="PATH")
    export_hf: str | None = option(
        None, "at the end, write the model as a transformers directory (config.json, model.safetensors, the tokenizer, "
        "generation_config.json) to DIR, which must not exist or be empty: rank 0 exports the final checkpoint (written "
        "for it when --ckpt-at-end and --ckpt-every are off), as `lowband export OUT --out DIR` does "
        "(docs/export.md)", flag="--export-hf", metavar="DIR")

    def trackers(self) -> tuple[str, ...]:
        """The trackers ``report_to`` names (the older ``tensorboard = true`` adds tensorboard), each once."""
        names = [n.lower() for n in split_list(self.report_to or "")]
        return tuple(dict.fromkeys([*names, *(["tensorboard"] if self.tensorboard else [])]))


@dataclass(kw_only=True)
class FaultToleranceJob:
    """torchft: one torchrun per node, nodes may die and join (docs/fault-tolerance.md). The node's
    runtime configuration is :meth:`TrainConfig.ft_config` (a :class:`lowband.ft.node.FaultToleranceConfig`)."""

    lighthouse: str | None = option(None, "the Lighthouse's address (http://HOST:PORT, printed by `lowband "
                                    "lighthouse`); turns fault tolerance on", flag="--ft-lighthouse", metavar="URL")
    node: int = option(0, "this node's slot, 0 <= N < --ft-max-nodes (a restarted node takes its old slot)",
                       flag="--ft-node")
    max_nodes: int = option(1, "the most nodes at once; each step's global batch is laid out for this many "
                            "(a dead node's slice is skipped)", flag="--ft-max-nodes")
    timeout_s: float = option(10.0, "a collective between nodes, a commit vote or a state transfer that takes "
                              "longer fails (the step is dropped), e.g. 10s", flag="--ft-timeout",
                              type=parse_duration, metavar="DURATION")
    quorum: str = option(
        "async", "async: form each step's quorum while the step's forward and backward run, as torchft does; "
        "NoLoCo forms one per outer window while its inner steps run, so a slow node outside a node's group holds "
        "it up only once it is a whole window behind; DiLoCo and SparseLoCo always form theirs before the outer "
        "step. sync: before each step that communicates, waited for", flag="--ft-quorum", choices=("async", "sync"))
    start_nodes: int | None = option(
        None, "a new job trains its first step once N nodes are live (default: --ft-max-nodes), so its nodes start "
        "together; after 120 s it starts with those there are. A node that joins a running job does not wait",
        flag="--ft-start-nodes", metavar="N")
    secret_file: str | None = option(
        None, "the job's secret, a file every node holds (`lowband secret PATH` makes one; or set LOWBAND_SECRET_FILE "
        "or LOWBAND_SECRET): every member of every quorum proves it, bound to its job, slot and address; a node "
        "without it is refused. Never give the secret itself on a command line (docs/internet.md)",
        flag="--secret-file", metavar="PATH")
    key_file: str | None = option(
        None, "this node's own private key (`lowband secret PATH --nodes N` writes PATH.node{i}.key for --ft-node i; "
        "mode 0600, on this node only); with --roster, the node signs its reports, its claim to its slot and the "
        "state it serves with it, and a job with a roster refuses what is not signed so (docs/internet.md)",
        flag="--key-file", metavar="PATH")
    roster: str | None = option(
        None, "the job's roster of members' public keys (PATH.roster of `lowband secret PATH --nodes N`, signed by "
        "the secret; the same file on every node and on the Lighthouse); needs --secret-file and --key-file",
        flag="--roster", metavar="PATH")
    bind: str | None = option(
        None, "the job's network address this node's listeners (torchft Manager, state server, gloo) bind: loopback "
        "or a VPN address of this machine, in any spelling (a host name: every address it resolves to); a wildcard "
        "or public one needs --trusted-network, and one not on this machine stops the node before it starts "
        "(default: LOWBAND_FT_ADVERTISE, else 127.0.0.1)", flag="--ft-bind", metavar="ADDR")
    trusted_network: bool = option(False, "allow --ft-bind on a wildcard or public address: every host that can "
                                   "reach it is trusted", flag="--trusted-network")


# Method options that change how a step is computed on this host, not what it computes: nodes (a CPU one and a GPU
# one) may differ in them, and a checkpoint resumes with either.
_LAYOUT_ONLY = frozenset({"blocks"})


@dataclass(kw_only=True)
class TrainConfig:
    """One training run: a table per concern (see the module's docstring)."""

    method: RunMethod = field(default_factory=RunMethod)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    fault_tolerance: FaultToleranceJob = field(default_factory=FaultToleranceJob)

    @classmethod
    def from_tables(cls, tables: Mapping[str, Mapping[str, Any]]) -> TrainConfig:
        """The config from its tables by field name, as :func:`lowband.train.jobfile.loads` gives them
        (``method``: ``name`` and the hyper-parameters by field name or alias); tables and keys not given
        keep their defaults. A bad value is a ValueError that names it."""
        unknown = set(tables) - set(sections())
        if unknown:
            raise ValueError(f"unknown table(s) {', '.join(sorted(unknown))}; the tables are: {', '.join(sections())}")
        kwargs: dict[str, Any] = {}
        for table, cls_ in sections().items():
            body = dict(tables.get(table, {}))
            if table == "method":
                name = body.pop("name", RunMethod.name)
                kwargs[table] = RunMethod(name=name, hp=body)
                continue
            keys = job_fields(cls_)
            bad = set(body) - set(keys)
            if bad:
                raise ValueError(f"[{table}] has no key {', '.join(sorted(bad))}; its keys are: {', '.join(keys)}")
            if table == "data" and isinstance(body.get("val_size"), float) and body["val_size"] >= 1:
                body["val_size"] = int(body["val_size"])  # a count given as a float (a flag's text)
            kwargs[table] = cls_(**body)
        return cls(**kwargs)

    def tables(self) -> dict[str, dict[str, Any]]:
        """Every table by field name: the inverse of :meth:`from_tables` (``method``: name and every
        hyper-parameter, defaults included)."""
        out: dict[str, dict[str, Any]] = {"method": {"name": self.method.name, **self.method.hp.as_dict()}}
        for table, cls_ in sections().items():
            if table != "method":
                section = getattr(self, table)
                out[table] = {k: getattr(section, k) for k in job_fields(cls_)}
        return out

    def fingerprint(self, ranks_per_node: int | None = None) -> str:
        """What must be equal on every node for them to train one model: the method and its
        hyper-parameters, the model, its precision and shards per node, the data by content (its token
        store's digest, computed when the store was written: the text is not read again), how it is cut
        and tokenised (columns, split, lengths, packing, the tokenizer by content or the trained one's
        kind, size and sample), the schedule, the seed, the job's layout and its roster of keys. Two nodes with the same
        files under other paths agree; another job's node does not. A user's data not yet tokenised on
        this host is tokenised here (once: the run then opens the store)."""

        s, d, ft = self.schedule, self.data, self.fault_tolerance
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("WORLD_SIZE", "1"))

        def content(path):  # a missing tokenizer is named by validate()
            return None if path is None else file_digest(path) if Path(path).exists() else f"missing {path}"

        return fingerprint(
            self.method.name, sorted((k, v) for k, v in self.method.hp.as_dict().items() if k not in _LAYOUT_ONLY),
            self.model.name, self.model.precision,
            self.model.shards or ranks_per_node, self.model.activation_checkpointing,
            data_digest(data_config_for(self.model.name, d)), d.source_column, d.target_column,
            d.text_column, d.val_size, d.max_source_len, d.max_target_len, d.max_len, d.packing, d.max_examples,
            content(d.tokenizer),
            None if d.tokenizer else (d.tokenizer_kind, d.vocab_size, d.tokenizer_sample_bytes if d.path else None),
            s.steps, s.batch_size, s.grad_accum, s.lr_schedule, s.warmup_steps, s.min_lr_ratio,
            self.run.seed, ft.max_nodes, ft.quorum,
            # A job with a roster signs its states and claims; its nodes and a node without one cannot heal from
            # each other, so they are two jobs (only here when given: other jobs' fingerprints stay as they were).
            *(("roster", content(ft.roster)) if ft.roster else ()))

    def ft_config(self, ranks_per_node: int | None = None):
        """The node's fault-tolerance configuration, or None (no ``fault_tolerance.lighthouse``)."""
        ft = self.fault_tolerance
        if ft.lighthouse is None:
            return None

        spec = METHODS[self.method.name]
        if (ft.key_file is None) != (ft.roster is None):
            raise ValueError("--key-file and --roster go together: a node signs with its own key (--key-file) what the "
                             "others check against the job's roster (--roster); give both, or neither")
        secret = load_secret(ft.secret_file)
        roster = None if ft.roster is None else load_roster(ft.roster, secret)
        return FaultToleranceConfig(
            lighthouse=ft.lighthouse, node=ft.node, max_nodes=ft.max_nodes, timeout_s=ft.timeout_s,
            async_quorum=ft.quorum == "async" and spec.ft_quorum != "outer",
            window_quorum=ft.quorum == "async" and spec.ft_quorum == "window",
            start_nodes=ft.max_nodes if ft.start_nodes is None else ft.start_nodes,
            fingerprint=self.fingerprint(ranks_per_node), secret=secret, bind=ft.bind,
            trusted_network=ft.trusted_network, steps=self.schedule.steps, roster=roster,
            key=None if roster is None else load_key(ft.key_file, ft.node, roster),
        )

    def validate(self) -> None:
        """Check everything that can be checked before any process group exists."""
        method, s, r = self.method.hp, self.schedule, self.run
        note = method.tail_note(s.steps)
        if note is not None:
            log.warning("%s: %s", self.method.name, note)
        for value, flag in ((s.steps, "--steps"), (s.batch_size, "--batch-size"), (r.val_batches, "--val-batches"),
                            (s.grad_accum, "--grad-accum")):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for value, flag in ((r.val_every, "--val-every"), (self.checkpoint.every, "--ckpt-every"),
                            (s.warmup_steps, "--warmup-steps"), (r.log_every, "--log-every")):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")

        check_trackers(r.trackers())  # a tracker not installed is named now, not after the model is built

        if self.model.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.model.precision!r}")
        if self.model.compile:
            check_compile("inductor")  # no C++ compiler (CPU) or Triton (GPU): said now, not at the first step
        if s.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"--schedule must be 'constant' or 'cosine', got {s.lr_schedule!r}")
        if self.link.bandwidth_bps is not None and not self.link.bandwidth_bps > 0:
            raise ValueError(f"--link-bandwidth must be > 0 bit/s, got {self.link.bandwidth_bps}")
        if not self.link.latency_s >= 0:
            raise ValueError(f"--link-latency must be >= 0 s, got {self.link.latency_s}")
        if s.time_budget_s is not None and not s.time_budget_s > 0:
            raise ValueError(f"--time-budget must be > 0 s, got {s.time_budget_s}; leave it out for no budget")
        if s.time_budget_s is not None and self.fault_tolerance.lighthouse is not None:
            raise ValueError("--time-budget is not supported with fault tolerance (--ft-lighthouse): nodes that "
                             "die and join cannot agree on one training clock; give --steps instead")
        if not 0.0 <= s.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {s.min_lr_ratio}")
        for flag, path in (("--data", self.data.path), ("--val-data", self.data.val_path)):
            if path is not None:
                try:
                    check_data_file(path)  # lists the files (a glob, a directory): reads none
                except (FileNotFoundError, ValueError) as e:
                    raise type(e)(f"{flag}: {e}") from None
        if self.data.tokenizer is not None and not Path(self.data.tokenizer).exists():
            raise FileNotFoundError(f"--tokenizer {self.data.tokenizer!r} does not exist; pass a tokenizer.json or "
                                    "its directory, or leave --tokenizer out to train one on the data")
        if self.fault_tolerance.lighthouse is not None:
            if self.fault_tolerance.quorum not in ("async", "sync"):
                raise ValueError(f"--ft-quorum must be 'async' or 'sync', got {self.fault_tolerance.quorum!r}")
            self.ft_config()
            method.check_fault_tolerance()
            require_torchft()
        if r.export_hf is not None:
            check_out(r.export_hf, force=False, keep=(Path(r.out),))  # refused now, not after the run

        resolve_model(self.model.name)  # a named size, a local directory, or a hub id in the local cache


def replace(cfg: TrainConfig, **tables: Mapping[str, Any]) -> TrainConfig:
    """``cfg`` with some keys of some tables changed: ``replace(cfg, schedule={"steps": 10})``."""
    merged = cfg.tables()
    for table, body in tables.items():
        if table == "method" and "name" in body and body["name"] != cfg.method.name:
            merged["method"] = {}  # another method: the old one's hyper-parameters do not apply
        merged.setdefault(table, {}).update(body)
    return TrainConfig.from_tables(merged)


@functools.cache
def sections() -> dict[str, type]:
    """table -> the class of its TrainConfig field, in order (``method``: RunMethod, whose keys are its
    ``name`` and the method's hyper-parameters)."""
    return dict(typing.get_type_hints(TrainConfig))
