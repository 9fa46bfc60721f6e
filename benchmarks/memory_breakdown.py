#!/usr/bin/env python
"""Where lowband FlexDeMo's peak memory per rank goes: RSS at every FSDP2 hook, and tensor sizes.

Runs FlexDeMo as ``vs_detonation.py`` does (same model, data, sharding, hyper-parameters; 2 nodes
× 2 ranks, forked gloo processes, glibc returning freed memory so that RSS follows live memory)
and records on rank 0:

* RSS (``/proc/self/statm``) at every FSDP2 hook (pre/post forward and backward, unshard,
  reshard of each unit) and at the phase boundaries: measured, exact at those points;
* the highest RSS between two consecutive hooks, sampled by a thread every 0.3 ms: measured,
  but a sample can miss a transient shorter than that;
* exact tensor bytes: parameter shards, gradient shards, FlexDeMo's state, each unit's unsharded
  size, and the bytes autograd saves for backward during forward (``saved_tensors_hooks``, each
  storage once, the model's parameters left out).

Run: ``python benchmarks/memory_breakdown.py [--model t5-small] [--steps 2] [--json PATH]``. It
prints the timeline of the last step (RSS at each hook, and the peak after it) and the sizes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
import warnings

MIB = 2**20
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


class Timeline:
    """RSS at each labelled point, and the highest RSS sampled until the next label."""

    def __init__(self, interval_s: float = 3e-4) -> None:
        self.points: list[list] = []  # [label, rss at the label, peak until the next label]
        self.interval_s = interval_s
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._thread.join()

    def mark(self, label: str) -> None:
        r = rss_bytes()
        self.points.append([label, r, r])

    def _run(self) -> None:
        while not self._stop:
            r = rss_bytes()
            if self.points and r > self.points[-1][2]:
                self.points[-1][2] = r
            time.sleep(self.interval_s)


def _worker(rank: int, opts: dict, data) -> dict:
    warnings.filterwarnings("ignore")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: as vs_detonation.py --malloc return
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    import gc

    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_pg

    from lowband.comm.link import Link
    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology
    from lowband.optim._common import local
    from lowband.train.data import train_batch
    from lowband.train.methods import build_optimizer
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    tl = Timeline()
    tl.start()
    tl.mark("setup: start (forked, data loaded)")
    topo = Topology(num_nodes=opts["nodes"], ranks_per_node=opts["ranks_per_node"])
    spec = build_model(opts["model"], vocab_size=data.vocab_size, seed=opts["seed"])
    model = spec.model
    blocks = transformer_blocks(model)
    tl.mark("setup: model built (unsharded)")
    model = shard_model(model, topo, blocks=blocks)
    gc.collect()
    tl.mark("setup: sharded")
    link = Link(topo)
    hp = dict(lr=opts["lr"], topk=opts["topk"], chunk=opts["chunk"], decay=opts["decay"], values="bf16")
    opt = build_optimizer("flexdemo", model.named_parameters(), link=link, hp=hp)
    params = [p for g in opt.param_groups for p in g["params"]]
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    tl.mark("setup: optimizer built")
    out: dict = {}

    def unit_of(group) -> str:
        return group._module_fqn or "root"

    for name in ("pre_forward", "post_forward", "pre_backward", "post_backward", "unshard", "reshard"):
        original = getattr(fsdp_pg.FSDPParamGroup, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            tl.mark(f"{unit_of(self)}.{_name} <")
            result = _original(self, *args, **kwargs)
            tl.mark(f"{unit_of(self)}.{_name} >")
            return result

        setattr(fsdp_pg.FSDPParamGroup, name, wrapped)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups]

    def unsharded_ptrs() -> set:
        return {fp._unsharded_param.untyped_storage().data_ptr() for g in groups for fp in g.fsdp_params
                if hasattr(fp, "_unsharded_param")}

    def saved_bytes_counter():
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in unsharded_ptrs():  # an unsharded weight: counted with its unit
                seen.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    torch.manual_seed(opts["seed"] * 1000 + rank)
    steps = []
    for step in range(opts["steps"]):
        batch = train_batch(data, step=step, rank=rank, world_size=topo.world_size, batch_size=opts["batch_size"],
                            seed=opts["seed"])
        tl.mark(f"step {step}: zero_grad")
        opt.zero_grad(set_to_none=True)
        tl.mark(f"step {step}: forward")
        seen, hooks = saved_bytes_counter()
        with hooks:
            loss = compute_loss(model, batch)
        activation_bytes = sum(seen.values())
        tl.mark(f"step {step}: backward")
        loss.backward()
        g_bytes = sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
        tl.mark(f"step {step}: optimizer.step()")
        opt.step()
        tl.mark(f"step {step}: done")
        steps.append(dict(loss=float(loss), grad_bytes=g_bytes, saved_for_backward_bytes=activation_bytes))
    tl.stop()
    out["timeline"] = tl.points
    out["steps"] = steps
    out["param_bytes"] = sum(local(p).numel() * local(p).element_size() for p in params)
    # local(): this rank's part of a DTensor (δ is (replicas, *shape) over the 2-D mesh; its global numel
    # would count every rank's part)
    out["state_bytes"] = sum(local(v).numel() * local(v).element_size() for st in opt.state.values()
                             for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    out["unit_unsharded_bytes"] = {unit_of(g): sum(4 * fp._orig_size.numel() for fp in g.fsdp_params) for g in groups}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="t5-small")
    ap.add_argument("--steps", type=int, default=2, help="steps (default 2: the last one is reported)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--source-len", type=int, default=128)
    ap.add_argument("--target-len", type=int, default=32)
    ap.add_argument("--vocab-size", type=int, default=32128)
    ap.add_argument("--json", default=None, help="write rank 0's timeline and sizes here")
    args = ap.parse_args(argv)
    from lowband.testing.ranks import run_ranks
    from lowband.train.data import DataConfig, load_data

    data = load_data(DataConfig(max_source_len=args.source_len, max_target_len=args.target_len,
                                vocab_size=args.vocab_size, seed=0))
    opts = dict(model=args.model, steps=args.steps, batch_size=args.batch_size, nodes=2, ranks_per_node=2, seed=0,
                lr=1e-3, topk=1, chunk=128, decay=0.999)
    r = run_ranks(_worker, world_size=4, ranks_per_node=2, timeout_s=3600, args=(opts, data))[0]
    last = f"step {args.steps - 1}:"
    tl = r["timeline"]
    first = next(i for i, p in enumerate(tl) if p[0].startswith(last))
    print("rank 0, setup")
    for label, at, _peak in tl[:first]:
        if label.startswith("setup"):
            print(f"  {at / MIB:8.1f} MiB at   {label}")
    print(f"rank 0, {last[:-1]}: RSS at each point, and the peak sampled until the next one (MiB)")
    for label, at, peak in tl[first:]:
        print(f"  {at / MIB:8.1f}  peak after {peak / MIB:8.1f}  {label}")
    top = max(tl[first:], key=lambda p: p[2])
    print(f"peak of {last[:-1]}: {top[2] / MIB:.1f} MiB, after '{top[0]}'")
    print(f"parameter shards {r['param_bytes'] / MIB:.1f} MiB; FlexDeMo state {r['state_bytes'] / MIB:.1f} MiB; "
          f"gradient shards {r['steps'][-1]['grad_bytes'] / MIB:.1f} MiB; saved for backward (activations) "
          f"{r['steps'][-1]['saved_for_backward_bytes'] / MIB:.1f} MiB; losses {[s['loss'] for s in r['steps']]}")
    print("unsharded size of each FSDP2 unit (MiB): " + ", ".join(
        f"{k} {v / MIB:.2f}" for k, v in r["unit_unsharded_bytes"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
