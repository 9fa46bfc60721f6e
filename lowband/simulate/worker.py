"""One rank of ``lowband simulate``'s measurement: times DiLoCo's all-reduce and NoLoCo's exchange.

Run by torchrun on every emulated node (one rank per node)::

    python -m torch.distributed.run ... -m lowband.simulate.worker --size-bytes 4194304 --out times.json

Through :class:`lowband.comm.link.Link` on ``Topology(num_nodes=W, ranks_per_node=1)`` each rank

1. warms up: one full-size all-reduce and one full-size exchange (not timed);
2. probes the per-message latency: ``probes`` back-to-back exchanges of one float with its
   NoLoCo peer(s), and ``probes`` all-reduces of 2·W floats (every ring segment non-empty);
3. ``reps`` times, each after a barrier: an all-reduce of ``size_bytes`` (DiLoCo's pseudo-gradient,
   M), then an exchange of 2·M (NoLoCo's φ and θ−φ) with the members of its group from
   :func:`lowband.optim.outer.groups.noloco_groups` for outer step ``rep + 1``, then (diagnostic)
   the same ``batch_isend_irecv`` as ``Link.exchange`` with the receives listed before the sends.

Why the diagnostic: gloo's TCP transport sends a message only after the receiver announced its
posted receive (NOTIFY_RECV_READY), and that announcement joins the same per-peer write queue as
the data. When both ends post the send first (as ``Link.exchange`` does) and one end's data is
already queued, its receive announcement waits behind its whole message: the two directions then
run one after the other and the exchange takes up to twice as long as the link needs. Posting
receives first avoids it.

Rank 0 gathers every rank's times and writes them to ``--out`` as JSON. Times are wall-clock
seconds on each rank (``time.perf_counter``), from the end of the barrier to the end of the op.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from lowband.comm.link import Link
from lowband.distributed.topology import Topology
from lowband.optim.outer.groups import noloco_groups
from lowband.util import atomic_path

__all__ = ["main", "measure"]

log = logging.getLogger(__name__)

ELEMENT_BYTES = 4  # float32


def measure(*, size_bytes: int, reps: int, group_size: int, seed: int, probes: int,
            bandwidth_bps: float | None = None, latency_s: float = 0.0) -> dict[str, Any]:
    """Time the operations on this rank (process group already initialised); return its record."""
    import torch  # heavy: a command that does not train must not pay for it
    import torch.distributed as dist  # heavy: a command that does not train must not pay for it


    world, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology(num_nodes=world, ranks_per_node=1)
    topo.check_launch()
    link = Link(topo, bandwidth_bps=bandwidth_bps, latency_s=latency_s)
    numel = size_bytes // ELEMENT_BYTES
    grad = torch.ones(numel)  # DiLoCo: the pseudo-gradient, M bytes
    message = torch.ones(2 * numel)  # NoLoCo: φ and θ−φ in one message, 2·M bytes

    def peers(outer_index: int) -> list[int]:
        groups = noloco_groups(world, group_size, seed=seed, outer_index=outer_index)
        return [r for r in next(g for g in groups if rank in g) if r != rank]

    def timed(fn) -> float:  # noqa: ANN001 - a zero-argument callable
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # 1. warm-up: connections, buffers, TCP windows.
    link.all_reduce(grad)
    link.exchange(message, peers(0))

    # 2. latency probes, back to back (a pair paces itself; the first absorbs the start skew).
    tiny = torch.zeros(1)
    tiny_ring = torch.zeros(2 * world)
    first = peers(0)
    dist.barrier()
    tiny_exchange_s = [timed(lambda: link.exchange(tiny, first)) for _ in range(probes)]
    dist.barrier()
    tiny_all_reduce_s = [timed(lambda: link.all_reduce(tiny_ring, op="sum")) for _ in range(probes)]

    def exchange_receive_first(p: list[int]) -> None:
        # Link.exchange's operations exactly, fresh buffers included, with the receives listed first.
        received = [torch.empty_like(message) for _ in p]
        ops = [dist.P2POp(dist.irecv, buf, q) for q, buf in zip(p, received, strict=True)]
        ops += [dist.P2POp(dist.isend, message, q) for q in p]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    # The diagnostic bypasses the link: under in-process shaping it would not be shaped.
    diagnose = not link.shaping
    if diagnose:
        exchange_receive_first(first)  # warm-up of this path too

    # 3. the timed operations.
    all_reduce_s, exchange_s, exchange_receive_first_s, exchange_peers = [], [], [], []
    for rep in range(reps):
        dist.barrier()
        all_reduce_s.append(timed(lambda: link.all_reduce(grad)))
        p = peers(rep + 1)
        exchange_peers.append(p)
        dist.barrier()
        exchange_s.append(timed(lambda p=p: link.exchange(message, p)))
        if diagnose:
            dist.barrier()
            exchange_receive_first_s.append(timed(lambda p=p: exchange_receive_first(p)))
    records = [op for step in [*link.history, link.current] for op in step.ops]
    big = [op for op in records if op.payload_bytes in (grad.numel() * 4, message.numel() * 4)]
    return {
        "rank": rank,
        "world_size": world,
        "all_reduce_bytes": grad.numel() * ELEMENT_BYTES,
        "exchange_bytes": message.numel() * ELEMENT_BYTES,
        "all_reduce_s": all_reduce_s,
        "exchange_s": exchange_s,
        "exchange_receive_first_s": exchange_receive_first_s,
        "exchange_peers": exchange_peers,
        "tiny_exchange_s": tiny_exchange_s,
        "tiny_exchange_median_s": statistics.median(tiny_exchange_s),
        "tiny_all_reduce_s": tiny_all_reduce_s,
        "tiny_all_reduce_median_s": statistics.median(tiny_all_reduce_s),
        "tiny_all_reduce_bytes": tiny_ring.numel() * ELEMENT_BYTES,
        "link_shaping_bps": link.bandwidth_bps,
        "link_bytes_sent": {op.kind: op.bytes_sent for op in big},
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lowband.simulate.worker", description=__doc__.splitlines()[0])
    p.add_argument("--size-bytes", type=int, required=True, help="all-reduce payload M in bytes (a multiple of 4)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each operation")
    p.add_argument("--group-size", type=int, default=2, help="NoLoCo's group size n")
    p.add_argument("--seed", type=int, default=0, help="seed of NoLoCo's groups")
    p.add_argument("--probes", type=int, default=20, help="latency probes of each kind")
    p.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    p.add_argument("--out", type=Path, required=True, help="JSON file written by rank 0")
    p.add_argument("--link-bandwidth", type=float, default=None, help="shape the link in-process (bit/s)")
    p.add_argument("--link-latency", type=float, default=0.0, help="latency per message added by the link (s)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of each rank (under torchrun)."""
    entered_at = time.time()  # wall-clock stamps: the driver splits its launch time with them
    args = _parser().parse_args(argv)
    if args.size_bytes < ELEMENT_BYTES or args.size_bytes % ELEMENT_BYTES:
        raise ValueError(f"--size-bytes must be a positive multiple of {ELEMENT_BYTES}, got {args.size_bytes}")
    if args.reps < 1 or args.probes < 1:
        raise ValueError(f"--reps and --probes must be >= 1, got {args.reps} and {args.probes}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank" + os.environ.get("RANK", "?") + " %(message)s")
    import torch  # heavy: a command that does not train must not pay for it
    import torch.distributed as dist  # heavy: a command that does not train must not pay for it

    torch.set_num_threads(1)
    imported_at = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    try:
        initialised_at = time.time()
        record = measure(size_bytes=args.size_bytes, reps=args.reps, group_size=args.group_size,
                         seed=args.seed, probes=args.probes, bandwidth_bps=args.link_bandwidth,
                         latency_s=args.link_latency)  # fmt: skip
        record["stamps"] = {"entered": entered_at, "torch_imported": imported_at, "initialised": initialised_at,
                            "measured": time.time()}  # fmt: skip
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(record, gathered, dst=0)
        if dist.get_rank() == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(args.out) as tmp:
                tmp.write_text(json.dumps({"ranks": gathered}, indent=1))
            log.info("wrote %s", args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
