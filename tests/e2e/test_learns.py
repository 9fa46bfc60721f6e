"""Every method learns a task with a known low loss, not merely "the loss moved".

The task (:func:`lowband.testing.ranks.reverse_task_batch`, length LEARN_LEN): reverse LEARN_LEN symbols
drawn uniformly from 16, then EOS; every batch is freshly drawn, so the training loss is a loss on
unseen data. A model that does not read its source can do no better, at each target position, than
the entropy of that token given the previous ones; the symbols are independent and uniform, so that
is ln 16 at a symbol and 0 at EOS: on average LEARN_LEN / (LEARN_LEN + 1) · ln 16 = 1.85 nats per
target token (the "blind" bound, computed below from generated data; the unigram entropy of the
target tokens, 2.49 nats, is what a model that learnt only token frequencies reaches). LOSS_BOUND is
well below the blind bound: a method under it must put the right symbols in the right order.

One launch on a 2 × 2 gloo mesh trains every method (t5-tiny, the library's sharding, link and
optimizers) for LEARN_STEPS steps (DiLoCo: DILOCO_STEPS) at lr 3e-3 (DiLoCo's inner AdamW 1e-3, its outer
step 0.7 with Nesterov momentum). Measured on this machine (2026-12-06), the mean of the last 10 steps at
step 100 / 150: AdamW 0.856 / 0.776, Deto-Full 0.749 / 0.689, DeMo 0.950 / 0.754, FlexDeMo Top-1 0.988 /
0.718, Top-8 0.750 / 0.677, Top-1 with 1-bit values 0.981 / 0.786, NoLoCo 0.922 / 0.793; DiLoCo 1.208 /
1.078, too near the bound at 100, so it keeps 150 (the others ran 150 until then: the suite's CPU).
At lr 3e-3 and 200 steps a probe run on this machine ended (mean of the last
10 steps) at 0.63-0.72 nats for every method but DiLoCo, which plateaus near 1.05 (1.03 at inner
lr 1e-3, 1.08 at 3e-3, 1.12 with H=5); lr 1e-3, the paper's, is too slow for the sign-based
methods at this budget.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from lowband.testing.ranks import REVERSE_SYMBOLS, reverse_task_batch, run_ranks, train_reverse_task

LEARN_LEN = 2
LEARN_STEPS = 100
DILOCO_STEPS = 150
LEARN_BATCH = 32
# Mean training loss over the last LAST_STEPS steps must be below this (nats per target token).
LOSS_BOUND = 1.25
LAST_STEPS = 10
CONFIGS: dict[str, tuple[str, dict]] = {
    "adamw": ("adamw", {"lr": 3e-3}),
    "deto-full": ("deto-full", {"lr": 3e-3}),
    "demo": ("demo", {"lr": 3e-3}),
    "flexdemo:topk=1": ("flexdemo", {"lr": 3e-3, "topk": 1}),
    "flexdemo:topk=8": ("flexdemo", {"lr": 3e-3, "topk": 8}),
    "flexdemo:topk=1,values=sign": ("flexdemo", {"lr": 3e-3, "topk": 1, "values": "sign"}),
    "diloco:H=10": ("diloco", {"lr": 1e-3, "H": 10}),
    "noloco:H=10": ("noloco", {"lr": 3e-3, "H": 10}),
}


def _entropy(counts: Counter) -> float:
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def task_entropies(batches: int = 64) -> tuple[float, float]:
    """(unigram entropy of the target tokens, blind bound: the mean per-position entropy), in nats."""
    unigram: Counter = Counter()
    by_position = [Counter() for _ in range(LEARN_LEN + 1)]
    for step in range(batches):
        labels = reverse_task_batch(rank=0, step=step, world_size=1, batch_size=256, length=LEARN_LEN)["labels"]
        for row in labels.tolist():
            unigram.update(row)
            for i, tok in enumerate(row):
                by_position[i][tok] += 1
    return _entropy(unigram), sum(_entropy(c) for c in by_position) / len(by_position)


def _train_all(rank: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return {name: train_reverse_task(rank, method=m, hp=hp, steps=DILOCO_STEPS if m == "diloco" else LEARN_STEPS,
                                     batch_size=LEARN_BATCH, length=LEARN_LEN)
            for name, (m, hp) in CONFIGS.items()}


def test_the_bound_means_reading_the_input():
    unigram, blind = task_entropies()
    # The empirical figures agree with the closed forms (16 uniform symbols, EOS at the end).
    assert blind == pytest.approx(LEARN_LEN / (LEARN_LEN + 1) * math.log(REVERSE_SYMBOLS), abs=0.01)
    assert unigram > blind
    assert LOSS_BOUND < 0.7 * blind, (LOSS_BOUND, blind)


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)  # about 3 minutes on 2 idle cores; a shared, loaded machine takes far longer
def test_every_method_learns_to_reverse():
    _, blind = task_entropies()
    losses = run_ranks(_train_all, world_size=4, ranks_per_node=2, timeout_s=1700)[0]
    final = {name: sum(ls[-LAST_STEPS:]) / LAST_STEPS for name, ls in losses.items()}
    first = {name: ls[0] for name, ls in losses.items()}
    failed = {n: round(v, 3) for n, v in final.items() if not v < LOSS_BOUND}
    assert not failed, (f"mean loss of the last {LAST_STEPS} steps (of {LEARN_STEPS}, DiLoCo's of {DILOCO_STEPS}) "
                        f"not below {LOSS_BOUND} "
                        f"(blind bound {blind:.3f}, start {first}): {failed}")
