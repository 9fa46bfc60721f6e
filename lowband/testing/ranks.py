"""Run a function on W real processes with gloo, for tests and quick experiments.

Processes are forked (far quicker to start than with torchrun or spawn), each
with ``OMP_NUM_THREADS=1`` and one torch thread, on a free port. Every launch has a timeout; a rank
that raises makes the launch raise with that rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from lowband.comm.link import Link
from lowband.distributed.sharding import shard_model
from lowband.distributed.topology import Topology
from lowband.train.methods import build_optimizer, method_shards
from lowband.train.models import build_model, compute_loss, transformer_blocks
from lowband.train.tokenizer import EOS_ID

__all__ = [
    "LoopbackLink", "default_sigint", "free_port", "full_params", "reverse_task_batch", "run_ranks", "tiny_batch", "tiny_loss", "tiny_model",
    "tiny_sharded", "train_reverse_task",
]


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test will Ctrl-C: SIGINT back to its default disposition.

    A job started in the background by a shell without job control (``nohup pytest &``, many CI
    runners) inherits SIGINT as ignored, and Python then installs no KeyboardInterrupt handler, so
    the child would never see the test's Ctrl-C.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, local_world: int, store_path: str, fn, args, kwargs, queue, extra_env) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world), LOCAL_WORLD_SIZE=str(local_world), OMP_NUM_THREADS="1",
        GROUP_RANK=str(rank // local_world),
    )
    os.environ.update(extra_env)
    import torch  # heavy: a command that does not train must not pay for it
    import torch.distributed as dist  # heavy: a command that does not train must not pay for it

    torch.set_num_threads(1)
    try:
        # The ranks meet through a file, not a TCP port: a port picked free and released can be taken by
        # another test's store before rank 0 binds it, and the ranks then wait on a stranger's store.
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        result = fn(rank, *args, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    timeout_s: float = 120.0,
    args: tuple = (),
    kwargs: dict | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` forked gloo processes; return results by rank.

    ``fn`` must be picklable-free (it is inherited through fork) and return picklable results.
    Raises RuntimeError with the failing ranks' tracebacks, or TimeoutError naming the ranks
    that did not finish within ``timeout_s``.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="lowband-ranks-")
    store_path = os.path.join(store_dir, "store")
    local_world = ranks_per_node or world_size
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, local_world, store_path, fn, args, kwargs or {}, queue,
                                          env or {}), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                errors = {r: v for r, (s, v) in results.items() if s == "error"}
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s} s; errors so far: {errors}")
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and len(results) < world_size:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died (exit codes "
                                           f"{[procs[i].exitcode for i in dead]})") from None
                continue
            results[rank] = (status, value)
            if status == "error":
                # Give the other ranks a moment to report too, then fail with every error.
                time.sleep(0.5)
                while True:
                    try:
                        r2, s2, v2 = queue.get_nowait()
                        results[r2] = (s2, v2)
                    except queue_mod.Empty:
                        break
                errors = "\n".join(f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error")
                raise RuntimeError(f"distributed run failed:\n{errors}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(store_dir, ignore_errors=True)
    return [results[r][1] for r in range(world_size)]


# --------------------------------------------------------------------------- a tiny model for tests
class LoopbackLink:
    """A stand-in link of two replicas that send the same message, in one process: the all-gather
    returns this rank's message twice (and keeps a copy of each in ``messages``), with no fault
    tolerance (every contribution counts, every step may be applied)."""

    group_size = 2
    participating = True

    def __init__(self) -> None:

        self.topology = SimpleNamespace(shards=1, world_size=2, replicas=2)
        self.messages: list = []

    def commit(self) -> bool:
        return True

    def all_gather(self, tensor, *, async_op=False):
        import torch  # heavy: a command that does not train must not pay for it

        assert not async_op
        self.messages.append(tensor.clone())
        return torch.stack([tensor, tensor])


def tiny_model(seed: int = 0):
    """Linear+tanh blocks of odd sizes (13 → 37 → 29 → 3): FSDP2 shards are uneven and not
    multiples of any chunk size. ``model[0]`` and ``model[1]`` are the blocks to shard."""
    import torch  # heavy: a command that does not train must not pay for it
    from torch import nn  # heavy: a command that does not train must not pay for it

    class Block(nn.Module):
        def __init__(self, d_in: int, d_out: int) -> None:
            super().__init__()
            self.lin = nn.Linear(d_in, d_out)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    torch.manual_seed(seed)
    return nn.Sequential(Block(13, 37), Block(37, 29), nn.Linear(29, 3))


def tiny_sharded(topology, seed: int = 0):
    """:func:`tiny_model` sharded with FSDP2 over the node's ranks (its two blocks, then the root)."""

    model = tiny_model(seed)
    return shard_model(model, topology, blocks=[model[0], model[1]])


