"""The fake trainer of the bench tests, and the helpers that run it.

A script that writes the files ``lowband train`` writes (per-rank summaries and rank 0's
metrics.jsonl) stands in for the training entry point, so that planning, launching, aggregation,
failure handling, tables and plots are tested on their own; ``in_process_launcher`` runs it for
every rank in the test's own process. The ``fake_trainer`` fixture (tests/bench/conftest.py)
writes it to a file.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import lowband.commands.bench as bench

# The fake trainer. It reads only what the bench passes and writes what the contract promises.
# Bytes per step and step time follow the method, so tables have distinct, checkable numbers.
FAKE_TRAINER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    from lowband.train.summary import RunSummary

    from lowband.train.args import parse_train_args

    def main(args, env):
        assert args[0] == "train", args
        cfg = parse_train_args(args[1:])  # the run's config file, --out beside it
        method, out, steps = cfg.method.name, Path(cfg.run.out), cfg.schedule.steps
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        per_node = int(env["LOCAL_WORLD_SIZE"])
        if method in env.get("FAKE_FAIL_METHODS", "").split(","):
            print(f"RuntimeError: fake trainer: {method} blew up on purpose", file=sys.stderr, flush=True)
            return 1
        if method in env.get("FAKE_HANG_METHODS", "").split(","):
            out.mkdir(parents=True, exist_ok=True)
            (out / f"started-{rank}").touch()
            __import__("time").sleep(300)
        shards = cfg.model.shards
        topk, chunk = getattr(cfg.method.hp, "topk", None), getattr(cfg.method.hp, "chunk", None)
        bw = cfg.link.bandwidth_bps or 1e8  # shaping is in the run's configuration
        per_rank = {"adamw": 1e6, "deto-full": 1e6}.get(method, 3.0 * (topk or 1) * 1e6 / 128)
        per_rank = per_rank * 2 / shards  # smaller shards: more of them cross per node
        comm = per_rank * per_node * 8 / bw
        node = rank // per_node
        total = steps  # the loss falls over the run's (most) steps
        if cfg.schedule.time_budget_s is not None:  # stop at the first step past the budget, as the trainer does
            steps = min(steps, int(cfg.schedule.time_budget_s // (0.1 + comm)) + 1)
        # Loss falls with the step, faster for FlexDeMo-family methods (so targets are reached at known steps).
        rate = 1.5 if method in ("flexdemo", "demo") else 1.0
        history = [{"step": s, "epoch": 0, "tokens": 100 * s, "train_time_s": (0.1 + comm) * s, "wall_s": 0.5 * s,
                    "val_loss": 5.0 - rate * s / total} for s in [*range(0, steps, max(1, steps // 3)), steps]]
        if env.get("FAKE_BEST_LR"):  # the loss grows with the lr's distance (in decades) from this one
            import math

            lr = float(getattr(cfg.method.hp, "lr", None) or 1e-3)
            best = float(env["FAKE_BEST_LR"])
            if env.get("FAKE_BEST_LR_FROM"):  # "STEPS:LR": runs of at least STEPS steps are best at LR instead
                at, other = env["FAKE_BEST_LR_FROM"].split(":")
                best = float(other) if steps >= int(at) else best
            offset = 0.2 * math.log10(lr / best) ** 2
            if env.get("FAKE_PLATEAU"):  # "STEPS:LR": runs under STEPS steps end, at every lr above LR, level with
                at, edge = env["FAKE_PLATEAU"].split(":")  # LR's loss but 0.001 lower per decade (a near-tie that
                if steps < int(at) and lr > float(edge):  # favours large lrs, as AdamW's short runs on the frontier)
                    offset = 0.2 * math.log10(float(edge) / best) ** 2 - 0.001 * math.log10(lr / float(edge))
            history = [{**h, "val_loss": h["val_loss"] + offset} for h in history]
        if env.get("FAKE_SEED_NOISE"):  # each seed ends this much higher than the one before (a seed spread)
            history = [{**h, "val_loss": h["val_loss"] + float(env["FAKE_SEED_NOISE"]) * cfg.run.seed} for h in history]
        summary = {
            "rank": rank, "node": node, "method": method, "topk": topk, "chunk": chunk, "shards": shards,
            "nodes": world // per_node, "ranks_per_node": per_node, "replicas": world // shards,
            "steps": steps, "model": cfg.model.name, "num_params": 1234, "status": "ok", "batch_size": 8,
            "hp": {"lr": 0.001, "topk": topk, "chunk": chunk},
            "step_time_s": 0.1 + comm, "compute_time_s": 0.1, "comm_time_s": comm,
            "inter_node_bytes_per_step": per_rank, "node_inter_node_bytes_per_step": per_rank * per_node,
            "link_ops": {"all_gather": {"count": steps, "bytes": int(per_rank * steps),
                                        "inter_node_bytes": int(per_rank * steps), "largest_group": world // shards}},
            "peak_rss_mb": 100.0 + rank, "val_loss": history[-1]["val_loss"], "val_history": history,
            "train_time_s": history[-1]["train_time_s"], "tokens": 100 * steps,
            "train_loss": 4.0, "shaping": {"bandwidth_bps": bw, "latency_s": 0.0},
            "start_step": 0, "data": "fake", "grad_accum": 1, "precision": "fp32", "activation_checkpointing": False,
            "memory": {}, "exposed_comm_time_s": comm, "sync_time_s": None, "outer_steps": None,
            "screened": json.loads(env.get("FAKE_SCREENED") or "{}"),
            "wall_time_s": 1.0, "config": {},
        }
        out.mkdir(parents=True, exist_ok=True)
        RunSummary(**summary).write(out)  # the trainer's schema: a missing field fails here
        if rank == 0:
            with open(out / "metrics.jsonl", "w") as f:
                for point in history:
                    f.write(json.dumps({"type": "val", **point}) + "\\n")
        return 0

    if __name__ == "__main__":
        sys.exit(main(sys.argv[1:], os.environ))
    """
)


def load_fake(path: Path):
    namespace: dict = {"__name__": "fake_trainer"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["main"]


def in_process_launcher(fake_main, calls: list):
    """A stand-in for launch_nodes: runs the fake trainer's main for every rank, in this process."""

    def launch(*, num_nodes, ranks_per_node, module_args, env, net, timeout_s, log_dir, **entry):
        calls.append(list(module_args))
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        world = num_nodes * ranks_per_node
        rcs = []
        for node in range(num_nodes):
            rc = 0
            for local in range(ranks_per_node):
                rank_env = {**os.environ, **env, "RANK": str(node * ranks_per_node + local),
                            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(ranks_per_node)}  # fmt: skip
                rc = rc or fake_main(list(module_args), rank_env)
            rcs.append(rc)
        logs = [Path(log_dir) / f"node{i}.log" for i in range(num_nodes)]
        for p in logs:
            p.write_text("fake log\n")
        ok = all(rc == 0 for rc in rcs)
        return SimpleNamespace(
            ok=ok, wall_time_s=0.01, returncodes=rcs, log_paths=logs, timed_out=False, killed=[False] * num_nodes,
            failure_message=lambda: "" if ok else f"node 0: exit status 1; last lines:\nfake failure {rcs}",
        )  # fmt: skip

    return launch


def bench_args(*argv: str) -> argparse.Namespace:
    """Parsed ``lowband bench`` options; equal steps (``--time-budget off``) unless the test gives a budget,
    so tests of other things keep their step counts (the CLI's default is ``auto``: tests/bench/test_timebudget.py)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = list(argv)
    if "--time-budget" not in argv:
        argv += ["--time-budget", "off"]
    return parser.parse_args(argv)
