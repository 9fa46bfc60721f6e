"""Command-line arguments of ``lowband train``."""

from __future__ import annotations

import argparse
import json
import logging

from lowband.link import parse_bandwidth
from lowband.train.loop import TrainConfig, run_training
from lowband.train.methods import METHODS
from lowband.util import parse_bool, parse_duration

__all__ = ["add_arguments", "main", "config_from_args", "HP_FLAGS"]

# flag -> hyper-parameter name (each method accepts a subset; see METHODS).
HP_FLAGS = {
    "lr": "lr", "weight_decay": "weight_decay", "topk": "topk", "chunk": "chunk", "decay": "decay",
    "sign": "sign", "values": "values", "sync_every": "H", "outer_lr": "outer_lr",
    "outer_momentum": "outer_momentum", "group_size": "n", "alpha": "alpha", "beta": "beta", "gamma": "gamma",
    "clip": "clip", "overlap": "overlap", "delay": "delay",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--method", default=d.method, choices=list(METHODS),
                   help="; ".join(f"{m.name}: {m.description}" for m in METHODS.values()))
    g = p.add_argument_group("method hyper-parameters (default: the method's own; see docs)")
    g.add_argument("--lr", type=float, help="learning rate")
    g.add_argument("--weight-decay", type=float, help="decoupled weight decay")
    g.add_argument("--topk", type=int, help="DeMo/FlexDeMo: DCT coefficients kept per chunk")
    g.add_argument("--chunk", type=int, help="DeMo/FlexDeMo: DCT chunk size")
    g.add_argument("--decay", type=float, help="DeMo/FlexDeMo: momentum decay beta")
    g.add_argument("--sign", type=parse_bool, help="DeMo/FlexDeMo/Deto-Full: step with sign() (true/false)")
    g.add_argument("--values", choices=["bf16", "fp32", "sign", "int8", "int4"],
                   help="wire format of values: DeMo/FlexDeMo bf16|fp32|sign; DiLoCo/NoLoCo fp32|bf16|int8|int4")
    g.add_argument("--sync-every", type=int, help="DiLoCo/NoLoCo: inner steps H between outer steps")
    g.add_argument("--outer-lr", type=float, help="DiLoCo: outer learning rate (NoLoCo: --beta)")
    g.add_argument("--outer-momentum", type=float, help="DiLoCo: outer Nesterov momentum")
    g.add_argument("--group-size", type=int, help="NoLoCo: replicas per gossip group n")
    g.add_argument("--alpha", type=float, help="NoLoCo: momentum alpha")
    g.add_argument("--beta", type=float, help="NoLoCo: pseudo-gradient weight beta")
    g.add_argument("--gamma", type=float, help="NoLoCo: weight of the pull towards the group mean (default beta)")
    g.add_argument("--clip", type=float, help="DiLoCo/NoLoCo: inner gradient clipping norm")
    g.add_argument("--overlap", type=parse_bool, help="DeMo/FlexDeMo: apply each exchange one step later, overlapped "
                   "with the next step's compute; DiLoCo/NoLoCo: merge each outer step one inner step after "
                   "it starts (delay 1) (true/false)")
    g.add_argument("--delay", type=int, help="DiLoCo/NoLoCo: inner steps tau (1 <= tau < H) between the start of an "
                   "outer step's exchange and its merge (0: blocking)")
    g.add_argument("--hp", default=None, help="more hyper-parameters as JSON, e.g. '{\"beta1\": 0.9}'")

    m = p.add_argument_group("model and data")
    m.add_argument("--model", default=d.model, help="named size (t5-tiny, t5-mini, t5-small, gpt-mini, ...) "
                   "or a local model directory (config.json, optional weights)")
    m.add_argument("--data", default=None, help="local .jsonl/.csv/.txt file (default: embedded Wikipedia "
                   "lead paragraph -> description pairs)")
    m.add_argument("--val-data", default=None, help="separate validation file (same format as --data)")
    m.add_argument("--tokenizer", default=None, help="a tokenizer.json or its directory (default: train one "
                   "on the data, cached)")
    m.add_argument("--source-column", default=d.source_column)
    m.add_argument("--target-column", default=d.target_column)
    m.add_argument("--text-column", default=d.text_column)
    m.add_argument("--max-source-len", type=int, default=d.max_source_len, help="paper: 512")
    m.add_argument("--max-target-len", type=int, default=d.max_target_len, help="paper: 150")
    m.add_argument("--max-len", type=int, default=d.max_len, help="causal LM sequence length")
    m.add_argument("--vocab-size", type=int, default=d.vocab_size)
    m.add_argument("--val-size", type=float, default=d.val_size, help="validation examples (>= 1) or share (< 1)")
    m.add_argument("--max-examples", type=int, default=None, help="use at most this many examples")

    s = p.add_argument_group("link shaping (emulated slow links; real links need none)")
    s.add_argument("--link-bandwidth", type=parse_bandwidth, default=None, metavar="RATE",
                   help="shape traffic between nodes in-process to this uplink rate per node, e.g. 100mbit "
                        "(default: no shaping)")
    s.add_argument("--link-latency", type=parse_duration, default=d.link_latency_s, metavar="DURATION",
                   help="add this latency per message between nodes, e.g. 20ms (default: 0)")

    r = p.add_argument_group("run")
    r.add_argument("--steps", type=int, default=d.steps)
    r.add_argument("--batch-size", type=int, default=d.batch_size, help="examples per rank per micro-batch")
    r.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step "
                   "(the step equals one on a grad-accum-times larger batch; one intra-node reduce-scatter)")
    r.add_argument("--precision", choices=["fp32", "bf16"], default=d.precision, help="bf16: FSDP2 mixed "
                   "precision (bf16 parameters and compute, fp32 gradient reduction, fp32 optimizer state)")
    r.add_argument("--activation-checkpointing", action="store_true", help="recompute each transformer "
                   "block's activations in backward (less memory, about one more forward)")
    r.add_argument("--memory-profile", action="store_true", help="CPU: make glibc return freed memory so the "
                   "summary's per-phase peaks follow live memory (~25%% more CPU time)")
    r.add_argument("--seed", type=int, default=d.seed)
    r.add_argument("--shards", type=int, default=None, help="ranks sharding one model copy (default: all "
                   "ranks of a node; demo: 1)")
    r.add_argument("--schedule", choices=["constant", "cosine"], default=d.schedule)
    r.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    r.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    r.add_argument("--val-every", type=int, default=d.val_every, help="validate every N steps (0: per epoch)")
    r.add_argument("--val-batches", type=int, default=d.val_batches)
    r.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="DCP checkpoint every N steps (0: off)")
    r.add_argument("--ckpt-at-end", action="store_true", help="write a checkpoint after the last step")
    r.add_argument("--resume", default=None, help="checkpoint directory, or 'auto' for the newest in OUT")
    r.add_argument("--out", default=d.out, help="run directory")
    r.add_argument("--tensorboard", action="store_true")
    r.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    hp = {HP_FLAGS[k]: v for k, v in vars(args).items() if k in HP_FLAGS and v is not None}
    if args.hp:
        try:
            extra = json.loads(args.hp)
        except json.JSONDecodeError as e:
            raise ValueError(f"--hp must be a JSON object, e.g. '{{\"beta1\": 0.9}}': {e}") from e
        if not isinstance(extra, dict):
            raise ValueError("--hp must be a JSON object")
        hp.update(extra)
    val_size: float | int = args.val_size
    if val_size >= 1:
        val_size = int(val_size)
    return TrainConfig(
        method=args.method, hp=hp, model=args.model, data=args.data, val_data=args.val_data,
        tokenizer=args.tokenizer, source_column=args.source_column,
        target_column=args.target_column, text_column=args.text_column, max_source_len=args.max_source_len,
        max_target_len=args.max_target_len, max_len=args.max_len, vocab_size=args.vocab_size,
        val_size=val_size, max_examples=args.max_examples, steps=args.steps, batch_size=args.batch_size,
        seed=args.seed, shards=args.shards,
        grad_accum=args.grad_accum, precision=args.precision, activation_checkpointing=args.activation_checkpointing,
        memory_profile=args.memory_profile, schedule=args.schedule, warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio, val_every=args.val_every, val_batches=args.val_batches,
        ckpt_every=args.ckpt_every, ckpt_at_end=args.ckpt_at_end, resume=args.resume, out=args.out,
        link_bandwidth_bps=args.link_bandwidth, link_latency_s=args.link_latency,
        tensorboard=args.tensorboard, progress=not args.no_progress,
    )


def main(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    summary = run_training(cfg)
    if summary["rank"] == 0:
        print(json.dumps({k: summary[k] for k in ("method", "steps", "step_time_s", "comm_time_s",
                                                  "inter_node_bytes_per_step", "val_loss", "peak_rss_mb")}))
    return 0
