"""Which device a training run computes on (the run config's `device:`). The device a process group's collectives
take their tensors on is parallel/backend.py's."""

from __future__ import annotations

import re

import torch

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
