"""Multi-rank execution over torch.distributed: the sequence-parallel group that shards one prefix state."""

from .sequence import SequenceParallel, balanced_ranges

__all__ = ["SequenceParallel", "balanced_ranges"]
