"""Watching FSDP2's parameter all-gathers, whatever the torch: it calls `dist.all_gather_single` from torch 2.13 on
and `dist.all_gather_into_tensor` before (2.11), looked up on the module at each call, so a wrapper set there sees
every gather."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@contextmanager
def watching_weight_gathers(seen: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within, `seen(output)` runs on the output buffer of each of FSDP2's parameter all-gathers."""
    plain = getattr(dist, GATHER)

    def watched(output, *args, **kwargs):
        seen(output)
        return plain(output, *args, **kwargs)

    setattr(dist, GATHER, watched)
    try:
        yield
    finally:
        setattr(dist, GATHER, plain)
