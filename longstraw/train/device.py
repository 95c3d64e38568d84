"""Which device a training run computes on (the run config's `device:`), and which device a process group's
collectives take their tensors on."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

DEVICE_SETTINGS = "auto, cpu, cuda or cuda:N"
_SETTING = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_setting(setting: str) -> str:
    """`setting` if it is one of auto | cpu | cuda | cuda:N, else a ValueError naming the choices."""
    if not isinstance(setting, str) or not _SETTING.fullmatch(setting):
        raise ValueError(f"device {setting!r} is not one of {DEVICE_SETTINGS} (N: a GPU index, e.g. cuda:0); auto "
                         "takes the GPU when torch sees one, else the CPU")
    return setting


def run_device(setting: str = "auto") -> torch.device:
    """The device of this process's model for a run config's `device:`.

    auto    this process's current CUDA device when torch sees one (a torchrun rank: its LOCAL_RANK's), else the CPU
    cpu     the CPU, even on a GPU machine
    cuda    the current CUDA device; a ValueError when there is none
    cuda:N  GPU N; a ValueError when there is no such GPU"""
    check_device_setting(setting)
    if setting == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if setting == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if available else torch.device("cpu")
    if not available:
        raise ValueError(f"device {setting!r}: torch sees no CUDA device here (torch {torch.__version__}, built for "
                         f"CUDA {torch.version.cuda or 'none: a CPU build'}); set device: cpu (or auto), or run on a "
                         "GPU machine with a CUDA build of torch")
    if setting == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    index, count = int(setting.split(":")[1]), torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {setting!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}; "
                         "pick one of them, or set device: cuda (the current one)")
    return torch.device("cuda", index)


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
