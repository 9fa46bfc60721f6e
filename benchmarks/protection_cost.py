"""What the protections of a job on the internet cost when nothing is wrong (issue 29: at most 5 % of step time at
100 Mbit/s + 50 ms, and robust aggregation within the seed spread of plain averaging).

One fault-tolerant job of 3 nodes x 1 rank on this machine per variant, side by side in one run, the variants
interleaved (A B C, then C B A, ...) so that the machine's drift falls on all of them alike:

- ``none``: no secret: an ungated Lighthouse, no tags, the papers' mean (the message checks are always on);
- ``secret``: the job's secret: every member's tag checked at every quorum, the Lighthouse behind its gate
  (every quorum and heartbeat through it);
- ``secret+roster``: and per-member keys (``lowband secret --nodes``, ``--key-file``, ``--roster``): each node's
  process registered at the gate with a signed claim, every quorum and heartbeat checked against it;
- ``secret+agree``: and ``aggregate=agree``.

Every node's link is shaped in-process to the given bandwidth and latency (``--link-bandwidth``,
``--link-latency``: modelled on the link's clock, as in ``lowband bench --emulation shaped``). It prints the
mean step time of each variant (over nodes and repeats), its ratio to ``none`` and the final validation losses.

With ``--flood`` the variants are instead (issue 44: a flood of refused calls from one other process may slow the job
by at most 20 % beyond the CPU the flooder itself takes):

- ``secret``: as above;
- ``secret+flood``: and one more process on this machine that sends the Lighthouse's gate an outsider's Quorum
  request after another, as fast as it can, for the whole run (every one refused); its CPU time and wall time
  are recorded;
  (``--flood-per-connection N``: over a new connection every N calls, as a flooder that would get past a limit
  per connection does);
- ``secret+hog``: and one CPU-bound process that burns as much CPU as the flooder did (its measured share of a
  core, in slices of a millisecond), so that what the flood costs beyond its own CPU use shows as flood against
  hog.

    python benchmarks/protection_cost.py                      # FlexDeMo Top-2, 100 Mbit/s + 50 ms, 2 repeats
    python benchmarks/protection_cost.py --method diloco --repeats 3
    python benchmarks/protection_cost.py --flood              # secret, secret+flood, secret+hog
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMON = ["--model", "t5-tiny", "--max-examples", "1500", "--val-size", "64", "--vocab-size", "512",
          "--batch-size", "4", "--val-batches", "2"]
METHODS = {"flexdemo": ["--method", "flexdemo", "--topk", "2"],
           "diloco": ["--method", "diloco", "--sync-every", "10"],
           "sparseloco": ["--method", "sparseloco", "--sync-every", "10"]}
VARIANTS = ("none", "secret", "secret+roster", "secret+agree")
FLOOD_VARIANTS = ("secret", "secret+flood", "secret+hog")

# An outsider that asks the gate for a quorum again and again until SIGTERM, then prints its CPU and wall time.
FLOODER = r"""
import json, signal, sys, threading, time
import grpc
from lowband.ft.gateway import QUORUM, admission_request
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
request = admission_request("lowband_f00d_node1:outsider", "http://127.0.0.1:1", "127.0.0.1:2")
per_connection = int(sys.argv[2])  # calls over one connection before the next (0: one connection for all)
threads = int(sys.argv[3])  # threads calling at once, each over connections of its own
counts = [0] * threads
def flood(k):
    while not stop:
        # a channel of its own (no subchannel shared with another): a new connection
        with grpc.insecure_channel(sys.argv[1].split("://", 1)[-1],
                                   options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            call = ch.unary_unary(QUORUM)
            n = 0
            while not stop and (per_connection == 0 or n < per_connection):
                try:
                    call(request, timeout=5)
                except grpc.RpcError:
                    pass
                counts[k] += 1
                n += 1
t0, cpu0 = time.monotonic(), time.process_time()  # after the imports: the flood's own CPU only
workers = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(threads)]
for w in workers:
    w.start()
while not stop:
    time.sleep(0.05)
for w in workers:
    w.join(10)
