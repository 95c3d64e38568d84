"""A CPU stand-in, for the tests only, of CUDA's half-precision batched matmul with an fp32 output
(`torch.bmm(a, b, out_dtype=torch.float32)`, `aten::bmm.dtype`), which longstraw/ops/fp32_matmul.py calls for DSA's
scores and gradients on CUDA. That op has no CPU kernel; `installed()` registers this one under the CPU dispatch key
and lets fp32_matmul take its CUDA branch for CPU tensors, so the code the GPU runs runs here unchanged. Nothing in
longstraw imports this module.

Contracts, from PyTorch's aten/src/ATen/native/cuda/Blas.cpp (`_bmm_dtype_cuda` -> `baddbmm_bmm_out_dtype_checks`),
asserted so that a caller breaking one fails here instead of on the GPU:
- both operands 3-D ("batch1 must be a 3D tensor"), [b, m, k] and [b, k, n];
- of one dtype ("batch1 and batch2 must have the same dtype");
- out_dtype the input dtype, or fp32 for fp16/bf16 inputs ("out_dtype must be the same as input dtype or fp32 for
  fp16/bf16 inputs"); only the fp32 case is modelled, the one the library asks for.
cuBLAS multiplies the half operands exactly and accumulates in fp32 (compute type 32F): modelled as the products
summed in fp64 and rounded once to fp32, which is at least as accurate, so a test tolerance that passes here is
about fp32 rounding, not about a looser kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from longstraw.ops import fp32_matmul


class ContractError(AssertionError):
    """A call that the CUDA kernel would reject."""


@dataclass
class Calls:
    """The stand-in's calls: (operand dtype, [b, m, k], [b, k, n]) each."""

    shapes: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


def _bmm_dtype(calls: Calls):
    def bmm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if a.dim() != 3 or b.dim() != 3:
            raise ContractError(f"bmm.dtype takes 3-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
        if a.dtype != b.dtype:
            raise ContractError(f"bmm.dtype operands of one dtype, got {a.dtype} and {b.dtype}")
        if a.dtype not in (torch.float16, torch.bfloat16) or out_dtype != torch.float32:
            raise ContractError(f"modelled: fp16/bf16 operands into fp32, got {a.dtype} -> {out_dtype}")
        if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            raise ContractError(f"bmm.dtype shapes do not match: {tuple(a.shape)} @ {tuple(b.shape)}")
        calls.shapes.append((a.dtype, tuple(a.shape), tuple(b.shape)))
        return torch.bmm(a.double(), b.double()).float()

    return bmm_dtype


@contextmanager
def installed() -> Iterator[Calls]:
    """The stand-in registered as `aten::bmm.dtype`'s CPU kernel, and fp32_matmul taking its CUDA branch for CPU
    tensors, while the context lasts; yields the record of calls."""
    calls = Calls()
    lib = torch.library.Library("aten", "IMPL")
    devices = set(fp32_matmul.HALF_PRODUCT_DEVICES)
    try:
        lib.impl("bmm.dtype", _bmm_dtype(calls), "CPU")
        fp32_matmul.HALF_PRODUCT_DEVICES.add("cpu")
        yield calls
    finally:
        fp32_matmul.HALF_PRODUCT_DEVICES.clear()
        fp32_matmul.HALF_PRODUCT_DEVICES.update(devices)
        lib._destroy()
