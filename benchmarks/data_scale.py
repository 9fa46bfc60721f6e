"""Data at scale (issue 46, item 2): the token store of a large corpus against the embedded corpus.

For each corpus size (``--sizes``, default ``100MB,1GB``):

1. **A corpus** of that size: a ``.txt`` of seeded random documents (one per line, 5 to ~600 words,
   log-normal lengths), the words drawn from the embedded corpus's word frequencies. Written once
   under ``--corpus-dir`` (default ``runs/data_scale/corpus``; never committed) and reused.
2. **The one-time tokenisation**, in a fresh process, into an empty store folder: the tokenizer
   trained on the first ``--tokenizer-sample`` of documents, then every document encoded. Reported:
   the tokenizer's training time, the encoding time and its throughput (MB of text per second), the
   whole time, the process's CPU time (MB per CPU-second: what a machine shared with others does not
   change), its peak RSS.
3. **Warm starts**, one rank: ``lowband train`` (gpt-tiny, ``--steps`` steps) on the store and,
   with the same flags, on the embedded corpus (its caches warm too), alternating, ``--repeats``
   times each: the time from launch to the first step's record in ``metrics.jsonl``, and the peak
   RSS (``summary_rank0.json``).
4. **2 nodes x 2 ranks** (``--mesh``, default on): the same two runs under
   ``torchrun --nproc-per-node 4`` with ``--shards 2``: launch to first step, peak RSS of every rank.

It prints a table and writes ``results.json`` to ``--out`` (default ``runs/data_scale``). The
figures of the 2-core development machine are in ``benchmarks/README.md``.

    python benchmarks/data_scale.py                       # 100MB and 1GB: tens of minutes on 2 cores
    python benchmarks/data_scale.py --sizes 20MB --steps 2 --no-mesh   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowband.units import format_bytes, parse_size  # noqa: E402


def make_corpus(path: Path, size_bytes: int, seed: int) -> Path:
    """A .txt of seeded random documents, words drawn from the embedded corpus's word frequencies."""
    if path.is_file() and path.stat().st_size >= size_bytes:
        return path
    from lowband.train.data import default_corpus_texts

    counts = Counter(w for t in default_corpus_texts() for w in t.split())
    words = np.array(list(counts), dtype=object)
    p = np.array(list(counts.values()), dtype=np.float64)
    cdf = np.cumsum(p / p.sum())
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    t0 = time.perf_counter()
    with tmp.open("w", encoding="utf-8") as f:
        while written < size_bytes:
            lengths = np.clip(rng.lognormal(np.log(90), 0.7, size=4000).astype(np.int64), 5, 600)
            picks = words[np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(words) - 1)]
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            chunk = "\n".join(" ".join(picks[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)) + "\n"
            f.write(chunk)
            written += len(chunk.encode("utf-8"))
    tmp.replace(path)
    print(f"wrote {path} ({format_bytes(written)}) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


_TOKENIZE = """
import json, logging, resource, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
t0 = time.perf_counter()
from lowband.train.data import DataConfig, open_stores
store, _ = open_stores(DataConfig(path=sys.argv[1], kind="causal", store_dir=sys.argv[2],
                                  tokenizer_sample_bytes=int(sys.argv[3])))
index = store.index
print(json.dumps({"wall_s": time.perf_counter() - t0, "store": str(store.path),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime
                  + resource.getrusage(resource.RUSAGE_SELF).ru_stime,
                  "tokenizer_s": index["tokenizer_s"], "encode_s": index["encode_s"], "documents": index["documents"],
                  "tokens": index["tokens"]["text"], "input_bytes": index["input_bytes"],
                  "store_bytes": sum(f.stat().st_size for f in store.path.iterdir())}))
"""


def tokenize(corpus: Path, store_dir: Path, sample_bytes: int, env: dict[str, str]) -> dict:
    """Build the store in a fresh process, from an empty folder and an empty tokenizer cache."""
    shutil.rmtree(store_dir, ignore_errors=True)
    cache = store_dir.with_name(store_dir.name + "-cache")
    shutil.rmtree(cache, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", _TOKENIZE, str(corpus), str(store_dir), str(sample_bytes)],
                          env={**env, "LOWBAND_CACHE": str(cache)}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tokenisation failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["encode_mb_s"] = out["input_bytes"] / 1e6 / max(out["encode_s"], 1e-9)
    out["total_mb_s"] = out["input_bytes"] / 1e6 / max(out["wall_s"], 1e-9)
    # Throughput per CPU-second does not depend on what else runs on a shared machine.
    out["mb_per_cpu_s"] = out["input_bytes"] / 1e6 / max(out["cpu_s"], 1e-9)
    return out


def train_run(out: Path, *, data: Path | None, store_dir: Path, ranks: int, steps: int, env: dict[str, str],
              timeout_s: float) -> dict:
    """One ``lowband train``: seconds from launch to the first step's record, and every rank's peak RSS."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    args = ["train", "--model", "gpt-tiny", "--steps", str(steps), "--batch-size", "8", "--val-batches", "1",
            "--no-progress", "--out", str(out), "--store-dir", str(store_dir)]
    if data is not None:
        args += ["--data", str(data)]
    if ranks == 1:
        argv = [sys.executable, "-m", "lowband", *args, "--method", "adamw"]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
                str(ranks), "--max-restarts", "0", "-m", "lowband", *args, "--shards", "2"]
    log = (out / "run.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    first = None
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and time.perf_counter() - t0 < timeout_s:
        if first is None and metrics.exists() and '"type": "train"' in metrics.read_text():
            first = time.perf_counter() - t0
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        raise RuntimeError(f"{argv} ran past {timeout_s} s; see {out / 'run.log'}")
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed ({proc.returncode}):\n{(out / 'run.log').read_text()[-3000:]}")
    if first is None:  # the run ended between two polls
        first = time.perf_counter() - t0
    rss = [json.loads((out / f"summary_rank{r}.json").read_text())["peak_rss_mb"] for r in range(ranks)]
    return {"first_step_s": first, "wall_s": time.perf_counter() - t0, "peak_rss_mb": rss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100MB,1GB", help="corpus sizes, comma-separated (default 100MB,1GB)")
    p.add_argument("--corpus-dir", type=Path, default=ROOT / "runs" / "data_scale" / "corpus")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "data_scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokenizer-sample", default="32MB")
    p.add_argument("--no-mesh", dest="mesh", action="store_false", help="skip the 2 nodes x 2 ranks runs")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--repeats", type=int, default=2, help="runs of each warm start (store and embedded alternate)")
    p.add_argument("--keep-store", action="store_true",
                   help="reuse a store already in --out (and its tokenisation figures in results.json)")
    args = p.parse_args()
    sample = parse_size(args.tokenizer_sample)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOWBAND_CACHE": str(args.out / "cache"), "OMP_NUM_THREADS": "1"}
    before_path = args.out / "results.json"
    before = json.loads(before_path.read_text())["sizes"] if before_path.is_file() else {}
    results: dict = {"machine": {"cpus": os.cpu_count()}, "sizes": {}}
    mesh = [1, 4] if args.mesh else [1]
    for ranks in mesh:  # the embedded corpus's caches, warm as the store will be
        train_run(args.out / "warmup", data=None, store_dir=args.out / "none", ranks=ranks, steps=1, env=env,
                  timeout_s=args.timeout)
    for size_text in args.sizes.split(","):
        size = parse_size(size_text)
        corpus = make_corpus(args.corpus_dir / f"corpus-{size_text}-seed{args.seed}.txt", size, args.seed)
        store_dir = args.out / f"stores-{size_text}"
        row: dict = {"corpus": str(corpus), "corpus_bytes": corpus.stat().st_size}
        if args.keep_store and store_dir.is_dir() and size_text in before:
            row["tokenize"] = before[size_text]["tokenize"]
        else:
            row["tokenize"] = tokenize(corpus, store_dir, sample, env)
        print(f"{size_text}: tokenised {row['tokenize']}", flush=True)
        # Store and embedded runs alternate, so that both see the same load of this shared machine.
        for ranks in mesh:
            for rep in range(args.repeats):
                for name, data in (("store", corpus), ("embedded", None)):
                    run = train_run(args.out / f"{name}-{size_text}-{ranks}", data=data, store_dir=store_dir,
                                    ranks=ranks, steps=args.steps, env=env, timeout_s=args.timeout)
                    row.setdefault(f"{name}-{ranks}", []).append(run)
                    print(f"{size_text}, {name}, {ranks} rank(s), repeat {rep}: {run}", flush=True)
        results["sizes"][size_text] = row
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| corpus | tokenizer s | encode s | encode MB/s | ranks | first step s, store / embedded (median) | "
          "peak RSS MB of the largest rank, store / embedded (median) |")
    print("|---|---:|---:|---:|---:|---|---|")
    for row in results["sizes"].values():
        tok = row["tokenize"]
        for ranks in mesh:
            s, e = row[f"store-{ranks}"], row[f"embedded-{ranks}"]

            def med(runs, key):
                return float(np.median([r[key] if key == "first_step_s" else max(r[key]) for r in runs]))

            print(f"| {format_bytes(row['corpus_bytes'])} | {tok['tokenizer_s']:.0f} | {tok['encode_s']:.0f} | "
                  f"{tok['encode_mb_s']:.2f} | {ranks} | {med(s, 'first_step_s'):.1f} / {med(e, 'first_step_s'):.1f} "
                  f"| {med(s, 'peak_rss_mb'):.0f} / {med(e, 'peak_rss_mb'):.0f} |")
    print(f"\nresults: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
