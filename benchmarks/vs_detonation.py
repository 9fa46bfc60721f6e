#!/usr/bin/env python
"""lowband FlexDeMo side by side with the public FlexDeMo implementation (DeToNATION 0.5.2).

Three configurations run on the same model, data, seed and 2-D mesh (default 2 nodes × 2 ranks,
gloo on this machine), each in a fresh set of forked processes so that peak memory is per
configuration:

1. ``flexdemo``   lowband FlexDeMo, Top-k / chunk c (bf16 values, uint8 indices), model sharded
                  with FSDP2 over the node (lowband.distributed.sharding.shard_model), exchange through the Link;
2. ``adamw``      lowband AdamWFullSync: AdamW on the gradient all-reduced between nodes
                  (HSDP-equivalent), same sharding, same Link;
3. ``detonation`` DeToNATION 0.5.2: ``prepare_detonation(model, Optimizers.SGD, DeMoReplicator(...))``,
                  FSDP1 HYBRID_SHARD over (replicate × shard) = (nodes × ranks per node), T5Block
                  auto-wrap as in its examples/t5/train.py, forward/backward under ``model.no_sync()``.

What is measured and what is computed:

* Inter-node bytes: the tensors are real, their byte counts are real; how many of them cross
  between nodes is a MODEL, the ring formula (all-gather: (G-1)·payload sent per rank;
  all-reduce: 2(G-1)/G·n; reduce-scatter: (G-1)/G·n), counted only for hops between ranks of
  different nodes. For lowband this is the Link's StepTraffic; for every configuration the
  benchmark also wraps the torch.distributed collectives in the worker processes and counts every
  call on a group that spans nodes with the same formula (for lowband the two counts must agree).
* Peak RSS per rank: measured (getrusage ru_maxrss). The high-water mark is reset
  (/proc/self/clear_refs = 5) before forward, backward and optimizer.step() of every step, after
  the model was built and sharded, so each phase has its own peak and "peak RSS during training"
  (the largest) excludes set-up; "RSS before training" is the level it started from. By default
  (--malloc return) glibc's mmap threshold is fixed at 64 KiB in each worker so that freed tensors
  leave RSS at once and RSS follows live memory (the CPU stand-in for a GPU's
  max_memory_allocated); --malloc default keeps glibc's own behaviour.
* Gradients held: the sum of ``p.grad`` bytes this rank holds (local shard of a DTensor, the
  whole tensor otherwise), measured right before ``optimizer.step()``; optimizer state and
  parameter bytes likewise (tensor sizes, not RSS).
* Seconds per step: wall time of forward + backward + step, mean over the steps after the first
  (the first pays one-off initialisation), slowest rank. Four ranks share two cores here: times
  compare the methods on this machine, they are not link times.

Run: ``python benchmarks/vs_detonation.py [--model t5-small] [--steps 3] [--batch-size 4]
[--source-len 128 --target-len 32] [--out DIR]``. Needs ``pip install detonation==0.5.2 einops
mltiming`` (DeToNATION 0.5.2 imports mltiming without declaring it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import inspect
import io
import json
import os
import platform
import resource
import sys
import time
import warnings
from pathlib import Path

CONFIGS = ("flexdemo", "adamw", "detonation")
LABELS = {
    "flexdemo": "lowband FlexDeMo (FSDP2)",
    "adamw": "lowband AdamW full sync (HSDP-eq.)",
    "detonation": "DeToNATION 0.5.2 FlexDeMo (FSDP1 HSDP)",
}
MB = 1024 * 1024


# ---------------------------------------------------------------------------- measuring helpers
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def malloc_trim() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def malloc_return_freed(threshold: int = 64 * 1024) -> bool:
    """Make glibc serve allocations >= threshold with mmap and give them back on free.

    glibc's default raises its mmap threshold dynamically (up to 32 MiB) and keeps freed heap
    memory, so RSS lags the memory actually in use by whatever the allocator kept. With a fixed
    threshold freed tensors leave RSS at once and peak RSS tracks the peak of live memory.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, threshold) == 1
        ok = libc.mallopt(m_trim_threshold, threshold) == 1 and ok
        return ok
    except Exception:  # noqa: BLE001 - not glibc
        return False


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS (Linux ≥ 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def tensor_bytes(t) -> int:
    from lowband.optim._common import local

    t = local(t)
    return t.numel() * t.element_size()


def grad_bytes(params) -> int:
    return sum(tensor_bytes(p.grad) for p in params if p.grad is not None)


def state_bytes(opt) -> int:
    import torch

    total = 0
    for st in opt.state.values():
        if not isinstance(st, dict):  # DeToNATION keeps an int under the key "detonation_step"
            continue
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += tensor_bytes(v)
    return total


class CollectiveCounter:
    """Wraps torch.distributed collectives in this process and counts their bytes (ring model).

    Every call is recorded with its kind, group size, payload (this rank's input tensor bytes) and
    the bytes this rank sends under the ring algorithm; the bytes count as inter-node when this
    rank's successor in the group's ring is on another node (node = rank // ranks_per_node), as
    lowband's Link counts them.
    """

    KINDS = (
        "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
        "all_gather_coalesced", "all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor",
        "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter", "broadcast", "all_to_all_single",
    )

    def __init__(self, ranks_per_node: int) -> None:
        self.ranks_per_node = ranks_per_node
        self.ops: list[dict] = []
        self.phase = "setup"
        self._installed = False

    def install(self) -> None:
        import torch.distributed as dist

        if self._installed:
            return
        for name in self.KINDS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            setattr(dist, name, self._wrap(name, fn))
        self._installed = True

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                self._record(name, sig.bind(*args, **kwargs).arguments)
            except Exception as e:  # noqa: BLE001 - never break the collective because of counting
                self.ops.append(dict(phase=self.phase, kind=name, error=repr(e)))
            return fn(*args, **kwargs)

        return wrapper

    def _record(self, name: str, a: dict) -> None:
        import torch.distributed as dist

        group = a.get("group")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        g = len(ranks)
        if g <= 1:
            return
        me = dist.get_rank()

        def nb(t):
            return t.numel() * t.element_size()

        dtypes: dict[str, int] = {}
        if name == "all_gather":
            payload = nb(a["tensor"])
            sent = (g - 1) * payload
            dtypes[str(a["tensor"].dtype)] = sent
        elif name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
            payload = nb(a["input_tensor"])
            sent = (g - 1) * payload
            dtypes[str(a["input_tensor"].dtype)] = sent
        elif name == "all_gather_coalesced":
            payload = sum(nb(t) for t in a["input_tensor_list"])
            sent = (g - 1) * payload
        elif name == "all_reduce":
            payload = nb(a["tensor"])
            sent = 2 * (g - 1) * payload // g
            dtypes[str(a["tensor"].dtype)] = sent
        elif name == "all_reduce_coalesced":
            payload = sum(nb(t) for t in a["tensors"])
            sent = 2 * (g - 1) * payload // g
        elif name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
            payload = nb(a["input"])
            sent = (g - 1) * payload // g
        elif name == "reduce_scatter":
            payload = sum(nb(t) for t in a["input_list"])
            sent = (g - 1) * payload // g
        elif name == "all_to_all_single":  # every block but this rank's own goes to another rank
            t, splits = a["input"], a.get("input_split_sizes")
            payload = nb(t)
            i = ranks.index(me)
            if splits:
                row = t.numel() // max(1, t.shape[0]) if t.dim() else 1
                sent = (sum(splits) - splits[i]) * row * t.element_size()
            else:
                sent = (g - 1) * payload // g
            dtypes[str(t.dtype)] = sent
        elif name == "broadcast":
            payload = nb(a["tensor"])
            sent = payload  # pipelined ring broadcast: at most n per rank
        else:  # pragma: no cover
            payload = sent = 0
        node = lambda r: r // self.ranks_per_node  # noqa: E731
        i = ranks.index(me)
        crossing = node(ranks[(i + 1) % g]) != node(me)
        self.ops.append(dict(
            phase=self.phase, kind=name, group_size=g, group_spans_nodes=len({node(r) for r in ranks}) > 1,
            payload_bytes=payload, bytes_sent=sent, inter_node_bytes_sent=sent if crossing else 0,
            dtypes=dtypes,
        ))

    def summary(self, phase) -> dict:
        ops = [o for o in self.ops if o["phase"] == phase and "error" not in o]
        inter = [o for o in ops if o["inter_node_bytes_sent"] > 0]
        by_kind: dict[str, dict] = {}
        dtypes: dict[str, int] = {}
        for o in inter:
            d = by_kind.setdefault(o["kind"], dict(count=0, inter_node_bytes_sent=0))
            d["count"] += 1
            d["inter_node_bytes_sent"] += o["inter_node_bytes_sent"]
            for k, v in o["dtypes"].items():
                dtypes[k] = dtypes.get(k, 0) + v
        return dict(
            inter_node_bytes_sent=sum(o["inter_node_bytes_sent"] for o in ops),
            inter_node_collectives=len(inter),
            intra_node_bytes_sent=sum(o["bytes_sent"] - o["inter_node_bytes_sent"] for o in ops),
            intra_node_collectives=sum(1 for o in ops if o["inter_node_bytes_sent"] == 0),
            inter_node_by_kind=by_kind,
            inter_node_bytes_by_dtype=dtypes,
            errors=[o for o in self.ops if o["phase"] == phase and "error" in o],
        )


# ---------------------------------------------------------------------------- one configuration
def _worker(rank: int, config: str, opts: dict, data) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch
    import torch.distributed as dist

    from lowband.comm.link import Link
    from lowband.distributed.topology import Topology
    from lowband.train.data import train_batch
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    malloc_ok = malloc_return_freed() if opts["malloc"] == "return" else None
    counter = CollectiveCounter(opts["ranks_per_node"])
    counter.install()
    world = dist.get_world_size()
    topo = Topology(num_nodes=opts["nodes"], ranks_per_node=opts["ranks_per_node"])
    mesh = topo.mesh()
    out: dict = dict(rank=rank, config=config, node=topo.node_of(rank), malloc_return_freed=malloc_ok)

    spec = build_model(opts["model"], vocab_size=data.vocab_size, seed=opts["seed"])
    model = spec.model
    out["model_params"] = spec.num_params
    blocks = transformer_blocks(model)
    link = None
    det = None
    if config in ("flexdemo", "adamw"):
        from lowband.distributed.sharding import shard_model
        from lowband.train.methods import build_optimizer

        model = shard_model(model, topo, blocks=blocks, activation_checkpointing=opts["activation_checkpointing"])
        link = Link(topo)
        if config == "flexdemo":
            hp = dict(lr=opts["lr"], topk=opts["topk"], chunk=opts["chunk"], decay=opts["decay"], values="bf16")
            opt = build_optimizer("flexdemo", model.named_parameters(), link=link, hp=hp)
            out["payload_bytes_per_step"] = opt.payload_bytes()
        else:
            opt = build_optimizer("adamw", model.named_parameters(), link=link, hp=dict(lr=opts["lr"]))
        params = [p for g in opt.param_groups for p in g["params"]]
        no_sync = contextlib.nullcontext
    else:
        import detonation.prepare as dprep
        from detonation import DeMoReplicator, Optimizers, prepare_detonation
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        # The one change to prepare_detonation: it passes device_id=int(LOCAL_RANK), a CUDA device;
        # on a CPU-only machine FSDP1 needs device_id=cpu. Everything else is its own code path.
        real_fsdp = dprep.FSDP

        def cpu_fsdp(module, *args, device_id=None, **kwargs):
            return real_fsdp(module, *args, device_id=torch.device("cpu"), **kwargs)

        dprep.FSDP = cpu_fsdp
        replicator = DeMoReplicator(compression_decay=opts["decay"], compression_topk=opts["topk"],
                                    compression_chunk=opts["chunk"])
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={type(b) for b in blocks})
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # it prints its whole {shard length: chunk} table
            model, opt = prepare_detonation(
                model, Optimizers.SGD, replicator,
                # the same groups its default would build (init_device_mesh("cuda", (R, S))), on CPU
                sharding_parallel_group=mesh["shard"].get_group(),
                replication_parallel_group=mesh["replicate"].get_group(),
                fsdp_kwargs={"auto_wrap_policy": policy},
                lr=opts["lr"],
            )
        if opts["activation_checkpointing"]:
            # FSDP1's own recipe: each T5 block inside its FSDP unit recomputed in backward (non-reentrant)
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )

            block_types = tuple({type(b) for b in blocks})
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block_types))
        det = replicator
        params = [p for g in opt.param_groups for p in g["params"]]
        picks = []
        for p in params:
            n = p.shape[0] if p.dim() == 1 else None
            c = replicator.transform.shape_dict.get(n) if n is not None else None
            picks.append(dict(shape=list(p.shape), numel=p.numel(), chunk=c))
        out["detonation_chunks"] = picks
        out["detonation_printed"] = printed.getvalue().strip()[:2000]
        no_sync = model.no_sync

    out["param_bytes_local"] = sum(tensor_bytes(p) for p in params)
    setup_ops = counter.summary("setup")
    out["setup_inter_node_bytes_sent"] = setup_ops["inter_node_bytes_sent"]

    # -------- memory baseline
    import gc

    gc.collect()
    malloc_trim()
    out["peak_rss_setup_bytes"] = maxrss_bytes()
    out["rss_before_train_bytes"] = rss_bytes()
    out["peak_reset"] = reset_peak_rss()

    torch.manual_seed(opts["seed"] * 1000 + rank)  # dropout: the same per rank in every configuration
    dist.barrier()
    steps = []
    for step in range(opts["steps"]):
        batch = train_batch(data, step=step, rank=rank, world_size=world, batch_size=opts["batch_size"],
                            seed=opts["seed"])
        counter.phase = f"step{step}"
        # The high-water mark is reset before each phase, so each phase's peak is known; the
        # training peak is the largest of them.
        opt.zero_grad(set_to_none=True)
        reset_peak_rss()
        rss_fwd = rss_bytes()
        c0, t0 = time.process_time(), time.perf_counter()
        with no_sync():
            loss = compute_loss(model, batch)
            peak_fwd = maxrss_bytes()
            reset_peak_rss()
            rss_bwd = rss_bytes()
            loss.backward()
        c1, t1 = time.process_time(), time.perf_counter()
        peak_bwd = maxrss_bytes()
        g_bytes = grad_bytes(params)
        reset_peak_rss()
        rss_opt = rss_bytes()
        c2, t2 = time.process_time(), time.perf_counter()
        opt.step()
        c3, t3 = time.process_time(), time.perf_counter()
        peak_opt = maxrss_bytes()
        rec = dict(step=step, loss=float(loss.detach()), grad_bytes=g_bytes, fwd_bwd_s=t1 - t0,
                   optim_s=t3 - t2, step_s=(t1 - t0) + (t3 - t2),
                   cpu_s=(c1 - c0) + (c3 - c2), optim_cpu_s=c3 - c2,
                   rss_before_fwd=rss_fwd, peak_rss_fwd=peak_fwd, rss_before_bwd=rss_bwd, peak_rss_bwd=peak_bwd,
                   peak_rss_fwd_bwd=max(peak_fwd, peak_bwd),
                   rss_before_optim=rss_opt, peak_rss_optim=peak_opt)
        if link is not None:
            traffic = link.end_step()
            rec["link_inter_node_bytes_sent"] = traffic.inter_node_bytes_sent
            rec["link_ops"] = {kind: tally.to_dict() for kind, tally in traffic.by_kind().items()}
        rec["counted"] = counter.summary(f"step{step}")
        if det is not None:
            rec["detonation_own_data_transmit"] = det.data_transmitted[-1] if det.data_transmitted else None
        rec["rss_bytes"] = rss_bytes()
        steps.append(rec)
    counter.phase = "after"
    out["steps"] = steps
    out["peak_rss_train_bytes"] = max(max(st["peak_rss_fwd_bwd"], st["peak_rss_optim"]) for st in steps)
    out["grad_bytes_after_step"] = grad_bytes(params)
    out["state_bytes"] = state_bytes(opt)
    out["rss_after_train_bytes"] = rss_bytes()
    return out


