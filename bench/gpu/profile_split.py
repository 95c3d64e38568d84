"""Where a profiled run's time went: torch.profiler's kernel time (CPU op time where no GPU ran) grouped into
attention, flash-linear-attention's Gated DeltaNet kernels, matrix products and the rest, by kernel name. The
groups are name patterns, so each report also lists the top kernels: a misfiled one shows there."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# checked in this order: the first group one of whose patterns a (lower-cased) name contains takes it
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # PyTorch's FlashAttention-2 (pytorch_flash::flash_fwd_kernel...), memory-efficient (fmha_cutlassF...), cuDNN
    # and CPU flash kernels, and the blocked torch path's softmax pieces are not attention-named: they land in other
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    # fla's Triton kernels (chunk_gated_delta_rule_fwd_kernel_h..., recompute_w_u_fwd_kernel, solve_tril...)
    ("fla", ("chunk_", "gated_delta", "delta_rule", "merge_16x16", "recompute_w_u", "wy_repr", "l2norm",
             "solve_tril", "gdn_", "fused_recurrent", "kkt")),
    # cuBLAS/CUTLASS GEMMs (nvjet..., sm90_xmma_gemm..., cutlass...gemm) and, on the CPU, the aten products
    ("matmul", ("gemm", "gemv", "nvjet", "xmma", "cublas", "cutlass", "aten::mm", "aten::bmm", "aten::addmm",
                "aten::matmul", "aten::linear", "aten::baddbmm")),
)


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, pats in GROUPS if any(p in low for p in pats)), "other")


@contextmanager
def profiled(device: torch.device):
    """torch.profiler over the block, the GPU's kernels on CUDA (CPU ops otherwise); yields the profiler."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        yield prof
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def split(prof, device: torch.device, top: int = 8) -> dict:
    """{unit, total_ms, ms: {group: ms}, share: {group: fraction}, top: [(name, ms)]} of a finished profile:
    on CUDA the self time of every kernel, on the CPU the self time of every aten op."""
    times: Counter[str] = Counter()
    for e in prof.key_averages():
        if device.type == "cuda":
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
        else:
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        if us > 0:
            times[e.key] += us / 1e3
    groups: Counter[str] = Counter({g: 0.0 for g, _ in GROUPS} | {"other": 0.0})
    for name, ms in times.items():
        groups[group_of(name)] += ms
    total = sum(groups.values())
    return {"unit": "kernel" if device.type == "cuda" else "CPU op", "total_ms": total, "ms": dict(groups),
            "share": {g: (ms / total if total else 0.0) for g, ms in groups.items()},
            "top": [(name, ms) for name, ms in times.most_common(top)]}
