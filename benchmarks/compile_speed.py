#!/usr/bin/env python
"""``lowband train --compile`` against the same run without it: real tokens/s, compile time, losses.

For each method (default AdamW and FlexDeMo) the script runs the same short ``lowband train`` job twice,
eager and with ``--compile`` (torch.compile on each transformer block, inductor), on the same model,
data, seed and emulated nodes (``--nodes`` × ``--ranks-per-node`` processes on this machine, loopback),
interleaved: each round runs every method eager and compiled back to back, the order of the pair
alternating from round to round, so that other load on the machine falls on both alike.

Each rank records every training step's wall time (``Trainer.train_step``: the batch, forward,
backward, optimizer step with its communication) and the real (non-padding) tokens it trained on, and
the time of the first validation (the hook is this script's, in the node's entry point; the library
is unchanged). Per run:

- **tokens/s**: the real tokens of every rank over the steps from ``--warmup-steps`` on that compiled
  nothing (a step compiles where TorchDynamo captured a new graph on some rank: the first step, and a
  later one where a batch's shape meets a case the dynamic graphs specialise on), divided by rank 0's
  time for those steps (the ranks step in lockstep);
- **compile s**: what the steps that compiled took beyond a median step, plus what the validations
  took beyond the eager run's (the first one compiles the validation graphs): the one-off cost of
  ``--compile`` (the training clock counts the steps' part);
- **max |Δ loss|**: the largest difference of rank 0's training loss at any step between the compiled
  run and the eager one of the same round (inductor keeps eager's dropout masks, so they follow one
  trajectory up to float noise), and of the final validation loss.

Inductor's compiled kernels are cached on disk (``TORCHINDUCTOR_CACHE_DIR``): the script gives its
runs a fresh cache of their own, so the first compiled run pays a cold compilation (as a user's first
run does) and later ones find the kernels cached (as a user's later runs do); the table says which.

Run::

    python benchmarks/compile_speed.py                         # t5-mini, adamw and flexdemo, 2 rounds
    python benchmarks/compile_speed.py --model gpt-mini --methods adamw --steps 60 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RECORD = "compile_speed_rank{rank}.json"


# --------------------------------------------------------------------------- inside a node
def _node_main(argv: list[str]) -> int:
    """A node's rank: ``lowband train`` with each step's time and real tokens recorded."""
    from torch._dynamo.utils import counters

    from lowband.train.loop import Trainer

    steps, evals = [], []
    train_step, evaluate, summarize = Trainer.train_step, Trainer.evaluate, Trainer.summarize

    def timed_step(self, step, *args, **kwargs):
        tokens0, graphs0, t0 = self.clock["tokens"], counters["stats"]["unique_graphs"], time.perf_counter()
        loss = train_step(self, step, *args, **kwargs)
        steps.append({"step": step, "time_s": time.perf_counter() - t0, "tokens": self.clock["tokens"] - tokens0,
                      "loss": loss, "compiled": counters["stats"]["unique_graphs"] > graphs0})
        return loss

    def timed_evaluate(self, step, *args, **kwargs):
        graphs0, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        loss = evaluate(self, step, *args, **kwargs)
        evals.append({"step": step, "time_s": time.perf_counter() - t0, "val_loss": loss,
                      "compiled": counters["stats"]["unique_graphs"] > graphs0})
        return loss

    def write_record(self, *args, **kwargs):
        (self.out / RECORD.format(rank=self.rank)).write_text(json.dumps({"steps": steps, "evals": evals}))
        return summarize(self, *args, **kwargs)

    Trainer.train_step, Trainer.evaluate, Trainer.summarize = timed_step, timed_evaluate, write_record
    from lowband.cli import main

    return main(argv)


# --------------------------------------------------------------------------- one run
def _train_args(a, method: str, compiled: bool, out: Path) -> list[str]:
    return ["train", "--method", method, "--model", a.model, "--steps", str(a.steps), "--batch-size",
            str(a.batch_size), "--seed", str(a.seed), "--val-every", "0", "--val-batches", str(a.val_batches),
            "--log-every", "0", "--no-progress", "--out", str(out), *(["--compile"] if compiled else []),
            *a.train_args]


def _run(a, method: str, compiled: bool, out: Path, cache: Path) -> dict:
    from lowband.cluster.launch import launch_nodes

    result = launch_nodes(num_nodes=a.nodes, ranks_per_node=a.ranks_per_node,
                          module_args=["_node", *_train_args(a, method, compiled, out / "job")],
                          env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, net=None, timeout_s=a.timeout,
                          log_dir=out, script=Path(__file__).resolve())
    result.raise_for_failure()
    world = a.nodes * a.ranks_per_node
    ranks = [json.loads((out / "job" / RECORD.format(rank=r)).read_text()) for r in range(world)]
    # Timed: the steps after the first ones that compiled no graph on any rank (a later step compiles where a
    # batch's shape meets a case the dynamic graphs specialise on).
    k = a.warmup_steps
    compiling = {i for r in ranks for i, s in enumerate(r["steps"]) if s["compiled"]}
    timed = [i for i in range(k, len(ranks[0]["steps"])) if i not in compiling]
    median_s = statistics.median(ranks[0]["steps"][i]["time_s"] for i in timed)
    return {
        "tokens": sum(r["steps"][i]["tokens"] for r in ranks for i in timed),
        "time_s": sum(ranks[0]["steps"][i]["time_s"] for i in timed),
        "compiling_steps": sorted(compiling),
        # What the steps that compiled took beyond a median step (rank 0), and the validations' times.
        "step_compile_s": sum(ranks[0]["steps"][i]["time_s"] - median_s for i in compiling),
        "val_s": [e["time_s"] for e in ranks[0]["evals"]],
        "median_step_s": median_s,
        "losses": [s["loss"] for s in ranks[0]["steps"]],
        "val_loss": ranks[0]["evals"][-1]["val_loss"],
        "wall_s": result.wall_time_s,
    }


# --------------------------------------------------------------------------- the report
def _table(rounds: list[dict], methods: list[str]) -> list[str]:
    lines = [f"{'method':<12} {'round':>5} {'eager tok/s':>12} {'compiled tok/s':>15} {'speed-up':>9} "
             f"{'compile s':>10} {'inductor cache':>15} {'max |Δ loss|':>13} {'|Δ val|':>9}  steps that compiled"]
    for method in methods:
        for i, r in enumerate(rounds):
            e, c = r[method]["eager"], r[method]["compiled"]
            tps_e, tps_c = e["tokens"] / e["time_s"], c["tokens"] / c["time_s"]
            compile_s = c["step_compile_s"] + sum(x - y for x, y in zip(c["val_s"], e["val_s"], strict=True))
            dloss = max(abs(x - y) for x, y in zip(e["losses"], c["losses"], strict=True))
            lines.append(f"{method:<12} {i + 1:>5} {tps_e:>12.0f} {tps_c:>15.0f} {tps_c / tps_e:>8.2f}x "
                         f"{compile_s:>10.1f} {c['cache']:>15} {dloss:>13.2e} {abs(e['val_loss'] - c['val_loss']):>9.2e}  "
                         f"{','.join(map(str, c['compiling_steps']))}")
        ratios = [r[method]["compiled"]["tokens"] / r[method]["compiled"]["time_s"]
                  / (r[method]["eager"]["tokens"] / r[method]["eager"]["time_s"]) for r in rounds]
        lines.append(f"{method:<12} {'all':>5} {'':>12} {'':>15} {statistics.median(ratios):>8.2f}x (median)")
    return lines


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_node":
        return _node_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="t5-mini", help="lowband train --model (default t5-mini)")
    p.add_argument("--methods", default="adamw,flexdemo", help="comma list (default adamw,flexdemo)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="first steps left out of tokens/s (allocator warm-up), besides every step that compiled "
                        "(default 5)")
    p.add_argument("--rounds", type=int, default=2, help="eager/compiled pairs per method (default 2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                   help="more lowband train arguments for every run (last on the line)")
    p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    p.add_argument("--out", default=None, help="default: a temporary directory")
    a = p.parse_args()
    if not 0 < a.warmup_steps < a.steps:
        p.error(f"--warmup-steps must be in 1..--steps - 1, got {a.warmup_steps}")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    root = Path(a.out or tempfile.mkdtemp(prefix="compile_speed_"))
    cache = root / "inductor-cache"  # fresh: the first compiled run compiles cold
    rounds: list[dict] = []
    compiled_before = False
    total, done, t_all = 2 * a.rounds * len(methods), 0, time.perf_counter()
    for i in range(a.rounds):
        rounds.append({})
        for method in methods:
            order = (False, True) if i % 2 == 0 else (True, False)
            for compiled in order:
                kind = "compiled" if compiled else "eager"
                t0 = time.perf_counter()
                run = _run(a, method, compiled, root / f"round{i + 1}" / f"{method}-{kind}", cache)
                run["cache"] = ("warm" if compiled_before else "cold") if compiled else "-"
                compiled_before |= compiled
                rounds[-1].setdefault(method, {})[kind] = run
                done += 1
                print(f"[{done}/{total}] round {i + 1}, {method} {kind}: {time.perf_counter() - t0:.0f} s "
                      f"(about {(time.perf_counter() - t_all) / done * (total - done):.0f} s left)",
                      file=sys.stderr, flush=True)
    table = _table(rounds, methods)
    doc = {"model": a.model, "methods": methods, "steps": a.steps, "warmup_steps": a.warmup_steps,
           "batch_size": a.batch_size, "nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "seed": a.seed,
           "train_args": a.train_args, "cpu_count": os.cpu_count(), "rounds": rounds, "table": table}
    (root / "compile_speed.json").write_text(json.dumps(doc, indent=1))
    print(f"{a.model}, {a.nodes} node(s) x {a.ranks_per_node} rank(s), {a.steps} steps (first {a.warmup_steps} "
          f"left out of tokens/s), batch {a.batch_size}/rank, seed {a.seed}; tokens/s: real tokens of all ranks")
    print("\n".join(table))
    print(f"results: {root / 'compile_speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