calls = sum(counts)
print(json.dumps({"calls": calls, "cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - t0}), flush=True)
"""
# A process that burns ``duty`` of one core (its CPU time kept at duty x its wall time, in slices of a millisecond)
# until SIGTERM, then prints its CPU and wall time.
HOG = r"""
import json, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
duty, t0, cpu0 = min(1.0, float(sys.argv[1])), time.monotonic(), time.process_time()
while not stop:
    if time.process_time() - cpu0 < duty * (time.monotonic() - t0):
        t = time.thread_time()
        while time.thread_time() - t < 0.001:
            pass
    else:
        time.sleep(0.001)
print(json.dumps({"cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - t0}), flush=True)
"""


def summary(log: Path) -> dict:
    """The node's closing summary: the last line of its log that is a JSON object with ``step_time_s``."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{") and '"step_time_s"' in line:
            return json.loads(line)
    raise RuntimeError(f"no summary in {log}: the node did not finish; its log's end:\n{log.read_text()[-2000:]}")


def _side(code: str, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, text=True, env=env)


def _stop(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1])


def run(variant: str, args, out: Path, side: dict) -> list[dict]:
    """One job of ``variant``; ``side`` carries the flooder's CPU share (a core's fraction) to the hog, and gets
    the side process's own record."""
    from lowband.cluster.ftjob import FaultTolerantJob
    from lowband.trust.keys import write_keys
    from lowband.trust.secret import write_secret

    train = [*COMMON, *METHODS[args.method], "--steps", str(args.steps), "--link-bandwidth", str(args.bandwidth),
             "--link-latency", str(args.latency)]
    if variant.endswith("+agree"):
        train += ["--aggregate", "agree"]
    out.mkdir(parents=True, exist_ok=True)
    secret = write_secret(out / "job.secret") if variant != "none" else None
    if variant.endswith("+roster"):
        write_keys(secret, 3)
    with FaultTolerantJob(train_args=train, nodes=3, ranks_per_node=1, out=out, min_nodes=3,
                          secret_file=secret, roster=variant.endswith("+roster")) as job:
        extra = (_side(FLOODER, job.address, str(args.flood_per_connection), str(args.flood_threads))
                 if variant.endswith("+flood") else
                 _side(HOG, str(side.get("duty", 1.0))) if variant.endswith("+hog") else None)
        try:
            job.start_all()
            codes = job.wait(timeout_s=args.timeout)
        finally:
            if extra is not None:
                record = _stop(extra)
                side[variant] = record
                if variant.endswith("+flood"):
                    side["duty"] = record["cpu_s"] / max(record["wall_s"], 1e-9)
    if any(c != 0 for c in codes.values()):
        raise RuntimeError(f"{variant}: nodes exited {codes}; see {out}")
    return [summary(out / f"node{i}.log") for i in range(3)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=sorted(METHODS), default="flexdemo")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--bandwidth", type=float, default=100e6, help="bits per second (default 100 Mbit/s)")
    p.add_argument("--latency", type=float, default=0.05, help="seconds per message (default 50 ms)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--flood", action="store_true",
                   help="compare a flood of refused calls to the gate with a CPU-bound process of the same CPU use")
    p.add_argument("--flood-per-connection", type=int, default=0, metavar="N",
                   help="with --flood: the flooder opens a new connection after every N calls (default 0: one "
                        "connection for the whole flood)")
    p.add_argument("--flood-threads", type=int, default=1, metavar="N",
                   help="with --flood: N threads of the flooder call at once, each over connections of its own")
    args = p.parse_args()
    variants = FLOOD_VARIANTS if args.flood else VARIANTS
    root = args.out or Path(tempfile.mkdtemp(prefix="lowband-protection-"))
    steps: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    side: dict = {}
    sides: dict[str, list[dict]] = {v: [] for v in variants}
    total, t0 = args.repeats * len(variants), time.monotonic()
    k = 0
    for r in range(args.repeats):
        # the flood runs before the hog in the first repeat: the hog burns what the flooder took
        for v in (variants if r % 2 == 0 else tuple(reversed(variants))):
            k += 1
            left = "" if k == 1 else f", about {(time.monotonic() - t0) / (k - 1) * (total - k + 1):.0f} s left"
            print(f"[{k}/{total}] {v}, repeat {r + 1}{left}", flush=True)
            recs = run(v, args, root / f"{v.replace('+', '-')}-r{r}", side)
            steps[v] += [rec["step_time_s"] for rec in recs]
            losses[v] += [rec["val_loss"] for rec in recs[:1]]  # the replicas are identical (FlexDeMo, DiLoCo)
            if v in side:
                sides[v].append(side.pop(v))
    if args.flood:
        base = statistics.fmean(steps["secret"])
        print(f"\n{args.method}, 3 nodes x 1 rank, {args.steps} steps, link {args.bandwidth / 1e6:g} Mbit/s + "
              f"{args.latency * 1e3:g} ms; {args.repeats} repeats, interleaved. Runs: {root}\n")
        print("| variant | s/step | ratio to secret | the side process: CPU share of a core, calls |")
        print("|---|---:|---:|---|")
        for v in variants:
            m = statistics.fmean(steps[v])
            what = "; ".join(f"{x['cpu_s'] / x['wall_s']:.2f}" + (f", {x['calls']} calls" if "calls" in x else "")
                             for x in sides[v])
            print(f"| {v} | {m:.4f} | {m / base:.3f} | {what} |")
        gap = (statistics.fmean(steps["secret+flood"]) - statistics.fmean(steps["secret+hog"])) / base
        print(f"\nthe flood beyond its own CPU use: {100 * gap:+.1f} % of the step (goal: at most +20 %)")
        return 0
    base = statistics.fmean(steps["none"])
    print(f"\n{args.method}, 3 nodes x 1 rank, {args.steps} steps, link {args.bandwidth / 1e6:g} Mbit/s + "
          f"{args.latency * 1e3:g} ms (shaped in-process); {args.repeats} repeats, interleaved. Runs: {root}\n")
    print("| variant | s/step (mean of nodes and repeats) | ratio to none | final val loss per repeat |")
    print("|---|---:|---:|---|")
    for v in VARIANTS:
        m = statistics.fmean(steps[v])
        print(f"| {v} | {m:.4f} | {m / base:.3f} | {', '.join(f'{x:.4f}' for x in losses[v])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
