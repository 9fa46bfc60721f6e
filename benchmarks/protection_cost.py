"""What the protections of a job on the internet cost when nothing is wrong (issue 29: at most 5 % of step time at
100 Mbit/s + 50 ms, and robust aggregation within the seed spread of plain averaging).

One fault-tolerant job of 3 nodes x 1 rank on this machine per variant, side by side in one run, the variants
interleaved (A B C, then C B A, ...) so that the machine's drift falls on all of them alike:

- ``none``: no secret: an ungated Lighthouse, no tags, the papers' mean (the message checks are always on);
- ``secret``: the job's secret: every member's tag checked at every quorum, the Lighthouse behind its gate
  (every quorum and heartbeat through it);
- ``secret+agree``: and ``aggregate=agree``.

Every node's link is shaped in-process to the given bandwidth and latency (``--link-bandwidth``,
``--link-latency``: modelled on the link's clock, as in ``lowband bench --emulation shaped``). It prints the
mean step time of each variant (over nodes and repeats), its ratio to ``none`` and the final validation losses.

    python benchmarks/protection_cost.py                      # FlexDeMo Top-2, 100 Mbit/s + 50 ms, 2 repeats
    python benchmarks/protection_cost.py --method diloco --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMMON = ["--model", "t5-tiny", "--max-examples", "1500", "--val-size", "64", "--vocab-size", "512",
          "--batch-size", "4", "--val-batches", "2"]
METHODS = {"flexdemo": ["--method", "flexdemo", "--topk", "2"],
           "diloco": ["--method", "diloco", "--sync-every", "10"],
           "sparseloco": ["--method", "sparseloco", "--sync-every", "10"]}
VARIANTS = ("none", "secret", "secret+agree")


def summary(log: Path) -> dict:
    """The node's closing summary: the last line of its log that is a JSON object with ``step_time_s``."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{") and '"step_time_s"' in line:
            return json.loads(line)
    raise RuntimeError(f"no summary in {log}: the node did not finish; its log's end:\n{log.read_text()[-2000:]}")


def run(variant: str, args, out: Path) -> list[dict]:
    from lowband.cluster.ftjob import FaultTolerantJob
    from lowband.trust.secret import write_secret

    train = [*COMMON, *METHODS[args.method], "--steps", str(args.steps), "--link-bandwidth", str(args.bandwidth),
             "--link-latency", str(args.latency)]
    if variant.endswith("+agree"):
        train += ["--aggregate", "agree"]
    out.mkdir(parents=True, exist_ok=True)
    secret = write_secret(out / "job.secret") if variant != "none" else None
    with FaultTolerantJob(train_args=train, nodes=3, ranks_per_node=1, out=out, min_nodes=3,
                          secret_file=secret) as job:
        job.start_all()
        codes = job.wait(timeout_s=args.timeout)
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
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="lowband-protection-"))
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
    total, t0 = args.repeats * len(VARIANTS), time.monotonic()
    k = 0
    for r in range(args.repeats):
        for v in (VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))):
            k += 1
            left = "" if k == 1 else f", about {(time.monotonic() - t0) / (k - 1) * (total - k + 1):.0f} s left"
            print(f"[{k}/{total}] {v}, repeat {r + 1}{left}", flush=True)
            recs = run(v, args, root / f"{v.replace('+', '-')}-r{r}")
            steps[v] += [rec["step_time_s"] for rec in recs]
            losses[v] += [rec["val_loss"] for rec in recs[:1]]  # the replicas are identical (FlexDeMo, DiLoCo)
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
