"""The group of ranks that hold one prefix state together: `SequenceGroup` (one rank holding all of it, every
collective the identity) and `SequenceParallel` (C ranks of a torch.distributed group).

The engine, the ops and rollout always take a group and never ask whether it is one rank: the single-rank value
`ONE_RANK` runs the same code with collectives that do nothing, so there is one code path, not two.

Rank r owns the rows of one contiguous, balanced token range (`ranges`); fixed-size states are replicated. Every
forward over the state (a prompt chunk, a batch of branches, a decode step) is run by all ranks of the group on
the same tokens: the token-local work is replicated, and attention over the prefix is split by owner. Each rank
attends the segment's queries over its own rows and the partial results merge exactly by log-sum-exp (`merge`),
so every rank holds the same output. In a backward the gradient of a rank's own rows stays on it (dState is
sharded like the state), and the ranks' shares of the queries' gradient are summed (`sum_`), so that everything
replicated (the segment's activations, parameters, fixed-size states) gets the same, exact gradient on every
rank: no parameter gradient needs reducing over the group. What a rank owns and must hand to the others (a
chunk's dState rows, its boundary states) goes by `share`.

Why this schedule: one primitive serves capture, replay, the exact prompt backward and decoding; all ranks run
the same collectives in the same order (ZeRO-3 / FSDP gather parameters layer by layer, in lockstep); and at
long prompts attention over the prefix is most of the work (Qwen3.5-27B at 2.1M tokens: ~88% of a forward's
FLOPs), which it splits C ways. What it does not split is the token-local work (projections, MLPs, the
recurrence), which every rank repeats; a layer-major wavefront or LASP-2 state passing would split that too.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def balanced_ranges(length: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering [0, length), sizes differing by at most one (the first ones larger)."""
    base, extra = divmod(length, parts)
    starts = [r * base + min(r, extra) for r in range(parts + 1)]
    return list(zip(starts[:-1], starts[1:]))


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

    def ranges(self, length: int) -> list[tuple[int, int]]:
        """The token range [start, end) of each rank of the group, in rank order."""
        return balanced_ranges(length, self.size)

    def owner(self, position: int, length: int) -> int:
        """The rank whose range of a `length`-token state holds `position`."""
        return next(r for r, (a, b) in enumerate(self.ranges(length)) if a <= position < b)

    def global_rank(self, rank: int) -> int:
        return rank

    # ---- collectives (the identity on one rank) ------------------------------------------------------------
    def merge(self, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """The partial attention results (o [..., d], lse [...]) of all ranks merged by log-sum-exp; a rank with
        no rows passes lse = -inf. Returns the same (o, lse) on every rank."""
        return o, lse

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

    def dp_sum_(self, t: Tensor) -> Tensor:
        """In place: the sum of `t` over the data-parallel groups."""
        return t

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (so that decisions taken from local facts, e.g. free memory, agree)."""
        return value

    def check_same(self, ids: Tensor, what: str) -> None:
        """ValueError on every rank unless every rank passed the same token ids."""


ONE_RANK = SequenceGroup()


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
        # where the group's own small tensors (checksums, counts, seeds) live: NCCL moves CUDA tensors only
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

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
    def merge(self, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """The partial attention results (o [..., d], lse [...]) of all ranks merged by log-sum-exp; a rank with
        no rows passes lse = -inf. Returns the same (o, lse) on every rank."""
        total = torch.logsumexp(torch.stack(self.gather(lse)), dim=0)
        safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
        acc = torch.promote_types(o.dtype, torch.float32)
        weighted = o.to(acc) * torch.exp(lse - safe)[..., None].to(acc)
        self.sum_(weighted)
        return weighted.to(o.dtype), total

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

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (so that decisions taken from local facts, e.g. free memory, agree)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)

    def check_same(self, ids: Tensor, what: str) -> None:
        """ValueError on every rank unless every rank passed the same token ids."""
        digest = hashlib.sha256(ids.detach().to(torch.int64).cpu().numpy().tobytes()).digest()
        mine = torch.tensor([ids.numel(), *digest[:7]], dtype=torch.int64, device=self.device)
        same = True
        for group in (self.group, self.dp) if self.dp is not None else (self.group,):
            lo, hi = mine.clone(), mine.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            same = same and torch.equal(lo, hi)
        if not same:
            raise ValueError(f"the ranks of the sequence-parallel group passed different {what}; every rank must "
                             f"pass the same full {what} (rank {self.rank} has {ids.numel()} tokens)")
