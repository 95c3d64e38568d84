"""The group of ranks that hold one prefix state together: `SequenceGroup` (one rank holding all of it, every
collective the identity) and `SequenceParallel` (C ranks of a torch.distributed group).

The engine, the ops and rollout always take a group and never ask whether it is one rank: the single-rank value
`ONE_RANK` runs the same code with collectives that do nothing, so there is one code path, not two.

Layout: every prompt chunk is cut into C contiguous blocks, one per rank (`chunk_blocks`), in rank order for even
chunks and reversed for odd ones, so that the causal work inside chunks evens out over pairs of chunks. A rank
holds the rows of its block of every chunk (`state.RowMap`); fixed-size states are replicated.

A prompt chunk runs split over that layout (engine/chunks.py): each rank computes only its block, through every
layer. Attention: the chunk's earlier blocks' K/V come by all-gather, the rows of earlier chunks stay where they
live and every rank's queries visit them (`ops/split_attention.py`); DSA: every rank scores every rank's queries
over its own rows, the owners merge the candidates into the global top-k, and the sparse attention runs where
the selected rows live (`ops/split_sparse_attention.py`); Gated DeltaNet: each block's affine summary of the
recurrence is all-gathered and composed (`ops/gated_delta.py`). Parameter gradients are then partial per rank
and summed over the group.
Replay gives each rank its share of the branches (padded with fillers that add nothing, so that G need not
divide by C), whose queries visit every rank's rows as a split chunk's do. Scoring without gradients and decoding
(few queries over the sharded prefix: the right pattern there) run all the queries on every rank; the attention
over the prefix is split by owner and merged by log-sum-exp (`ops.attention.merge_over`, over `gather` and
`sum_`), so every rank holds the same output. In a backward the gradient of a rank's own rows stays on it (dState
is sharded like the state).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from .backend import collective_device

Tensor = torch.Tensor

# The all-gather whose backward sums each rank's block gradient back to its owner: torch 2.13 names it
# all_gather_single_autograd (and deprecates the old name); torch 2.11 has only all_gather_tensor_autograd.
_all_gather_autograd = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


def balanced_ranges(length: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering [0, length), sizes differing by at most one (the first ones larger)."""
    base, extra = divmod(length, parts)
    starts = [r * base + min(r, extra) for r in range(parts + 1)]
    return list(zip(starts[:-1], starts[1:]))


def pad_to(t: Tensor, length: int, dim: int) -> Tensor:
    """`t` padded with zeros to `length` along `dim` (contiguous: collectives move raw storage)."""
    pad = length - t.shape[dim]
    if not pad:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _in_place(t: Tensor, collective) -> Tensor:
    """Run `collective` on `t` in place; collectives move raw storage, so a strided view goes through a copy."""
    if t.is_contiguous():
        collective(t)
        return t
    c = t.contiguous()
    collective(c)
    return t.copy_(c)


