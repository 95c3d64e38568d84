"""ops/fp32_matmul.py: fp32 (or wider) products of half operands, as bf16 products on CUDA (its branch run here on
CPU tensors through tests/bmm_standin.py) and upcast elsewhere; references are fp64 products written here."""

from __future__ import annotations

import pytest
import torch

from longstraw.ops.fp32_matmul import matmul_fp32, operand_dtype
from tests import bmm_standin


def operands(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """a [2, 3, 5, 40] and b [2, 3, 40, 7], b a transposed view (the layout the DSA ops pass keys in)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 3, 5, 40, generator=g).to(dtype)
    b = torch.randn(2, 3, 7, 40, generator=g).to(dtype).transpose(-1, -2)
    return a, b


def rel(x: torch.Tensor, want: torch.Tensor) -> float:
    return float((x.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("cuda_branch", [False, True], ids=["upcast", "cuda-branch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_operands_give_fp32_sums_of_exact_products(cuda_branch, dtype):
    a, b = operands(dtype)
    want = a.double() @ b.double()  # the products of the half values, summed in fp64
    if cuda_branch:
        with bmm_standin.installed() as calls:
            got = matmul_fp32(a, b)
        assert len(calls.shapes) == 1 and calls.shapes[0] == (dtype, (6, 5, 40), (6, 40, 7))
    else:
        got = matmul_fp32(a, b)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 5, 7)
    # fp32 rounding of the sum, far below a half-precision output's (2**-8 for bf16, 2**-11 for fp16)
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_other_operands_are_upcast_never_multiplied_in_half(dtypes):
    a, b = operands(torch.float64)
    a, b = a.to(dtypes[0]), b.to(dtypes[1])
    with bmm_standin.installed() as calls:
        got = matmul_fp32(a, b)
    assert calls.shapes == []
    assert got.dtype == (torch.float64 if torch.float64 in dtypes else torch.float32)
    assert rel(got, a.double() @ b.double()) < (1e-14 if got.dtype == torch.float64 else 1e-6)


def test_operand_dtype_rounds_intermediates_only_where_products_run_in_half():
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    assert operand_dtype(bf16) == torch.float32  # CPU: upcast, so an fp32 intermediate stays fp32
    assert operand_dtype(torch.zeros(2, dtype=torch.float64)) == torch.float64
    with bmm_standin.installed():
        assert operand_dtype(bf16) == torch.bfloat16
        assert operand_dtype(torch.zeros(2)) == torch.float32


def test_mismatched_operands_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(2, 5, 4\) and \(3, 4, 6\)"):
        matmul_fp32(torch.zeros(2, 5, 4), torch.zeros(3, 4, 6))
    with pytest.raises(ValueError, match="same leading dims"):
        matmul_fp32(torch.zeros(2, 5, 4), torch.zeros(2, 5, 6))


def test_standin_rejects_what_the_cuda_kernel_rejects():
    with bmm_standin.installed():
        with pytest.raises(bmm_standin.ContractError, match="one dtype"):
            torch.bmm(torch.zeros(1, 2, 3, dtype=torch.bfloat16), torch.zeros(1, 3, 2, dtype=torch.float16),
                      out_dtype=torch.float32)
