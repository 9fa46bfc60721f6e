"""Faults as a user would inject them by hand, on a fault-tolerant job of 3 nodes x 2 ranks on this machine.

Each scenario starts one Lighthouse and one torchrun per node (``lowband.cluster.ftjob``), then does
what a user at a terminal would: ``kill -9`` every process of a node, only its ranks, one rank, only
its torchrun agent; freezes a node (SIGSTOP, then SIGCONT: a hung machine or a link that drops for a
while); kills the same node again after it rejoined; kills two nodes at once; restarts nodes. Then it
checks what must hold:

- no hang: the job ends within its timeout;
- no lost run: every node that was running at the end exits 0;
- at most one step (DiLoCo/NoLoCo: one outer step) dropped per fault on each survivor;
- no quorum ever has more members than node slots (a slot never runs twice);
- the nodes that finished hold the same parameters, bit for bit (not NoLoCo: its replicas differ by design);
- nothing is left behind (no process of the job, orphans included).

    python benchmarks/ft_chaos.py                          # every scenario, every method
    python benchmarks/ft_chaos.py --methods flexdemo --scenarios twice

Figures are measured on this machine, one run each; the timing of a fault against a node's step is
whatever it happens to be, so repeated runs hit different moments.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMMON = ["--model", "t5-tiny", "--max-examples", "3000", "--val-size", "64", "--vocab-size", "512",
          "--batch-size", "4", "--val-batches", "2"]

METHODS = {
    "flexdemo": ["--method", "flexdemo", "--topk", "2"],
    "adamw": ["--method", "adamw"],
    "diloco": ["--method", "diloco", "--sync-every", "5"],
    "noloco": ["--method", "noloco", "--sync-every", "5"],
    "sparseloco": ["--method", "sparseloco", "--sync-every", "5"],
}

# Each action: (job step at which it is done, verb, node, argument). Steps are the job's (the most
# advanced running node), so an action lands wherever the nodes happen to be.
SCENARIOS = {
    # one node killed (all its processes), restarted, killed again, restarted again
    "twice": [(40, "kill", 2, "all"), (80, "start", 2, None), (140, "kill", 2, "all"), (180, "start", 2, None)],
    # a node killed again while it is still starting (before it joined), then started once more
    "early": [(40, "kill", 2, "all"), (80, "start", 2, None), (82, "kill", 2, "all"), (120, "start", 2, None)],
    # only the ranks die; the torchrun agent sees its workers fail and gives up; then restart
    "ranks": [(40, "kill", 1, "ranks"), (80, "start", 1, None)],
    # a single rank of a node dies: torchrun tears the node's other rank down
    "one-rank": [(40, "kill", 0, "rank"), (80, "start", 0, None)],
    # torchrun agent dies, its ranks are orphaned and keep training (or not); the node is started again
    "agent": [(40, "kill", 2, "agent"), (80, "start", 2, None)],
    # two of three nodes die at once; the last trains alone; both come back
    "two-nodes": [(40, "kill", 1, "all"), (40, "kill", 2, "all"), (80, "start", 1, None), (100, "start", 2, None)],
    # a node hangs for 15 s (SIGSTOP), then continues with stale state
    "freeze": [(40, "freeze", 1, 15.0)],
    # every node dies; all are started again and resume from their last checkpoint on disk
    "all": [(120, "kill", 0, "all"), (120, "kill", 1, "all"), (120, "kill", 2, "all"),
            (0, "start", 0, None), (0, "start", 1, None), (0, "start", 2, None)],
}

#: extra `lowband train` arguments of a scenario
EXTRA = {"all": ["--ckpt-every", "50", "--resume", "if-any"]}


def run_scenario(method: str, name: str, *, steps: int, out: Path, timeout_s: float) -> dict:
    from lowband.cluster._procs import descendants, is_alive
    from lowband.cluster.ftjob import FaultTolerantJob

    plan = list(SCENARIOS[name])
    args = [*METHODS[method], "--steps", str(steps), *COMMON, *EXTRA.get(name, [])]
    t0 = time.monotonic()
    result: dict = {"method": method, "scenario": name, "hang": False}
    with FaultTolerantJob(train_args=args, nodes=3, ranks_per_node=2, out=out) as job:
        job.start_all()
        deadline = t0 + timeout_s
        restarted: dict[int, int] = {}  # node -> its last recorded step when it was started again
        while True:
            # An action on a node that was started again waits until it trains (a kill of a node still
            # starting up is another scenario: "early").
            if plan and job.job_step() >= plan[0][0] and (
                    plan[0][2] not in restarted or job.steps_done(plan[0][2]) != restarted[plan[0][2]]
                    or name == "early"):
                at, verb, node, arg = plan.pop(0)
                print(f"  [{time.monotonic() - t0:6.1f} s] job step {job.job_step()}: {verb} node {node}"
                      f"{'' if arg is None else f' ({arg})'}", flush=True)
                if verb == "kill":
                    job.kill(node, arg)
                elif verb == "freeze":
                    job.freeze(node, arg)
                else:
                    p = job.procs[node]
                    while p.poll() is None and time.monotonic() < deadline:  # agent still winding down
                        time.sleep(0.2)
                    restarted[node] = job.steps_done(node)
                    job.start(node)
                continue
            running = [n for n, p in job.procs.items() if p.poll() is None]
            if not running and not plan:
                break
            if not running:
                result["error"] = f"every node exited before the plan finished (left: {plan})"
                break
            if time.monotonic() > deadline:
                result["hang"] = True
                break
            time.sleep(0.2)
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["exit"] = {n: p.poll() for n, p in job.procs.items()}
        all_pids = [p.pid for p in job.procs.values()] + [q for qs in job.orphans.values() for q in qs]
        events = job.events
    time.sleep(1.0)
    result["leftover"] = [p for p in descendants(all_pids)] + [
        p for qs in job.orphans.values() for p in qs if is_alive(p)]
    recs = {}
    for node in range(3):
        for rank in range(2):
            path = out / f"node{node}" / f"ft_rank{rank}.json"
            if path.exists():
                recs[(node, rank)] = json.loads(path.read_text())
    finished = [n for n, c in result["exit"].items() if c == 0]
    result["finished"] = finished
    result["dropped"] = {f"{n}.{r}": rec.get("dropped_steps") for (n, r), rec in recs.items()}
    result["heals"] = {f"{n}.{r}": [(h["step"], round(h.get("bytes", 0) / 1e6, 2), )
                                    for h in rec.get("healed", [])] for (n, r), rec in recs.items()}
    same = None
    if method != "noloco" and finished:
        same = all(len({recs[(n, r)]["param_sha256"] for n in finished if (n, r) in recs}) == 1 for r in range(2))
    result["params_equal"] = same
    most = 0  # the most live nodes any quorum had: more than the slots means a slot ran twice
    for node in range(3):
        path = out / f"node{node}" / "metrics.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            if '"membership"' in line:
                most = max(most, json.loads(line)["replicas"])
    result["most_replicas"] = most
    result["events"] = [{k: v for k, v in e.items() if k != "unix_s"} for e in events]
    faults = sum(1 for a in SCENARIOS[name] if a[1] in ("kill", "freeze"))
    ok = (not result["hang"] and "error" not in result and not result["leftover"]
          and all(c == 0 for n, c in result["exit"].items() if c is not None and c >= 0 and n in finished)
          and all(result["exit"][n] == 0 for n in _expected_alive(name))
          and all((d or 0) <= faults for d in result["dropped"].values())
          and same is not False and most <= 3)
    result["ok"] = ok
    return result


def _expected_alive(name: str) -> list[int]:
    """Nodes that must end with exit 0: every node whose last action is not a kill."""
    last = {}
    for _, verb, node, _arg in SCENARIOS[name]:
        last[node] = verb
    return [n for n in range(3) if last.get(n, "start") != "kill"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds before a scenario counts as hung")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ft_chaos_"))
    rows = []
    for method in args.methods:
        for name in args.scenarios:
            print(f"{method} / {name}: {SCENARIOS[name]}", flush=True)
            res = run_scenario(method, name, steps=args.steps, out=root / f"{method}-{name}", timeout_s=args.timeout)
            print(json.dumps(res, default=str), flush=True)
            rows.append(res)
    print("\n| method | scenario | ok | wall s | exit codes | dropped (node.rank) | heals (step, MB) | params equal |")
    print("|---|---|---|---:|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['scenario']} | {'yes' if r['ok'] else '**no**'} | {r['wall_s']} | {r['exit']} "
              f"| {r['dropped']} | {r['heals']} | {r['params_equal']} |")
    print(f"\nruns in {root}")
    (root / "chaos.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