def tiny_batch(rank: int, step: int):
    """Rank ``rank``'s (inputs, targets) at ``step`` for :func:`tiny_model`: a pure function."""
    import torch  # heavy: a command that does not train must not pay for it

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g)


def tiny_loss(model, rank: int, step: int):
    """Mean squared error of ``model`` on :func:`tiny_batch`."""
    x, y = tiny_batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def tiny_steps(model, opt, link, rank: int, steps) -> list:
    """Train ``model`` on :func:`tiny_loss` for ``steps`` (step numbers); the link's record of each step."""
    traffic = []
    for step in steps:
        opt.zero_grad()
        tiny_loss(model, rank, step).backward()
        opt.step()
        traffic.append(link.end_step())
    return traffic


def full_params(model) -> list:
    """Every parameter as a full tensor (gathered from FSDP2 shards), detached copies."""
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


# --------------------------------------------------------------------------- a task with a known low loss
# Reversing: the source is REVERSE_LEN symbols drawn uniformly from REVERSE_SYMBOLS ids (after the
# tokenizer's special ids PAD, EOS, UNK), the target the same symbols reversed, then EOS.
REVERSE_LEN = 8
REVERSE_SYMBOLS = 16
_FIRST_SYMBOL = 3  # lowband.train.tokenizer: PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
REVERSE_VOCAB = _FIRST_SYMBOL + REVERSE_SYMBOLS


def reverse_task_batch(*, rank: int, step: int, world_size: int, batch_size: int, seed: int = 0,
                       length: int = REVERSE_LEN) -> dict:
    """Rank ``rank``'s batch of the reversing task at ``step``: a pure function of its arguments.

    Every (seed, step, rank) draws fresh sequences, so the training loss is a loss on unseen data. A
    model that ignores the source can do no better than ln(REVERSE_SYMBOLS) nats at a symbol and 0
    at EOS (the symbols are independent and uniform): ``length / (length + 1) * ln 16`` per target
    token. A loss far below that means the model reads its input.
    """
    import torch  # heavy: a command that does not train must not pay for it


    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * world_size + rank)
    src = torch.randint(_FIRST_SYMBOL, REVERSE_VOCAB, (batch_size, length), generator=g)
    eos = torch.full((batch_size, 1), EOS_ID)
    return {"input_ids": torch.cat([src, eos], dim=1), "attention_mask": torch.ones(batch_size, length + 1,
                                                                                      dtype=torch.long),
            "labels": torch.cat([src.flip(1), eos], dim=1)}


def train_reverse_task(rank: int, *, method: str, hp: dict, steps: int, batch_size: int = 8, seed: int = 0,
                       model: str = "t5-tiny", length: int = REVERSE_LEN, compile_backend: str | None = None,
                       activation_checkpointing: bool = False) -> list[float]:
    """Train ``method`` on the reversing task on this rank; return the mean loss over all ranks per step.

    The library's own pipeline, as ``lowband train`` runs it: the named model built from ``seed``,
    FSDP2 over the node's ranks (``method_shards``), the link, ``build_optimizer`` from the method
    registry, dropout seeded per (seed, step, rank). Only the data differ: generated, not loaded.
    Call it on every rank of a running process group (e.g. from :func:`run_ranks`); several calls
    in one launch are independent (each builds its own topology and groups). ``compile_backend`` and
    ``activation_checkpointing``: :func:`~lowband.distributed.sharding.shard_model`'s, as ``--compile`` and
    ``--activation-checkpointing`` set them.
    """
    import torch  # heavy: a command that does not train must not pay for it
    import torch.distributed as dist  # heavy: a command that does not train must not pay for it


    topology = Topology.from_env(shards=method_shards(method, Topology.from_env().ranks_per_node, None))
    world = topology.world_size
    net = build_model(model, vocab_size=REVERSE_VOCAB, seed=seed).model
    # One shape for every batch (as packed data have): static graphs, as lowband train compiles for such data.
    net = shard_model(net, topology, blocks=transformer_blocks(net), compile_backend=compile_backend,
                      compile_dynamic=None, activation_checkpointing=activation_checkpointing)
    link = Link(topology)
    opt = build_optimizer(method, net.named_parameters(), link=link, hp=hp, model=net)
    losses = []
    for step in range(steps):
        batch = reverse_task_batch(rank=rank, step=step, world_size=world, batch_size=batch_size, seed=seed,
                                   length=length)
        torch.manual_seed((seed * 1_000_003 + step) * world + rank)
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(net, batch)
        loss.backward()
        opt.step()
        link.end_step()
        link.history.clear()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses
