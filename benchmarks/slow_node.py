"""What one slow node costs the others: NoLoCo (or any method) with and without fault tolerance.

One node sleeps ``--slow-s`` seconds before each of its training steps (a straggler: slower compute,
a busy machine); the others run at full speed. For each mode the job runs twice, once without the
sleep and once with it, and the script reports the fast nodes' wall time per outer window (the
time between two outer steps, from ``metrics.jsonl``), so the difference is what the straggler
costs them:

- ``ft``: one torchrun per node with a torchft Lighthouse (``lowband train --ft-lighthouse``), the
  default ``--ft-quorum async``: NoLoCo forms one quorum per outer window, in the background while
  the inner steps run, and waits for it before the outer step;
- ``ft-sync``: the same with ``--ft-quorum sync``: a quorum over all live nodes right before each outer
  step, waited for;
- ``plain``: one multi-node torchrun job on loopback (``lowband.cluster.launch``), no fault tolerance:
  NoLoCo waits for the peers of its group only.

The modes given run one after the other in one invocation, each with and without the straggler::

    python benchmarks/slow_node.py --mode ft ft-sync plain --nodes 4 --slow-s 0.1 0.3

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

SLOW_S, SLOW_NODE, SLOW_STEPS = "LOWBAND_BENCH_SLOW_S", "LOWBAND_BENCH_SLOW_NODE", "LOWBAND_BENCH_SLOW_STEPS"


# --------------------------------------------------------------------------- inside a node
def _node_main(argv: list[str]) -> int:
    """A node's rank: ``lowband train`` with the sleep when this node is the slow one."""
    slow_s = float(os.environ.get(SLOW_S, "0"))
    node = int(argv[argv.index("--ft-node") + 1]) if "--ft-node" in argv else int(os.environ.get("GROUP_RANK", "0"))
    if slow_s > 0 and node == int(os.environ.get(SLOW_NODE, "-1")):
        from lowband.train.loop import Trainer

        step = Trainer.train_step

        first, last = (int(x) for x in os.environ.get(SLOW_STEPS, f"0:{1 << 40}").split(":"))

        def slow_step(self, at, *args, **kwargs):
            if first <= at < last:
                time.sleep(slow_s)
            return step(self, at, *args, **kwargs)

        Trainer.train_step = slow_step
    from lowband.cli import main

    return main(argv)


# --------------------------------------------------------------------------- the jobs
def _train_args(a) -> list[str]:
    return ["train", "--method", a.method, "--sync-every", str(a.sync_every), "--steps", str(a.steps),
            "--model", "t5-tiny", "--max-examples", "1500", "--val-size", "64", "--vocab-size", "512",
            "--batch-size", str(a.batch_size), "--val-batches", "1", "--val-every", "0", "--no-progress",
            *(["--group-size", str(a.group_size)] if a.method == "noloco" else [])]


def _run_ft(a, out: Path, slow_s: float, quorum: str = "async") -> None:
    from lowband.cluster.ftjob import FaultTolerantJob

    class SlowJob(FaultTolerantJob):
        def start(self, node: int) -> None:  # FaultTolerantJob.start with this file as the entry point
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
                   "_node", "train", *self.train_args, "--ft-lighthouse", self.address, "--ft-node", str(node),
                   "--ft-max-nodes", str(self.nodes), "--ft-timeout", f"{self.ft_timeout_s}s", "--ft-quorum", quorum,
                   "--out", str(self.node_out(node))]
            env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error",
                       **{SLOW_S: str(slow_s), SLOW_NODE: str(a.slow_node), SLOW_STEPS: a.slow_steps})
            with open(self.out / f"node{node}.log", "a") as log:
                self.procs[node] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                    start_new_session=True)

    # Every node in the first quorum (no node trains alone while the others start): no node dies here.
    with SlowJob(train_args=_train_args(a)[1:], nodes=a.nodes, ranks_per_node=1, out=out,
                 ft_timeout_s=a.ft_timeout, min_nodes=a.nodes) as job:
        job.start_all()
        codes = job.wait(timeout_s=a.timeout)
    if any(codes.values()):
        raise RuntimeError(f"a node failed: {codes}; see {out}/node*.log")


