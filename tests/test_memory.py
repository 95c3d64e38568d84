"""`memory.free_bytes`: what a new tensor can take. On CUDA that is the driver's free memory plus what torch's
caching allocator holds reserved but unallocated (issue 36: after warm-up the cache is most of it, and the
checkpointing and prompt-order choices saw too little). CUDA is simulated by monkeypatching torch.cuda."""

from __future__ import annotations

import torch

from longstraw.memory import free_bytes

GB = 1 << 30


def test_cuda_free_bytes_count_the_allocators_cache(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (asked.append(d), (3 * GB, 80 * GB))[1])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 70 * GB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 20 * GB)
    gpu = torch.device("cuda", 1)
    assert free_bytes(gpu) == 3 * GB + 50 * GB  # the driver's 3 GB and the 50 GB cached
    assert asked == [gpu]
    # a fresh process: nothing cached
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    assert free_bytes(gpu) == 3 * GB


def test_host_free_bytes_are_memavailable():
    import pathlib

    line = next(x for x in pathlib.Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    assert abs(free_bytes(torch.device("cpu")) - int(line.split()[1]) * 1024) < GB  # read a moment apart
