"""lowband/optim/_common.py: what the optimizers share (the finite check)."""

from __future__ import annotations

import torch


def test_all_finite_sees_nan_and_inf_in_any_tensor_and_ignores_empty_ones():
    from lowband.optim._common import all_finite

    ok = [torch.randn(5), torch.empty(0), torch.tensor([3e38, -3e38]), torch.ones(2, dtype=torch.float64)]
    assert all_finite(ok) and all_finite([]) and all_finite([torch.empty(0)])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.zeros(4)
        t[2] = bad
        assert not all_finite(ok + [t]) and not all_finite([t.double()] + ok)


def test_grads_nonfinite_sees_nan_and_inf_in_any_gradient_of_one_process():
    from lowband.optim._common import grads_nonfinite

    ok = [torch.randn(7), torch.empty(0), torch.tensor([3e38, -3e38]), torch.ones(3, dtype=torch.bfloat16)]
    assert not grads_nonfinite(ok, None) and not grads_nonfinite([], None)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in range(len(ok)):
            if ok[at].numel() == 0:
                continue
            grads = [g.clone() for g in ok]
            grads[at][-1] = bad
            assert grads_nonfinite(grads, None), (bad, at)


def test_a_large_finite_float64_is_finite_to_the_checks():
    # The checks compare the tensors' ends in float64: a finite float64 beyond float32's range is not Inf.
    from lowband.optim._common import all_finite, nonfinite_flag

    big = torch.tensor([1e300, -1e300], dtype=torch.float64)
    assert all_finite([big]) and int(nonfinite_flag([big], big.device)) == 0
    assert not all_finite([big, torch.tensor([float("-inf")], dtype=torch.bfloat16)])
