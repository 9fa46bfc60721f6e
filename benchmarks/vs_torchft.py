#!/usr/bin/env python
"""lowband's DiLoCo side by side with torchft's own DiLoCo; FlexDeMo against DeToNATION 0.5.2 re-measured.

Part ``diloco`` (issue 45 item 3). Two implementations train the same model (built by lowband from
the seed), the same batches (``lowband.train.data.train_batch``), the same dropout seeds, the same H
(inner steps per outer step), inner optimizer (AdamW, same lr and weight decay, no clipping) and
outer optimizer (SGD with Nesterov momentum, the same lr and momentum), on 2 nodes of 1 rank each
(forked gloo processes on this machine):

* ``lowband``: :class:`lowband.optim.outer.diloco.DiLoCo` built by ``build_optimizer("diloco", ...)``
  as ``lowband train`` builds it: ``shard_model`` (FSDP2 inside the node; with 1 rank per node the
  model stays whole), the pseudo-gradient through a :class:`lowband.comm.link.Link` that shapes its
  traffic in-process (the node's uplink at ``--bandwidth`` with ``--latency`` per sequential message).
* ``torchft``: ``torchft.local_sgd.DiLoCo(manager, [model], inner, outer, sync_every=H)`` on torchft's
  ``Manager`` (``ProcessGroupGloo``, ``use_async_quorum=False``) and a ``LighthouseServer`` (started in
  rank 0's process, torchft's default ticks and timeouts), driven the way torchft's
  ``examples/train_diloco.py`` drives it: zero_grad, forward, backward, ``inner_optimizer.step()``
  (DiLoCo's step hooks do the rest). Differences from that example, each for an equal footing:
  ``init_sync=False`` (both replicas are built from the same seed, as lowband's are; no state is
  sent at start), ``min_replica_size`` = the number of nodes (every quorum holds both), the
  backup weights on the CPU (its default for a CPU model).

What is measured and what is modelled:

* The link is MODELLED, the same way for both: netem is not available here, so no kernel delay can
  be put on the loopback. lowband's Link shapes its own all-reduce (:class:`lowband.comm.shaping.UplinkClock`:
  bytes·8/bandwidth on the node's uplink, queued behind operations in flight, then 2(G−1) messages ×
  latency). torchft's ``Manager.allreduce`` is wrapped here to apply the same clock, with the same
  formula, to every all-reduce DiLoCo starts (one per parameter): its work's ``wait()`` returns no
  earlier than the model says (:class:`ShapedAllreduce`). torchft also asks its Lighthouse for a
  quorum at every outer step; ``--quorum-rtt`` (default on) charges each quorum one round trip
  (2 × latency, the Lighthouse as a third host), the one control-plane cost on its critical path
  (``should_commit`` goes to the node's own Manager server; heartbeats run in the background).
  lowband without ``--ft`` forms no quorum.
* Bytes between nodes per outer step per rank are COUNTED from the real tensors with the ring model
  (all-reduce: 2(G−1)/G · payload sent): lowband's from its Link's ``StepTraffic`` and, as a cross
  check, from ``torch.distributed``'s collectives wrapped in each worker (``vs_detonation.CollectiveCounter``;
  the two must agree); torchft's from the wrapped ``Manager.allreduce``. gRPC traffic (quorum,
  commit vote, heartbeats) is not counted.
* Seconds per outer step: wall time of the H inner steps and the outer step (slowest rank), mean over
  the outer steps after the first (the first pays one-off set-up: torchft configures its process
  group at its first quorum). Of which: the syncing ``step()`` (the outer step, its wait on the
  link included), the link time the model charged, and torchft's quorum.
* Peak RSS per rank (``getrusage``), the high-water mark reset after set-up (model, optimizers,
  Manager built), so "peak RSS in training" excludes set-up; glibc returns freed memory at once
  (``vs_detonation.malloc_return_freed``) so RSS follows live memory. Workers are forked from this
  process: every figure includes the same inherited base.
* Final validation loss: each node's model after the last outer step (the run ends on one) on the
  first ``--val-batches`` validation batches; the nodes hold the same weights, their mean is shown.

The runs are interleaved (lowband, torchft, lowband, torchft, one pair per seed) so that load from
other work on the machine falls on both alike; the table shows each measure's mean and its spread
(max − min) over the seeds.

Part ``flexdemo``: lowband FlexDeMo against DeToNATION 0.5.2 (the public FlexDeMo) through
``benchmarks/vs_detonation.py``'s own worker and summaries (imported, not copied), over
``--fd-steps`` steps (default 30; the first is warm-up), interleaved the same way over two seeds:
whole step time (forward + backward + step, slowest rank), CPU time, peak RSS in training, inter-node
bytes. No link limit there (DeToNATION's collectives do not go through lowband's Link), as in
vs_detonation.py. Needs ``pip install detonation==0.5.2 einops mltiming`` (or ``pip install -e '.[compare]'``;
not a main dependency of lowband; DeToNATION imports mltiming without declaring it); without it that
part is skipped with a note. Part ``diloco`` needs torchft 0.2.0 (``pip install -e '.[ft]'``).

Run: ``python benchmarks/vs_torchft.py`` (both parts, a few minutes on two cores) or
``python benchmarks/vs_torchft.py --parts diloco --model t5-small --vocab-size 32128 --outer-steps 10 -H 50``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMPLS = ("lowband", "torchft")
LABELS = {"lowband": "lowband DiLoCo", "torchft": "torchft DiLoCo",
          "flexdemo": "lowband FlexDeMo", "detonation": "DeToNATION 0.5.2"}
MB = 1024 * 1024
#: torchft's Rust side logs every quorum and commit at INFO: only errors here, unless RUST_LOG says otherwise.
QUIET_TORCHFT = {"RUST_LOG": os.environ.get("RUST_LOG", "error")}


def _load_vs_detonation():
    """benchmarks/vs_detonation.py as a module (benchmarks/ is not a package)."""
    name = "vs_detonation"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "vs_detonation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


vd = _load_vs_detonation()


# ---------------------------------------------------------------------------- the link model for torchft
class ShapedWork:
    """A torchft work whose ``wait()`` returns no earlier than the modelled link delivers its data."""

    def __init__(self, work, ready_at: float, *, sleep: Callable[[float], None] = time.sleep,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self._work = work
        self.ready_at = ready_at
        self._sleep = sleep
        self._now = now

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        remaining = self.ready_at - self._now()
        if remaining > 0:
            self._sleep(remaining)
        return result

    def __getattr__(self, name: str):  # get_future, is_completed, ...: the real work's
        return getattr(self._work, name)


class ShapedAllreduce:
    """lowband's Link model (:class:`~lowband.comm.shaping.UplinkClock`, ring bytes) applied to torchft's all-reduces.

    Every member of a torchft quorum is another node (one rank per node here), so each all-reduce of
    ``payload`` bytes sends 2(G−1)/G·payload across, occupies the node's uplink for bytes·8/bandwidth
    (queued behind operations still on it) and is ready 2(G−1) latencies after its last byte, as
    :meth:`lowband.comm.link.Link.all_reduce` in shaped mode. ``ops`` records each call.
    """

    def __init__(self, *, bandwidth_bps: float | None, latency_s: float,
                 sleep: Callable[[float], None] = time.sleep, now: Callable[[], float] = time.perf_counter) -> None:
        from lowband.comm.shaping import UplinkClock

        if bandwidth_bps is not None and not bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps}")
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self.uplink = UplinkClock()
        self.ops: list[dict] = []
        self._sleep = sleep
        self._now = now

    def schedule(self, start: float, payload_bytes: int, group_size: int) -> float:
        """Record one all-reduce of ``payload_bytes`` over ``group_size`` nodes started at ``start``; when it is ready."""
        from lowband.comm.traffic import ring_inter_node_bytes

        g = group_size
        sent = 2 * (g - 1) * payload_bytes // g if g > 1 else 0
        inter, _, node_sent = ring_inter_node_bytes(list(range(g)), 0, lambda r: r, sent, 1) if g > 1 else (0, 0, 0)
        latency = self.latency_s * 2 * (g - 1) if inter else 0.0
        if self.bandwidth_bps is not None:
            ready = self.uplink.schedule(start, node_sent, self.bandwidth_bps, latency)
        else:
            ready = start + latency
        self.ops.append(dict(payload_bytes=payload_bytes, inter_node_bytes_sent=inter, modelled_s=ready - start))
        return ready

    def wrap(self, allreduce: Callable, group_size: Callable[[], int]) -> Callable:
        """``allreduce`` (torchft's ``Manager.allreduce``) with the model applied to the work it returns."""

        def shaped(tensor, *args, **kwargs):
            start = self._now()
            work = allreduce(tensor, *args, **kwargs)
            ready = self.schedule(start, tensor.numel() * tensor.element_size(), group_size())
            return ShapedWork(work, ready, sleep=self._sleep, now=self._now)

        return shaped

    def take(self) -> tuple[int, float, int]:
        """(inter-node bytes sent, modelled seconds of the last one, operations) since the last call; clears."""
        ops, self.ops = self.ops, []
        return sum(o["inter_node_bytes_sent"] for o in ops), max((o["modelled_s"] for o in ops), default=0.0), len(ops)


class DelayedQuorum:
    """torchft's Manager client with one modelled round trip added to each quorum it asks the Lighthouse for."""

    def __init__(self, client, delay_s: float, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self._client = client
        self.delay_s = delay_s
        self._sleep = sleep
        self.quorum_s: list[float] = []

    def _quorum(self, *args, **kwargs):
        t = time.perf_counter()
        quorum = self._client._quorum(*args, **kwargs)
        if self.delay_s > 0:
            self._sleep(self.delay_s)
        self.quorum_s.append(time.perf_counter() - t)
        return quorum

    def __getattr__(self, name: str):
        return getattr(self._client, name)


# ---------------------------------------------------------------------------- one DiLoCo run (one rank)
def _diloco_worker(rank: int, impl: str, opts: dict, data) -> dict:
    """One rank (one node) of one DiLoCo run: build ``impl``'s side, train, time, count, evaluate."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import gc
    import logging

    import torch
    import torch.distributed as dist

    from lowband.comm.link import Link
    from lowband.distributed.topology import Topology
    from lowband.train.data import train_batch
    from lowband.train.loop import evaluate
    from lowband.train.models import build_model, compute_loss, transformer_blocks
    from lowband.train.ranklog import QUIET_LOGGERS

    for name in QUIET_LOGGERS:  # torchft's Python loggers: one line per quorum and commit
        logging.getLogger(name).setLevel(logging.WARNING)
    # and a warning per Manager that NCCL's flight recorder cannot be reset: there is no NCCL here.
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    malloc_ok = vd.malloc_return_freed() if opts["malloc"] == "return" else None
    counter = vd.CollectiveCounter(1)
    counter.install()
    nodes, H, seed = opts["nodes"], opts["H"], opts["seed"]
    world = dist.get_world_size()
    model = build_model(opts["model"], vocab_size=data.vocab_size, seed=seed).model
    out: dict = dict(rank=rank, impl=impl, malloc_return_freed=malloc_ok,
                     params=sum(p.numel() for p in model.parameters()))
    link = shaper = quorum = manager = lighthouse = diloco = None
    if impl == "lowband":
        from lowband.distributed.sharding import shard_model
        from lowband.train.methods import build_optimizer, method_shards

        topo = Topology(num_nodes=nodes, ranks_per_node=1, shards=method_shards("diloco", 1, None))
        model = shard_model(model, topo, blocks=transformer_blocks(model))
        link = Link(topo, bandwidth_bps=opts["bandwidth_bps"], latency_s=opts["latency_s"])
        opt = build_optimizer("diloco", model.named_parameters(), link=link, hp=dict(
            lr=opts["lr"], weight_decay=opts["weight_decay"], sync_every=H, outer_lr=opts["outer_lr"],
            outer_momentum=opts["outer_momentum"], nesterov=True, max_grad_norm=None))
        inner = opt
    else:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo

        # The Lighthouse lives in rank 0's process; its port reaches the others as a tensor (nothing pickled).
        port = torch.zeros(1, dtype=torch.int64)
        if rank == 0:
            lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=nodes)
            port[0] = int(lighthouse.address().rsplit(":", 1)[1])
        dist.broadcast(port, 0)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the node's store (torchrun's)
        inner = torch.optim.AdamW(model.parameters(), lr=opts["lr"], weight_decay=opts["weight_decay"])
        outer = torch.optim.SGD(model.parameters(), lr=opts["outer_lr"], momentum=opts["outer_momentum"],
                                nesterov=True)

        def state_dict():
            return {"model": model.state_dict(), "inner_optim": inner.state_dict(), "outer_optim": outer.state_dict()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            inner.load_state_dict(sd["inner_optim"])
            outer.load_state_dict(sd["outer_optim"])

        timeout = timedelta(seconds=opts["timeout_s"])
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=nodes, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout, rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
            lighthouse_addr=f"http://127.0.0.1:{int(port[0])}", replica_id=f"vs_torchft_{rank}",
            hostname="127.0.0.1", init_sync=False,
        )
        shaper = ShapedAllreduce(bandwidth_bps=opts["bandwidth_bps"], latency_s=opts["latency_s"])
        manager.allreduce = shaper.wrap(manager.allreduce, manager.num_participants)
        quorum = DelayedQuorum(manager._client, 2 * opts["latency_s"] if opts["quorum_rtt"] else 0.0)
        manager._client = quorum
        diloco = DiLoCo(manager, [model], inner, outer, sync_every=H, backup_device=torch.device("cpu"),
                        pin_memory=False)
        diloco.__enter__()
        opt = inner

    gc.collect()
    vd.malloc_trim()
    out["peak_rss_setup_bytes"] = vd.maxrss_bytes()
    out["rss_before_train_bytes"] = vd.rss_bytes()
    out["peak_reset"] = vd.reset_peak_rss()
    torch.manual_seed(seed * 1000 + rank)  # dropout: the same per rank for both implementations
    dist.barrier()
    counter.phase = "train"
    steps, outers = [], []
    window_start, window_cpu = time.perf_counter(), time.process_time()
    bytes_link = 0
    modelled_link_s = 0.0
    for step in range(H * opts["outer_steps"]):
        batch = train_batch(data, step=step, rank=rank, world_size=world, batch_size=opts["batch_size"], seed=seed)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model, batch)
        loss.backward()
        t1, c1 = time.perf_counter(), time.process_time()
        opt.step()
        t2, c2 = time.perf_counter(), time.process_time()
        steps.append(dict(loss=float(loss.detach()), step_s=t2 - t0, optim_s=t2 - t1, optim_cpu_s=c2 - c1))
        if link is not None:
            traffic = link.end_step()
            bytes_link += traffic.inter_node_bytes_sent
            modelled_link_s += sum(op.modelled_link_time_s for op in traffic.ops)
        if (step + 1) % H == 0:
            now = time.perf_counter()
            rec = dict(outer=len(outers), wall_s=now - window_start, cpu_s=time.process_time() - window_cpu,
                       sync_step_s=t2 - t1, sync_step_cpu_s=c2 - c1)
            if shaper is not None:
                rec["inter_node_bytes_sent"], rec["modelled_link_s"], rec["collectives"] = shaper.take()
                rec["quorum_s"] = sum(quorum.quorum_s)
                quorum.quorum_s.clear()
                rec["committed_steps"] = manager.current_step()
            else:
                rec["inter_node_bytes_sent"], rec["modelled_link_s"] = bytes_link, modelled_link_s
                rec["collectives"] = None
                rec["quorum_s"] = 0.0
            rec["counted"] = counter.summary("train")
            counter.ops = [o for o in counter.ops if o["phase"] != "train"]
            outers.append(rec)
            bytes_link, modelled_link_s = 0, 0.0
            window_start, window_cpu = time.perf_counter(), time.process_time()
    out["peak_rss_train_bytes"] = vd.maxrss_bytes()
    counter.phase = "after"
    if hasattr(opt, "flush"):
        opt.flush()
    out["val_loss"] = evaluate(model, data, batch_size=opts["batch_size"], max_batches=opts["val_batches"],
                               device=torch.device("cpu"))
    out["steps"] = steps
    out["outers"] = outers
    # Outer steps that changed the weights: an uncommitted (torchft) or dropped (lowband) one would make
    # the two runs incomparable.
    out["outer_applied"] = (manager.current_step() if manager is not None
                            else opt.outer_steps - opt.dropped_outer_steps)
    if diloco is not None:
        diloco.__exit__(None, None, None)
    dist.barrier()  # every node is done with the Lighthouse before it goes
    if manager is not None:
        manager.shutdown(wait=False)
    if lighthouse is not None:
        lighthouse.shutdown()
    return out


# ---------------------------------------------------------------------------- summaries (pure)
def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize_diloco(ranks: list[dict]) -> dict:
    """One run's figures from its ranks' records: per outer step the slowest rank, steps 2..N averaged."""
    n = len(ranks[0]["outers"])
    H = len(ranks[0]["steps"]) // n
    per_outer = [max(r["outers"][k]["wall_s"] for r in ranks) for k in range(n)]
    warm = per_outer[1:] or per_outer

    def warm_mean(key: str) -> float:
        vals = [max(r["outers"][k][key] for r in ranks) for k in range(n)]
        return _mean(vals[1:] or vals)

    return dict(
        outer_s=_mean(warm), first_outer_s=per_outer[0], outer_s_each=per_outer,
        sync_step_s=warm_mean("sync_step_s"), modelled_link_s=warm_mean("modelled_link_s"),
        cpu_s=warm_mean("cpu_s"), sync_step_cpu_s=warm_mean("sync_step_cpu_s"),
        inner_step_s=max(_mean(st["step_s"] for i, st in enumerate(r["steps"]) if (i + 1) % H) for r in ranks),
        inner_optim_cpu_s=max(_mean(st["optim_cpu_s"] for i, st in enumerate(r["steps"]) if (i + 1) % H)
                              for r in ranks),
        quorum_s=warm_mean("quorum_s"),
        bytes_per_outer=max(o["inter_node_bytes_sent"] for r in ranks for o in r["outers"]),
        bytes_per_outer_dist=max(o["counted"]["inter_node_bytes_sent"] for r in ranks for o in r["outers"]),
        collectives_per_outer=max((o["collectives"] or o["counted"]["inter_node_collectives"]) for r in ranks
                                  for o in r["outers"]),
        peak_rss_train_bytes=max(r["peak_rss_train_bytes"] for r in ranks),
        rss_before_train_bytes=max(r["rss_before_train_bytes"] or 0 for r in ranks),
        peak_rss_setup_bytes=max(r["peak_rss_setup_bytes"] for r in ranks),
        val_loss=_mean(r["val_loss"] for r in ranks),
        outer_applied=min(r["outer_applied"] for r in ranks),
        val_loss_nodes_differ=max(r["val_loss"] for r in ranks) - min(r["val_loss"] for r in ranks),
        train_loss=[_mean(r["steps"][i]["loss"] for r in ranks) for i in range(len(ranks[0]["steps"]))],
        params=ranks[0]["params"],
    )


def spread(values: Sequence[float]) -> dict:
    """Mean, smallest, largest and spread (largest − smallest) of one measure over the seeds."""
    vals = [float(v) for v in values]
    return dict(mean=_mean(vals), min=min(vals), max=max(vals), spread=max(vals) - min(vals), n=len(vals))


def interleaved(impls: Sequence[str], seeds: Sequence[int]) -> list[tuple[int, str]]:
    """The order of the runs: for each seed every implementation in turn (A, B, A, B, ...)."""
    return [(s, i) for s in seeds for i in impls]


def aggregate(runs: dict[str, list[dict]], keys: Sequence[str]) -> dict[str, dict[str, dict]]:
    """Per implementation, :func:`spread` of each measure in ``keys`` over its runs."""
    return {impl: {k: spread([r[k] for r in rs]) for k in keys} for impl, rs in runs.items() if rs}


def fmt_measure(s: dict, fmt: Callable[[float], str]) -> str:
    """``mean (min–max)`` of one aggregated measure, or the value alone when every run gave the same."""
    if s["spread"] == 0 or s["n"] == 1:
        return fmt(s["mean"])
    return f"{fmt(s['mean'])} ({fmt(s['min'])}–{fmt(s['max'])})"


def render_table(agg: dict[str, dict[str, dict]], rows: Sequence[tuple[str, str, Callable[[float], str]]]) -> str:
    """A plain-text table: one row per (label, measure, format), one column per implementation."""
    cols = list(agg)
    cells = [[fmt_measure(agg[c][key], fmt) for c in cols] for _, key, fmt in rows]
    w0 = max(len(label) for label, _, _ in rows) + 2
    widths = [max(len(LABELS.get(c, c)), *(len(r[j]) for r in cells)) + 2 for j, c in enumerate(cols)]
    lines = ["".ljust(w0) + "".join(LABELS.get(c, c).rjust(w) for c, w in zip(cols, widths, strict=True))]
    for (label, _, _), row in zip(rows, cells, strict=True):
        lines.append(label.ljust(w0) + "".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def diloco_checks(agg: dict, outer_steps: int) -> list[tuple[str, bool]]:
    """The issue's goals, judged on the means: time, bytes, and the loss within the other's spread; and that
    every run applied all ``outer_steps`` outer steps (else the runs are not comparable)."""
    lo, tf = agg["lowband"], agg["torchft"]
    d_loss = abs(lo["val_loss"]["mean"] - tf["val_loss"]["mean"])
    allowed = max(lo["val_loss"]["spread"], tf["val_loss"]["spread"])
    return [
        (f"lowband at least as fast: {lo['outer_s']['mean']:.3f} <= {tf['outer_s']['mean']:.3f} s per outer step",
         lo["outer_s"]["mean"] <= tf["outer_s"]["mean"]),
        (f"lowband no more bytes: {lo['bytes_per_outer']['mean']:,.0f} <= {tf['bytes_per_outer']['mean']:,.0f} "
         f"per outer step (difference {lo['bytes_per_outer']['mean'] - tf['bytes_per_outer']['mean']:+,.0f})",
         lo["bytes_per_outer"]["mean"] <= tf["bytes_per_outer"]["mean"]),
        (f"validation loss within the seeds' spread: |Δ mean| {d_loss:.5f} <= {allowed:.5f}", d_loss <= allowed),
        (f"every run applied all {outer_steps} outer steps",
         lo["outer_applied"]["min"] == tf["outer_applied"]["min"] == outer_steps),
    ]


def _secs(x: float) -> str:
    return f"{x:.3f}"


def _bytes(x: float) -> str:
    return f"{x:,.0f}"


def _mib(x: float) -> str:
    return f"{x / MB:,.1f} MiB"


def _loss(x: float) -> str:
    return f"{x:.4f}"


DILOCO_ROWS = (
    ("s / outer step (outer 2..N, slowest rank)", "outer_s", _secs),
    ("  of which the syncing step()", "sync_step_s", _secs),
    ("  of which link time modelled", "modelled_link_s", _secs),
    ("  of which quorum (torchft; waits for the peer)", "quorum_s", _secs),
    ("CPU s / outer step (process, all threads)", "cpu_s", _secs),
    ("  of which the syncing step()", "sync_step_cpu_s", _secs),
    ("s / inner step without sync (mean, slowest)", "inner_step_s", _secs),
    ("  CPU s of its optimizer step()", "inner_optim_cpu_s", lambda x: f"{x:.4f}"),
    ("s of the first outer step", "first_outer_s", _secs),
    ("inter-node bytes / outer step / rank", "bytes_per_outer", _bytes),
    ("  counted on torch.distributed", "bytes_per_outer_dist", _bytes),
    ("inter-node collectives / outer step", "collectives_per_outer", lambda x: f"{x:.0f}"),
    ("RSS before training", "rss_before_train_bytes", _mib),
    ("peak RSS in training (largest rank)", "peak_rss_train_bytes", _mib),
    ("final validation loss", "val_loss", _loss),
    ("outer steps applied (fewest of a run)", "outer_applied", lambda x: f"{x:.0f}"),
)

FLEXDEMO_ROWS = (
    ("s / step (steps 2..N, slowest rank)", "step_s", _secs),
    ("  of which optimizer.step()", "optim_s", _secs),
    ("CPU s / step (process time)", "cpu_s", _secs),
    ("peak RSS in training (largest rank)", "peak_rss_train_bytes", _mib),
    ("RSS before training", "rss_before_train_bytes", _mib),
    ("inter-node bytes / step / rank", "inter_node_bytes_per_step_counted", _bytes),
    ("training loss, last step", "loss_last_mean", _loss),
)


def trajectory_gap(a: list[float], b: list[float]) -> dict:
    """Mean and largest |difference| of two training-loss trajectories."""
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return dict(mean_abs_diff=_mean(d), max_abs_diff=max(d) if d else float("nan"))


# ---------------------------------------------------------------------------- the two parts
def run_diloco(args, data) -> tuple[list[str], dict, int]:
    from lowband.testing.ranks import run_ranks

    # Looked up, not imported: importing torchft here would set its Rust logger up in this process, before
    # the workers are forked and given RUST_LOG.
    if importlib.util.find_spec("torchft") is None:
        note = "DiLoCo vs torchft skipped: torchft is not installed; pip install -e '.[ft]'"
        return [note], dict(skipped=note), 0

    opts = dict(model=args.model, H=args.H, outer_steps=args.outer_steps, batch_size=args.batch_size, lr=args.lr,
                weight_decay=args.weight_decay, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                nodes=args.nodes, bandwidth_bps=args.bandwidth_mbit * 1e6, latency_s=args.latency_ms / 1e3,
                quorum_rtt=args.quorum_rtt, val_batches=args.val_batches, malloc=args.malloc,
                timeout_s=args.timeout)
    runs: dict[str, list[dict]] = {i: [] for i in IMPLS}
    failures = {}
    print(f"DiLoCo: {args.nodes} nodes x 1 rank, model {args.model}, H={args.H}, {args.outer_steps} outer steps, "
          f"batch {args.batch_size}/rank, link {args.bandwidth_mbit:g} Mbit/s + {args.latency_ms:g} ms (modelled)")
    for seed, impl in interleaved(IMPLS, args.seeds):
        t = time.perf_counter()
        print(f"  running {impl} seed {seed} ...", flush=True)
        try:
            ranks = run_ranks(_diloco_worker, world_size=args.nodes, ranks_per_node=1, timeout_s=args.timeout,
                              args=(impl, dict(opts, seed=seed), data), env=QUIET_TORCHFT)
        except Exception as e:  # noqa: BLE001 - report and go on
            failures[f"{impl} seed {seed}"] = f"{type(e).__name__}: {e}"
            print(f"    FAILED: {str(e)[:3000]}", flush=True)
            continue
        s = summarize_diloco(ranks)
        s["seed"] = seed
        runs[impl].append(s)
        print(f"    {time.perf_counter() - t:.1f} s: {s['outer_s']:.3f} s/outer step, {s['bytes_per_outer']:,} B, "
              f"val loss {s['val_loss']:.4f}", flush=True)
    lines = [f"DiLoCo, {args.model} ({_first(runs, 'params')} parameters), {args.nodes} nodes x 1 rank, H={args.H}, "
             f"{args.outer_steps} outer steps, batch {args.batch_size}/rank, inner AdamW lr {args.lr:g} wd "
             f"{args.weight_decay:g}, outer SGD lr {args.outer_lr:g} momentum {args.outer_momentum:g} Nesterov; link "
             f"{args.bandwidth_mbit:g} Mbit/s + {args.latency_ms:g} ms modelled; seeds {args.seeds}; mean (min–max)"]
    result: dict = dict(runs=runs, failures=failures)
    if all(runs[i] for i in IMPLS):
        agg = aggregate(runs, [k for _, k, _ in DILOCO_ROWS])
        lines.append(render_table(agg, DILOCO_ROWS))
        gaps = {}
        for lo, tf in zip(runs["lowband"], runs["torchft"], strict=False):
            if lo["seed"] == tf["seed"]:
                gaps[lo["seed"]] = trajectory_gap(lo["train_loss"], tf["train_loss"])
        lines.append("training loss, lowband vs torchft per seed: " + "; ".join(
            f"seed {s}: mean |Δ| {g['mean_abs_diff']:.2e}, max {g['max_abs_diff']:.2e}" for s, g in gaps.items()))
        lines.append("Goals (issue 45 item 3)")
        chk = diloco_checks(agg, args.outer_steps)
        lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}" for name, ok in chk]
        result.update(aggregate=agg, trajectory_gaps=gaps, checks=[dict(check=n, passed=ok) for n, ok in chk])
    for k, v in failures.items():
        lines.append(f"  FAILED {k}: {v.splitlines()[0] if v else ''}")
    return lines, result, 1 if failures else 0


def _first(runs: dict, key: str):
    for rs in runs.values():
        for r in rs:
            return f"{r[key]:,}"
    return "?"


def run_flexdemo(args, data) -> tuple[list[str], dict, int]:
    from lowband.testing.ranks import run_ranks

    try:
        import detonation  # noqa: F401
    except ImportError as e:
        note = (f"FlexDeMo vs DeToNATION skipped: DeToNATION is not importable ({e}); "
                "pip install detonation==0.5.2 einops mltiming")
        return [note], dict(skipped=note), 0
    world = args.nodes * args.fd_ranks_per_node
    opts = dict(model=args.fd_model, steps=args.fd_steps, batch_size=args.fd_batch_size, topk=1, chunk=128,
                lr=1e-3, decay=0.999, malloc=args.malloc, nodes=args.nodes, ranks_per_node=args.fd_ranks_per_node,
                activation_checkpointing=False)
    print(f"FlexDeMo vs DeToNATION: {args.nodes} nodes x {args.fd_ranks_per_node} ranks, model {args.fd_model}, "
          f"{args.fd_steps} steps, batch {args.fd_batch_size}/rank", flush=True)
    runs: dict[str, list[dict]] = {"flexdemo": [], "detonation": []}
    failures = {}
    for seed, config in interleaved(tuple(runs), args.seeds):
        t = time.perf_counter()
        print(f"  running {config} seed {seed} ...", flush=True)
        try:
            ranks = run_ranks(vd._worker, world_size=world, ranks_per_node=args.fd_ranks_per_node,
                              timeout_s=args.timeout, args=(config, dict(opts, seed=seed), data))
        except Exception as e:  # noqa: BLE001 - report and go on
            failures[f"{config} seed {seed}"] = f"{type(e).__name__}: {e}"
            print(f"    FAILED: {str(e)[:3000]}", flush=True)
            continue
        s = vd.summarize(config, ranks, opts["chunk"])
        s["seed"] = seed
        runs[config].append(s)
        print(f"    {time.perf_counter() - t:.1f} s: {s['step_s']:.3f} s/step, peak RSS "
              f"{s['peak_rss_train_bytes'] / MB:,.1f} MiB", flush=True)
    lines = [f"FlexDeMo vs DeToNATION 0.5.2, {args.fd_model}, {args.nodes} nodes x {args.fd_ranks_per_node} ranks, "
             f"{args.fd_steps} steps (first is warm-up), batch {args.fd_batch_size}/rank, Top-1 chunk 128, no link "
             f"limit; seeds {args.seeds}; mean (min–max)"]
    result: dict = dict(runs=runs, failures=failures)
    if all(runs.values()):
        agg = aggregate(runs, [k for _, k, _ in FLEXDEMO_ROWS])
        lines.append(render_table(agg, FLEXDEMO_ROWS))
        f, d = agg["flexdemo"], agg["detonation"]
        lines.append(f"ratios DeToNATION / lowband FlexDeMo: s/step {d['step_s']['mean'] / f['step_s']['mean']:.3f}, "
                     f"peak RSS {d['peak_rss_train_bytes']['mean'] / f['peak_rss_train_bytes']['mean']:.3f}, "
                     f"bytes {d['inter_node_bytes_per_step_counted']['mean'] / f['inter_node_bytes_per_step_counted']['mean']:.2f}")
        result["aggregate"] = agg
    for k, v in failures.items():
        lines.append(f"  FAILED {k}: {v.splitlines()[0] if v else ''}")
    return lines, result, 1 if failures else 0


def _commit() -> str | None:
    """The checkout's commit, for the record (None outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="diloco,flexdemo", help="comma-separated: diloco, flexdemo (default both)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1],
                    help="comma-separated seeds; each runs every implementation once, interleaved (default 0,1)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="tokenizer/embedding vocabulary (default 8192)")
    ap.add_argument("--source-len", type=int, default=128, help="source tokens (default 128)")
    ap.add_argument("--target-len", type=int, default=32, help="target tokens (default 32)")
    ap.add_argument("--malloc", choices=("return", "default"), default="return",
                    help="'return' (default): freed memory leaves RSS at once, so peak RSS follows live memory")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    ap.add_argument("--out", default="runs/vs_torchft", help="directory for results.json and table.txt")
    g = ap.add_argument_group("diloco part")
    g.add_argument("--model", default="t5-mini", help="lowband model (default t5-mini)")
    g.add_argument("-H", "--sync-every", dest="H", type=int, default=10, help="inner steps per outer step (default 10)")
    g.add_argument("--outer-steps", type=int, default=5, help="outer steps per run (default 5; the first is warm-up)")
    g.add_argument("--batch-size", type=int, default=8, help="examples per rank per inner step (default 8)")
    g.add_argument("--lr", type=float, default=4e-4, help="inner AdamW lr (default 4e-4, DiLoCo's paper)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="inner AdamW weight decay (default 0.1)")
    g.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD lr (default 0.7, DiLoCo's paper)")
    g.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (default 0.9)")
    g.add_argument("--bandwidth-mbit", type=float, default=100.0, help="modelled link, Mbit/s (default 100)")
    g.add_argument("--latency-ms", type=float, default=50.0, help="modelled latency per message, ms (default 50)")
    g.add_argument("--quorum-rtt", action=argparse.BooleanOptionalAction, default=True,
                   help="charge each torchft quorum one modelled round trip (default on)")
    g.add_argument("--val-batches", type=int, default=8, help="validation batches for the final loss (default 8)")
    g = ap.add_argument_group("flexdemo part")
    g.add_argument("--fd-model", default="t5-mini", help="model (default t5-mini; t5-small is the old 3-step figure's)")
    g.add_argument("--fd-steps", type=int, default=30, help="steps per run (default 30; the first is warm-up)")
    g.add_argument("--fd-batch-size", type=int, default=4, help="examples per rank per step (default 4)")
    g.add_argument("--fd-ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    args = ap.parse_args(argv)

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = sorted(set(parts) - {"diloco", "flexdemo"})
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from diloco, flexdemo")
    if args.H < 1 or args.outer_steps < 1 or args.fd_steps < 2 or args.nodes < 2 or not args.seeds:
        ap.error("need -H >= 1, --outer-steps >= 1, --fd-steps >= 2, --nodes >= 2 and at least one seed")
    if args.bandwidth_mbit <= 0 or args.latency_ms < 0:
        ap.error("--bandwidth-mbit must be > 0 and --latency-ms >= 0")

    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch

    from lowband.train.data import DataConfig, load_data

    data = load_data(DataConfig(max_source_len=args.source_len, max_target_len=args.target_len,
                                vocab_size=args.vocab_size, seed=0))
    t0 = time.perf_counter()
    lines: list[str] = []
    result: dict = dict(benchmark="vs_torchft", args=vars(args), commit=_commit(), torch=torch.__version__,
                        python=platform.python_version(), cpus=os.cpu_count(), load_avg_start=os.getloadavg())
    rc = 0
    for part, fn in (("diloco", run_diloco), ("flexdemo", run_flexdemo)):
        if part in parts:
            part_lines, part_result, part_rc = fn(args, data)
            lines += part_lines + [""]
            result[part] = part_result
            rc = max(rc, part_rc)
    result["load_avg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - t0
    lines.append(f"commit {result['commit']}; {os.cpu_count()} CPUs, load average {result['load_avg_start'][0]:.2f} at start, "
                 f"{result['load_avg_end'][0]:.2f} at end; {result['wall_s']:.0f} s in all")
    text = "\n".join(lines)
    print()
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, body in (("results.json", json.dumps(result, indent=1, default=str)), ("table.txt", text + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(body)
        tmp.replace(out / name)
    print(f"wrote {out / 'results.json'} and {out / 'table.txt'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
