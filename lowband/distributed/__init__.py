"""The layout of ranks: nodes × ranks as a DeviceMesh, FSDP2 sharding inside a node, tied embeddings, compiled blocks."""

from lowband.distributed.sharding import PRECISIONS, mixed_precision_policy, set_gradient_sync, shard_model
from lowband.distributed.tied_embedding import (
    ShardedEmbedding,
    ShardedTiedProjection,
    VocabShard,
    shard_tied_embedding,
)
from lowband.distributed.topology import Topology

__all__ = ["PRECISIONS", "ShardedEmbedding", "ShardedTiedProjection", "Topology", "VocabShard", "mixed_precision_policy", "set_gradient_sync", "shard_model", "shard_tied_embedding"]
