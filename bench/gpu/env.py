"""The environment of a GPU run, printed before anything is measured: Python, torch, CUDA and the driver, the GPU,
Triton, whether flash-linear-attention's kernel imports (and whether FLA refuses its gated backward here), and
which SDPA kernel torch takes for Qwen3.5's bf16 256-wide grouped-query attention (and which the library's own
dispatch takes).

    python bench/gpu/env.py --out bench/out/gpu/env.json     # exit 3: no FLA kernel on a GPU; 4: no longstraw
    python bench/gpu/env.py --dry-run                         # on the CPU: nothing is required

bench/gpu/run.sh stops on a non-zero exit with the one line printed last, and bench.py's first row is this report.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NO_FLA, NO_LONGSTRAW, NO_CUDA = 3, 4, 5  # exit codes of the checks
WHEELS_HINT = "run bench/gpu/wheels.sh here and carry bench/gpu/wheels (docs/gpu.md)"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


class _OpNames(TorchDispatchMode):
    """Records the aten ops that run below autograd: the SDPA kernel that torch's dispatcher picked."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _attention_ops(names: list[str]) -> list[str]:
    """The attention kernels (and any repeat or expand of the key/value heads) among `names`, in order, once
    each."""
    keep = [n for n in names if "attention" in n or "repeat" in n or "expand" in n]
    return list(dict.fromkeys(keep))


def sdpa_kernels(device: torch.device, dtype: torch.dtype, heads: int = 24, kv_heads: int = 4, dim: int = 256,
                 tokens: int = 256) -> dict:
    """The aten ops of one causal grouped-query attention forward and backward, through torch's
    `scaled_dot_product_attention(enable_gqa=True)` and through the library's `segment_attention` over a prefix
    (kernel "auto"): which kernel runs, and whether anything repeats the key/value heads."""
    from longstraw.ops.attention import SegmentContext, choose_kernel, segment_attention

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype, generator=g, requires_grad=True)
            for _ in range(2))
    prefix = tuple(torch.randn(kv_heads, tokens, dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    out = {"choose_kernel": choose_kernel(device.type, dtype, dim, dim)}
    for name, run in (("torch_sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                            enable_gqa=True)),
                      ("segment_attention",
                       lambda: segment_attention(q, k, v, dim**-0.5, SegmentContext(prefix=prefix)))):
        try:
            with _OpNames() as fwd:
                o = run()
            with _OpNames() as bwd:
                o.backward(torch.ones_like(o))
            out[name] = {"forward": _attention_ops(fwd.names), "backward": _attention_ops(bwd.names)}
        except Exception as e:  # a kernel that refuses these shapes is what this report is for
            out[name] = {"error": _error(e)}
    return out


def _driver() -> str | None:
    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return got.stdout.strip().splitlines()[0] if got.returncode == 0 and got.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(dry: bool = False) -> dict:
    """The report (a JSON-able dict); `problem` names what stops a GPU run, None when nothing does."""
    env: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "cuda_available": torch.cuda.is_available(), "triton": _version("triton"),
                 "transformers": _version("transformers"), "pydantic": _version("pydantic"),
                 "fla_core": _version("fla-core"), "flash_linear_attention": _version("flash-linear-attention"),
                 "driver": _driver(), "problem": None, "exit": 0}
    if env["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        env |= {"gpu": p.name, "gpu_memory_gb": round(p.total_memory / 1e9, 1), "sm": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count, "cudnn": torch.backends.cudnn.version(),
                "sdpa_enabled": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                 "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                 "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}}
    try:
        importlib.import_module("longstraw")
        env["longstraw"] = "ok"
    except Exception as e:
        env["longstraw"] = _error(e)
        env |= {"problem": f"import longstraw failed ({env['longstraw']}): {WHEELS_HINT}", "exit": NO_LONGSTRAW}
        return env
    try:
        fla = importlib.import_module("fla.ops.gated_delta_rule")
        env["fla_kernel"] = "ok" if hasattr(fla, "chunk_gated_delta_rule") else "no chunk_gated_delta_rule"
    except Exception as e:
        env["fla_kernel"] = _error(e)
    # None, or why FLA's gated chunk backward would raise here, so that the dispatch takes the torch rule with autograd
    env["fla_backward_refused"] = None
    if env["fla_kernel"] == "ok":
        from longstraw.ops.gated_delta import fla_backward_refused
        env["fla_backward_refused"] = fla_backward_refused()
    device = torch.device("cuda" if env["cuda_available"] and not dry else "cpu")
    env["sdpa"] = sdpa_kernels(device, torch.bfloat16)
    if not dry and not env["cuda_available"]:
        env |= {"problem": "this torch sees no CUDA GPU (bench/gpu/run.sh --dry-run runs on the CPU)",
                "exit": NO_CUDA}
    elif not dry and env["fla_kernel"] != "ok":
        env |= {"problem": f"flash-linear-attention's kernel is missing ({env['fla_kernel']}): the bench would time "
                           f"the torch delta rule; {WHEELS_HINT}", "exit": NO_FLA}
    return env


def summary(env: dict) -> str:
    """A few lines for a person."""
    gpu = (f"{env['gpu']} ({env['gpu_memory_gb']} GB, sm {env['sm']}, {env['multiprocessors']} SMs), driver "
           f"{env['driver']}, CUDA {env['cuda']}, cuDNN {env.get('cudnn')}" if env.get("gpu") else "no CUDA GPU")
    lines = [f"python {env['python']}, torch {env['torch']}, triton {env['triton']}, transformers "
             f"{env['transformers']}, pydantic {env['pydantic']}", gpu,
             f"import longstraw: {env['longstraw']}; FLA kernel (fla-core {env['fla_core']}): "
             f"{env.get('fla_kernel', 'not checked')}; its backward: "
             f"{env.get('fla_backward_refused') or ('runs' if env.get('fla_kernel') == 'ok' else 'not checked')}"]
    for name, ops in env.get("sdpa", {}).items():
        if name != "choose_kernel":
            lines.append(f"bf16 GQA 24/4 x 256, {name}: {ops}")
    if "sdpa" in env:
        lines.append(f"the library's kernel choice: {env['sdpa']['choose_kernel']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="on the CPU: report, require nothing")
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args(argv)
    env = environment(args.dry_run)
    print(summary(env), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(env, indent=1))
    if env["problem"]:
        print(f"STOP: {env['problem']}", flush=True)
    return env["exit"]


if __name__ == "__main__":
    sys.exit(main())
