"""The segment layer: the context of one forward over a segment of tokens (`Segment`, `core.py`) and, one module
each, the mixing primitives a layer runs over it (`attend`, `select_topk` / `attend_sparse`, `delta_rule`,
`conv_tail`). It sits above `ops/` and `state/` (the kernels and the data) and below `models/` and `engine/`.

A new mixing primitive is a new module here: a function of the segment that reads its context (`prefix_rows`,
`prefix_grad`, `initial_state`, `own_rows`, `split`, `cache`) and calls the primitive's op, or on a split chunk
its split variant; nothing in `core.py` changes.
"""

from .attention import attend
from .convolution import conv_tail
from .core import ChunkSplit, DecodeCache, PrefixView, QueryTile, Segment
from .delta_rule import delta_rule
from .sparse_attention import attend_sparse, select_topk

__all__ = [
    "ChunkSplit",
    "DecodeCache",
    "PrefixView",
    "QueryTile",
    "Segment",
    "attend",
    "attend_sparse",
    "conv_tail",
    "delta_rule",
    "select_topk",
]
