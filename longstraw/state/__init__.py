"""Prefix state: what each layer keeps of the prompt (`LayerState` kinds), the whole prompt's (`PrefixState`),
and the context of one forward (`Segment`).

A new state kind is one module here (a dataclass subclassing `TokenState` or `FixedState`) plus its line in
`STATE_KINDS`, which the store uses to read states back by name.
"""

from .attention import AttentionState
from .latent import LatentState
from .prefix import PrefixState, RowMap, boundary_states
from .protocol import FixedState, LayerState, TokenState
from .recurrent import RecurrentState
from .segment import DecodeCache, PrefixView, QueryTile, Segment

STATE_KINDS: dict[str, type[LayerState]] = {cls.kind: cls for cls in (AttentionState, LatentState, RecurrentState)}

__all__ = [
    "STATE_KINDS",
    "AttentionState",
    "DecodeCache",
    "FixedState",
    "LatentState",
    "LayerState",
    "PrefixState",
    "PrefixView",
    "QueryTile",
    "RecurrentState",
    "RowMap",
    "Segment",
    "TokenState",
    "boundary_states",
]
