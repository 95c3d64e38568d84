"""Where flash-linear-attention refuses its gated chunk backward (fla-core 0.6.0 on Hopper with Triton >= 3.4.0 and
< 3.7.1, without its tilelang backend: its issue #640), `gated_delta_rule` takes the torch chunked rule for calls
that autograd records, warns once, and keeps FLA's kernel for forwards without autograd.

FLA is not importable in the project's .venv: FLA's modules that `fla_backward_refused` reads are stood in for here
(a few attributes each, set per case), and the FLA kernel is a stub that counts its calls and computes the torch
rule. The last test reads the real fla-core from the folder `make fla-interp` installs (as test_fla_interpreter.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from longstraw.ops import gated_delta
from tests.ops.test_gated_delta import make_inputs, reference_gated_delta

ROOT = Path(__file__).resolve().parents[2]
FLA_INTERP = ROOT / ".venv" / "fla-interp"  # the Makefile's FLA_INTERP


@pytest.fixture(autouse=True)
def fresh_answer():
    """The answer is cached per process, as FLA's flags are fixed at its import: each case asks anew."""
    gated_delta.fla_backward_refused.cache_clear()
    yield
    gated_delta.fla_backward_refused.cache_clear()


def stand_in_fla(monkeypatch, *, hopper=True, triton_3_4_0=True, triton_3_7_1=False, tilelang_available=False,
                 tilelang_enabled=True, dispatch_disabled=False, flags=True) -> None:
    """FLA's modules as `fla_backward_refused` reads them: chunk_o's flags, fla.backends' dispatch switch and the
    tilelang backend's availability and switch. (Only these names: the real fla and triton stay unimported.)"""
    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    if flags:
        chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_4_0, chunk_o.TRITON_ABOVE_3_7_1 = (
            hopper, triton_3_4_0, triton_3_7_1)
    backends = types.ModuleType("fla.backends")
    backends._DISPATCH_DISABLED = dispatch_disabled

    class CommonTileLangBackend:
        @classmethod
        def is_available(cls) -> bool:
            return tilelang_available

        def is_enabled(self) -> bool:
            return tilelang_enabled

    tilelang = types.ModuleType("fla.ops.common.backends.tilelang")
    tilelang.CommonTileLangBackend = CommonTileLangBackend
    for module in (chunk_o, backends, tilelang):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def test_without_fla_nothing_is_refused():
    assert "fla" not in sys.modules  # the project's .venv: FLA is not installed, so the torch rule runs anyway
    assert gated_delta.fla_backward_refused() is None


@pytest.mark.parametrize("case,refused", [
    (dict(), "tilelang is not available"),
    (dict(tilelang_available=True, tilelang_enabled=False), "FLA_TILELANG=0"),
    (dict(tilelang_available=True, dispatch_disabled=True), "FLA_DISABLE_BACKEND_DISPATCH=1"),
    (dict(tilelang_available=True), None),  # FLA's dispatch hands the call to tilelang
    (dict(hopper=False), None),
    (dict(triton_3_4_0=False), None),
    (dict(triton_3_7_1=True), None),
    (dict(flags=False), None),  # an FLA without this check
])
def test_refusal_follows_flas_own_condition(monkeypatch, case, refused):
    stand_in_fla(monkeypatch, **case)
    got = gated_delta.fla_backward_refused()
    if refused is None:
        assert got is None
    else:
        assert got is not None and refused in got
        assert "#640" in got and "Triton >= 3.7.1" in got and "pip install tilelang" in got  # the cause, the fix


