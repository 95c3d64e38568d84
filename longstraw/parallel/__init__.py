"""Multi-rank execution over torch.distributed: the sequence-parallel group that shards one prefix state, and
FSDP2 sharding of the parameters (ZeRO-2/3)."""

from .fsdp import full_tensor, gradient_replicas, is_sharded, local_shard, shard_from_rank0, shard_model
from .sequence import ONE_RANK, SequenceGroup, SequenceParallel, balanced_ranges

__all__ = ["ONE_RANK", "SequenceGroup", "SequenceParallel", "balanced_ranges", "full_tensor", "gradient_replicas", "is_sharded", "local_shard", "shard_from_rank0",
           "shard_model"]
