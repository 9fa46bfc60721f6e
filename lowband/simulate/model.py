"""The model of one synchronisation step: DiLoCo's all-reduce against NoLoCo's group exchange.

Pure numpy; no processes, no torch. The formulas are written out in :mod:`lowband.simulate`'s
docstring; this module implements them.

Every message of ``b`` bytes on a link of ``B`` bit/s with latency ``L`` takes::

    t(b) = (L + 8·b / B) · X,   X = exp(σ·Z − σ²/2),  Z ~ N(0, 1)   (independent per message)

``X`` is log-normal with mean 1 (median exp(−σ²/2)): on average a message takes the
deterministic time, and σ only adds the wait for the slowest of several. σ = 0 gives X = 1 and
every expectation below equals its closed form exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "MAX_REPLICAS",
    "SyncModel",
    "SyncTimes",
    "closed_form",
    "default_replica_counts",
    "expected_max_factor",
    "group_sizes",
    "message_time_s",
    "simulate",
    "sweep",
    "tree_round_messages",
]

log = logging.getLogger(__name__)

#: The largest replica count the model accepts (Monte Carlo cost grows with N).
MAX_REPLICAS = 65_536
#: Above this N the ring without step barrier (cost ∝ N²) is not simulated.
MAX_DATAFLOW_REPLICAS = 4_096
#: Log-normal draws spent on the no-barrier ring per replica count (at least _MIN_DATAFLOW_TRIALS trials).
_DATAFLOW_DRAW_BUDGET = 10_000_000
_MIN_DATAFLOW_TRIALS = 8
#: Largest array of draws held at once (elements); larger Monte Carlo runs go in chunks.
_CHUNK_ELEMENTS = 4_000_000

# Stream ids: each quantity draws from its own stream seeded by (seed, stream, N or k), so a
# figure for one N does not depend on which other N are in the sweep.
_STREAM_MAX, _STREAM_PAIR, _STREAM_RING_FLOW, _STREAM_TREE_FLOW = 1, 2, 3, 4


def default_replica_counts(max_replicas: int = 1024) -> list[int]:
    """Powers of two from 2 to ``max_replicas``: 2, 4, 8, ..., 1024."""
    out, n = [], 2
    while n <= max_replicas:
        out.append(n)
        n *= 2
    return out


def message_time_s(nbytes: float, *, bandwidth_bps: float, latency_s: float) -> float:
    """Deterministic time of one message: latency + serialisation, ``L + 8·b/B`` seconds."""
    return latency_s + 8.0 * nbytes / bandwidth_bps


def group_sizes(num_replicas: int, group_size: int) -> list[int]:
    """Sizes of NoLoCo's groups for R replicas and groups of n (as ``noloco_groups`` cuts them).

    R // n groups of n; the r = R mod n left over join the first groups one each (R = 3, n = 2:
    one group of three). R < n: one group of all R.
    """
    if num_replicas < 2:
        raise ValueError(f"num_replicas must be >= 2, got {num_replicas}")
    if group_size < 2:
        raise ValueError(f"group_size (n) must be >= 2, got {group_size}")
    count = num_replicas // group_size
    if count == 0:
        return [num_replicas]
    extra = num_replicas - count * group_size
    return [group_size + extra // count + (1 if i < extra % count else 0) for i in range(count)]


def tree_round_messages(num_replicas: int) -> list[int]:
    """Concurrent messages in each round of a binomial-tree reduce over N replicas.

    Round r (1-based, r = 1..⌈log2 N⌉) sends from every replica i with i mod 2^r = 2^(r−1) to
    i − 2^(r−1): ⌈(N − 2^(r−1)) / 2^r⌉ messages (N/2^r for a power of two). The broadcast runs the
    same rounds backwards.
    """
    rounds = math.ceil(math.log2(num_replicas))
    return [-(-(num_replicas - 2 ** (r - 1)) // 2**r) for r in range(1, rounds + 1)]


@dataclass(frozen=True, kw_only=True)
class SyncModel:
    """Inputs of the model.

    Args:
        model_bytes: M, bytes of one model copy (parameters × bytes per parameter). DiLoCo
            all-reduces M; NoLoCo sends φ and θ−φ, 2·M, to each of its n−1 peers.
        bandwidth_bps: B, each replica's link rate (up and down, full duplex), bit/s.
        latency_s: L, fixed time per message, seconds.
        sigma: σ of the log-normal factor per message (0: deterministic).
        group_size: n, NoLoCo's group size (2: pairs).
        samples: Monte Carlo samples per expectation.
        seed: seed of every Monte Carlo stream.
    """

    model_bytes: float
    bandwidth_bps: float
    latency_s: float
    sigma: float = 0.5
    group_size: int = 2
    samples: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.model_bytes) and self.model_bytes > 0):
            raise ValueError(f"model size must be > 0 bytes, got {self.model_bytes!r}")
        if not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise ValueError(f"bandwidth must be > 0 bit/s, got {self.bandwidth_bps!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency must be >= 0 s, got {self.latency_s!r}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma (σ of the log-normal spread) must be >= 0 (0: deterministic), got {self.sigma!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group size n must be an integer >= 2 (2: pairs), got {self.group_size!r}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples must be an integer >= 1, e.g. 2000, got {self.samples!r}")

    def pair_message_s(self, group: int) -> float:
        """Deterministic time of one NoLoCo message in a group of ``group``: L + 8·2M·(g−1)/B.

        A member sends 2M to each of its g−1 peers at once over one uplink.
        """
        return message_time_s(2 * self.model_bytes * (group - 1), bandwidth_bps=self.bandwidth_bps,
                              latency_s=self.latency_s)  # fmt: skip

    def ring_step_s(self, num_replicas: int) -> float:
        """Deterministic time of one ring step: L + 8·(M/N)/B."""
        return message_time_s(self.model_bytes / num_replicas, bandwidth_bps=self.bandwidth_bps,
                              latency_s=self.latency_s)  # fmt: skip

    def tree_round_s(self) -> float:
        """Deterministic time of one tree round: L + 8·M/B."""
        return message_time_s(self.model_bytes, bandwidth_bps=self.bandwidth_bps, latency_s=self.latency_s)


@dataclass(frozen=True, kw_only=True)
class SyncTimes:
    """Expected sync-step times (seconds) for one replica count N; all modelled.

    ``pair_s``: NoLoCo, mean over replicas of the time until its own group is done (no barrier
    over all replicas). ``pair_slowest_s``: the slowest group's time, for completeness.
    ``ring_s``: ring all-reduce with every step waiting for the slowest of the N messages.
    ``ring_no_barrier_s``: the ring without step barrier (each replica waits only for its
    predecessor), mean over replicas; None where not simulated (N > 4096).
    ``tree_s``: binomial-tree reduce + broadcast, each round waiting for its slowest message (the
    NoLoCo paper's model). ``tree_no_barrier_s``: the same tree where each message waits only for
    the data and the link it needs, mean over replicas.
    """

    num_replicas: int
    pair_s: float
    pair_slowest_s: float
    ring_s: float
    ring_no_barrier_s: float | None
    tree_s: float
    tree_no_barrier_s: float

    @property
    def ring_ratio(self) -> float:
        """DiLoCo (ring) / NoLoCo."""
        return self.ring_s / self.pair_s

    @property
    def tree_ratio(self) -> float:
        """DiLoCo (tree) / NoLoCo: the NoLoCo paper's comparison."""
        return self.tree_s / self.pair_s

    @property
    def ring_no_barrier_ratio(self) -> float | None:
        """DiLoCo (ring without step barrier) / NoLoCo; None where not simulated."""
        return None if self.ring_no_barrier_s is None else self.ring_no_barrier_s / self.pair_s

    @property
    def tree_no_barrier_ratio(self) -> float:
        """DiLoCo (tree without round barrier) / NoLoCo."""
        return self.tree_no_barrier_s / self.pair_s

    def as_dict(self) -> dict[str, float | int | None]:
        d: dict[str, float | int | None] = asdict(self)
        d.update(ring_ratio=self.ring_ratio, tree_ratio=self.tree_ratio,
                 ring_no_barrier_ratio=self.ring_no_barrier_ratio,
                 tree_no_barrier_ratio=self.tree_no_barrier_ratio)  # fmt: skip
        return d


def closed_form(num_replicas: int, model: SyncModel) -> SyncTimes:
    """The σ = 0 formulas (no Monte Carlo)::

        pair = L + 8·2M·(g−1)/B   (g = n: L + 16·M/B for pairs)
        ring = 2(N−1)·(L + 8·M/(N·B))
        tree = 2·⌈log2 N⌉·(L + 8·M/B)
    """
    _check_replicas(num_replicas)
    sizes = group_sizes(num_replicas, model.group_size)
    pair = sum(g * model.pair_message_s(g) for g in sizes) / num_replicas
    ring = 2 * (num_replicas - 1) * model.ring_step_s(num_replicas)
    tree = 2 * math.ceil(math.log2(num_replicas)) * model.tree_round_s()
    return SyncTimes(num_replicas=num_replicas, pair_s=pair, pair_slowest_s=max(model.pair_message_s(g) for g in sizes),
                     ring_s=ring, ring_no_barrier_s=ring, tree_s=tree, tree_no_barrier_s=tree)  # fmt: skip


def _check_replicas(num_replicas: int) -> None:
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int | np.integer):
        raise ValueError(f"a replica count must be an integer, got {num_replicas!r}")
    if not 2 <= num_replicas <= MAX_REPLICAS:
        raise ValueError(f"a replica count N must be in [2, {MAX_REPLICAS}], got {num_replicas}")


