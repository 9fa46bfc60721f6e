#!/usr/bin/env python
"""FlexDeMo's ``step()`` against AdamW's, on the same parameter shards, in one process.

For each model (default t5-mini at vocab 8192, as in ``lowband bench``, and t5-small at vocab
32128, as in ``benchmarks/vs_detonation.py``) the script builds the parameters one rank holds
when FSDP2 shards the model over ``--shards`` ranks of a node (rank 0's rows of dim 0, i.e.
``ceil(d0 / S)`` rows of every parameter, tied weights once; the values are the model's
initialisation) and gives every parameter the same fixed random gradient. Two copies of these
shards are stepped: one by :class:`lowband.optim.FlexDeMo`, one by
:class:`lowband.optim.AdamWFullSync` (torch's AdamW; no link, so no all-reduce), both at the
registry defaults of ``lowband train`` unless told otherwise.

What FlexDeMo's step costs here is its whole compute: momentum, DCT, top-k, packing, the decode
of what it sent (error feedback), the decode of the mean over the R replicas and the sign step.
The all-gather between nodes is replaced by a loopback that returns R copies of this rank's own
message (``--replicas``, default 2 as on the 2 × 2 mesh): decoding costs the same whichever
indices the peers picked, so the compute is that of an R-replica step; the link's time is not in
it (the bench models that separately).

Timing: after ``--warmup`` steps of each (the first allocates the state), ``--repeats`` rounds of
one FlexDeMo step then one AdamW step. FlexDeMo writes its momentum over the gradients, so they
are copied back before each of its steps, outside the timed region. Per round the script takes the process CPU time and the
wall time of each step; it prints the medians over the rounds and the median of the per-round
ratios FlexDeMo / AdamW. On a loaded machine the ratio is the figure to compare, not the absolute
times. ``--threads`` sets torch's intra-op threads (default 1: one rank's share of a core, as the
multi-process runs on this machine give it).

Kernels and host synchronisations: for each block layout of FlexDeMo (``blocks="group"``, a GPU's
default: a param group's chunk rows in as few blocks as possible; ``blocks="cache"``, the CPU's
default: blocks of about 2^20 elements that stay in the caches) the script counts what one
``step()`` launches with torch.profiler (:func:`lowband.testing.launches.count_launches`: the
dispatched ops that run a kernel, and the host reads of device values). The count is the same on
the CPU as on a GPU, so it is measured here; the times above are the CPU's default layout's
(``--blocks`` times another).

Run::

    python benchmarks/step_cost.py                          # t5-mini and t5-small, 7 rounds
    python benchmarks/step_cost.py --models t5-small --repeats 11 --json runs/step_cost.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lowband.testing.launches import count_launches

log = logging.getLogger("step_cost")

# The vocabulary each named model is benchmarked at (the bench's t5-mini, vs_detonation's t5-small).
DEFAULT_VOCAB = {"t5-mini": 8192, "t5-small": 32128}


class LoopbackLink:
    """The Link's ``all_gather`` in one process: R copies of this rank's message, no topology.

    FlexDeMo then decodes an R-replica mean exactly as on R nodes (the cost of the decode does not
    depend on which indices the peers picked). Nothing is sent and nothing is timed for a link.
    """

    topology = None
    participating = True  # every copy counts (Link.participating: False only on a node healing under FT)
    group_rank = 0  # this rank's row of the gather (every row is its message)

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas

    def commit(self) -> bool:  # no fault tolerance: every step is applied
        return True

    def all_gather(self, message: torch.Tensor, async_op: bool = False) -> torch.Tensor:
        if async_op:
            raise ValueError("LoopbackLink has no asynchronous all-gather; build FlexDeMo with overlap=False")
        return message.unsqueeze(0).expand(self.replicas, -1).contiguous()


def shard_tensors(model_name: str, *, vocab_size: int, shards: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Rank 0's FSDP2 shard of every parameter of ``model_name``: (name, rows 0..ceil(d0/S)-1 of dim 0)."""
    from lowband.train.models import build_model

    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    model = build_model(model_name, vocab_size=vocab_size, seed=seed).model
    out = []
    for name, p in model.named_parameters():  # tied weights appear once
        rows = -(-p.shape[0] // shards)
        out.append((name, p.detach()[:rows].clone().contiguous()))
    return out


def make_params(shards: list[tuple[str, torch.Tensor]], *, device: str = "cpu", seed: int = 1,
                grad_scale: float = 1e-2) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters holding copies of ``shards`` on ``device``, each with the same seeded random gradient."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for name, t in shards:
        p = torch.nn.Parameter(t.clone().to(device))
        p.grad = (torch.randn(t.shape, generator=g) * grad_scale).to(device)
        params.append((name, p))
    return params


def build_flexdemo(named_params, *, replicas: int, topk: int, chunk: int, values: str, lr: float,
                   blocks: str = "auto"):
    from lowband.optim import FlexDeMo

    link = LoopbackLink(replicas) if replicas > 1 else None
    return FlexDeMo(named_params, lr=lr, topk=topk, chunk=chunk, values=values, link=link, blocks=blocks)


def flexdemo_launches(shards: list[tuple[str, torch.Tensor]], *, blocks: str, replicas: int = 2, topk: int = 1,
                      chunk: int = 128, values: str = "bf16", lr: float = 1e-3, device: str = "cpu",
                      cuda: bool = False):
    """What one FlexDeMo ``step()`` on ``shards`` launches with the block layout ``blocks``
    (:data:`lowband.optim.flexdemo.optimizer.BLOCK_LAYOUTS`), after 2 steps that create the state:
    :class:`lowband.testing.launches.Launches` (``cuda``: the device's kernels counted too)."""
    flex = build_flexdemo(make_params(shards, device=device), replicas=replicas, topk=topk, chunk=chunk,
                          values=values, lr=lr, blocks=blocks)
    for _ in range(2):
        flex.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return count_launches(flex.step, cuda=cuda)


def build_adamw(named_params, *, lr: float):
    from lowband.optim import AdamWFullSync

    return AdamWFullSync(named_params, lr=lr, link=None)


def sparseloco_outer_launches(shards: list[tuple[str, torch.Tensor]], *, replicas: int = 2,
                              transform: str = "none", device: str = "cpu"):
    """What SparseLoCo's outer step launches beyond an inner step, on ``shards`` (H = 2, its defaults,
    AdamW with torch's multi-tensor kernels inside): the difference of two counted ``step()`` calls,
    the outer one and the inner one after it, as :class:`lowband.testing.launches.Launches`."""
    from torch.optim import AdamW

    from lowband.optim import SparseLoCo
    from lowband.testing.launches import Launches

    opt = SparseLoCo(make_params(shards, device=device), lambda groups: AdamW(groups, lr=1e-4, foreach=True),
                     link=LoopbackLink(replicas), sync_every=2, transform=transform)
    for _ in range(3):  # the state, one outer step, one inner step: the next is an outer step
        opt.step()
    outer, inner = count_launches(opt.step), count_launches(opt.step)
    return Launches(outer.kernels - inner.kernels, outer.syncs - inner.syncs)


@dataclass
class StepCost:
    """Per-round times of both optimizers' step() on one model's shards."""

    model: str
    vocab_size: int
    shards: int
    replicas: int
    topk: int
    chunk: int
    values: str
    threads: int
    tensors: int
    elements: int
    flexdemo_cpu_s: list[float] = field(default_factory=list)
    adamw_cpu_s: list[float] = field(default_factory=list)
    flexdemo_wall_s: list[float] = field(default_factory=list)
    adamw_wall_s: list[float] = field(default_factory=list)
    #: FlexDeMo's step: {"kernels", "syncs", "device_kernels"} per block layout ("group", "cache").
    launches: dict = field(default_factory=dict)
    #: SparseLoCo's outer step beyond an inner step: {"kernels", "syncs", ...} per transform.
    sparseloco_outer: dict = field(default_factory=dict)

    def summary(self) -> dict:
        def med(xs):
            return statistics.median(xs)

        return {
            "flexdemo_cpu_s_median": med(self.flexdemo_cpu_s),
            "adamw_cpu_s_median": med(self.adamw_cpu_s),
            "ratio_cpu_median": med([f / a for f, a in zip(self.flexdemo_cpu_s, self.adamw_cpu_s, strict=True)]),
            "flexdemo_wall_s_median": med(self.flexdemo_wall_s),
            "adamw_wall_s_median": med(self.adamw_wall_s),
            "ratio_wall_median": med([f / a for f, a in zip(self.flexdemo_wall_s, self.adamw_wall_s,
                                                             strict=True)]),
        }


def _timed(step, sync) -> tuple[float, float]:
    sync()
    c0, w0 = time.process_time(), time.perf_counter()
    step()
    sync()
    return time.process_time() - c0, time.perf_counter() - w0


def time_steps(shards: list[tuple[str, torch.Tensor]], *, model: str, vocab_size: int, n_shards: int,
               replicas: int = 2, topk: int = 1, chunk: int = 128, values: str = "bf16", lr: float = 1e-3,
               repeats: int = 7, warmup: int = 2, device: str = "cpu", blocks: str = "auto") -> StepCost:
    """Time FlexDeMo's and AdamW's step() on two copies of ``shards``, alternating, ``repeats`` rounds."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    flex = build_flexdemo(make_params(shards, device=device), replicas=replicas, topk=topk, chunk=chunk,
                          values=values, lr=lr, blocks=blocks)
    adam = build_adamw(make_params(shards, device=device), lr=lr)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # FlexDeMo writes its momentum over the gradients (its step's scratch): every FlexDeMo step gets
    # the original gradients back first, outside the timed region, so both optimizers step on the same.
    flex_params = [p for group in flex.param_groups for p in group["params"]]
    grads = [p.grad.clone() for p in flex_params]

    def restore() -> None:
        torch._foreach_copy_([p.grad for p in flex_params], grads)

    for _ in range(warmup):
        restore()
        flex.step()
        adam.step()
    cost = StepCost(model=model, vocab_size=vocab_size, shards=n_shards, replicas=replicas, topk=topk, chunk=chunk,
                    values=values, threads=torch.get_num_threads(), tensors=len(shards),
                    elements=sum(t.numel() for _, t in shards))
    for _ in range(repeats):
        restore()
        c, w = _timed(flex.step, sync)
        cost.flexdemo_cpu_s.append(c)
        cost.flexdemo_wall_s.append(w)
        c, w = _timed(adam.step, sync)
        cost.adamw_cpu_s.append(c)
        cost.adamw_wall_s.append(w)
    return cost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="t5-mini,t5-small", help="comma-separated named sizes (default: %(default)s)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="vocabulary for every model (default: t5-mini 8192, t5-small 32128, others 8192)")
    ap.add_argument("--shards", type=int, default=2, help="ranks per node that share a model copy (default 2)")
    ap.add_argument("--replicas", type=int, default=2, help="model copies whose messages are decoded (default 2)")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--values", default="bf16", choices=("bf16", "fp32", "sign"))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--blocks", default="auto", choices=("auto", "group", "cache"),
                    help="FlexDeMo's block layout for the timing (default auto: cache on the CPU, group on a GPU)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per model (default 7)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the figures to OUT")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)

    results = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        vocab = args.vocab_size or DEFAULT_VOCAB.get(name, 8192)
        shards = shard_tensors(name, vocab_size=vocab, shards=args.shards)
        cost = time_steps(shards, model=name, vocab_size=vocab, n_shards=args.shards, replicas=args.replicas,
                          topk=args.topk, chunk=args.chunk, values=args.values, lr=args.lr,
                          repeats=args.repeats, warmup=args.warmup, blocks=args.blocks)
        for blocks in ("group", "cache"):
            cost.launches[blocks] = flexdemo_launches(shards, blocks=blocks, replicas=args.replicas, topk=args.topk,
                                                      chunk=args.chunk, values=args.values, lr=args.lr)._asdict()
        for transform in ("none", "dct"):
            cost.sparseloco_outer[transform] = sparseloco_outer_launches(shards, replicas=args.replicas,
                                                                         transform=transform)._asdict()
        s = cost.summary()
        results.append({**asdict(cost), **s})
        print(f"{name} (vocab {vocab}): {cost.tensors} tensors, {cost.elements:,} elements per rank "
              f"(S={args.shards}), R={args.replicas}, Top-{args.topk}, chunk {args.chunk}, {args.values}, "
              f"{cost.threads} thread(s), {args.repeats} rounds")
        print(f"  step() CPU s, median:  FlexDeMo {s['flexdemo_cpu_s_median']:.4f}  "
              f"AdamW {s['adamw_cpu_s_median']:.4f}  ratio {s['ratio_cpu_median']:.2f}")
        print(f"  step() wall s, median: FlexDeMo {s['flexdemo_wall_s_median']:.4f}  "
              f"AdamW {s['adamw_wall_s_median']:.4f}  ratio {s['ratio_wall_median']:.2f}")
        for blocks, where in (("group", "a GPU's default"), ("cache", "the CPU's default, timed above")):
            kernels, syncs = cost.launches[blocks]["kernels"], cost.launches[blocks]["syncs"]
            print(f"  FlexDeMo step(), blocks={blocks} ({where}): {kernels} kernels launched, {syncs} host sync(s)")
        for transform, n in cost.sparseloco_outer.items():
            kernels, syncs = n["kernels"], n["syncs"]
            print(f"  SparseLoCo outer step, transform={transform}: {kernels} kernels and {syncs} host sync(s) "
                  "beyond an inner step")
        sys.stdout.flush()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
