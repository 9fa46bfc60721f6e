"""Made-up run records (a loss curve, a step time, bytes per step) for the quality and report tests."""

from __future__ import annotations

from lowband.bench.record import RunRecord
from lowband.comm.traffic import OpTally


def val_history(losses, *, dt=2.0, tokens=1000, every=10):
    return [{"step": i * every, "epoch": 0, "tokens": i * tokens, "train_time_s": i * dt, "wall_s": i * dt + 5,
             "val_loss": v} for i, v in enumerate(losses)]  # fmt: skip


def run_record(method, losses, *, seed=0, label=None, params=None, dt=2.0, bw=1e8, nbytes=1e6, compute=0.1, ops=1):
    params = dict(params or {})
    history = val_history(losses, dt=dt)
    steps = history[-1]["step"]
    return RunRecord(
        id=f"{method}-{seed}", label=label or method, method=method, params=params, shards=2,
        hyperparameters={"lr": params.get("lr", 1e-3)}, seed=seed, status="ok", bandwidth_bps=bw,
        latency_s=0.05, nodes=2, ranks_per_node=2, replicas=2, steps=steps,
        val_loss=losses[-1], val_history=history, train_time_s=history[-1]["train_time_s"], step_time_s=compute + 0.5, compute_time_s=compute,
        inter_node_bytes_per_step=nbytes, link_ops={"all_gather": OpTally(count=4 * steps * ops)},
    )  # fmt: skip
