"""Where the optimizer's fp32 master weights and AdamW moments live when they leave the device (`optim.offload`).

cpu   host memory, stepped by DeepSpeed's CPU Adam (`deepspeed.ops.adam.DeepSpeedCPUAdam`, AdamW mode: its
      vectorised C++ kernel, compiled by torch's JIT extension builder at first use, ~1 minute with g++ and ninja,
      then cached under TORCH_EXTENSIONS_DIR: by default `<venv>/torch_extensions`, so each venv builds it once;
      `make install` builds it).
nvme  the same CPU Adam, over master weights and moments that are memory-mapped files under `optim.nvme_path`
      (`FileTensors`: one file per tensor, numpy.memmap): the kernel reads and writes them through the page cache,
      and the OS writes the pages back to the disk. Host memory then holds only the pages in use.

Why not DeepSpeed's own NVMe swapper (`PartitionedOptimizerSwapper`, what `offload_optimizer: nvme` runs in
DeepSpeed's ZeRO-3 engine): it can run outside that engine on CPU (tried: DeepSpeedCPUAdam over a flat fp32
partition swapped in and out around each step gave torch's AdamW weights), but it needs
- libaio and its headers (Debian's libaio-dev), a system package that pip cannot install and this project's
  machines do not have: its `async_io` op does not build without it;
- that op's JIT build (4.5 minutes on the 2-core CI machine) on top of CPU Adam's;
- DeepSpeed's own process-group layer (`deepspeed.comm`) initialised, which on CPU builds a third op (shm comm);
- its engine's conventions: flat fp32 partitions carrying `ds_id` string attributes, tensors under 1 MB kept in
  memory, swap buffers sized by the largest partition.
So `nvme` uses torch's equivalent (memory-mapped files) with DeepSpeed's CPU Adam doing the math; the files are
scratch space (recreated at every start, deleted when the optimizer goes), never a checkpoint: checkpoints hold the
master and moments as every optimizer's (longstraw/train/checkpoint.py, atomic and checksummed).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

INSTALL = ("optim.offload needs DeepSpeed (its CPU Adam): `make install`, or in the venv `pip install ninja` then "
           "`pip install --no-build-isolation 'deepspeed>=0.19,<0.20'` (after torch)")


def extensions_dir() -> str:
    """Where torch's JIT extension builder keeps DeepSpeed's compiled ops: TORCH_EXTENSIONS_DIR when set, else
    `torch_extensions/` in the virtual environment (one build per venv, removed with it) when it is writable,
    else torch's default (~/.cache/torch_extensions)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
        return os.environ["TORCH_EXTENSIONS_DIR"]
    return str(Path.home() / ".cache" / "torch_extensions")


def cpu_adam_class() -> type[torch.optim.Optimizer]:
    """DeepSpeed's CPU Adam class (importing DeepSpeed; its op is built at the first instance)."""
    extensions_dir()
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:
        raise ImportError(f"{INSTALL} ({e})") from None
    return DeepSpeedCPUAdam


def cpu_adam(params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float) -> torch.optim.Optimizer:
    """DeepSpeedCPUAdam in AdamW mode (decoupled weight decay, as torch.optim.AdamW) with fp32 moments over host
    tensors."""
    cls = cpu_adam_class()
    try:
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True,
                   fp32_optimizer_states=True)
    except Exception as e:  # the JIT build: a missing compiler or ninja
        raise RuntimeError(f"DeepSpeed's CPU Adam op did not build ({type(e).__name__}: {e}); it needs g++ and "
                           f"ninja (pip install ninja), and writes to {extensions_dir()}") from e


def build_cpu_adam() -> str:
    """Build (or find built) DeepSpeed's CPU Adam op now, e.g. at install time; returns where it lies."""
    opt = cpu_adam([torch.zeros(1, requires_grad=True)], 1e-3, (0.9, 0.999), 1e-8, 0.0)
    del opt
    return extensions_dir()


class FileTensors:
    """fp32 tensors backed by memory-mapped files in a directory of their own under `root` (offload nvme).

    The directory is `root/longstraw-optim-rank<R>-pid<P>-<random>`: one optimizer's, removed when the optimizer
    is garbage-collected or the process exits normally; a directory left by a process that no longer runs (killed)
    is removed when the next one starts here."""

    def __init__(self, root: str | Path, rank: int) -> None:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob("longstraw-optim-rank*-pid*-*"):
            pid = old.name.split("-pid", 1)[1].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"longstraw-optim-rank{rank}-pid{os.getpid()}-", dir=root))
        self._count = 0
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)

    def new(self, shape: torch.Size | tuple[int, ...], fill: torch.Tensor | None = None) -> torch.Tensor:
        """A zero (or `fill`) fp32 tensor of `shape` whose storage is a fresh file in this directory."""
        self._count += 1
        numel = int(np.prod(shape)) if len(shape) else 1
        mm = np.memmap(self.dir / f"t{self._count:06d}.f32", dtype=np.float32, mode="w+", shape=(max(numel, 1),))
        t = torch.from_numpy(mm)[:numel].view(tuple(shape))
        if fill is not None:
            t.copy_(fill)
        return t

    def close(self) -> None:
        self._finalizer()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
