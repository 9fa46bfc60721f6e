"""lowband.train.schedule: linear warm-up, then cosine decay (the trainer's and NoLoCo's lr schedule)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lowband.train.schedule import warmup_cosine, warmup_cosine_factor


def test_warmup_cosine_factors():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = warmup_cosine(opt, warmup_steps=4, total_steps=14, min_ratio=0.1)
    lrs = []
    for _ in range(16):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])
    assert lrs[9] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lrs[14:] == pytest.approx([0.2, 0.2])


def test_constant_after_warmup_with_min_ratio_one():
    factors = [warmup_cosine_factor(s, warmup_steps=2, total_steps=10, min_ratio=1.0) for s in range(12)]
    assert factors == pytest.approx([0.5, 1.0] + [1.0] * 10)


@pytest.mark.parametrize(
    "kwargs, needle",
    [(dict(warmup_steps=-1, total_steps=5), "warmup_steps"), (dict(warmup_steps=5, total_steps=5), "total_steps"),
     (dict(warmup_steps=1, total_steps=5, min_ratio=1.5), "min_ratio")],
)
def test_warmup_cosine_bad_input(kwargs, needle):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=needle):
        warmup_cosine(opt, **kwargs)