# ---------------------------------------------------------------------------- aggregation & report
def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(config: str, ranks: list[dict], chunk: int) -> dict:
    warm = lambda r: r["steps"][1:] or r["steps"]  # noqa: E731
    s = dict(config=config, label=LABELS[config])
    per_step_counted = [max(r["steps"][i]["counted"]["inter_node_bytes_sent"] for r in ranks)
                        for i in range(len(ranks[0]["steps"]))]
    s["inter_node_bytes_per_step_counted"] = max(per_step_counted)
    s["inter_node_bytes_per_step_counted_each_step"] = per_step_counted
    if "link_inter_node_bytes_sent" in ranks[0]["steps"][0]:
        s["inter_node_bytes_per_step_link"] = max(st["link_inter_node_bytes_sent"] for r in ranks for st in r["steps"])
    s["inter_node_collectives_per_step"] = max(st["counted"]["inter_node_collectives"] for r in ranks for st in r["steps"])
    s["inter_node_bytes_by_dtype"] = ranks[0]["steps"][-1]["counted"]["inter_node_bytes_by_dtype"]
    s["intra_node_bytes_per_step_counted"] = max(st["counted"]["intra_node_bytes_sent"] for r in ranks for st in r["steps"])
    s["setup_inter_node_bytes_sent"] = max(r["setup_inter_node_bytes_sent"] for r in ranks)
    s["grad_bytes_peak"] = max(st["grad_bytes"] for r in ranks for st in r["steps"])
    s["state_bytes"] = max(r["state_bytes"] for r in ranks)
    s["param_bytes_local"] = max(r["param_bytes_local"] for r in ranks)
    s["tensor_bytes_peak"] = s["grad_bytes_peak"] + s["state_bytes"] + s["param_bytes_local"]
    s["rss_before_train_bytes"] = max(r["rss_before_train_bytes"] or 0 for r in ranks)
    s["peak_rss_train_bytes"] = max(r["peak_rss_train_bytes"] for r in ranks)
    s["peak_rss_setup_bytes"] = max(r["peak_rss_setup_bytes"] for r in ranks)
    s["peak_rss_increase_bytes"] = max(r["peak_rss_train_bytes"] - (r["rss_before_train_bytes"] or 0) for r in ranks)
    s["peak_reset_ok"] = all(r["peak_reset"] for r in ranks)
    s["peak_rss_fwd_bytes"] = max(st["peak_rss_fwd"] for r in ranks for st in r["steps"])
    s["peak_rss_bwd_bytes"] = max(st["peak_rss_bwd"] for r in ranks for st in r["steps"])
    s["peak_rss_optim_bytes"] = max(st["peak_rss_optim"] for r in ranks for st in r["steps"])
    s["rss_before_optim_bytes"] = max(st["rss_before_optim"] for r in ranks for st in r["steps"])
    s["optim_rss_increase_bytes"] = max(st["peak_rss_optim"] - st["rss_before_optim"] for r in ranks for st in r["steps"])
    s["step_s"] = max(_mean(st["step_s"] for st in warm(r)) for r in ranks)
    s["optim_s"] = max(_mean(st["optim_s"] for st in warm(r)) for r in ranks)
    s["cpu_s"] = max(_mean(st["cpu_s"] for st in warm(r)) for r in ranks)
    s["optim_cpu_s"] = max(_mean(st["optim_cpu_s"] for st in warm(r)) for r in ranks)
    s["first_step_s"] = max(r["steps"][0]["step_s"] for r in ranks)
    s["loss_step0_mean"] = _mean(r["steps"][0]["loss"] for r in ranks)
    s["loss_last_mean"] = _mean(r["steps"][-1]["loss"] for r in ranks)
    s["model_params"] = ranks[0]["model_params"]
    if config == "flexdemo":
        s["payload_bytes_per_step"] = ranks[0]["payload_bytes_per_step"]
    if config == "detonation":
        picks = ranks[0]["detonation_chunks"]
        s["detonation_params"] = len(picks)
        s["detonation_chunk_not_requested"] = [p for p in picks if p["chunk"] != chunk]
        s["detonation_own_data_transmit"] = ranks[0]["steps"][-1].get("detonation_own_data_transmit")
    return s


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    if n >= 10 * MB:
        return f"{n / MB:,.1f} MiB"
    if n >= 10 * 1024:
        return f"{n / 1024:,.1f} KiB"
    return f"{n:,} B"


