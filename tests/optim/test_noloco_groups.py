"""lowband/optim/outer/groups.py: NoLoCo's gossip groups partition the replicas."""

from __future__ import annotations

from lowband.optim.outer.groups import noloco_groups


def test_noloco_groups_partition_the_replicas():
    for replicas in range(2, 12):
        for n in range(2, replicas + 1):
            seen = set()
            for k in range(6):
                groups = noloco_groups(replicas, n, seed=1, outer_index=k)
                assert groups == noloco_groups(replicas, n, seed=1, outer_index=k)  # deterministic
                members = sorted(x for g in groups for x in g)
                assert members == list(range(replicas))
                # replicas // n groups of n; the ones left over spread over them (sizes differ by <= 1).
                sizes = [len(g) for g in groups]
                assert len(groups) == replicas // n and min(sizes) >= n and max(sizes) - min(sizes) <= 1
                seen.add(str(groups))
            if replicas // n >= 2:
                assert len(seen) > 1, (replicas, n)
    assert noloco_groups(3, 2, seed=0, outer_index=0) == [[0, 1, 2]]
    assert noloco_groups(8, 2, seed=0, outer_index=0) != noloco_groups(8, 2, seed=1, outer_index=0)
