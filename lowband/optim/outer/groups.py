"""NoLoCo's gossip groups: which replicas average together at each outer step.

Drawn the same on every rank without coordination (a seeded permutation), so that the optimizer
(:class:`~lowband.optim.outer.noloco.NoLoCo`) and the simulator (:mod:`lowband.simulate`) agree.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["noloco_group_size", "noloco_groups"]


def _mix_seed(seed: int, outer_index: int) -> int:
    # The salt "lowband.noloco" is part of every draw: changing it changes the groups of every run
    # (and of every checkpoint resumed), so it stays as it is wherever this code lives.
    digest = hashlib.sha256(f"lowband.noloco:{seed}:{outer_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def noloco_groups(num_replicas: int, group_size: int, *, seed: int, outer_index: int) -> list[list[int]]:
    """The groups of NoLoCo's outer step ``outer_index``: the same on every rank, without coordination.

    A permutation of the replicas from ``torch.Generator`` seeded with a hash of (seed, outer_index)
    is cut into ``num_replicas // group_size`` groups of ``group_size``; the r left over (r <
    group_size) join the first r groups one each (R = 3, n = 2: one group of three). Each group is
    sorted, which fixes the summation order so that all members compute the same means bit for bit.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if num_replicas == 1:
        return [[0]]
    if not 2 <= group_size <= num_replicas:
        raise ValueError(f"group_size must be in [2, R={num_replicas}], got {group_size}")
    gen = torch.Generator().manual_seed(_mix_seed(seed, outer_index))
    perm = torch.randperm(num_replicas, generator=gen).tolist()
    count = num_replicas // group_size
    groups = [perm[i * group_size:(i + 1) * group_size] for i in range(count)]
    for i, r in enumerate(perm[count * group_size:]):
        groups[i % count].append(r)
    return [sorted(g) for g in groups]


def noloco_group_size(group_size: int, live_replicas: int) -> int:
    """The group size n of an outer step with ``live_replicas`` replicas: min(n, live replicas).

    Without fault tolerance n ≤ R is checked when NoLoCo is built and this is n. Under fault
    tolerance the live nodes change from one outer step's quorum to the next: with fewer live than
    n, the step takes all live replicas as one group (an exchange needs no replica that is not
    there, and a run that lost nodes goes on rather than stopping mid-run); with one, nothing is
    exchanged.
    """
    if live_replicas < 1:
        raise ValueError(f"live_replicas must be >= 1, got {live_replicas}")
    return max(min(group_size, live_replicas), 1)
