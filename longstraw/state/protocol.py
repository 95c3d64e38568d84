"""The contract between one layer kind's prefix state and the engine, rollout and store.

A layer keeps one `LayerState` for the prefix. The engine, rollout and store only call the methods below; they
never ask which kind a state is. Two families of behaviour cover every kind so far, each written once:

- `TokenState`: grows with the prefix, one row per token along axis -2 of every tensor (attention K/V, the MLA
  latent and DSA indexer keys). Its rows are shared by all branches and never copied; in exact mode dLoss/dState
  is added in place into a *sink* (a `grad_buffer()`) that the forward is handed.
- `FixedState`: a fixed-size summary of all tokens so far (the Gated DeltaNet conv tail and delta-rule state).
  Each branch continues from its own view of it; in exact mode it enters a forward as an autograd leaf, and a
  chunk recompute needs it at the chunk start (a *boundary*).

A concrete kind is a dataclass of tensors (optional ones may be None) that names itself (`kind`, the store's
name) and the tensors that get a gradient (`grad_fields`). Sharding along the sequence (issue "Scale-out") cuts
with `narrow` and joins with `concat`; the log-sum-exp merge of partial attention stays in `ops/attention.py`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import ClassVar, TypeVar

import torch

Tensor = torch.Tensor
S = TypeVar("S", bound="LayerState")


class LayerState(ABC):
    kind: ClassVar[str]  # name in the store and in STATE_KINDS
    label: ClassVar[str]  # what `longstraw state-size` calls it
    grad_fields: ClassVar[tuple[str, ...]]  # tensors that get dLoss/d(tensor); the others are constant to the loss
    token_axis: ClassVar[int | None]  # axis of the tokens in every tensor (-2), or None for fixed-size states

    # ---- contents -------------------------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, Tensor]:
        """The tensors by name, in declaration order (absent optional tensors left out)."""
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(self.named_tensors().values())

    def differentiable(self) -> tuple[Tensor, ...]:
        """The tensors that carry gradient (as a segment emits them, with autograd history)."""
        return tuple(getattr(self, name) for name in self.grad_fields)

    def map(self: S, fn: Callable[[Tensor], Tensor]) -> S:
        """The same kind with `fn` applied to every tensor."""
        return type(self)(**{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)})

    @classmethod
    def from_tensors(cls: type[S], tensors: dict[str, Tensor]) -> S:
        return cls(**tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nelement() * t.element_size() for t in self.tensors())

    @property
    def description(self) -> str:
        """What `longstraw state-size` calls this layer's state."""
        return self.label

    @property
    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes this state adds per prefix token."""

    @property
    @abstractmethod
    def fixed_bytes(self) -> int:
        """Bytes that do not grow with the prefix."""

    def to(self: S, device: torch.device | str) -> S:
        return self.map(lambda t: t.to(device))

    def detach(self: S) -> S:
        return self.map(Tensor.detach)

    def row(self: S, b: int) -> S:
        """Batch row `b` of a state as a segment emits it (batch dim first) -> the unbatched state."""
        return self.map(lambda t: t[b])

    # ---- along the tokens -----------------------------------------------------------------------------------
    @abstractmethod
    def narrow(self: S, start: int, end: int) -> S:
        """Tokens [start, end) as views; a fixed-size state (the state after all its tokens) is returned whole."""

    @classmethod
    @abstractmethod
    def concat(cls: type[S], parts: Sequence[S]) -> S:
        """The state of consecutive token ranges joined in order."""

    # ---- capture --------------------------------------------------------------------------------------------
    @abstractmethod
    def append(self, start: int | Tensor, new: LayerState) -> LayerState:
        """The state after a segment at `start` (an int, or a 0-dim device tensor) emitted `new` (unbatched):
        per-token rows are written in place (the buffer is preallocated), a fixed-size state is replaced by `new`."""

    @abstractmethod
    def boundary(self) -> LayerState | None:
        """What exact mode must keep at a chunk start to recompute that chunk (None: nothing, the earlier rows
        stay in the state)."""

    # ---- exact mode -----------------------------------------------------------------------------------------
    def grad_buffer(self: S) -> S:
        """Zeros in this state's layout for the tensors that get a gradient (the dState buffer)."""
        return type(self)(**{f.name: torch.zeros_like(getattr(self, f.name)) if f.name in self.grad_fields else None
                             for f in fields(self)})

    def add_(self: S, other: LayerState) -> S:
        """In-place sum of two gradient buffers of this kind (e.g. of branch slices replayed apart)."""
        theirs = other.named_tensors()
        for name, t in self.named_tensors().items():
            t.add_(theirs[name].to(t))
        return self

    @abstractmethod
    def leaf(self) -> LayerState:
        """What a forward with autograd reads so that dLoss/d(this state) is collected."""

    @abstractmethod
    def leaf_grad(self) -> LayerState | None:
        """dLoss/d(this leaf) after backward; None when the gradient went into the sink handed to the forward."""

    @abstractmethod
    def segment_grads(self, start: int, end: int) -> list[Tensor]:
        """Read as a dState buffer: the gradients of what a segment over tokens [start, end) emits, with batch
        dim 1, in `differentiable()` order."""

    # ---- decoding -------------------------------------------------------------------------------------------
    @abstractmethod
    def for_branches(self, rows: int) -> LayerState:
        """The prefix as `rows` decoding branches read it (never a copy of per-token rows)."""

    @abstractmethod
    def decode_buffer(self, rows: int) -> LayerState | None:
        """Per-branch buffers in this layout for the tokens a branch generates (this state's token count = how
        many); None when a branch carries its own fixed-size state instead."""

    @abstractmethod
    def advance(self, new: LayerState) -> LayerState:
        """The state after a segment emitted `new` whose rows are kept elsewhere (in the decode buffers, or on the
        rank that owns them): a fixed-size state moves on to `new`, per-token rows stay as they are."""


