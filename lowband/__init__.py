"""lowband: training across nodes joined by slow links.

What a training loop of one's own needs, in one place::

    from lowband import FlexDeMo, Link, Topology, shard_model, transformer_blocks, save_checkpoint

- the layout of ranks: :class:`Topology` (nodes × ranks -> a 2-D DeviceMesh), :func:`shard_model`
  (FSDP2 over a node's ranks), :func:`transformer_blocks`;
- the one door between nodes: :class:`Link` (byte counts, shaping);
- the optimizers (:class:`FlexDeMo`, :class:`DiLoCo`, :class:`NoLoCo`, :class:`SparseLoCo` and the full-sync
  baselines) and their typed configs (``FlexDeMoConfig``, ... as ``lowband train`` builds them);
- checkpoints: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`latest_checkpoint`;
- fault tolerance's entry point: :class:`FaultToleranceConfig` and :class:`FaultTolerance` (torchft);
- the whole trainer: :class:`TrainConfig` and :class:`Trainer`.

Names are imported when first used: ``import lowband`` (and the ``lowband`` command's start) does not
pay for torch, transformers or torchft until a name that needs them is asked for.
"""

from __future__ import annotations

from lowband.util import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # layout of ranks
    "Topology": "lowband.distributed.topology",
    "shard_model": "lowband.distributed.sharding",
    "transformer_blocks": "lowband.train.models",
    # traffic between nodes
    "Link": "lowband.comm.link",
    "PeerLostError": "lowband.comm.link",
    "PeerTimeoutError": "lowband.comm.link",
    # optimizers
    "FlexDeMo": "lowband.optim",
    "DiLoCo": "lowband.optim",
    "NoLoCo": "lowband.optim",
    "SparseLoCo": "lowband.optim",
    "AdamWFullSync": "lowband.optim",
    "DetoFull": "lowband.optim",
    "MuonFullSync": "lowband.optim",
    "NonFiniteGradientError": "lowband.optim",
    # their configs, as lowband train builds them
    "METHODS": "lowband.train.methods",
    "AdamWConfig": "lowband.train.methods",
    "MuonConfig": "lowband.train.methods",
    "DetoFullConfig": "lowband.train.methods",
    "FlexDeMoConfig": "lowband.train.methods",
    "DiLoCoConfig": "lowband.train.methods",
    "NoLoCoConfig": "lowband.train.methods",
    "SparseLoCoConfig": "lowband.train.methods",
    # checkpoints
    "save_checkpoint": "lowband.checkpoint.dcp",
    "load_checkpoint": "lowband.checkpoint.dcp",
    "latest_checkpoint": "lowband.checkpoint.dcp",
    # fault tolerance
    "FaultToleranceConfig": "lowband.ft.node",
    "FaultTolerance": "lowband.ft.node",
    # the trainer
    "TrainConfig": "lowband.train.config",
    "Trainer": "lowband.train.loop",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
