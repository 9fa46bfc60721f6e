"""What one slow node costs the others: NoLoCo (or any method) with and without fault tolerance.

One node sleeps ``--slow-s`` seconds before each of its training steps (a straggler: slower compute,
a busy machine); the others run at full speed. For each mode the job runs twice, once without the
sleep and once with it, and the script reports the fast nodes' wall time per outer window (the
time between two outer steps, from ``metrics.jsonl``), so the difference is what the straggler
costs them:

- ``--mode ft``: one torchrun per node with a torchft Lighthouse (``lowband train --ft-lighthouse``):
  every outer step forms a quorum over all live nodes;
- ``--mode plain``: one multi-node torchrun job on loopback (``lowband.cluster.launch``): NoLoCo waits
  for the peers of its group only.

Run::

    python benchmarks/slow_node.py --mode ft --nodes 3 --slow-s 0.1 0.3
    python benchmarks/slow_node.py --mode plain --nodes 3 --slow-s 0.1 0.3

The sleep is injected here (the node's entry point wraps ``Trainer.train_step``), not in the
library. Everything runs on this machine's CPUs: other load on them adds noise to every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SLOW_S, SLOW_NODE = "LOWBAND_BENCH_SLOW_S", "LOWBAND_BENCH_SLOW_NODE"


# --------------------------------------------------------------------------- inside a node
def _node_main(argv: list[str]) -> int:
    """A node's rank: ``lowband train`` with the sleep when this node is the slow one."""
    slow_s = float(os.environ.get(SLOW_S, "0"))
    node = int(argv[argv.index("--ft-node") + 1]) if "--ft-node" in argv else int(os.environ.get("GROUP_RANK", "0"))
    if slow_s > 0 and node == int(os.environ.get(SLOW_NODE, "-1")):
        from lowband.train.loop import Trainer

        step = Trainer.train_step

        def slow_step(self, *args, **kwargs):
            time.sleep(slow_s)
            return step(self, *args, **kwargs)

        Trainer.train_step = slow_step
    from lowband.cli import main

    return main(argv)


# --------------------------------------------------------------------------- the jobs
def _train_args(a) -> list[str]:
    return ["train", "--method", a.method, "--sync-every", str(a.sync_every), "--steps", str(a.steps),
            "--model", "t5-tiny", "--max-examples", "1500", "--val-size", "64", "--vocab-size", "512",
            "--batch-size", str(a.batch_size), "--val-batches", "1", "--val-every", "0", "--no-progress",
            *(["--group-size", str(a.group_size)] if a.method == "noloco" else [])]


def _run_ft(a, out: Path, slow_s: float) -> None:
    from lowband.cluster.ftjob import FaultTolerantJob

    class SlowJob(FaultTolerantJob):
        def start(self, node: int) -> None:  # FaultTolerantJob.start with this file as the entry point
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
                   "_node", "train", *self.train_args, "--ft-lighthouse", self.address, "--ft-node", str(node),
                   "--ft-max-nodes", str(self.nodes), "--ft-timeout", f"{self.ft_timeout_s}s",
                   "--out", str(self.node_out(node))]
            env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error", **{SLOW_S: str(slow_s),
                                                                            SLOW_NODE: str(a.slow_node)})
            with open(self.out / f"node{node}.log", "a") as log:
                self.procs[node] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                    start_new_session=True)

    with SlowJob(train_args=_train_args(a)[1:], nodes=a.nodes, ranks_per_node=1, out=out,
                 ft_timeout_s=a.ft_timeout) as job:
        job.start_all()
        codes = job.wait(timeout_s=a.timeout)
    if any(codes.values()):
        raise RuntimeError(f"a node failed: {codes}; see {out}/node*.log")


def _run_plain(a, out: Path, slow_s: float) -> None:
    from lowband.cluster.launch import launch_nodes

    result = launch_nodes(num_nodes=a.nodes, ranks_per_node=1, module_args=["_node", *_train_args(a), "--out",
                                                                           str(out / "job")],
                          env={SLOW_S: str(slow_s), SLOW_NODE: str(a.slow_node)}, net=None, timeout_s=a.timeout,
                          log_dir=out, script=Path(__file__))
    result.raise_for_failure()


# --------------------------------------------------------------------------- what the fast nodes saw
def _windows(metrics: Path, sync_every: int, skip: int) -> list[float]:
    """Wall time of each outer window (outer step to outer step) in one node's metrics, after ``skip`` windows."""
    walls = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "train" and rec["step"] % sync_every == 0:
            walls[rec["step"]] = rec["wall_s"]  # a healed node may record a step twice: the last one
    steps = sorted(walls)
    return [walls[b] - walls[a] for a, b in zip(steps, steps[1:], strict=False) if b - a == sync_every][skip:]


def _report(a, out: Path) -> dict:
    fast = [n for n in range(a.nodes) if n != a.slow_node]
    if a.mode == "plain":
        fast = [0]  # rank 0 writes the metrics of a multi-node job (node 0, a fast one)
    res = {}
    for n in fast:
        path = out / (f"node{n}" if a.mode == "ft" else "job") / "metrics.jsonl"
        w = _windows(path, a.sync_every, skip=2)
        entry = {"windows": len(w), "median_window_s": statistics.median(w) if w else None,
                 "mean_window_s": statistics.fmean(w) if w else None}
        if a.mode == "ft":
            rec = json.loads((out / f"node{n}" / "ft_rank0.json").read_text())
            entry.update(quorum_s=rec["quorum_s"], dropped=rec["dropped_steps"], healed=len(rec["healed"]))
            members = [json.loads(x) for x in path.read_text().splitlines()]
            entry["membership_changes"] = sum(1 for r in members if r["type"] == "membership")
        res[f"node{n}"] = entry
    if a.mode == "ft":
        slow = json.loads((out / f"node{a.slow_node}" / "ft_rank0.json").read_text())
        res[f"node{a.slow_node} (slow)"] = {"healed": len(slow["healed"]), "quorum_s": slow["quorum_s"],
                                            "dropped": slow["dropped_steps"]}
    return res


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_node":
        return _node_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ft", "plain"), required=True)
    p.add_argument("--method", default="noloco")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--slow-node", type=int, default=None, help="default: the last node")
    p.add_argument("--slow-s", type=float, nargs="+", default=[0.3],
                   help="sleep before each step of the slow node (one run per value, after one run without)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ft-timeout", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    p.add_argument("--out", default=None, help="default: a temporary directory")
    a = p.parse_args()
    if a.slow_node is None:
        a.slow_node = a.nodes - 1
    root = Path(a.out or tempfile.mkdtemp(prefix="slow_node_"))
    results = {}
    runs = [("no straggler", 0.0)] + [(f"node {a.slow_node} +{s:g} s/step", s) for s in a.slow_s]
    for label, slow_s in runs:
        out = root / f"{a.mode}_slow{slow_s:g}"
        t0 = time.perf_counter()
        (_run_ft if a.mode == "ft" else _run_plain)(a, out, slow_s)
        results[label] = {"run_wall_s": time.perf_counter() - t0, **_report(a, out)}
    summary = {"mode": a.mode, "method": a.method, "nodes": a.nodes, "sync_every": a.sync_every,
               "group_size": a.group_size, "steps": a.steps, "slow_s": a.slow_s, "results": results}
    (root / f"{a.mode}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
