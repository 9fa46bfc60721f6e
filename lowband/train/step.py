"""One optimizer step of ``lowband train``: N micro-batches accumulated, then ``optimizer.step()``.

Per step and rank, with the rank's batch split into N micro-batches b_1..b_N::

    for i in 1..N:
        FSDP2 gradient sync on only for i = N          # the intra-node reduce-scatter runs once
        loss_i = compute_loss(model, b_i) · t_i / T    # t_i: loss tokens of b_i, T = Σ t_i
        loss_i.backward()                               # gradients add up (fp32 with bf16 compute)
    optimizer.step()                                    # the inter-node part, through the link

compute_loss is the mean over a micro-batch's tokens, so Σ_i loss_i is the mean over all T
tokens of the batch: the step equals one step on the whole (N-times larger) batch, up to
floating-point rounding. Micro-batches 1..N−1 keep their unsharded gradients (FSDP2 accumulates
them in its reduce dtype, fp32) and reduce-scatter nothing; the N-th backward reduce-scatters the
sum once, so intra-node traffic does not grow with N. Without FSDP2 (one shard, fp32) gradients
accumulate in ``p.grad`` as usual.

Each micro-batch is trimmed to its own longest sequence (padding columns of the whole batch
are dropped), which changes no loss term: padded positions are masked and carry label -100.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from lowband.distributed.sharding import set_gradient_sync
from lowband.train.models import compute_loss

__all__ = ["split_batch", "loss_tokens", "train_step"]


def loss_tokens(batch: Mapping[str, torch.Tensor], *, kind: str) -> int:
    """Tokens that enter the loss: labels ≠ −100 (causal: the model shifts, so the first is never a target)."""
    labels = batch["labels"]
    if kind == "causal":
        labels = labels[..., 1:]
    return int((labels != -100).sum())


def _trim(batch: dict[str, torch.Tensor], *, kind: str) -> dict[str, torch.Tensor]:
    """Drop the padding columns this micro-batch does not need (batches are padded on the right)."""
    out = dict(batch)
    if "attention_mask" in out:
        width = max(int(out["attention_mask"].sum(1).max()), 1)
        out["input_ids"], out["attention_mask"] = out["input_ids"][:, :width], out["attention_mask"][:, :width]
        if kind == "causal":
            out["labels"] = out["labels"][:, :width]
    if kind == "seq2seq":
        width = max(int((out["labels"] != -100).sum(1).max()), 1)
        out["labels"] = out["labels"][:, :width]
    return {k: v.contiguous() for k, v in out.items()}  # the models .view() their labels


def split_batch(batch: Mapping[str, torch.Tensor], micro_batches: int, *, kind: str) -> list[dict[str, torch.Tensor]]:
    """Split a batch along its first dimension into ``micro_batches`` parts, each trimmed of padding.

    Raises:
        ValueError: more micro-batches than examples, or a batch size not divisible by them.
    """
    n = next(iter(batch.values())).shape[0]
    if micro_batches < 1 or n % micro_batches != 0:
        raise ValueError(f"a batch of {n} examples cannot be split into {micro_batches} equal micro-batches; "
                         "pick --grad-accum dividing the batch")
    if micro_batches == 1:
        return [dict(batch)]
    size = n // micro_batches
    return [_trim({k: v[i * size:(i + 1) * size] for k, v in batch.items()}, kind=kind) for i in range(micro_batches)]


def train_step(model, optimizer, micro: list[Mapping[str, torch.Tensor]], *, kind: str, loss_fn=None,
               profile=None) -> float:
    """Forward and backward over the micro-batches, then ``optimizer.step()``; return the batch's loss.

    Args:
        model: the (FSDP2-sharded) model.
        optimizer: any lowband optimizer (``zero_grad`` is called first).
        micro: the micro-batches of this rank's batch (:func:`split_batch`).
        kind: "seq2seq" or "causal" (how loss tokens are counted).
        loss_fn: ``loss_fn(model, batch)`` → mean loss over the batch's tokens; default
            :func:`lowband.train.models.compute_loss`.
        profile: a :class:`lowband.train.memory.PhaseMemory`, or None.

    Returns:
        The mean loss over all loss tokens of the batch (a float).
    """
    if loss_fn is None:
        loss_fn = compute_loss
    phase = profile.phase if profile is not None else (lambda name: contextlib.nullcontext())
    counts = [loss_tokens(b, kind=kind) for b in micro]
    total = max(sum(counts), 1)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    try:
        for i, (b, t) in enumerate(zip(micro, counts, strict=True)):
            last = i == len(micro) - 1
            if len(micro) > 1:
                set_gradient_sync(model, last)
            with phase("forward"):
                loss = loss_fn(model, b) * (t / total) if len(micro) > 1 else loss_fn(model, b)
            with phase("backward"):
                loss.backward()
            loss_sum += float(loss.detach())
    finally:
        if len(micro) > 1:
            set_gradient_sync(model, True)
    with phase("step"):
        optimizer.step()
    return loss_sum
