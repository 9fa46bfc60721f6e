"""Each rank's logging in ``lowband train``: who speaks, and with which prefix.

A job of N nodes × R ranks writes N × R logs (or one interleaved log per node, as torchrun and srun
do). Local rank 0 of each node logs INFO and above; every other rank WARNING and above only, as
torchtitan does: the ranks of a node mostly say the same thing. Every line names its node and rank::

    2026-12-07 15:33:34,368 [node 1 rank 2] INFO lowband.train.loop: step 120/1000 | loss 3.412 | ...

The identity comes from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``: the node's
index among the job's torchrun agents); under fault tolerance each node is a torchrun of its own, so
the node is its ``--ft-node`` slot instead. Library modules keep ``logging.getLogger(__name__)``;
only the ``lowband train`` command configures the root logger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

__all__ = ["QUIET_LOGGERS", "RankIdentity", "configure_rank_logging", "rank_identity"]


@dataclass(frozen=True)
class RankIdentity:
    """Where a process of a job runs: its node, its global rank and its rank inside the node."""

    node: int
    rank: int
    local_rank: int

    @property
    def prefix(self) -> str:
        """``[node 1 rank 2]``: what every log line of this rank carries."""
        return f"[node {self.node} rank {self.rank}]"

    @property
    def level(self) -> int:
        """INFO for local rank 0 of a node, WARNING for the others."""
        return logging.INFO if self.local_rank == 0 else logging.WARNING


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the environment variable {name}={text!r} is not an integer; torchrun sets it, "
                         f"unset it or launch with torchrun") from None


def rank_identity(environ: Mapping[str, str] | None = None, *, node: int | None = None) -> RankIdentity:
    """This process's :class:`RankIdentity` from torchrun's environment (default ``os.environ``); ``node``
    (a fault-tolerant node's ``--ft-node``) overrides the node read there. Without torchrun: node 0, rank 0."""
    env = os.environ if environ is None else environ
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    if node is None:
        local_world = max(_env_int(env, "LOCAL_WORLD_SIZE", 1), 1)
        node = _env_int(env, "GROUP_RANK", rank // local_world)  # the topology's node_of without GROUP_RANK
    return RankIdentity(node=node, rank=rank, local_rank=local_rank)


#: Loggers held at WARNING: torchft's Manager logs three INFO lines per step (quorum, commit vote), which would
#: bury the progress lines; lowband logs each change of membership itself (lowband.ft.session).
QUIET_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits")


def configure_rank_logging(identity: RankIdentity, *, stream: TextIO | None = None) -> None:
    """Set the root logger up for this rank: its level (:attr:`RankIdentity.level`) and a format that names its
    node and rank; :data:`QUIET_LOGGERS` at WARNING; Python warnings through logging. Called again (the node known only once the config is read),
    it replaces what it set."""
    logging.basicConfig(level=identity.level, stream=stream, force=True,
                        format=f"%(asctime)s {identity.prefix} %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(identity.level, logging.WARNING))
    logging.captureWarnings(True)  # Python warnings (torch's, transformers') get the rank's prefix too
