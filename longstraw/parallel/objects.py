"""Small JSON values between ranks (commands, results, file checksums): UTF-8 bytes in uint8 tensors, never
pickle. torch's `broadcast_object_list` / `all_gather_object` unpickle what a peer sends; these do not.

All are collectives over `group` (default: the world): every rank of it calls them in the same order. On a
backend that moves CUDA tensors only (NCCL), pass a gloo group (the pipeline's control group) or `device`.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _encode(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decode(t: torch.Tensor):
    return json.loads(bytes(t.cpu().numpy()).decode())


def broadcast_json(value, src: int = 0, group: dist.ProcessGroup | None = None,
                   device: torch.device | str = "cpu"):
    """`value` of rank `src` (a global rank) on every rank; the others pass anything (None)."""
    mine = dist.get_rank() == src
    data = _encode(value).to(device) if mine else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    buf = data if mine else torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group=group)
    return value if mine else _decode(buf)


def gather_json(value, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> list:
    """The `value` of every rank of `group`, in rank order, on every rank."""
    data = _encode(value).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [_decode(o[: int(s)]) for o, s in zip(out, sizes)]
