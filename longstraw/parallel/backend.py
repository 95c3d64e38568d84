"""Which device a process group's collectives take their tensors on: a host scalar (a norm of host-resident
gradients, a count, a checksum) moves there before a collective, and its result back."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Backends whose collectives take accelerator tensors only (a host tensor makes NCCL fail); every other backend
# here (gloo, mpi, ucc, torch's "fake") takes host tensors.
_DEVICE_ONLY = {"nccl": "cuda", "xccl": "xpu"}


def backend_device(backend: str) -> torch.device:
    """The device to hand a backend's collectives their tensors on: CUDA for NCCL, the CPU for gloo and the
    others. A group with one backend per device type ("cpu:gloo,cuda:nccl") takes host tensors as they are."""
    parts = [part.strip().lower() for part in str(backend).split(",") if part.strip()]
    if any(part.partition(":")[0] == "cpu" for part in parts if ":" in part):
        return torch.device("cpu")
    names = {part.rpartition(":")[2] for part in parts}
    for name, device in _DEVICE_ONLY.items():
        if name in names:
            return torch.device(device)  # the current device of that type (torchrun's ranks set theirs)
    return torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device `group`'s (default: the world's) backend reduces on: move a host scalar there before a
    collective, and its result back."""
    return backend_device(dist.get_backend(group))


def sum_over_ranks(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In place: `t` summed over `group`'s ranks, whatever device the group's backend takes (a host tensor, e.g.
    the norm of host-resident gradients or a count, travels to the GPU and back under NCCL). Returns `t`."""
    where = collective_device(group)
    if t.device.type == where.type:
        dist.all_reduce(t, group=group)
        return t
    moved = t.to(where)
    dist.all_reduce(moved, group=group)
    return t.copy_(moved)