class StubKernel:
    """FLA's chunk kernel as the dispatch calls it; computes the torch rule, counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q, k, v, *, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        assert output_final_state and use_qk_l2norm_in_kernel
        self.calls += 1
        return gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, initial_state)


@pytest.fixture
def stub(monkeypatch) -> StubKernel:
    """CPU tensors take the CUDA branch of the dispatch, whose chunk kernel is the stub; nothing warned yet."""
    kernel = StubKernel()
    monkeypatch.setattr(gated_delta, "_fla_device", lambda x: True)
    monkeypatch.setattr(gated_delta, "_fla_kernel", lambda name="chunk_gated_delta_rule": kernel)
    monkeypatch.setattr(gated_delta, "_warned_fla_backward", False)
    return kernel


def _inputs(requires_grad: bool) -> list[torch.Tensor]:
    (q, k, v, g, beta), s0 = make_inputs(1, 70, 2, 4, 8, 6, with_state=True, dtype=torch.float64, seed=3)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta, s0)]


def test_with_grad_the_torch_rule_runs_and_warns_once(monkeypatch, stub):
    stand_in_fla(monkeypatch)
    xs = _inputs(requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the once is the library's, not the warnings filter's
        for _ in range(3):
            o, final = gated_delta.gated_delta_rule(*xs[:5], initial_state=xs[5])
            (o.square().sum() + final.square().sum()).backward()
    assert stub.calls == 0  # FLA's kernel would raise in this backward
    mine = [w for w in caught if issubclass(w.category, RuntimeWarning) and "#640" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "Triton >= 3.7.1" in str(mine[0].message) and "pip install tilelang" in str(mine[0].message)
    want_o, want_final = reference_gated_delta(*(x.detach() for x in xs[:5]), initial_state=xs[5].detach())
    torch.testing.assert_close(o.detach(), want_o, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(final.detach(), want_final, rtol=1e-9, atol=1e-11)
    assert all(x.grad is not None and bool(x.grad.abs().sum() > 0) for x in xs)


@pytest.mark.parametrize("how", ["no_grad", "no_input_requires_grad"])
def test_without_a_backward_flas_forward_runs(monkeypatch, stub, how):
    stand_in_fla(monkeypatch)
    xs = _inputs(requires_grad=how == "no_grad")  # no_grad: the capture's case, inputs that would want gradients
    with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(how != "no_grad"):
        warnings.simplefilter("always")
        gated_delta.gated_delta_rule(*xs[:5], initial_state=xs[5])
    assert stub.calls == 1
    assert not [w for w in caught if "#640" in str(w.message)]


def test_with_grad_and_nothing_refused_flas_kernel_runs(monkeypatch, stub):
    stand_in_fla(monkeypatch, triton_3_7_1=True)
    xs = _inputs(requires_grad=True)
    gated_delta.gated_delta_rule(*xs[:5], initial_state=xs[5])
    assert stub.calls == 1 and not gated_delta._warned_fla_backward


def test_gpu_environment_report_names_the_refusal(monkeypatch):
    """bench/gpu/env.py's report (a dry run: no GPU wanted) carries the reason, and its summary shows it."""
    stand_in_fla(monkeypatch)
    kernels = types.ModuleType("fla.ops.gated_delta_rule")
    kernels.chunk_gated_delta_rule = StubKernel()
    monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
    spec = importlib.util.spec_from_file_location("gpu_env_refused", ROOT / "bench" / "gpu" / "env.py")
    env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env)
    monkeypatch.setattr(env, "sdpa_kernels", lambda device, dtype: {"choose_kernel": "cpu_flash"})
    report = env.environment(dry=True)
    assert report["fla_kernel"] == "ok" and "#640" in report["fla_backward_refused"]
    assert report["exit"] == 0  # the torch rule serves the backward: a report, not a stop
    assert "#640" in env.summary(report)


def test_real_fla_flags_are_the_names_read():
    """fla-core from `make fla-interp` (Triton 3.6.0, on this CPU): nothing refused as it is; with its Hopper flag
    set, refused (no tilelang there); with its tilelang backend reported available, not refused."""
    if not (FLA_INTERP / ".installed").exists():
        pytest.fail(f"{FLA_INTERP} is not installed: run `make fla-interp` (or `make test`, which runs it)")
    script = """
import json, sys
from longstraw.ops import gated_delta
import fla.ops.common.chunk_o as chunk_o
from fla.ops.common.backends.tilelang import CommonTileLangBackend
out = {"flags": [chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_4_0, chunk_o.TRITON_ABOVE_3_7_1],
       "as_is": gated_delta.fla_backward_refused()}
chunk_o.IS_NVIDIA_HOPPER = True
gated_delta.fla_backward_refused.cache_clear()
out["hopper"] = gated_delta.fla_backward_refused()
CommonTileLangBackend.is_available = classmethod(lambda cls: True)
gated_delta.fla_backward_refused.cache_clear()
out["hopper_tilelang"] = gated_delta.fla_backward_refused()
print(json.dumps(out))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "FLA_TILELANG": "1",
           "PYTHONPATH": os.pathsep.join([str(FLA_INTERP), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("FLA_DISABLE_BACKEND_DISPATCH", None)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["flags"] == [False, True, False]  # no GPU here; Triton 3.6.0
    assert out["as_is"] is None
    assert out["hopper"].startswith("flash-linear-attention ") and "Triton 3.6.0" in out["hopper"]
    assert "tilelang is not available" in out["hopper"]
    assert out["hopper_tilelang"] is None