def render(summaries: dict, opts: dict) -> str:
    cols = [c for c in CONFIGS if c in summaries]
    rows = [
        ("inter-node bytes sent / step / rank", lambda s: f"{s['inter_node_bytes_per_step_counted']:,}"),
        ("  (same, readable)", lambda s: fmt_bytes(s["inter_node_bytes_per_step_counted"])),
        ("  lowband Link StepTraffic", lambda s: f"{s['inter_node_bytes_per_step_link']:,}" if "inter_node_bytes_per_step_link" in s else "n/a"),
        ("inter-node collectives / step / rank", lambda s: str(s["inter_node_collectives_per_step"])),
        ("inter-node bytes by dtype", lambda s: ", ".join(f"{k.replace('torch.', '')} {v:,}" for k, v in s["inter_node_bytes_by_dtype"].items()) or "-"),
        ("intra-node bytes / step / rank", lambda s: fmt_bytes(s["intra_node_bytes_per_step_counted"])),
        ("parameters held (local)", lambda s: fmt_bytes(s["param_bytes_local"])),
        ("gradients held, peak (before step)", lambda s: fmt_bytes(s["grad_bytes_peak"])),
        ("optimizer state", lambda s: fmt_bytes(s["state_bytes"])),
        ("params + grads + state", lambda s: fmt_bytes(s["tensor_bytes_peak"])),
        ("RSS right before training", lambda s: fmt_bytes(s["rss_before_train_bytes"])),
        ("peak RSS during training", lambda s: fmt_bytes(s["peak_rss_train_bytes"])),
        ("  increase over before-training", lambda s: fmt_bytes(s["peak_rss_increase_bytes"])),
        ("  peak in forward", lambda s: fmt_bytes(s["peak_rss_fwd_bytes"])),
        ("  peak in backward", lambda s: fmt_bytes(s["peak_rss_bwd_bytes"])),
        ("  RSS when optimizer.step() starts", lambda s: fmt_bytes(s["rss_before_optim_bytes"])),
        ("  peak in optimizer.step()", lambda s: fmt_bytes(s["peak_rss_optim_bytes"])),
        ("  step() increase over its start", lambda s: fmt_bytes(s["optim_rss_increase_bytes"])),
        ("peak RSS during set-up", lambda s: fmt_bytes(s["peak_rss_setup_bytes"])),
        ("s / step (steps 2..N, slowest rank)", lambda s: f"{s['step_s']:.2f}"),
        ("  of which optimizer.step()", lambda s: f"{s['optim_s']:.2f}"),
        ("CPU s / step (process time, all threads)", lambda s: f"{s['cpu_s']:.2f}"),
        ("  of which optimizer.step()", lambda s: f"{s['optim_cpu_s']:.2f}"),
        ("first step s", lambda s: f"{s['first_step_s']:.2f}"),
        ("loss step 1 / last (mean of ranks)", lambda s: f"{s['loss_step0_mean']:.4f} / {s['loss_last_mean']:.4f}"),
    ]
    w0 = max(len(r[0]) for r in rows) + 2
    widths = [max(len(LABELS[c]), *(len(f(summaries[c])) for _, f in rows)) + 2 for c in cols]
    lines = ["".ljust(w0) + "".join(LABELS[c].rjust(w) for c, w in zip(cols, widths, strict=True))]
    for name, f in rows:
        lines.append(name.ljust(w0) + "".join(f(summaries[c]).rjust(w) for c, w in zip(cols, widths, strict=True)))
    return "\n".join(lines)


