"""lowband/train/config.py: the job configuration refuses a bad value with the choices."""

from __future__ import annotations

import pytest


def test_unknown_precision_is_refused_with_the_choices():
    from lowband.train.config import TrainConfig

    with pytest.raises(ValueError, match="--precision must be one of fp32, bf16"):
        TrainConfig.from_tables({"model": {"precision": "fp16"}}).validate()
    with pytest.raises(ValueError, match="--grad-accum must be >= 1"):
        TrainConfig.from_tables({"schedule": {"grad_accum": 0}}).validate()
