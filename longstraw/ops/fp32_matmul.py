"""Matrix products that accumulate and return fp32 from half-precision operands (DSA's scores and gradients).

Upcasting bf16 operands to fp32 before a product keeps fp32 accumulation, but runs the product on the GPU's fp32
units instead of its tensor cores (an order of magnitude slower). CUDA's `torch.bmm` takes half operands with an
fp32 output (`out_dtype`; cuBLAS accumulates in fp32): the same products (that of two bf16 values is exact in fp32)
summed in fp32. Where no such kernel exists (the CPU) the operands are upcast first, which computes the same thing.

An fp32 intermediate (softmax probabilities, score gradients) meets a half operand rounded to its dtype only where
the product then runs on half operands, as flash attention rounds P and dS; elsewhere rounding would gain nothing,
so it stays fp32 (`operand_dtype`).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor
HALF_DTYPES = (torch.bfloat16, torch.float16)
# The device types whose bmm multiplies half operands into an fp32 output. A test may add "cpu" beside a stand-in
# kernel for `aten::bmm.dtype`, to run this path on the CPU.
HALF_PRODUCT_DEVICES = {"cuda"}
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()  # torch.bmm(..., out_dtype=): present from 2.8 on


def half_products(t: Tensor) -> bool:
    """Whether products with operands like `t` run on its half dtype with fp32 accumulation."""
    return _BMM_OUT_DTYPE and t.dtype in HALF_DTYPES and t.device.type in HALF_PRODUCT_DEVICES


def operand_dtype(like: Tensor) -> torch.dtype:
    """The dtype to give an fp32 intermediate before its product with `like` (see the module docstring)."""
    return like.dtype if half_products(like) else torch.promote_types(like.dtype, torch.float32)


def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a [..., m, k] @ b [..., k, n] (the same leading dims) -> [..., m, n] in fp32, or wider if an operand is.
    Operands of one half dtype multiply as they are where `half_products` holds; otherwise both are upcast."""
    if a.shape[:-2] != b.shape[:-2] or a.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul_fp32 multiplies [..., m, k] by [..., k, n] with the same leading dims; got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}: reshape or expand the operands to match")
    if a.dtype == b.dtype and half_products(a) and b.device == a.device:
        batch = a.shape[:-2]
        count = math.prod(batch)
        out = torch.bmm(a.reshape(count, *a.shape[-2:]), b.reshape(count, *b.shape[-2:]), out_dtype=torch.float32)
        return out.view(*batch, a.shape[-2], b.shape[-1])
    acc = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return torch.matmul(a.to(acc), b.to(acc))
