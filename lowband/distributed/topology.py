"""Nodes × ranks per node -> a 2-D DeviceMesh ("replicate", "shard").

Ranks are laid out node-major, as torchrun numbers them: rank = node · ranks_per_node + local_rank.
The mesh is ``arange(W).reshape(W // S, S)``:

- ``mesh["shard"]`` holds the S ranks that shard one copy of the model (FSDP2 over fast links);
- ``mesh["replicate"]`` holds the ranks that hold the *same* shard in different copies.

With S = ranks_per_node (FlexDeMo, the default) every replicate group spans the nodes, one rank
per node. With S = 1 (DeMo on nodes with several ranks) every rank is a replica, and a replicate
group holds ranks of the same node too: the link then counts and shapes only the bytes that cross
between nodes (it asks :meth:`Topology.node_of`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

__all__ = ["Topology"]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


@dataclass(frozen=True, kw_only=True)
class Topology:
    """How the ranks of a job map onto nodes, model copies and shards.

    Args:
        num_nodes: physical nodes (machines) joined by the slow link.
        ranks_per_node: processes per node (torchrun's ``--nproc-per-node``).
        shards: S, the ranks that shard one model copy; must divide ``ranks_per_node``.
            Defaults to ``ranks_per_node`` (FlexDeMo); 1 gives DeMo / plain data parallelism.
    """

    num_nodes: int
    ranks_per_node: int
    shards: int | None = None
    _mesh: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        shards = self.ranks_per_node if self.shards is None else self.shards
        if shards < 1 or self.ranks_per_node % shards != 0:
            raise ValueError(
                f"shards={shards} must divide ranks_per_node={self.ranks_per_node}: a model copy is "
                f"sharded over ranks of one node only (fast links). Pick a divisor of {self.ranks_per_node}."
            )
        object.__setattr__(self, "shards", shards)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_env(cls, *, shards: int | None = None) -> Topology:
        """Read WORLD_SIZE and LOCAL_WORLD_SIZE as set by torchrun (or the process group)."""
        world = _env_int("WORLD_SIZE")
        if world is None and dist.is_initialized():
            world = dist.get_world_size()
        if world is None:
            world = 1
        local = _env_int("LOCAL_WORLD_SIZE")
        if local is None:
            local = world
        if local < 1 or world % local != 0:
            raise ValueError(
                f"world size {world} does not factor into nodes of LOCAL_WORLD_SIZE={local} ranks; "
                "launch the same --nproc-per-node on every node"
            )
        return cls(num_nodes=world // local, ranks_per_node=local, shards=shards)

    # ---------------------------------------------------------------- sizes
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def replicas(self) -> int:
        """R: model copies, the size of a replicate group."""
        return self.world_size // self.shards  # type: ignore[operator]

    def node_of(self, rank: int) -> int:
        """The physical node that a global rank runs on."""
        return rank // self.ranks_per_node

    def shard_index(self, rank: int) -> int:
        return rank % self.shards  # type: ignore[operator]

    def replica_index(self, rank: int) -> int:
        return rank // self.shards  # type: ignore[operator]

    def replicate_group_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same shard as ``rank``, in replica order."""
        s = self.shard_index(rank)
        return [r * self.shards + s for r in range(self.replicas)]  # type: ignore[operator]

    def shard_group_ranks(self, rank: int) -> list[int]:
        base = self.replica_index(rank) * self.shards  # type: ignore[operator]
        return list(range(base, base + self.shards))  # type: ignore[operator]

    # ---------------------------------------------------------------- mesh
    def check_launch(self) -> None:
        """Raise if the running process group does not match this topology."""
        if not dist.is_initialized():
            if self.world_size != 1:
                raise ValueError(
                    f"topology needs {self.world_size} ranks ({self.num_nodes} nodes × "
                    f"{self.ranks_per_node}) but torch.distributed is not initialised; launch with torchrun"
                )
            return
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(
                f"topology {self.num_nodes} nodes × {self.ranks_per_node} ranks = {self.world_size} ranks, "
                f"but the job was launched with world size {world}"
            )
        local = _env_int("LOCAL_WORLD_SIZE")
        if local is not None and local != self.ranks_per_node:
            raise ValueError(
                f"topology says {self.ranks_per_node} ranks per node but torchrun launched "
                f"LOCAL_WORLD_SIZE={local}; pass the same --nproc-per-node"
            )

    def mesh(self, device_type: str | None = None):
        """The 2-D DeviceMesh ("replicate", "shard"), built once and cached."""
        if self._mesh is not None:
            return self._mesh

        self.check_launch()
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(
            device_type, (self.replicas, self.shards), mesh_dim_names=("replicate", "shard")
        )
        object.__setattr__(self, "_mesh", mesh)
        return mesh

    def replicate_group(self):
        """Process group of this rank's replicate dimension (None when single-process)."""
        if not dist.is_initialized():
            return None
        return self.mesh()["replicate"].get_group()

    def shard_group(self):
        if not dist.is_initialized():
            return None
        return self.mesh()["shard"].get_group()

    def describe(self) -> str:
        return (
            f"{self.num_nodes} node(s) × {self.ranks_per_node} rank(s); "
            f"{self.replicas} replica(s) × {self.shards} shard(s)"
        )