class TokenState(LayerState):
    """A state with one row per token along axis -2 of every tensor."""

    token_axis = -2

    @property
    def tokens(self) -> int:
        return self.tensors()[0].shape[-2]

    @property
    def bytes_per_token(self) -> int:
        return sum(math.prod(t.shape[:-2] + t.shape[-1:]) * t.element_size() for t in self.tensors())

    @property
    def fixed_bytes(self) -> int:
        return 0

    def narrow(self, start, end):
        return self.map(lambda t: t.narrow(-2, start, end - start))

    @classmethod
    def concat(cls, parts):
        return cls(**{f.name: None if getattr(parts[0], f.name) is None
                      else torch.cat([getattr(p, f.name) for p in parts], dim=-2) for f in fields(parts[0])})

    def append(self, start, new):
        theirs = new.named_tensors()
        for name, buf in self.named_tensors().items():
            t = theirs[name]
            if isinstance(start, Tensor):  # a device-side position (static decode): index, never read on the host
                rows = start + torch.arange(t.shape[-2], device=buf.device)
                buf.index_copy_(buf.dim() - 2, rows, t.to(buf.dtype))
            else:
                buf.narrow(-2, start, t.shape[-2]).copy_(t)
        return self

    def boundary(self):
        return None

    def leaf(self):
        return self  # read as a constant; the forward adds dLoss/dState into the sink it is handed

    def leaf_grad(self):
        return None

    def segment_grads(self, start, end):
        return [t[None].narrow(-2, start, end - start) for t in self.differentiable()]

    def for_branches(self, rows):
        return self

    def decode_buffer(self, rows):
        return self.map(lambda t: t.new_empty(rows, *t.shape))

    def advance(self, new):
        return self  # generated tokens go to the decode buffers, the shared prefix never grows


class FixedState(LayerState):
    """A fixed-size state: what all tokens so far left behind."""

    token_axis = None

    @property
    def bytes_per_token(self) -> int:
        return 0

    @property
    def fixed_bytes(self) -> int:
        return self.nbytes

    def narrow(self, start, end):
        return self

    @classmethod
    def concat(cls, parts):
        return parts[-1]

    def append(self, start, new):
        return new.detach()

    def boundary(self):
        return self

    def leaf(self):
        return self.map(lambda t: t.detach().requires_grad_())  # same storage, a fresh autograd leaf

    def leaf_grad(self):
        return self.map(lambda t: t.grad if t.grad is not None else torch.zeros_like(t))

    def segment_grads(self, start, end):
        return [t[None] for t in self.differentiable()]

    def for_branches(self, rows):
        return self.map(lambda t: t[None].expand(rows, *t.shape))  # broadcast views; each next state is its own

    def decode_buffer(self, rows):
        return None

    def advance(self, new):
        return new.detach()