class SequenceGroup:
    """One rank that holds the whole prefix state: the group of size 1. Every collective is the identity, so code
    written for a group runs unchanged on one process. `SequenceParallel` is the same interface over C ranks."""

    rank, size, dp_rank, dp_size = 0, 1, 0, 1
    device = torch.device("cpu")  # where the group's own small tensors (checksums, counts, seeds) live
    bytes_communicated = 0  # payload this rank handed to collectives (for benchmarks)

    def branches(self, count: int) -> range:
        """The branches of a group of `count` that this rank's sequence-parallel group replays."""
        if count % self.dp_size:
            raise ValueError(f"a GRPO group of {count} responses does not split evenly over {self.dp_size} "
                             f"data-parallel groups; use a group size divisible by {self.dp_size}")
        per = count // self.dp_size
        return range(self.dp_rank * per, (self.dp_rank + 1) * per)

    def chunk_blocks(self, index: int, start: int, end: int) -> list[tuple[int, int]]:
        """Chunk `index` = [start, end) cut into one contiguous block per rank, listed by rank: balanced sizes, in
        rank order for even chunks and reversed for odd ones (the last block of a chunk does the most causal
        work; alternating who holds it balances the ranks)."""
        parts = [(start + a, start + b) for a, b in balanced_ranges(end - start, self.size)]
        return parts if index % 2 == 0 else parts[::-1]

    def boundary_owner(self, index: int, every: int = 1) -> int:
        """The rank that keeps the boundary states of chunk `index`, one of every `every`-th (they are replicated;
        one rank stores each, in turn)."""
        return index // every % self.size

    def global_rank(self, rank: int) -> int:
        return rank

    # ---- collectives (the identity on one rank) ------------------------------------------------------------
    def gather(self, t: Tensor) -> list[Tensor]:
        """`t` of every rank (same shape on all), in rank order."""
        return [t]

    def sum_(self, t: Tensor) -> Tensor:
        """In place: the sum of `t` over the group."""
        return t

    def broadcast_(self, t: Tensor, src: int) -> Tensor:
        """In place: `t` of rank `src` (a rank of this group) on every rank."""
        return t

    def share(self, mine: list[Tensor] | None, like: list[Tensor], owner: int) -> list[Tensor]:
        """Tensors that rank `owner` holds (`mine` there, None elsewhere) on every rank; `like` gives the other
        ranks their shapes and dtypes."""
        return mine

    def gather_blocks(self, t: Tensor, sizes: list[int], dim: int, autograd: bool = False) -> list[Tensor]:
        """Every rank's `t`, in rank order, whose length along `dim` is `sizes[rank]` (padded to the longest on
        the wire). With `autograd`, the backward sends each rank the sum of its block's gradients."""
        return [t]

    def exchange(self, parts: list[Tensor]) -> list[Tensor]:
        """All-to-all: `parts[r]` goes to rank r; returns what each rank sent this one, in rank order (every
        part of one shape on every rank)."""
        return parts

    def exchange_split(self, t: Tensor) -> list[Tensor]:
        """`exchange` of `t`'s C equal blocks on dim 0 ([C * B, ...]: block r to rank r), sent as `t` is (no
        stacked copy of the parts)."""
        return self.exchange(list(t.unflatten(0, (self.size, -1)).unbind(0)))

    def gather_padded(self, t: Tensor, length: int, dim: int) -> Tensor:
        """Every rank's `t` padded to `length` along `dim`, concatenated on dim 0 in rank order ([C * B, ...]
        for t [B, ...]; no autograd)."""
        return torch.cat(self.gather(pad_to(t, length, dim)), dim=0)

    def dp_sum_(self, t: Tensor) -> Tensor:
        """In place: the sum of `t` over the data-parallel groups."""
        return t

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (so that decisions taken from local facts, e.g. free memory, agree)."""
        return value

    def check_same(self, ids: Tensor, what: str) -> None:
        """ValueError on every rank unless every rank passed the same token ids."""

    def check_agree(self, what: str, settings: dict) -> None:
        """ValueError on every rank, naming the ranks and their values, unless every rank passed the same
        `settings` (JSON-able): those that decide the sequence of collectives (chunk, branch batch, boundary
        interval, mode, dtype). Call it before the first collective that depends on them."""


ONE_RANK = SequenceGroup()


def _disagreement(texts: list[str], ranks: list[int]) -> str:
    """Which settings differ between the ranks, with every rank's value."""
    values = [json.loads(t) for t in texts]
    keys = sorted({k for v in values for k in v})
    parts = []
    for k in keys:
        seen = [v.get(k) for v in values]
        if any(x != seen[0] for x in seen):
            parts.append(f"{k}: " + ", ".join(f"rank {r} has {x!r}" for r, x in zip(ranks, seen)))
    return "; ".join(parts)


