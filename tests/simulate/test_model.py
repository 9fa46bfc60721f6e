"""lowband/simulate/model.py: the sync-time model's closed forms and properties, its Monte Carlo, its refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lowband.simulate.model import (
    SyncModel,
    closed_form,
    default_replica_counts,
    expected_max_factor,
    group_sizes,
    simulate,
    sweep,
    tree_round_messages,
)

pytestmark = pytest.mark.timeout(120)

M = 125e6 * 4  # bytes
B = 1e9  # bit/s
L = 0.05  # s


def _model(sigma: float, **kw) -> SyncModel:
    return SyncModel(model_bytes=M, bandwidth_bps=B, latency_s=L, sigma=sigma, **kw)


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 64, 100, 256, 1024])
def test_sigma_zero_equals_the_closed_forms(n: int) -> None:
    r = simulate(n, _model(0.0))
    ring = 2 * (n - 1) * (L + 8 * M / (n * B))
    tree = 2 * math.ceil(math.log2(n)) * (L + 8 * M / B)
    sizes = group_sizes(n, 2)
    pair = sum(g * (L + 8 * 2 * M * (g - 1) / B) for g in sizes) / n  # g = 2: L + 16·M/B
    assert r.ring_s == pytest.approx(ring, rel=1e-12)
    assert r.tree_s == pytest.approx(tree, rel=1e-12)
    assert r.pair_s == pytest.approx(pair, rel=1e-12)
    assert r.ring_no_barrier_s == pytest.approx(ring, rel=1e-12)
    assert r.tree_no_barrier_s == pytest.approx(tree, rel=1e-12)
    if n % 2 == 0:
        assert r.pair_s == pytest.approx(L + 16 * M / B, rel=1e-12) == r.pair_slowest_s
    assert r == closed_form(n, _model(0.0))


def test_group_of_three_when_replicas_are_odd() -> None:
    assert group_sizes(3, 2) == [3]
    assert group_sizes(7, 2) == [3, 2, 2]
    r = closed_form(3, _model(0.0))
    assert r.pair_s == pytest.approx(L + 8 * 2 * M * 2 / B)  # each member sends 2M to two peers over one uplink


@pytest.mark.parametrize("replicas, n", [(2, 2), (7, 2), (8, 2), (9, 4), (10, 3), (5, 4), (16, 16)])
def test_group_sizes_match_nolocos_own_groups(replicas: int, n: int) -> None:
    from lowband.optim.outer.groups import noloco_groups

    groups = noloco_groups(replicas, n, seed=0, outer_index=3)
    assert sorted(group_sizes(replicas, n)) == sorted(len(g) for g in groups)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 256, 1000])
def test_tree_rounds_send_every_non_root_once(n: int) -> None:
    rounds = tree_round_messages(n)
    assert len(rounds) == math.ceil(math.log2(n))
    assert sum(rounds) == n - 1
    if n & (n - 1) == 0:
        assert rounds == [n // 2**r for r in range(1, len(rounds) + 1)]


@pytest.mark.slow
@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_ratio_grows_with_replicas(sigma: float) -> None:
    rows = sweep(default_replica_counts(1024), _model(sigma, samples=400))
    for attr in ("ring_ratio", "tree_ratio", "ring_no_barrier_ratio", "tree_no_barrier_ratio"):
        values = [getattr(r, attr) for r in rows]
        assert all(b > a for a, b in zip(values, values[1:], strict=False)), (attr, values)
    # NoLoCo's per-replica time does not depend on N (pairs, no global barrier); its slowest pair grows.
    pair = [r.pair_s for r in rows]
    assert max(pair) / min(pair) < 1.05
    if sigma > 0:
        slowest = [r.pair_slowest_s for r in rows]
        assert all(b > a for a, b in zip(slowest, slowest[1:], strict=False))


def test_ratio_at_two_replicas_is_about_one() -> None:
    """N = 2: the tree's 2 rounds of M against the pair's one message of 2M (≈ 1); the ring moves
    only M/2 per step (≈ 0.5 when bandwidth dominates). With σ > 0 the pair waits for the slower
    of its two messages while each tree round has one message: a little below 1."""
    r0 = simulate(2, _model(0.0))
    assert 0.95 < r0.tree_ratio < 1.05
    assert 0.45 < r0.ring_ratio < 0.55
    r = simulate(2, _model(0.5))
    assert 0.6 < r.tree_ratio < 1.0


def _lognormal_max_quadrature(k: int, sigma: float) -> float:
    """E[max of k mean-one log-normals] = ∫ 1 − F(x)^k dx, on a fine grid."""
    x = np.linspace(1e-6, 60.0, 400_000)
    z = (np.log(x) + 0.5 * sigma * sigma) / sigma
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    return float(np.trapezoid(1 - cdf**k, x))


@pytest.mark.slow
def test_slowest_of_k_grows_with_k_and_matches_quadrature() -> None:
    ks = [1, 2, 4, 16, 64, 256, 1024]
    values = [expected_max_factor(k, sigma=0.5, samples=4000, seed=0) for k in ks]
    assert all(b > a for a, b in zip(values, values[1:], strict=False)), values
    assert values[0] == pytest.approx(1.0, abs=0.03)  # mean one
    for k in (2, 256):
        assert expected_max_factor(k, sigma=0.5, samples=4000, seed=0) == pytest.approx(
            _lognormal_max_quadrature(k, 0.5), rel=0.03)
    assert expected_max_factor(1024, sigma=0.0, samples=10, seed=0) == 1.0


@pytest.mark.slow
def test_no_barrier_never_slower_than_barrier() -> None:
    for n in (2, 8, 64, 256):
        r = simulate(n, _model(0.5, samples=500))
        assert r.ring_no_barrier_s is not None and r.ring_no_barrier_s < r.ring_s
        assert r.tree_no_barrier_s < r.tree_s


@pytest.mark.slow
def test_monte_carlo_is_deterministic_with_a_seed() -> None:
    a = sweep([4, 64, 256], _model(0.5, samples=300, seed=7))
    b = sweep([4, 64, 256], _model(0.5, samples=300, seed=7))
    assert a == b
    c = sweep([256], _model(0.5, samples=300, seed=8))
    assert c[0] != a[-1]
    # One N's figures do not depend on which other N are in the sweep.
    assert sweep([256], _model(0.5, samples=300, seed=7))[0] == a[-1]


@pytest.mark.parametrize("kwargs, needle", [
    ({"sigma": -0.1}, "sigma"), ({"group_size": 1}, "group size"), ({"samples": 0}, "samples"),
    ({"latency_s": -1.0}, "latency"), ({"bandwidth_bps": 0.0}, "bandwidth"), ({"model_bytes": 0.0}, "model size"),
])  # fmt: skip
def test_model_rejects_bad_inputs(kwargs: dict, needle: str) -> None:
    base = dict(model_bytes=M, bandwidth_bps=B, latency_s=L)
    with pytest.raises(ValueError, match=needle):
        SyncModel(**{**base, **kwargs})
    with pytest.raises(ValueError, match=r"\[2, "):
        simulate(1, _model(0.0))