def ratios(summaries: dict) -> dict:
    r: dict = {}
    f = summaries.get("flexdemo")
    a = summaries.get("adamw")
    d = summaries.get("detonation")

    def q(x, y):
        return x / y if x and y else None

    if f and d:
        r["bytes_detonation_over_flexdemo"] = q(d["inter_node_bytes_per_step_counted"], f["inter_node_bytes_per_step_counted"])
        r["peak_rss_train_detonation_over_flexdemo"] = q(d["peak_rss_train_bytes"], f["peak_rss_train_bytes"])
        r["rss_increase_detonation_over_flexdemo"] = q(d["peak_rss_increase_bytes"], f["peak_rss_increase_bytes"])
        r["grad_bytes_detonation_over_flexdemo"] = q(d["grad_bytes_peak"], f["grad_bytes_peak"])
        r["tensor_bytes_detonation_over_flexdemo"] = q(d["tensor_bytes_peak"], f["tensor_bytes_peak"])
        r["step_s_detonation_over_flexdemo"] = q(d["step_s"], f["step_s"])
        r["peak_rss_train_flexdemo_over_detonation"] = q(f["peak_rss_train_bytes"], d["peak_rss_train_bytes"])
    if f and a:
        r["bytes_adamw_over_flexdemo"] = q(a["inter_node_bytes_per_step_counted"], f["inter_node_bytes_per_step_counted"])
        r["peak_rss_train_adamw_over_flexdemo"] = q(a["peak_rss_train_bytes"], f["peak_rss_train_bytes"])
        r["rss_increase_adamw_over_flexdemo"] = q(a["peak_rss_increase_bytes"], f["peak_rss_increase_bytes"])
        r["tensor_bytes_adamw_over_flexdemo"] = q(a["tensor_bytes_peak"], f["tensor_bytes_peak"])
        r["step_s_adamw_over_flexdemo"] = q(a["step_s"], f["step_s"])
        r["peak_rss_train_flexdemo_over_adamw"] = q(f["peak_rss_train_bytes"], a["peak_rss_train_bytes"])
    if a and d:
        r["bytes_adamw_over_detonation"] = q(a["inter_node_bytes_per_step_counted"], d["inter_node_bytes_per_step_counted"])
    return r


