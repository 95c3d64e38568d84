"""Memory facts the engine plans with and benchmarks report: free memory, peak use (RSS or CUDA); and the bytes a
stage read and wrote (`measured`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch


def free_bytes(device: torch.device) -> int:
    """Bytes a new tensor on `device` can take. CUDA: the driver's free memory plus what torch's caching allocator
    holds reserved but unallocated (after a warm-up that cache is most of the free memory, and it serves new
    tensors first). CPU: Linux MemAvailable."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + max(cached, 0)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak(device: torch.device | None = None) -> None:
    """Start a new peak measurement (CUDA allocator peak, or Linux VmHWM via /proc/self/clear_refs)."""
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux or not permitted: the peak then counts from process start


def peak_bytes(device: torch.device | None = None) -> int:
    """Peak CUDA allocation, or peak resident set size of this process since the last reset."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_freed() -> None:
    """Hand freed heap memory back to the OS (glibc), so the next peak measurement starts clean."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def current_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakMeter:
    """`with PeakMeter(device) as m:` -> m.peak_bytes (peak above the start) and m.seconds of the block."""

    def __init__(self, device: torch.device | None = None, collect: bool = True) -> None:
        """`collect`: start from a garbage-collected, trimmed heap (a full `gc.collect`, which costs 0.1-0.4 s in a
        process holding Prefect and MLflow: the training ops skip it, their tensors go by reference counting)."""
        self.device = device
        self.collect = collect
        self.peak_bytes = 0
        self.seconds = 0.0

    def __enter__(self) -> "PeakMeter":
        import time

        if self.collect:
            release_freed()
        self._base = torch.cuda.memory_allocated(self.device) if self._cuda else current_bytes()
        reset_peak(self.device)
        self._t0 = time.perf_counter()
        return self

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def __exit__(self, *exc) -> None:
        import time

        self.seconds = time.perf_counter() - self._t0
        self.peak_bytes = peak_bytes(self.device) - self._base


def io_bytes() -> tuple[int, int]:
    """(bytes read, bytes written) by this process so far: Linux /proc/self/io rchar/wchar, which count reads
    served from the page cache too (what a stage asks of storage); (0, 0) where there is no such file."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["rchar"]), int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def measured(fn: Callable[..., dict], *args, **kwargs) -> dict:
    """fn's result dict with `op_seconds` (wall) and the `read_bytes` / `written_bytes` of this process meanwhile."""
    r0, w0 = io_bytes()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    r1, w1 = io_bytes()
    return {**out, "op_seconds": time.perf_counter() - t0, "read_bytes": r1 - r0, "written_bytes": w1 - w0}
