"""Memory facts the engine plans with and benchmarks report: free memory, peak use (RSS or CUDA)."""

from __future__ import annotations

from pathlib import Path

import torch


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
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