# The memory goals on t5-small, 2 x 2 (the defaults): peak RSS per rank against each peer.
GOAL_VS_DETONATION, GOAL_VS_ADAMW = 0.80, 0.85


def checks(summaries: dict, rat: dict, ranks_per_node: int) -> list[tuple[str, bool | None]]:
    out: list[tuple[str, bool | None]] = []
    f, a, d = (summaries.get(k) for k in CONFIGS)
    if f and d:
        out.append(("inter-node bytes: DeToNATION / lowband FlexDeMo >= 2.5", rat["bytes_detonation_over_flexdemo"] >= 2.5))
    if f and a:
        out.append(("inter-node bytes: AdamW full sync / lowband FlexDeMo >= 150", rat["bytes_adamw_over_flexdemo"] >= 150))
        out.append(("peak RSS during training: lowband FlexDeMo < AdamW", f["peak_rss_train_bytes"] < a["peak_rss_train_bytes"]))
    if f and d:
        out.append(("peak RSS during training: lowband FlexDeMo < DeToNATION", f["peak_rss_train_bytes"] < d["peak_rss_train_bytes"]))
        out.append(("gradients held: DeToNATION (unsharded) / lowband FlexDeMo (shard) >= ranks per node",
                    rat["grad_bytes_detonation_over_flexdemo"] >= ranks_per_node * 0.99))
        out.append((f"goal: peak RSS FlexDeMo / DeToNATION <= {GOAL_VS_DETONATION} "
                    f"({rat['peak_rss_train_flexdemo_over_detonation']:.3f})",
                    rat["peak_rss_train_flexdemo_over_detonation"] <= GOAL_VS_DETONATION))
    if f and a:
        out.append((f"goal: peak RSS FlexDeMo / AdamW <= {GOAL_VS_ADAMW} ({rat['peak_rss_train_flexdemo_over_adamw']:.3f})",
                    rat["peak_rss_train_flexdemo_over_adamw"] <= GOAL_VS_ADAMW))
    for k in ("flexdemo", "adamw"):
        s = summaries.get(k)
        if s and "inter_node_bytes_per_step_link" in s:
            out.append((f"{k}: Link count == collective-wrapper count",
                        s["inter_node_bytes_per_step_link"] == s["inter_node_bytes_per_step_counted"]))
    return out