class SequenceParallel(SequenceGroup):
    """The sequence-parallel group (default: the whole world) and the collectives the engine needs of it.

    With a data-parallel group `dp` (the ranks that hold the same token range in the other sequence-parallel
    groups), the groups split a GRPO group's branches between them (`branches`) and sum what they computed.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, dp: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("SequenceParallel needs torch.distributed.init_process_group() first (torchrun sets "
                               "RANK/WORLD_SIZE; use backend gloo on CPU, nccl on GPU)")
        self.group, self.dp = group, dp
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.dp_rank = 0 if dp is None else dist.get_rank(dp)
        self.dp_size = 1 if dp is None else dist.get_world_size(dp)
        self.bytes_communicated = 0  # payload this rank handed to collectives (for benchmarks)
        self.device = collective_device(group)  # where the group's own small tensors (checksums, counts, seeds) live

    @classmethod
    def from_mesh(cls, mesh, sp: str = "sp", dp: str | None = "dp") -> "SequenceParallel":
        """The groups of a DeviceMesh's dimensions, e.g. init_device_mesh("cuda", (N // C, C), ("dp", "sp"))."""
        names = mesh.mesh_dim_names or ()
        return cls(mesh.get_group(sp), mesh.get_group(dp) if dp in names else None)

    def dp_sum_(self, t: Tensor) -> Tensor:
        """In place: the sum of `t` over the data-parallel groups."""
        if self.dp is None:
            return t
        self.bytes_communicated += t.nelement() * t.element_size()
        return _in_place(t, lambda c: dist.all_reduce(c, group=self.dp))

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # ---- collectives ------------------------------------------------------------------------------------
    def gather(self, t: Tensor) -> list[Tensor]:
        """`t` of every rank (same shape on all), in rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        self.bytes_communicated += t.nelement() * t.element_size()
        return out

    def sum_(self, t: Tensor) -> Tensor:
        """In place: the sum of `t` over the group."""
        self.bytes_communicated += t.nelement() * t.element_size()
        return _in_place(t, lambda c: dist.all_reduce(c, group=self.group))

    def broadcast_(self, t: Tensor, src: int) -> Tensor:
        """In place: `t` of rank `src` (a rank of this group) on every rank."""
        self.bytes_communicated += t.nelement() * t.element_size()
        return _in_place(t, lambda c: dist.broadcast(c, self.global_rank(src), group=self.group))

    def share(self, mine: list[Tensor] | None, like: list[Tensor], owner: int) -> list[Tensor]:
        # contiguous on every rank alike, so that a backward fed with them takes the same kernels everywhere
        # (bitwise equal gradients on all ranks)
        rows = [t.contiguous() for t in mine] if self.rank == owner else [t.new_empty(t.shape) for t in like]
        for t in rows:
            self.broadcast_(t, owner)
        return rows

    def gather_blocks(self, t: Tensor, sizes: list[int], dim: int, autograd: bool = False) -> list[Tensor]:
        t = pad_to(t, max(sizes), dim)
        self.bytes_communicated += t.nelement() * t.element_size()
        if autograd:
            whole = _all_gather_autograd(t.unsqueeze(0), 0, self.group or dist.group.WORLD)
            whole = fc.wait_tensor(whole) if isinstance(whole, fc.AsyncCollectiveTensor) else whole
            parts = whole.unbind(0)
        else:
            parts = self.gather(t)
        return [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]

    def exchange(self, parts: list[Tensor]) -> list[Tensor]:
        return self.exchange_split(torch.cat(parts))

    def exchange_split(self, t: Tensor) -> list[Tensor]:
        send = t.contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self.bytes_communicated += send.nelement() * send.element_size() * (self.size - 1) // self.size
        return list(recv.unflatten(0, (self.size, -1)).unbind(0))

    def check_agree(self, what: str, settings: dict) -> None:
        text = json.dumps(settings, sort_keys=True, default=str).encode()
        digest = hashlib.sha256(text).digest()
        mine = torch.tensor([len(text), *digest[:7]], dtype=torch.int64, device=self.device)
        for group in self._groups():  # the same collectives on every rank, whatever the values
            if self._same_everywhere(mine, group):
                continue
            longest = torch.tensor([len(text)], dtype=torch.int64, device=self.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
            buf = torch.zeros(int(longest), dtype=torch.uint8, device=self.device)
            buf[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
            parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, buf, group=group)
            texts = [bytes(p.cpu().tolist()).rstrip(b"\0").decode() for p in parts]
            ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(len(parts))]
            raise ValueError(f"the ranks passed different {what} ({_disagreement(texts, ranks)}); every rank must "
                             f"pass the same settings, or their collectives would not match")

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values, over the data-parallel groups too (so that decisions taken from local
        facts, e.g. free memory, agree everywhere: under ZeRO-3 every group's forwards gather the same layers)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        for group in self._groups():
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t)

    def _groups(self) -> tuple:
        return (self.group,) if self.dp is None else (self.group, self.dp)

    def _same_everywhere(self, mine: Tensor, group) -> bool:
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        return torch.equal(lo, hi)

    def check_same(self, ids: Tensor, what: str) -> None:
        """ValueError on every rank unless every rank passed the same token ids."""
        digest = hashlib.sha256(ids.detach().to(torch.int64).cpu().numpy().tobytes()).digest()
        mine = torch.tensor([ids.numel(), *digest[:7]], dtype=torch.int64, device=self.device)
        same = True
        for group in self._groups():
            same = self._same_everywhere(mine, group) and same
        if not same:
            raise ValueError(f"the ranks of the sequence-parallel group passed different {what}; every rank must "
                             f"pass the same full {what} (rank {self.rank} has {ids.numel()} tokens)")
