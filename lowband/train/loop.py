"""``lowband train``: the training loop, run on every rank (torchrun on clusters, or `lowband bench`).

Per step and rank: the rank's slice of the global batch -> forward/backward (FSDP2 reduce-scatters
inside the node) -> ``optimizer.step()`` (the inter-node part, through the link) -> the link's
record of the step. Rank 0 writes ``metrics.jsonl`` (and sends it to the ``--report-to`` trackers);
every rank writes ``summary_rank{R}.json``; local rank 0 of each node logs a progress line every
``--log-every`` steps (:mod:`lowband.train.progress`, docs/monitoring.md).

Outputs in ``--out`` (schema used by `lowband bench`):

- ``metrics.jsonl`` (rank 0): ``{"type": "train", "step", "epoch", "loss", "step_time_s",
  "compute_time_s", "comm_time_s", "exposed_comm_time_s", "inter_node_bytes_sent", "tokens",
  "train_time_s", "wall_s", "lr"}`` per step (``compute_time_s`` = step time − exposed
  communication, the time blocked in the link) and ``{"type": "val", "step", "epoch", "tokens",
  "train_time_s", "wall_s", "val_loss"}`` per validation.
- ``summary_rank{R}.json``: medians of the step timings (warm-up steps excluded), bytes per step,
  the link's operations by kind, peak memory, the final validation loss and its history.

Clocks. ``train_time_s`` is the training clock: the time spent in training steps (batch, forward,
backward, optimizer step with its communication) since step 0, summed over the steps; start-up,
validation and checkpoints are left out, as the FlexDeMo paper's "minutes of training". It goes on
across a resume (restored from the checkpoint). ``wall_s`` is the wall time since this process
started its loop, everything included. ``tokens`` counts the non-padding tokens this rank has
trained on (source and target); the bench sums it over ranks.
- ``checkpoints/step_NNNNNN/`` (DCP) every ``--ckpt-every`` steps and at the end.
- ``config.toml`` (the job) and ``tokenizer/`` (the tokenizer the run used, a transformers tokenizer
  directory), rank 0; with ``--export-hf DIR`` the final model as a transformers directory in DIR.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.contrib.logging import logging_redirect_tqdm

from lowband.checkpoint.dcp import latest_checkpoint, load_checkpoint, save_checkpoint, topology_record
from lowband.comm.link import Link
from lowband.comm.traffic import OpTally, merge_tallies
from lowband.distributed.sharding import shard_model
from lowband.distributed.topology import Topology
from lowband.ft.session import membership_for
from lowband.train import jobfile
from lowband.train.budget import StopFile, TimeBudget
from lowband.train.config import ScheduleConfig, TrainConfig
from lowband.train.data import (
    epoch_of,
    load_data,
    passes_note,
    real_tokens,
    steps_per_epoch,
    train_batch,
    val_batches,
)
from lowband.train.export import export_checkpoint
from lowband.train.memory import PhaseMemory
from lowband.train.methods import METHODS, method_shards
from lowband.train.metrics import MetricsFile
from lowband.train.models import build_model, compute_loss, resolve_model, transformer_blocks
from lowband.train.pretrained import data_config_for
from lowband.train.progress import ProgressLog, show_progress_bar
from lowband.train.schedule import warmup_cosine_factor
from lowband.train.step import split_batch, train_step
from lowband.train.summary import RunSummary
from lowband.train.tokenizer import save_for_transformers
from lowband.train.trackers import open_trackers
from lowband.trust.secret import load_secret

__all__ = ["Trainer", "run_training", "WARMUP_STEPS_EXCLUDED"]

log = logging.getLogger(__name__)

# Step timings of the first steps (allocator warm-up, first collectives) are left out of medians.
WARMUP_STEPS_EXCLUDED = 2


# --------------------------------------------------------------------------- helpers
def _init_distributed() -> None:
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def _peak_rss_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def lr_lambda(s: ScheduleConfig):
    """Multiplier of the base lr at each step: constant, or linear warm-up then cosine decay."""
    min_ratio = 1.0 if s.lr_schedule == "constant" else s.min_lr_ratio  # 1: no decay
    return functools.partial(warmup_cosine_factor, warmup_steps=s.warmup_steps, total_steps=s.steps,
                             min_ratio=min_ratio)


@torch.no_grad()
def evaluate(model, data, *, batch_size: int, max_batches: int, device) -> float:
    """Token-weighted mean validation loss of this rank's model copy (all shard ranks call it)."""

    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in val_batches(data, batch_size=batch_size, max_batches=max_batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        n = int((batch["labels"] != -100).sum())
        total += compute_loss(model, batch).item() * n
        tokens += n
    model.train(was_training)
    return total / max(tokens, 1)


# --------------------------------------------------------------------------- the run
@dataclass
class _Tally:
    """What the steps and validations of a run add up to, for its summary."""

    step_times: list[float] = field(default_factory=list)  # warm-up steps excluded (these four)
    compute_times: list[float] = field(default_factory=list)
    comm_times: list[float] = field(default_factory=list)
    exposed_times: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # every step (these two)
    node_sent: list[int] = field(default_factory=list)
    sync_times: list[float] = field(default_factory=list)  # DiLoCo/NoLoCo: steps with an outer step
    link_ops: dict[str, OpTally] = field(default_factory=dict)
    val_history: list[dict[str, float]] = field(default_factory=list)
    train_loss: float = float("nan")

    def add_ops(self, by_kind: dict[str, OpTally]) -> None:
        merge_tallies(self.link_ops, by_kind)


class Trainer:
    """One rank's training run, in named phases.

    :meth:`run` is ``build`` → ``evaluate(0)`` → ``train_step`` per step (with ``evaluate`` and
    ``checkpoint`` where due) → final ``evaluate`` and ``checkpoint`` → ``summarize``:

    - :meth:`build`: the process group, topology, data, model (FSDP2 inside a node), link,
      optimizer (from the method's config), lr schedule, a resume, the outputs.
    - :meth:`train_step`: one optimizer step: this rank's slice of the global batch → forward and
      backward (``grad_accum`` micro-batches) → ``optimizer.step()`` (the inter-node part, through
      the link) → the link's record of the step, written to ``metrics.jsonl``.
    - :meth:`evaluate`: validation loss of this rank's model copy, recorded.
    - :meth:`checkpoint`: a DCP checkpoint with the schedule, step and training clock.
    - :meth:`summarize`: this rank's :class:`~lowband.train.summary.RunSummary`, written.

    Args:
        cfg: the run (checked at once: :meth:`TrainConfig.validate`, and the model with its tokenizer:
            :func:`lowband.train.pretrained.data_config_for`).
    """

    def __init__(self, cfg: TrainConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        _ = self.data_config  # the model and its tokenizer, checked now: before any process group or data
        self.method = cfg.method.hp
        self.local = METHODS[cfg.method.name].family == "local"
        self.tally = _Tally()
        self.start_step = 0
        self.steps_done = cfg.schedule.steps  # the steps trained: fewer when --time-budget stops the run
        # Who trains with this rank: the same questions with and without fault tolerance (lowband.ft.session).
        self.membership = membership_for(cfg.ft_config())
        #: Called with the trainer once it is built, before the first step (``lowband train --poison`` installs
        #: fault injection on the optimizer this way).
        self.after_build: list = []

    @functools.cached_property
    def model_source(self):
        """Where ``--model`` points (:func:`lowband.train.models.resolve_model`)."""
        return resolve_model(self.cfg.model.name)

    @functools.cached_property
    def data_config(self):
        """The data the run loads: the model's kind, and a pretrained model's tokenizer, its own or a ``--tokenizer``
        that fits it (:func:`lowband.train.pretrained.data_config_for`)."""
        return data_config_for(self.model_source, self.cfg.data)

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        """Everything a step needs, in order: processes, topology, data, model, link, optimizer, resume, outputs."""
        self._start_processes()
        self._build_model()
        self._build_optimizer()
        if self.cfg.checkpoint.resume:
            self._resume()
        self._open_outputs()
        for hook in self.after_build:
            hook(self)

    def _start_processes(self) -> None:
        cfg = self.cfg
        _init_distributed()
        if cfg.model.precision != "fp32" and not dist.is_initialized():
            # FSDP2 applies the precision policy; a single process gets a one-rank group (no ports).
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.topology = Topology.from_env(shards=method_shards(cfg.method.name, local_world, cfg.model.shards))
        self.topology.check_launch()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        # Which slice of each step's global batch this rank reads (fault tolerance: by node slot).
        self.data_rank, self.data_world = self.membership.data_slot(rank=self.rank, world=self.world,
                                                                    topology=self.topology)
        self.out = Path(cfg.run.out)
        self.out.mkdir(parents=True, exist_ok=True)
        # T5 blocks return views; FSDP2 warns that an in-place op on them would skip its hook. Neither
        # model does one: tests/distributed/test_sharding.py checks sharded T5 gradients against unsharded ones.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.t_start = time.perf_counter()

    def _build_model(self) -> None:

        cfg = self.cfg
        # The split is the data's own (not the run's seed); a model built here takes the tokenizer's special ids.
        self.data = load_data(self.data_config)
        self.spec = build_model(self.model_source, vocab_size=self.data.vocab_size, seed=cfg.run.seed,
                                special=self.data.special)
        model = self.spec.model.to(self.device)
        self.model = shard_model(model, self.topology, blocks=transformer_blocks(model),
                                 precision=cfg.model.precision,
                                 activation_checkpointing=cfg.model.activation_checkpointing,
                                 compile_backend="inductor" if cfg.model.compile else None,
                                 compile_dynamic=None if self.data.packed else True)
        # The sharded parameters, held apart: FSDP2 swaps a module's attributes for the unsharded ones
        # during forward and backward, and a peer may copy this node's state then (async quorum).
        self._shards = dict(self.model.named_parameters())

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        self.membership.attach(self)
        self.link = Link(self.topology, bandwidth_bps=cfg.link.bandwidth_bps, latency_s=cfg.link.latency_s,
                         ft=self.membership.torchft)
        self.optimizer = self.method.build(list(self.model.named_parameters()), link=self.link, model=self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.schedule))
        # The training clock and token count (see the module docstring); a resumed run goes on from
        # the checkpoint's, so its curves continue the interrupted run's.
        self.clock: dict[str, float] = {"train_time_s": 0.0, "tokens": 0}
        self.budget = TimeBudget.of(cfg.schedule, self.device)  # --time-budget: lowband.train.budget
        self.stop = StopFile(cfg.run.stop_file) if cfg.run.stop_file else None  # --stop-file: the same module

    def _resume(self) -> None:
        cfg, out, model, optimizer, scheduler, link = (self.cfg, self.out, self.model, self.optimizer,
                                                       self.scheduler, self.link)

        resume = cfg.checkpoint.resume
        path = latest_checkpoint(out / "checkpoints") if resume in ("auto", "if-any") else Path(resume)
        if path is None and resume == "if-any":
            log.info("--resume if-any: no checkpoint under %s yet: starting afresh", out / "checkpoints")
            return
        if path is None:
            raise FileNotFoundError(f"--resume auto: no checkpoint under {out / 'checkpoints'}; "
                                    "drop --resume to start afresh")
        extra = load_checkpoint(path, model=model, optimizer=optimizer, method=cfg.method.name, secret=self._secret(),
                                trust=cfg.checkpoint.trust)
        start_step = int(extra["step"])
        _log_topology_change(extra, self.topology, cfg=cfg)
        resumed = extra
        scheduler.load_state_dict(extra["scheduler"])
        link.end_step()  # loading may run a zero-lr step (DCP initialises optimizer state): not traffic
        link.history.clear()
        log.info("resumed from %s at step %d", path, start_step)
        self.start_step = start_step
        self.clock = {"train_time_s": float(resumed.get("train_time_s", 0.0)), "tokens": int(resumed.get("tokens", 0))}

    def _open_outputs(self) -> None:

        cfg = self.cfg
        self.step_batch = cfg.schedule.batch_size * cfg.schedule.grad_accum  # examples per rank per optimizer step
        self.profile = PhaseMemory(self.device, return_freed=cfg.run.memory_profile)
        # A resumed run, or a node that may rejoin a fault-tolerant job, appends to the record of its earlier life.
        append = self.membership.appends_metrics(self)
        trackers = []
        if self.rank == 0:  # the complete job: `lowband train --config OUT/config.toml` runs it again
            self.out.mkdir(parents=True, exist_ok=True)
            job = jobfile.dumps(cfg)
            (self.out / "config.toml").write_text(job)
            # The tokenizer the run trained or was given: OUT needs nothing from the user's cache to be used.
            save_for_transformers(self.data.tokenizer, self.out / "tokenizer", seq2seq=self.spec.kind == "seq2seq")
            trackers = self._open_trackers(jobfile.loads(job))
        self.metrics = MetricsFile(self.out, enabled=self.rank == 0, append=self.start_step > 0 or append,
                                   trackers=trackers)
        self.steps_per_epoch = steps_per_epoch(self.data, world_size=self.data_world, batch_size=self.step_batch)
        note = passes_note(self.data, steps=cfg.schedule.steps, world_size=self.data_world,
                           batch_size=cfg.schedule.batch_size, grad_accum=cfg.schedule.grad_accum)
        if note and self.rank == 0:  # before step 0: the data-size guard
            log.warning("%s", note)
        self.bar = None
        if show_progress_bar(enabled=cfg.run.progress, rank=self.rank):  # a terminal: not a cluster's log file
            from tqdm import tqdm  # only on a terminal

            self.bar = tqdm(total=cfg.schedule.steps, initial=self.start_step, desc=cfg.method.name, file=sys.stderr,
                            dynamic_ncols=True, mininterval=1.0)
        # The --log-every lines: local rank 0 of each node (the other ranks of a node would say the same).
        self.progress = None
        if cfg.run.log_every and self.rank % self.topology.ranks_per_node == 0:
            self.progress = ProgressLog(every=cfg.run.log_every, total_steps=cfg.schedule.steps,
                                        budget_s=cfg.schedule.time_budget_s, tokens=self.clock["tokens"],
                                        train_time_s=self.clock["train_time_s"])
        self.wall0 = time.perf_counter()

    def _open_trackers(self, job: dict) -> list:
        """Rank 0's ``--report-to`` trackers; ``job``: the tables of the config.toml just written."""

        cfg = self.cfg
        name = cfg.run.run_name or self.out.resolve().name
        group = None
        if cfg.fault_tolerance.lighthouse is not None:  # every node reports: one run each, grouped by the job
            name, group = f"{name}-node{cfg.fault_tolerance.node}", name
        return open_trackers(cfg.run.trackers(), out=self.out, config=job, name=name,
                             project=cfg.run.wandb_project, group=group)

    # ------------------------------------------------------------------ phases
    def train_step(self, step: int) -> float:
        """Optimizer step ``step`` (0-based) on this rank; record it; return its training loss."""

        cfg, kind, t = self.cfg, self.spec.kind, self.tally
        t_batch = time.perf_counter()
        batch = {k: v.to(self.device) for k, v in
                 train_batch(self.data, step=step, rank=self.data_rank, world_size=self.data_world,
                             batch_size=self.step_batch, seed=cfg.run.seed).items()}
        # Dropout masks as a function of (seed, step, rank): a resumed run repeats them exactly.
        torch.manual_seed((cfg.run.seed * 1_000_003 + step) * self.world + self.rank)
        t0 = time.perf_counter()
        self.clock["tokens"] += real_tokens(batch, kind=kind)
        dropped0 = self._dropped()
        loss = train_step(self.model, self.optimizer, split_batch(batch, cfg.schedule.grad_accum, kind=kind), kind=kind,
                          profile=self.profile)
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        self.clock["train_time_s"] += time.perf_counter() - t_batch
        traffic = self.link.end_step()
        self.link.history.clear()
        self.membership.report_bad(self.optimizer)  # members evicted from the exchange for bad messages
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step}; lower --lr")
        t.train_loss = loss
        # Blocked in the link this step (an overlapped exchange counts only its wait).
        exposed = traffic.exposed_comm_time_s
        if step - self.start_step >= WARMUP_STEPS_EXCLUDED:
            t.step_times.append(step_time)
            t.comm_times.append(traffic.comm_time_s)
            t.exposed_times.append(exposed)
            t.compute_times.append(step_time - exposed)
        t.sent.append(traffic.inter_node_bytes_sent)
        t.node_sent.append(traffic.node_inter_node_bytes_sent)
        if (traffic.ops or exposed > 0) and self.local:
            t.sync_times.append(exposed)  # the outer step's time on the critical path
        t.add_ops(traffic.by_kind())
        epoch = epoch_of(step, data=self.data, world_size=self.data_world, batch_size=self.step_batch)
        step, ft = self.membership.step_record(step, dropped=self._dropped() > dropped0)
        self.metrics.write({"type": "train", **ft, "step": step + 1, "epoch": epoch, "loss": loss,
                            "step_time_s": step_time, "compute_time_s": step_time - exposed,
                            "comm_time_s": traffic.comm_time_s, "exposed_comm_time_s": exposed,
                            "inter_node_bytes_sent": traffic.inter_node_bytes_sent, "tokens": self.clock["tokens"],
                            "train_time_s": self.clock["train_time_s"], "wall_s": time.perf_counter() - self.wall0,
                            "lr": self.scheduler.get_last_lr()[0]})  # fmt: skip
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", s_step=f"{step_time:.3f}", comm=f"{traffic.comm_time_s:.3f}",
                                 refresh=False)
            self.bar.update(1)
        if self.progress is not None:
            report = self.progress.after_step(step=step + 1, loss=loss, step_time_s=step_time,
                                              exposed_comm_time_s=exposed,
                                              node_bytes_sent=traffic.node_inter_node_bytes_sent,
                                              tokens=self.clock["tokens"], train_time_s=self.clock["train_time_s"])
            if report is not None:
                log.info("%s", report.line())
                self.metrics.log_scalars(report.scalars(), step + 1)
        return loss

    def evaluate(self, step: int) -> float:
        """Validation loss after ``step`` steps, recorded in the history and ``metrics.jsonl``."""

        cfg = self.cfg
        v = evaluate(self.model, self.data, batch_size=cfg.schedule.batch_size, max_batches=cfg.run.val_batches,
                     device=self.device)
        point = {"step": step, "epoch": epoch_of(max(step - 1, 0), data=self.data, world_size=self.data_world,
                                                 batch_size=self.step_batch),
                 "tokens": self.clock["tokens"], "train_time_s": self.clock["train_time_s"],
                 "wall_s": time.perf_counter() - self.wall0, "val_loss": v}  # fmt: skip
        self.tally.val_history.append(point)
        self.metrics.write({"type": "val", **point})
        if self.progress is not None:
            self.progress.note_val(v)
        return v

    def checkpoint(self, step: int) -> None:
        """A DCP checkpoint after ``step`` steps (model, optimizer, schedule, training clock)."""

        cfg, topo = self.cfg, self.topology
        save_checkpoint(self.out / "checkpoints" / f"step_{step:06d}", model=self.model, optimizer=self.optimizer,
                        extra={"step": step, "scheduler": self.scheduler.state_dict(), **self.clock,
                               "method": cfg.method.name, "model": cfg.model.name,
                               "topology": topology_record(topo),
                               "global_batch": topo.world_size * self.step_batch},
                        secret=self._secret(), fingerprint=self.membership.fingerprint)

    def _secret(self) -> bytes | None:
        """The job's secret (--secret-file, else the environment: :func:`lowband.trust.secret.load_secret`), which signs
        its checkpoints."""

        if self.membership.secret is not None:
            return self.membership.secret
        return load_secret(self.cfg.fault_tolerance.secret_file)

    def summarize(self) -> RunSummary:
        """This rank's summary of the run, written to ``summary_rank{R}.json``."""
        cfg, t, topo = self.cfg, self.tally, self.topology
        hp = self.method.as_dict()
        stats = self.optimizer.stats()

        def med(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        summary = RunSummary(
            rank=self.rank, node=topo.node_of(self.rank), method=cfg.method.name, hp=hp, topk=hp.get("topk"),
            chunk=hp.get("chunk"), shards=topo.shards, nodes=topo.num_nodes, ranks_per_node=topo.ranks_per_node,
            replicas=topo.replicas, steps=self.steps_done, start_step=self.start_step, model=cfg.model.name,
            num_params=self.spec.num_params, data=self.data.name, batch_size=cfg.schedule.batch_size,
            grad_accum=cfg.schedule.grad_accum, precision=cfg.model.precision,
            activation_checkpointing=cfg.model.activation_checkpointing,
            memory=self.profile.summary(), status="ok", step_time_s=med(t.step_times),
            compute_time_s=med(t.compute_times), comm_time_s=med(t.comm_times),
            exposed_comm_time_s=med(t.exposed_times),
            sync_time_s=med(t.sync_times) if self.local else None,
            outer_steps=stats.outer_steps, screened=stats.screened(),
            inter_node_bytes_per_step=sum(t.sent) / max(len(t.sent), 1),
            node_inter_node_bytes_per_step=sum(t.node_sent) / max(len(t.node_sent), 1),
            link_ops=t.link_ops, peak_rss_mb=max(_peak_rss_mb(), self.profile.process_peak_mb()),
            val_loss=t.val_history[-1]["val_loss"], val_history=t.val_history, train_loss=t.train_loss,
            train_time_s=self.clock["train_time_s"], tokens=self.clock["tokens"],
            shaping=({"bandwidth_bps": self.link.bandwidth_bps, "latency_s": self.link.latency_s}
                     if self.link.shaping else None),
            wall_time_s=time.perf_counter() - self.t_start, config=cfg.tables(),
        )  # fmt: skip
        summary.write(self.out)
        return summary

    # ------------------------------------------------------------------ the loop
    def run(self) -> RunSummary:
        """Build, train ``cfg.schedule.steps`` steps (validating and checkpointing where due), summarize."""
        cfg = self.cfg
        self.build()
        if self.start_step == 0:
            self.evaluate(0)
        try:
            # Under a bar, log lines go through tqdm.write, so that they do not break the bar's line.
            with logging_redirect_tqdm() if self.bar is not None else contextlib.nullcontext():
                self.membership.train(self)  # the loop below, or fault tolerance's own around the same steps
            self.optimizer.flush()  # an overlapped exchange still in flight: apply it
            self.evaluate(self.steps_done)
            if cfg.checkpoint.at_end or cfg.checkpoint.every or cfg.run.export_hf:
                self.checkpoint(self.steps_done)  # --export-hf exports it: one path for a run and `lowband export`
        finally:
            if self.bar is not None:
                self.bar.close()
            self.metrics.close()
        summary = self.summarize()
        self.membership.finish()
        if dist.is_initialized():
            dist.barrier()
        self.membership.shutdown()
        if cfg.run.export_hf and self.rank == 0:
            self.export(cfg.run.export_hf)
        return summary

    def export(self, directory: str) -> None:
        """--export-hf: the final checkpoint as a transformers directory (:mod:`lowband.train.export`; rank 0).

        Read back from the checkpoint, in this process without a process group, rather than gathered from
        the live shards: the same code as ``lowband export``, so both give the same files.
        """

        path = self.out / "checkpoints" / f"step_{self.steps_done:06d}"  # written at the end of run()
        export_checkpoint(path, directory, tokenizer=self.out / "tokenizer", secret=self._secret())
        log.info("exported the model of step %d to %s", self.steps_done, directory)

    def _run_steps(self) -> None:
        """The loop: the membership's say before and after each step (fault tolerance's quorums; nothing without)."""
        cfg = self.cfg
        step, first = self.start_step, True
        while step < cfg.schedule.steps:
            step = self.membership.before_step(step, first=first)  # a joining node may jump ahead to the live step
            if step >= cfg.schedule.steps:
                break
            first = False
            window_end = not self.local or self.optimizer.communicates_next()
            self.train_step(step)
            step = self.membership.after_step(step + 1)  # a node that healed during the step goes on from the peer's
            if self._ends(step, window_end):
                break
            self._after_step(step)
        self.steps_done = step

    def _ends(self, step: int, window_end: bool) -> bool:
        """After ``step`` steps: True when --time-budget or --stop-file ends the run here (the budget sets the lr)."""
        spent = self.budget is not None and self.budget.stops(self.clock["train_time_s"], self.scheduler,
                                                              window_end=window_end)
        return spent or (window_end and self.stop is not None and self.stop.reached(step))

    def _after_step(self, done: int) -> None:
        """Validate and checkpoint where due once ``done`` steps are trained."""
        cfg = self.cfg
        end_of_epoch = done % self.steps_per_epoch == 0
        if done < cfg.schedule.steps and ((cfg.run.val_every and done % cfg.run.val_every == 0) or end_of_epoch):
            self.evaluate(done)
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.schedule.steps:
            self.checkpoint(done)

    # ------------------------------------------------------------------ counts
    def _dropped(self) -> int:
        """Steps (outer steps for DiLoCo) the optimizer dropped because an exchange failed."""
        return self.optimizer.stats().dropped_steps


def run_training(cfg: TrainConfig) -> RunSummary:
    """Train on this rank (``Trainer(cfg).run()``); return this rank's summary."""
    return Trainer(cfg).run()


def _log_topology_change(extra: dict, topology: Topology, *, cfg: TrainConfig) -> None:
    """Say what a resume on another topology changes: the replicas' state, the data position."""

    old, new = extra.get("topology"), topology_record(topology)
    if old is None or (old["replicas"], old["shards"]) == (new["replicas"], new["shards"]):
        return
    r0, r1 = old["replicas"], new["replicas"]
    log.warning("resuming a checkpoint of %d replica(s) × %d shard(s) on %d × %d: the model is resharded, "
                "per-replica state %s", r0, old["shards"], r1, new["shards"],
                "averaged" if r1 < r0 else "copied" if r1 > r0 else "kept")
    accum = cfg.schedule.grad_accum
    old_batch, batch = extra.get("global_batch"), topology.world_size * cfg.schedule.batch_size * accum
    if old_batch is not None and old_batch != batch:
        same = (f"--batch-size {old_batch // (topology.world_size * accum)}"
                if old_batch % (topology.world_size * accum) == 0
                else f"ranks × --batch-size × --grad-accum = {old_batch}")
        log.warning("the global batch changes from %d to %d examples per step: step k reads positions "
                    "[k·%d, (k+1)·%d) of its epoch's permutation, so part of this epoch is read again (smaller "
                    "batch) or skipped (larger), and epochs end at other steps; %s keeps the data order exactly",
                    old_batch, batch, batch, batch, same)