def _rng(seed: int, stream: int, key: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, key])


def _factors(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
    """Mean-one log-normal factors exp(σ·Z − σ²/2); exactly 1 when σ = 0."""
    if sigma == 0:
        return np.ones(shape)
    return np.exp(sigma * rng.standard_normal(shape) - 0.5 * sigma * sigma)


def expected_max_factor(k: int, *, sigma: float, samples: int, seed: int) -> float:
    """E[max of k independent mean-one log-normal factors], by Monte Carlo (exactly 1 at σ = 0)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if sigma == 0:
        return 1.0
    rng = _rng(seed, _STREAM_MAX, k)
    total, done = 0.0, 0
    per_chunk = max(1, _CHUNK_ELEMENTS // k)
    while done < samples:
        m = min(per_chunk, samples - done)
        total += float(_factors(rng, sigma, (m, k)).max(axis=1).sum())
        done += m
    return total / samples


def _pair_times(num_replicas: int, model: SyncModel) -> tuple[float, float]:
    """(mean over replicas, slowest group) of NoLoCo's exchange, by Monte Carlo.

    In a group of g every member sends one message to each of the g−1 others; member i is done
    when every message it sends or receives has arrived: the max over its 2(g−1) messages.
    """
    sizes = group_sizes(num_replicas, model.group_size)
    rng = _rng(model.seed, _STREAM_PAIR, num_replicas)
    sum_mean, sum_slowest = 0.0, 0.0
    per_chunk = max(1, _CHUNK_ELEMENTS // sum(g * g for g in sizes))
    done = 0
    while done < model.samples:
        m = min(per_chunk, model.samples - done)
        member_sum = np.zeros(m)
        slowest = np.zeros(m)
        for g in sorted(set(sizes)):
            count = sizes.count(g)
            x = _factors(rng, model.sigma, (m, count, g, g))  # x[..., i, j]: message i -> j
            idx = np.arange(g)
            x[..., idx, idx] = 0.0  # no message to oneself
            member = np.maximum(x.max(axis=-1), x.max(axis=-2)) * model.pair_message_s(g)  # (m, count, g)
            member_sum += member.sum(axis=(1, 2))
            slowest = np.maximum(slowest, member.max(axis=(1, 2)))
        sum_mean += float((member_sum / num_replicas).sum())
        sum_slowest += float(slowest.sum())
        done += m
    return sum_mean / model.samples, sum_slowest / model.samples


def _ring_no_barrier(num_replicas: int, model: SyncModel) -> float | None:
    """Ring all-reduce where replica i starts step s once its own step s−1 and its predecessor's
    step s−1 are done: T[s, i] = max(T[s−1, i], T[s−1, i−1]) + t[s, i]. Returns the mean over
    replicas of the time its last chunk arrives. None above MAX_DATAFLOW_REPLICAS."""
    if num_replicas > MAX_DATAFLOW_REPLICAS:
        return None
    steps = 2 * (num_replicas - 1)
    step_s = model.ring_step_s(num_replicas)
    if model.sigma == 0:
        return steps * step_s
    trials = min(model.samples, max(_MIN_DATAFLOW_TRIALS, _DATAFLOW_DRAW_BUDGET // (steps * num_replicas)))
    rng = _rng(model.seed, _STREAM_RING_FLOW, num_replicas)
    done_s = np.zeros((trials, num_replicas))
    for s in range(steps):
        t = step_s * _factors(rng, model.sigma, (trials, num_replicas))
        done_s = t if s == 0 else np.maximum(done_s, np.roll(done_s, 1, axis=1)) + t
    return float(done_s.mean())


def _tree_no_barrier(num_replicas: int, model: SyncModel) -> float:
    """Binomial-tree reduce + broadcast without round barrier; mean over replicas of when each
    has the result.

    A message starts once its sender has the data (all its children's messages, in the reduce;
    its parent's, in the broadcast) and the link end it shares is free (a parent receives, and
    sends, one message at a time, in round order)::

        reduce, round r = 1..R, child c -> parent p = c − 2^(r−1):
            arrive = max(ready[c], busy[p]) + t·X;  ready[p] = busy[p] = max(ready[p], arrive)
        broadcast, round r = R..1, parent p -> child c:
            have[c] = max(have[p], busy[p]) + t·X;  busy[p] = have[c]
    """
    rounds = math.ceil(math.log2(num_replicas))
    round_s = model.tree_round_s()
    if model.sigma == 0:
        return 2 * rounds * round_s
    trials = min(model.samples, max(_MIN_DATAFLOW_TRIALS, _DATAFLOW_DRAW_BUDGET // (2 * num_replicas)))
    rng = _rng(model.seed, _STREAM_TREE_FLOW, num_replicas)
    pairs = []  # (children, parents) of each round
    for r in range(1, rounds + 1):
        half = 2 ** (r - 1)
        children = np.arange(half, num_replicas, 2 * half)
        pairs.append((children, children - half))
    ready = np.zeros((trials, num_replicas))
    busy = np.zeros((trials, num_replicas))
    for children, parents in pairs:
        arrive = np.maximum(ready[:, children], busy[:, parents]) + round_s * _factors(
            rng, model.sigma, (trials, children.size))
        ready[:, parents] = np.maximum(ready[:, parents], arrive)
        busy[:, parents] = ready[:, parents]
    have = np.zeros((trials, num_replicas))
    have[:, 0] = ready[:, 0]
    busy = have.copy()
    for children, parents in reversed(pairs):
        have[:, children] = np.maximum(have[:, parents], busy[:, parents]) + round_s * _factors(
            rng, model.sigma, (trials, children.size))
        busy[:, parents] = have[:, children]
    return float(have.mean())


def simulate(num_replicas: int, model: SyncModel) -> SyncTimes:
    """Expected sync-step times for N replicas (Monte Carlo; equal to :func:`closed_form` at σ = 0).

    Steps and rounds are independent, so the expected total of a barrier-synchronised collective
    is the sum over its steps of E[max of the step's concurrent messages].
    """
    _check_replicas(num_replicas)
    num_replicas = int(num_replicas)
    if model.sigma == 0:
        return closed_form(num_replicas, model)

    def emax(k: int) -> float:
        return expected_max_factor(k, sigma=model.sigma, samples=model.samples, seed=model.seed)

    pair, pair_slowest = _pair_times(num_replicas, model)
    ring = 2 * (num_replicas - 1) * model.ring_step_s(num_replicas) * emax(num_replicas)
    tree = 2 * model.tree_round_s() * sum(emax(k) for k in tree_round_messages(num_replicas))
    return SyncTimes(num_replicas=num_replicas, pair_s=pair, pair_slowest_s=pair_slowest, ring_s=ring,
                     ring_no_barrier_s=_ring_no_barrier(num_replicas, model), tree_s=tree,
                     tree_no_barrier_s=_tree_no_barrier(num_replicas, model))  # fmt: skip


def sweep(replica_counts: Iterable[int], model: SyncModel) -> list[SyncTimes]:
    """:func:`simulate` for each distinct N, in increasing order."""
    counts: Sequence[int] = sorted(set(int(n) for n in replica_counts))
    out = []
    for n in counts:
        out.append(simulate(n, model))
        log.debug("modelled N=%d: %s", n, out[-1])
    return out