EXPLAIN = """\
What is measured and what is computed
  * inter-node bytes: the tensors handed to torch.distributed are real and their sizes are counted
    exactly; the bytes one rank SENDS between nodes are computed from them with the ring formula
    (all-gather (G-1)·payload, all-reduce 2(G-1)/G·n, reduce-scatter (G-1)/G·n), counting only hops
    between ranks of different nodes: a model of the algorithm, not a NIC counter. lowband: its
    Link's StepTraffic; every configuration: the torch.distributed collectives wrapped in each
    worker process (for lowband both counts agree). Intra-node (shard group) traffic is separate.
  * peak RSS: measured (getrusage ru_maxrss), per rank, largest over ranks. The high-water mark is
    reset (/proc/self/clear_refs) before forward, backward and optimizer.step() of every step, so
    each phase has its own peak; "peak RSS during training" is the largest. Workers are forked
    from this process: every RSS includes the same inherited base (torch, transformers, data).
    --malloc return (default) sets glibc's mmap threshold to 64 KiB so freed tensors leave RSS at
    once and RSS follows live memory; --malloc default shows glibc as it comes, where RSS also
    holds what the allocator kept (and FSDP2 keeps more of it than FSDP1).
  * gradients held / parameters / optimizer state: tensor bytes on the rank (DTensor: local
    shard), gradients right before optimizer.step(), largest over steps and ranks.
  * s/step: wall time of forward+backward+step, mean of steps 2..N, slowest rank; CPU s/step is
    the process time (all threads). Four processes share this machine's cores (and whatever else
    runs on it): the times compare the methods here, they are not link times (no link limit)."""


def trajectories(raw: dict) -> dict[str, list[float]]:
    """Per-step training loss of each configuration, the mean over its ranks."""
    return {c: [_mean(r["steps"][i]["loss"] for r in ranks) for i in range(len(ranks[0]["steps"]))]
            for c, ranks in raw.items()}


def compare_trajectories(traj: dict[str, list[float]]) -> dict:
    """Mean and largest |difference| per step of each pair of configurations, and their last losses."""
    out = {}
    cols = [c for c in CONFIGS if c in traj]
    for i, a in enumerate(cols):
        for b in cols[i + 1:]:
            d = [abs(x - y) for x, y in zip(traj[a], traj[b], strict=True)]
            out[f"{a}_vs_{b}"] = dict(mean_abs_diff=_mean(d), max_abs_diff=max(d), steps=len(d),
                                      last=(traj[a][-1], traj[b][-1]))
    return out


