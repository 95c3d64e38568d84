"""ops/split_attention.py's CUDA branches on 2 gloo ranks, through the test-only stand-in of the two CUDA attention
kernels (tests/sdpa_standin.py, registered in each spawned rank), with the kernels `choose_kernel` takes on CUDA:
the exact GRPO gradient of a tiny dense model whose prompt chunks run split over the ranks (own block, earlier
blocks, sharded prefix rows in blocks of 4 gradient rows) and, with per-layer checkpointing, tile by tile (lead
keys, this block for the later blocks' queries), against one process's: fp32 (memory-efficient kernel) to fp32
rounding of the fp64 gradient, bf16 (FlashAttention-2) as close to it as one process with the CPU flash kernel."""

from __future__ import annotations

import torch

import longstraw as ls
from longstraw.ops import attention, split_attention
from longstraw.parallel import SequenceParallel
from tests import sdpa_standin
from tests.conftest import flat_grad, rel_err, tiny_model
from tests.parallel.launch import run_ranks

CHUNK = 16  # blocks of 7 to 9 tokens on 2 ranks: at least the tiny model's query tiles
ADV = [1.0, -0.3, -0.7]
KERNELS = ("cuda_flash", "cuda_efficient")
RUNS = [(dtype, checkpoint) for dtype in (torch.float32, torch.bfloat16) for checkpoint in (False, True)]


def _group():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 97, (45,), generator=g), [torch.randint(0, 97, (n,), generator=g) for n in (6, 2, 9)]


def _engine(checkpoint: bool) -> ls.EngineConfig:
    return ls.EngineConfig(prompt_chunk=CHUNK, checkpoint_layers=checkpoint, prompt_order="chunks",
                           prompt_graph_budget=0)


def _key(dtype: torch.dtype, checkpoint: bool) -> str:
    return f"{str(dtype).removeprefix('torch.')}.{'tiles' if checkpoint else 'whole'}"


def cuda_branches_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's exact gradients with the CUDA kernels on the stand-in, and which split call sites ran which
    kernel ([kernel, site] flags, sites in `call_sites` order)."""
    attention.choose_kernel = sdpa_standin.as_on_cuda(attention.choose_kernel)
    attention.PREFIX_GRAD_ROWS = attention.PREFIX_GRAD_ROWS_CPU = 4  # several row blocks per prefix backward
    sp = SequenceParallel()
    prompt, responses = _group()
    out = {}
    with sdpa_standin.installed() as recorder:
        for dtype, checkpoint in RUNS:
            model = tiny_model("qwen3", dtype=dtype)
            ls.grpo_backward(model, prompt, responses, ADV, mode="exact", engine=_engine(checkpoint), parallel=sp)
            out[_key(dtype, checkpoint)] = flat_grad(model)
    sites = sdpa_standin.call_sites(split_attention)
    ran = recorder.paths(sites)
    out["ran"] = torch.tensor([[(kernel, *site[:3]) in ran for site in sites] for kernel in KERNELS])
    return out


def test_split_attention_cuda_branches_keep_the_exact_gradient():
    prompt, responses = _group()
    ranks = run_ranks(2, cuda_branches_rank, timeout=240)
    ran = torch.stack([r["ran"] for r in ranks]).any(0)
    sites = sdpa_standin.call_sites(split_attention)
    missing = [(kernel, *site[1:3]) for k, kernel in enumerate(KERNELS) for s, site in enumerate(sites)
               if not ran[k, s]]
    assert not missing, missing
    print(f"\ncuda_* code paths run in ops/split_attention.py: {int(ran.sum())} ({len(sites)} call sites x 2 kernels)")
    for dtype, checkpoint in RUNS:
        model = tiny_model("qwen3", dtype=dtype)
        ref64 = tiny_model("qwen3", dtype=torch.float64)
        ref64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
        ls.grpo_backward(ref64, prompt, responses, ADV, mode="naive")
        want = flat_grad(ref64)
        got = [r[_key(dtype, checkpoint)].double() for r in ranks]
        assert torch.equal(got[0], got[1])  # parameter gradients summed over the group: the same on each rank
        if dtype == torch.float32:
            assert rel_err(got[0], want) <= 1e-5, _key(dtype, checkpoint)
        else:
            ls.grpo_backward(model, prompt, responses, ADV, mode="exact", engine=_engine(checkpoint))
            one_process = rel_err(flat_grad(model).double(), want)
            assert rel_err(got[0], want) <= max(1.5 * one_process, 1e-2), (_key(dtype, checkpoint), one_process)
