"""Prefix state: what each layer keeps of the prompt (`LayerState` kinds) and the whole prompt's (`PrefixState`).
Pure data: nothing here imports the ops; the context of one forward over it is `longstraw.segment`.

A new state kind is one module here (a dataclass subclassing `TokenState` or `FixedState`) plus its line in
`STATE_KINDS`, which the store uses to read states back by name.
"""

from .attention import AttentionState
from .latent import LatentState
from .prefix import PrefixState, RowMap, boundary_states
from .protocol import FixedState, LayerState, TokenState
from .recurrent import RecurrentState

STATE_KINDS: dict[str, type[LayerState]] = {cls.kind: cls for cls in (AttentionState, LatentState, RecurrentState)}

__all__ = [
    "STATE_KINDS",
    "AttentionState",
    "FixedState",
    "LatentState",
    "LayerState",
    "PrefixState",
    "RecurrentState",
    "RowMap",
    "TokenState",
    "boundary_states",
]
