#!/usr/bin/env python
"""FlexDeMo with 2-D DCT tiles (``tile=t``) against 1-D chunks of t² elements, at equal bytes per step.

Both keep ``topk`` coefficients per row of t² elements (a t × t tile, or a chunk of c = t²), so on
matrices whose local shard is a multiple of t in both dimensions they send the same bytes; the
script prints both byte counts. Two parts:

(a) ``step()`` cost, in one process: rank 0's FSDP2 shards of a model (``--shards``, as
    ``benchmarks/step_cost.py`` builds them: the first ceil(d0/S) rows of every parameter, one
    fixed random gradient each), two copies, one stepped by FlexDeMo with 1-D chunks and one with
    tiles; the all-gather is a loopback of ``--replicas`` copies of the rank's own message. Each
    round times one step of each (the order alternates between rounds), the gradients restored
    first, outside the timed region. Printed: the medians, the median of the per-round ratios
    tiles / chunks, and the cost of the tiled copies alone (one ``to_tiles`` and one ``from_tiles``
    of every matrix; a tiled step makes two of each: the gradient and δ in, δ and the update out).

(b) training loss (``--train-steps N``, 0 skips it): ``lowband bench`` trains the model both ways
    (DeMo, ``--nodes`` × 1 rank, in-process shaping at 1 Gbit/s) at each of ``--seeds``, and the
    script prints each run's final validation and training loss and, per layout, the mean ± half
    the spread over the seeds.

Run::

    python benchmarks/tiles_vs_chunks.py                               # (a) only, t5-mini, Top-8, 16 × 16
    python benchmarks/tiles_vs_chunks.py --train-steps 300 --seeds 0,1 # and (b)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_cost import DEFAULT_VOCAB, LoopbackLink, make_params, shard_tensors  # noqa: E402

from lowband.compress import from_tiles, to_tiles  # noqa: E402
from lowband.optim import FlexDeMo  # noqa: E402


def time_layouts(shards, *, replicas: int, topk: int, tile: int, values: str, lr: float, repeats: int,
                 warmup: int) -> dict:
    """Per-round CPU times of step() with 1-D chunks of tile² and with tile × tile tiles, and of the tiled copies."""
    opts = {
        "chunks": FlexDeMo(make_params(shards), lr=lr, topk=topk, chunk=tile * tile, values=values,
                           link=LoopbackLink(replicas)),
        "tiles": FlexDeMo(make_params(shards), lr=lr, topk=topk, tile=tile, values=values,
                          link=LoopbackLink(replicas)),
    }
    params = {k: [p for g in o.param_groups for p in g["params"]] for k, o in opts.items()}
    grads = [p.grad.clone() for p in params["chunks"]]
    mats = [g.reshape(g.shape[0], math.prod(g.shape[1:])) for g in grads if g.dim() >= 2]
    times: dict = {"chunks": [], "tiles": [], "copies": []}

    def step(kind: str) -> float:
        torch._foreach_copy_([p.grad for p in params[kind]], grads)  # FlexDeMo's scratch: restored, untimed
        c0 = time.process_time()
        opts[kind].step()
        return time.process_time() - c0

    for _ in range(warmup):
        step("chunks")
        step("tiles")
    for r in range(repeats):
        for kind in ("chunks", "tiles") if r % 2 == 0 else ("tiles", "chunks"):
            times[kind].append(step(kind))
        c0 = time.process_time()
        for m in mats:
            from_tiles(to_tiles(m, tile), m.shape)
        times["copies"].append(time.process_time() - c0)
    return {
        "bytes": {k: o.payload_bytes() for k, o in opts.items()},
        "times": times,
        "elements": sum(g.numel() for g in grads),
        "tensors": len(grads),
        "matrices": len(mats),
    }


def train(args) -> None:
    """(b): ``lowband bench`` with both layouts at every seed, then the final losses side by side."""
    k, t = args.topk, args.tile
    specs = {"chunks": f"demo:chunk={t * t},topk={k}", "tiles": f"demo:tile={t},topk={k}"}
    out = Path(args.out)
    cmd = [sys.executable, "-m", "lowband", "bench", "--methods", *specs.values(), "--nodes", str(args.nodes),
           "--ranks-per-node", "1", "--steps", str(args.train_steps), "--seeds", args.seeds, "--model", args.model,
           "--emulation", "shaped", "--bandwidth", "1gbit", "--out", str(out), "--no-progress"]
    print("(b) " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    runs = json.loads((out / "results.json").read_text())["runs"]
    print(f"{'layout':8} {'seed':>4} {'val loss':>9} {'train loss':>10} {'bytes/step/node':>15}")
    for kind, spec in specs.items():
        mine = [r for r in runs if r["spec"] == spec]
        for r in mine:
            print(f"{kind:8} {r['seed']:>4} {r['val_loss']:9.4f} {r['train_loss']:10.4f} "
                  f"{r['inter_node_bytes_per_step']:15,.0f}")
        for key in ("val_loss", "train_loss"):
            xs = [r[key] for r in mine if r["status"] == "ok"]
            if xs:
                print(f"{kind:8} {key}: {statistics.mean(xs):.4f} ± {(max(xs) - min(xs)) / 2:.4f} "
                      f"(mean ± half the spread over {len(xs)} seed(s))")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="t5-mini")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: as benchmarks/step_cost.py")
    ap.add_argument("--shards", type=int, default=2, help="(a) ranks per node sharing a copy (default 2)")
    ap.add_argument("--replicas", type=int, default=2, help="(a) messages decoded per step (default 2)")
    ap.add_argument("--topk", type=int, default=8, help="coefficients per tile and per chunk (default 8)")
    ap.add_argument("--tile", type=int, default=16, help="tile side t; the chunks have t² elements (default 16)")
    ap.add_argument("--values", default="bf16", choices=("bf16", "fp32", "sign"))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--repeats", type=int, default=9, help="(a) timed rounds (default 9)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="(a) torch intra-op threads (default 1)")
    ap.add_argument("--train-steps", type=int, default=0, help="(b) steps per training run; 0 skips (b)")
    ap.add_argument("--seeds", default="0,1", help="(b) seeds, comma-separated (default 0,1)")
    ap.add_argument("--nodes", type=int, default=2, help="(b) emulated nodes, one rank each (default 2)")
    ap.add_argument("--out", default="runs/tiles_vs_chunks", help="(b) the bench's run directory")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    vocab = args.vocab_size or DEFAULT_VOCAB.get(args.model, 8192)
    shards = shard_tensors(args.model, vocab_size=vocab, shards=args.shards)
    res = time_layouts(shards, replicas=args.replicas, topk=args.topk, tile=args.tile, values=args.values,
                       lr=args.lr, repeats=args.repeats, warmup=args.warmup)
    t = res["times"]
    med = statistics.median
    print(f"(a) {args.model} (vocab {vocab}): {res['tensors']} tensors ({res['matrices']} matrices), "
          f"{res['elements']:,} elements per rank (S={args.shards}), R={args.replicas}, Top-{args.topk}, "
          f"{args.values}, {torch.get_num_threads()} thread(s), {args.repeats} rounds, CPU s")
    print(f"  bytes per step: chunks of {args.tile ** 2}: {res['bytes']['chunks']:,}   "
          f"tiles {args.tile}×{args.tile}: {res['bytes']['tiles']:,}")
    print(f"  step() median: chunks {med(t['chunks']):.4f}   tiles {med(t['tiles']):.4f}   "
          f"ratio tiles/chunks {med([a / b for a, b in zip(t['tiles'], t['chunks'], strict=True)]):.2f} "
          f"(per-round ratios {min(a / b for a, b in zip(t['tiles'], t['chunks'], strict=True)):.2f}.."
          f"{max(a / b for a, b in zip(t['tiles'], t['chunks'], strict=True)):.2f})")
    print(f"  one tiled copy in and out of every matrix: {med(t['copies']):.4f} "
          f"({med(t['copies']) / med(t['chunks']):.2f} of a chunked step)", flush=True)
    if args.train_steps:
        train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