def plot_trajectories(traj: dict[str, list[float]], cmp: dict, path: Path, title: str) -> None:
    """The training-loss curves of every configuration against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"flexdemo": dict(color="C0", lw=2.2), "detonation": dict(color="C3", lw=1.2, ls="--"),
              "adamw": dict(color="0.45", lw=1.2)}
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for c in CONFIGS:
        if c in traj:
            ax.plot(range(1, len(traj[c]) + 1), traj[c], label=LABELS[c], **styles[c])
    pair = cmp.get("flexdemo_vs_detonation")
    if pair:
        ax.text(0.98, 0.70, f"lowband vs DeToNATION: mean |diff| {pair['mean_abs_diff']:.4f}, "
                f"max {pair['max_abs_diff']:.4f}", transform=ax.transAxes, ha="right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def check_chunk_rule(chunk: int) -> dict:
    """DeToNATION's largest-divisor rule on docs/algorithms.md's example and on a prime length."""
    from detonation.util.dct_transform import DCTTransform

    rule = DCTTransform._get_smaller_split
    return {str(n): rule(n, chunk) for n in (16204, 4051, 2 * 4051 * 2, 131072, 4194304)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="t5-small", help="lowband model size (default t5-small, the real architecture)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per configuration (default 3; the first is warm-up for timing)")
    ap.add_argument("--batch-size", type=int, default=4, help="examples per rank per step (default 4)")
    ap.add_argument("--source-len", type=int, default=128, help="source tokens (default 128; paper 512)")
    ap.add_argument("--target-len", type=int, default=32, help="target tokens (default 32; paper 150)")
    ap.add_argument("--vocab-size", type=int, default=32128,
                    help="tokenizer/embedding vocabulary (default 32128: t5-small has its 60.5M parameters)")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--decay", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--malloc", choices=("return", "default"), default="return",
                    help="'return' (default): glibc mallopt so that freed tensors leave RSS at once and peak RSS "
                         "tracks live memory; 'default': glibc as it comes (RSS includes what the allocator keeps)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="every configuration recomputes each T5 block in backward (lowband: shard_model's "
                         "option; DeToNATION: FSDP1's apply_activation_checkpointing after wrapping)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    ap.add_argument("--out", default="runs/vs_detonation",
                    help="directory for results.json, table.txt, losses.json and losses.png")
    ap.add_argument("--plot", default=None,
                    help="where to write the PNG of the training-loss curves (default OUT/losses.png)")
    args = ap.parse_args(argv)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {CONFIGS}")
    if "detonation" in configs:
        try:
            from importlib.metadata import version

            import detonation  # noqa: F401

            det_version = version("detonation")
        except ImportError as e:
            ap.error(f"DeToNATION is not importable ({e}); pip install detonation==0.5.2 einops mltiming")
        if det_version != "0.5.2":
            print(f"warning: detonation {det_version} installed, this benchmark was written for 0.5.2", file=sys.stderr)
    else:
        det_version = None

    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch

    from lowband.testing.ranks import run_ranks
    from lowband.train.data import DataConfig, load_data

    world = args.nodes * args.ranks_per_node
    t0 = time.perf_counter()
    data = load_data(DataConfig(max_source_len=args.source_len, max_target_len=args.target_len,
                                vocab_size=args.vocab_size, seed=args.seed))
    print(f"data: {len(data.train)} training examples, vocabulary {data.vocab_size} ({time.perf_counter() - t0:.1f} s)")
    opts = dict(model=args.model, steps=args.steps, batch_size=args.batch_size, topk=args.topk, chunk=args.chunk,
                lr=args.lr, decay=args.decay, seed=args.seed, malloc=args.malloc, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                activation_checkpointing=args.activation_checkpointing)
    print(f"mesh: {args.nodes} nodes × {args.ranks_per_node} ranks (gloo, forked processes); model {args.model}; "
          f"batch {args.batch_size}/rank, {args.source_len}/{args.target_len} tokens; Top-{args.topk}, chunk {args.chunk}; "
          f"{args.steps} steps per configuration")
    if args.activation_checkpointing:
        print("activation checkpointing: every configuration recomputes each T5 block in backward "
              "(lowband: shard_model's option; DeToNATION: FSDP1's apply_activation_checkpointing)")
    raw: dict = {}
    summaries: dict = {}
    failures: dict = {}
    for config in configs:
        t = time.perf_counter()
        print(f"running {config} ({LABELS[config]}) ...", flush=True)
        try:
            ranks = run_ranks(_worker, world_size=world, ranks_per_node=args.ranks_per_node, timeout_s=args.timeout,
                              args=(config, opts, data))
        except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
            failures[config] = f"{type(e).__name__}: {e}"
            print(f"  FAILED: {failures[config][:3000]}", flush=True)
            continue
        raw[config] = ranks
        summaries[config] = summarize(config, ranks, args.chunk)
        print(f"  done in {time.perf_counter() - t:.1f} s", flush=True)
    rat = ratios(summaries)
    chk = checks(summaries, rat, args.ranks_per_node)
    traj = trajectories(raw)
    cmp = compare_trajectories(traj)

    lines = [render(summaries, opts) if summaries else "(no configuration ran)", ""]
    if cmp:
        lines.append(f"Training-loss trajectories over {args.steps} steps (mean of ranks per step)")
        for k, v in cmp.items():
            a, b = k.split("_vs_")
            lines.append(f"  {a} vs {b}: mean |diff| {v['mean_abs_diff']:.4f}, max {v['max_abs_diff']:.4f}; "
                         f"last {v['last'][0]:.4f} vs {v['last'][1]:.4f}")
        lines.append("")
    labels = dict(
        bytes_detonation_over_flexdemo="inter-node bytes DeToNATION / lowband FlexDeMo",
        bytes_adamw_over_flexdemo="inter-node bytes AdamW full sync / lowband FlexDeMo",
        bytes_adamw_over_detonation="inter-node bytes AdamW full sync / DeToNATION",
        peak_rss_train_detonation_over_flexdemo="peak RSS in training, DeToNATION / FlexDeMo",
        peak_rss_train_adamw_over_flexdemo="peak RSS in training, AdamW / FlexDeMo",
        rss_increase_detonation_over_flexdemo="RSS increase in training, DeToNATION / FlexDeMo",
        rss_increase_adamw_over_flexdemo="RSS increase in training, AdamW / FlexDeMo",
        grad_bytes_detonation_over_flexdemo="gradients held, DeToNATION / FlexDeMo",
        tensor_bytes_detonation_over_flexdemo="params+grads+state, DeToNATION / FlexDeMo",
        tensor_bytes_adamw_over_flexdemo="params+grads+state, AdamW / FlexDeMo",
        step_s_detonation_over_flexdemo="s/step, DeToNATION / FlexDeMo",
        step_s_adamw_over_flexdemo="s/step, AdamW / FlexDeMo",
        peak_rss_train_flexdemo_over_detonation="peak RSS in training, FlexDeMo / DeToNATION",
        peak_rss_train_flexdemo_over_adamw="peak RSS in training, FlexDeMo / AdamW",
    )
    lines.append("Ratios")
    for k, v in rat.items():
        lines.append(f"  {labels.get(k, k):<52} {v:8.2f}" if v is not None else f"  {labels.get(k, k):<52}      n/a")
    if "detonation" in summaries:
        d = summaries["detonation"]
        bad = d["detonation_chunk_not_requested"]
        lines.append("")
        lines.append(f"DeToNATION chunk sizes (largest divisor of each flat FSDP1 shard's length <= {args.chunk}): "
                     f"{d['detonation_params'] - len(bad)} of {d['detonation_params']} parameters got {args.chunk}; "
                     f"{len(bad)} got another chunk size")
        for p in bad:
            lines.append(f"  flat shard of {p['numel']:,} elements -> chunk {p['chunk']}")
        rule = check_chunk_rule(args.chunk)
        lines.append("  rule check (DCTTransform._get_smaller_split): " + ", ".join(f"{n} -> {c}" for n, c in rule.items()))
        if d.get("detonation_own_data_transmit") is not None:
            lines.append(f"  DeToNATION's own count of its payload per step (idx.nbytes + val.nbytes): "
                         f"{d['detonation_own_data_transmit']:,} bytes")
    lines.append("")
    lines.append("Acceptance checks")
    for name, ok in chk:
        lines.append(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    if failures:
        lines.append("")
        lines.append("Failed configurations")
        for k, v in failures.items():
            lines.append(f"  {k}: {v.splitlines()[0] if v else ''}")
    lines.append("")
    lines.append(EXPLAIN)
    if "detonation" in configs:
        lines.append("""\
  * DeToNATION runs through prepare_detonation(model, Optimizers.SGD, DeMoReplicator(topk, chunk,
    decay), fsdp_kwargs={auto_wrap_policy: T5Block}) with FSDP1 HYBRID_SHARD over the same
    (replicate, shard) groups lowband uses, forward/backward under model.no_sync() as its example
    does; differences: device_id=cpu instead of LOCAL_RANK (no GPU), fp32 (its example turns bf16
    mixed precision on only where CUDA bf16 exists), the groups passed explicitly (its default
    builds the same mesh with device "cuda").""")
    if summaries and not all(x["peak_reset_ok"] for x in summaries.values()):
        lines.append("  ! /proc/self/clear_refs could not be written: peaks are lifetime peaks (set-up included)")
    text = "\n".join(lines)
    print()
    print(text)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(
        benchmark="vs_detonation", args=vars(args), detonation_version=det_version, torch=torch.__version__,
        python=platform.python_version(), cpus=os.cpu_count(), summaries=summaries, ratios=rat,
        checks=[dict(check=n, passed=ok) for n, ok in chk], failures=failures, per_rank=raw,
        notes=EXPLAIN,
    )
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "table.txt").write_text(text + "\n")
    print(f"\nwrote {out / 'results.json'} and {out / 'table.txt'}")
    if traj:
        (out / "losses.json").write_text(json.dumps(dict(args=vars(args), losses=traj, comparison=cmp), indent=1))
        png = Path(args.plot) if args.plot else out / "losses.png"
        plot_trajectories(traj, cmp, png, f"{args.model}, vocab {args.vocab_size}, batch {args.batch_size}/rank, "
                          f"{args.nodes}x{args.ranks_per_node} ranks, Top-{args.topk}/chunk {args.chunk}, lr {args.lr}")
        print(f"wrote {out / 'losses.json'} and {png}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
