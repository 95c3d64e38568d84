"""flash-linear-attention's gated delta rule kernels on CPU under Triton's interpreter, called through longstraw's
dispatch (`ops.gated_delta.gated_delta_rule`, the code the CUDA path runs), beside the torch rule in float64.

Run by tests/ops/test_fla_interpreter.py in a subprocess: TRITON_INTERPRET=1 and PYTHONPATH = the folder `make test`
installs triton and fla-core into (never the project's .venv: with triton importable there, transformers' Qwen3.5
reference breaks on CPU). Prints one JSON line: versions, which kernels ran, shapes, the largest errors (relative
to the reference's largest magnitude); the test asserts on it.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (tests/ops/test_fla_interpreter.py does)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import autotuner, interpreter  # noqa: E402


# --- shims: what the interpreter lacks that FLA's kernels or their launch need ----------------------------------

# 1. The autotuner times every config with triton.testing.do_bench, which needs a GPU driver ("0 active drivers");
#    timings mean nothing under the interpreter anyway, so each kernel takes its first config.
autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]

# 2. Triton 3.6's interpreter converts a scalar to an index with int(ndarray), which NumPy >= 2.4 refuses for a
#    one-element array of ndim > 0 (triton-lang/triton#9171, fixed after 3.6.0); FLA's kernels hit it in range()
#    bounds. The same conversion through .item(), set after (so restored before) the interpreter's own.
_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor_item(tensor, scope) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


interpreter._patch_lang_tensor = _patch_lang_tensor_item

# 3. fla/ops/common/chunk_delta_h.py widens its chunk loop's index with `i_t.to(tl.int64)`: compiled, a loop index
#    is a Triton scalar; interpreted, the body runs with Python's range and gets an int, which has no .to. That
#    module's loops get a range yielding int32 Triton scalars instead (built inside the kernel, where the
#    interpreter has patched tl.full).
import fla  # noqa: E402
import fla.ops.common.chunk_delta_h as chunk_delta_h  # noqa: E402
import fla.ops.gated_delta_rule as fla_gdr  # noqa: E402


def _scalar_range(*bounds):
    for i in builtins.range(*(int(b) for b in bounds)):
        yield tl.full((), i, tl.int32)


chunk_delta_h.range = _scalar_range

# --- the checks ---------------------------------------------------------------------------------------------------

from longstraw.ops import gated_delta  # noqa: E402

gated_delta._fla_device = lambda x: True  # CPU tensors take the CUDA branch of the dispatch

calls = {"chunk_gated_delta_rule": 0, "fused_recurrent_gated_delta_rule": 0}


def _counted(name: str):
    kernel = getattr(fla_gdr, name)

    def run(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, **kwargs)

    return run


for _name in calls:  # the dispatch looks the kernel up on this module at each call
    setattr(fla_gdr, _name, _counted(_name))


def inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, seed: int) -> list[torch.Tensor]:
    """q, k, v as views into one projection, as Gated DeltaNet makes them (not contiguous), the decay, the write
    strength and an initial state; float64 (the kernels get float32 copies)."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(b, t, 2 * hk * dk + hv * dv, generator=gen, dtype=torch.float64)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -F.softplus(torch.randn(b, t, hv, generator=gen, dtype=torch.float64) - 1.0)
    beta = torch.sigmoid(torch.randn(b, t, hv, generator=gen, dtype=torch.float64))
    h0 = torch.randn(b, hv, dk, dv, generator=gen, dtype=torch.float64)
    return [q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv), g, beta, h0]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def outputs_and_grads(fn, xs: list[torch.Tensor], with_state: bool, seed: int) -> dict[str, torch.Tensor]:
    """o, the final state and the gradients of a random linear functional of both w.r.t. every input."""
    leaves = [x.detach().requires_grad_() for x in xs]
    o, final = fn(*leaves[:5], initial_state=leaves[5] if with_state else None)
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    ws = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * wo).sum() + (final.double() * ws).sum()
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if with_state else [])
    grads = torch.autograd.grad(loss, leaves[:len(names)])
    return {"o": o, "final_state": final, **{f"d{n}": gr for n, gr in zip(names, grads)}}


def check_chunk(b: int, t: int, hk: int, hv: int, dk: int, dv: int, with_state: bool, seed: int) -> dict:
    xs = inputs(b, t, hk, hv, dk, dv, seed)
    before = calls["chunk_gated_delta_rule"]
    start = time.perf_counter()
    got = outputs_and_grads(gated_delta.gated_delta_rule, [x.float() for x in xs], with_state, seed + 1)
    seconds = time.perf_counter() - start
    want = outputs_and_grads(gated_delta.chunk_gated_delta_rule, xs, with_state, seed + 1)
    return {
        "shape": dict(b=b, t=t, hk=hk, hv=hv, dk=dk, dv=dv, with_state=with_state),
        "kernel_calls": calls["chunk_gated_delta_rule"] - before,
        "seconds": round(seconds, 2),
        "shapes": {n: [list(got[n].shape), list(want[n].shape)] for n in want},
        "dtypes": {n: str(got[n].dtype) for n in ("o", "final_state")},
        "largest": {n: float(want[n].detach().abs().max()) for n in want},
        "errors": {n: rel(got[n], want[n]) for n in want},
    }


def check_decode_step(b: int, hk: int, hv: int, dk: int, dv: int, seed: int) -> dict:
    xs = inputs(b, 1, hk, hv, dk, dv, seed)
    before = calls["fused_recurrent_gated_delta_rule"]
    with torch.no_grad():
        got = gated_delta.gated_delta_rule(*(x.float() for x in xs[:5]), initial_state=xs[5].float())
        want = gated_delta.recurrent_gated_delta_rule(*xs[:5], initial_state=xs[5])
    names = ["o", "final_state"]
    return {
        "shape": dict(b=b, t=1, hk=hk, hv=hv, dk=dk, dv=dv, with_state=True),
        "kernel_calls": calls["fused_recurrent_gated_delta_rule"] - before,
        "shapes": {n: [list(a.shape), list(w.shape)] for n, a, w in zip(names, got, want)},
        "largest": {n: float(w.abs().max()) for n, w in zip(names, want)},
        "errors": {n: rel(a, w) for n, a, w in zip(names, got, want)},
    }


def main() -> None:
    start = time.perf_counter()
    report = {
        "versions": {"triton": triton.__version__, "fla": fla.__version__, "torch": torch.__version__},
        "fla_path": fla.__file__,
        # grouped value heads (each key head serves 3), dk != dv, two chunks of 64 (the second partial)
        "chunk_grouped": check_chunk(2, 100, 2, 6, 32, 16, with_state=True, seed=0),
        "chunk_plain_no_state": check_chunk(1, 70, 2, 2, 16, 16, with_state=False, seed=10),
        "decode_step_grouped": check_decode_step(3, 2, 6, 32, 16, seed=20),
    }
    report["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
