"""``lowband simulate``: model DiLoCo's all-reduce against NoLoCo's gossip for 2..1024 replicas, check it on emulated links."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from lowband.simulate.measure import MeasureSpec
from lowband.simulate.model import MAX_REPLICAS, SyncModel, default_replica_counts
from lowband.simulate.study import DEFAULT_OUT, SimulateConfig, run
from lowband.units import parse_bandwidth, parse_count, parse_duration, parse_int_list, parse_size

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``lowband simulate`` options to ``parser``."""
    m = parser.add_argument_group("model (MODELLED figures)")
    m.add_argument("--model-params", default="125e6", metavar="COUNT",
                   help="parameters of the model, e.g. 125e6, 125M, 1.3B (default: %(default)s, the NoLoCo paper's smallest)")
    m.add_argument("--bytes-per-param", type=float, default=4.0, metavar="BYTES",
                   help="bytes per parameter on the wire: 4 fp32, 2 bf16 (default: %(default)g)")
    m.add_argument("--bandwidth", default="1gbit", metavar="RATE",
                   help="each replica's link rate, e.g. 100mbit, 1gbit (default: %(default)s, 'the internet')")
    m.add_argument("--latency", default="50ms", metavar="DURATION",
                   help="fixed time per message, e.g. 50ms, 0.05 (seconds) (default: %(default)s)")
    m.add_argument("--sigma", type=float, default=0.5,
                   help="σ of the log-normal factor of each message time (mean 1); 0: deterministic (default: %(default)g)")
    m.add_argument("--group-size", type=int, default=2, metavar="N",
                   help="NoLoCo's group size n (default: %(default)s, pairs)")
    m.add_argument("--samples", type=int, default=2000, help="Monte Carlo samples per expectation (default: %(default)s)")
    m.add_argument("--seed", type=int, default=0, help="seed of the Monte Carlo and of NoLoCo's groups (default: %(default)s)")
    m.add_argument("--max-replicas", type=int, default=1024, metavar="N",
                   help="sweep N = 2, 4, 8, ... up to this (default: %(default)s)")
    m.add_argument("--replicas", default="", metavar="LIST",
                   help="also model these replica counts, e.g. 100,300")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help="writes simulate.json and simulate.png here (default: %(default)s)")
    g = parser.add_argument_group("measurement (MEASURED figures, on emulated links of this machine)")
    g.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                   help="measure at small N and print it beside the model (default: on; network namespaces "
                        "need root, else in-process shaping is used and said)")
    g.add_argument("--measure-nodes", default="4,8", metavar="LIST",
                   help="replica counts to measure, one emulated node and rank each (default: %(default)s)")
    g.add_argument("--measure-bandwidth", default="100mbit", metavar="RATE",
                   help="tbf rate of each emulated node's link (default: %(default)s)")
    g.add_argument("--measure-size", default="4MiB", metavar="SIZE",
                   help="all-reduce payload M for the measurement (NoLoCo sends 2M), e.g. 4MiB (default: %(default)s)")
    g.add_argument("--measure-reps", type=int, default=3, metavar="N", help="timed repetitions, median reported (default: %(default)s)")
    g.add_argument("--measure-timeout", type=float, default=180.0, metavar="SECONDS",
                   help="wall-clock limit of one N's launch (default: %(default)g)")


def config_from_args(args: argparse.Namespace) -> SimulateConfig:
    """Validate every option up front (before minutes of measuring) and build the configuration."""
    params = parse_count(args.model_params)
    if not (math.isfinite(args.bytes_per_param) and args.bytes_per_param > 0):
        raise ValueError(f"--bytes-per-param must be > 0 (4 for fp32, 2 for bf16), got {args.bytes_per_param}")
    if not 2 <= args.max_replicas <= MAX_REPLICAS:
        raise ValueError(f"--max-replicas must be in [2, {MAX_REPLICAS}], got {args.max_replicas}")
    extra = parse_int_list(args.replicas, what="--replicas", example="4,8", minimum=2, maximum=MAX_REPLICAS,
                           allow_empty=True)
    model = SyncModel(
        model_bytes=params * args.bytes_per_param,
        bandwidth_bps=parse_bandwidth(args.bandwidth),
        latency_s=parse_duration(args.latency),
        sigma=args.sigma,
        group_size=args.group_size,
        samples=args.samples,
        seed=args.seed,
    )
    counts = sorted(set(default_replica_counts(args.max_replicas)) | set(extra))
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory; give a directory")
    spec = None
    if args.measure:
        nodes = parse_int_list(args.measure_nodes, what="--measure-nodes", example="4,8", minimum=2, maximum=64,
                               allow_empty=True)
        spec = MeasureSpec(nodes=tuple(dict.fromkeys(nodes)), bandwidth_bps=parse_bandwidth(args.measure_bandwidth),
                           size_bytes=parse_size(args.measure_size), reps=args.measure_reps,
                           group_size=args.group_size, seed=args.seed, timeout_s=args.measure_timeout)  # fmt: skip
    return SimulateConfig(model=model, parameters=params, bytes_per_param=args.bytes_per_param,
                   replica_counts=counts, out_dir=args.out, measure=spec)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """``lowband simulate``: 0 on success, 1 when the measurement failed (the model is still written)."""
    cfg = config_from_args(args)
    result = run(cfg, command=sys.argv)
    return 1 if result["error"] else 0