def _run_plain(a, out: Path, slow_s: float) -> None:
    from lowband.cluster.launch import launch_nodes

    result = launch_nodes(num_nodes=a.nodes, ranks_per_node=1, module_args=["_node", *_train_args(a), "--out",
                                                                           str(out / "job")],
                          env={SLOW_S: str(slow_s), SLOW_NODE: str(a.slow_node), SLOW_STEPS: a.slow_steps},
                          net=None, timeout_s=a.timeout,
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


def _report(a, out: Path, mode: str) -> dict:
    fast = [n for n in range(a.nodes) if n != a.slow_node]
    if mode == "plain":
        fast = [0]  # rank 0 writes the metrics of a multi-node job (node 0, a fast one)
    res = {}
    for n in fast:
        path = out / (f"node{n}" if mode != "plain" else "job") / "metrics.jsonl"
        w = _windows(path, a.sync_every, skip=2)
        entry = {"windows": len(w), "median_window_s": statistics.median(w) if w else None,
                 "mean_window_s": statistics.fmean(w) if w else None,
                 "window_s": _windows(path, a.sync_every, skip=0)}
        if mode != "plain":
            rec = json.loads((out / f"node{n}" / "ft_rank0.json").read_text())
            entry.update(quorum_s=rec["quorum_s"], dropped=rec["dropped_steps"], healed=len(rec["healed"]))
            members = [json.loads(x) for x in path.read_text().splitlines()]
            entry["membership_changes"] = sum(1 for r in members if r["type"] == "membership")
        res[f"node{n}"] = entry
    if mode != "plain":
        slow = json.loads((out / f"node{a.slow_node}" / "ft_rank0.json").read_text())
        res[f"node{a.slow_node} (slow)"] = {"healed": len(slow["healed"]), "quorum_s": slow["quorum_s"],
                                            "dropped": slow["dropped_steps"]}
    return res


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_node":
        return _node_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ft", "ft-sync", "plain"), nargs="+", required=True,
                   help="ft: fault tolerance, default quorum (NoLoCo: one per window, in the background); ft-sync: "
                        "--ft-quorum sync; plain: no fault tolerance. Several run one after the other")
    p.add_argument("--method", default="noloco")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--slow-node", type=int, default=None, help="default: the last node")
    p.add_argument("--slow-s", type=float, nargs="+", default=[0.3],
                   help="sleep before each step of the slow node (one run per value, after one run without)")
    p.add_argument("--slow-steps", default=None, metavar="A:B",
                   help="sleep only before steps A <= step < B (a transient straggler; default: every step)")
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
    a.slow_steps = a.slow_steps or f"0:{a.steps}"
    root = Path(a.out or tempfile.mkdtemp(prefix="slow_node_"))
    results: dict[str, dict] = {}
    runs = [("no straggler", 0.0)] + [(f"node {a.slow_node} +{s:g} s/step", s) for s in a.slow_s]
    total, done, t_all = len(a.mode) * len(runs), 0, time.perf_counter()
    for mode in a.mode:
        for label, slow_s in runs:
            out = root / f"{mode}_slow{slow_s:g}"
            t0 = time.perf_counter()
            if mode == "plain":
                _run_plain(a, out, slow_s)
            else:
                _run_ft(a, out, slow_s, quorum="sync" if mode == "ft-sync" else "async")
            results.setdefault(mode, {})[label] = {"run_wall_s": time.perf_counter() - t0, **_report(a, out, mode)}
            done += 1
            left = (time.perf_counter() - t_all) / done * (total - done)
            print(f"[{done}/{total}] {mode}, {label}: {time.perf_counter() - t0:.0f} s (about {left:.0f} s left)",
                  file=sys.stderr, flush=True)
    summary = {"modes": a.mode, "method": a.method, "nodes": a.nodes, "sync_every": a.sync_every,
               "group_size": a.group_size, "steps": a.steps, "slow_s": a.slow_s, "results": results}
    (root / "slow_node.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    _table(summary)
    if a.slow_steps != f"0:{a.steps}":
        _window_table(summary, a)
    return 0


def _window_table(summary: dict, a) -> None:
    """Each fast node's wall time per window around a transient straggler's windows."""
    first, last = (int(x) for x in a.slow_steps.split(":"))
    h = a.sync_every
    lo, hi = max(first // h - 1, 1), last // h + 3  # window_s[i] is window i + 1 (steps (i+1)·H .. (i+2)·H − 1)
    print(f"\nwall time of outer windows {lo}..{hi - 1} (window w: steps w·{h} .. (w + 1)·{h} − 1, outer step to "
          f"outer step); the straggler sleeps before steps {first}..{last - 1}:")
    for mode, by_label in summary["results"].items():
        for label, res in by_label.items():
            if label == "no straggler":
                continue
            for node, v in res.items():
                if node.startswith("node") and "slow" not in node:
                    cells = " ".join(f"{x:5.2f}" for x in v["window_s"][lo - 1:hi - 1])
                    print(f"{mode:<8} {label:<22} {node}: {cells}")


def _table(summary: dict) -> None:
    """The fast nodes' median (mean) wall time per outer window, one row per mode, one column per run."""
    labels = list(next(iter(summary["results"].values())))
    print("\nfast nodes' wall time per outer window, median (mean) over nodes and windows:")
    print(f"{'mode':<10}" + "".join(f"{label:>26}" for label in labels))
    for mode, by_label in summary["results"].items():
        cells = []
        for label in labels:
            nodes = [v for k, v in by_label[label].items() if k.startswith("node") and "slow" not in k]
            med = statistics.median([v["median_window_s"] for v in nodes if v["median_window_s"] is not None])
            mean = statistics.fmean([v["mean_window_s"] for v in nodes if v["mean_window_s"] is not None])
            cells.append(f"{med:.2f} s ({mean:.2f} s)")
        print(f"{mode:<10}" + "".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
