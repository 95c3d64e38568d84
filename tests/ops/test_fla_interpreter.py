"""flash-linear-attention's gated delta rule kernels, which the CUDA path of `ops.gated_delta.gated_delta_rule`
runs, on CPU under Triton's interpreter: the chunk kernel (outputs, final state, every input's gradient, the
initial state's included) and the fused recurrent decode step, at grouped value heads with q and k passed at the
key heads, against the torch rule in float64.

The kernels run in a subprocess (tests/ops/fla_interpreter.py) that sees triton and fla-core from the folder
`make test` installs them into (`make fla-interp`); the project's .venv must not see them (with triton importable,
transformers' Qwen3.5 reference breaks on CPU). The test fails, not skips, when that folder is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLA_INTERP = ROOT / ".venv" / "fla-interp"  # the Makefile's FLA_INTERP
SCRIPT = Path(__file__).with_name("fla_interpreter.py")
# float32 kernels against the float64 rule, relative to the reference's largest magnitude (measured: <= 2e-6)
TOL = 1e-4


@pytest.fixture(scope="module")
def report() -> dict:
    if not (FLA_INTERP / ".installed").exists():
        pytest.fail(f"{FLA_INTERP} is not installed: `make test` installs triton and fla-core there for this test "
                    f"(its step `make fla-interp`); run `make fla-interp` or `make test`")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(FLA_INTERP), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{SCRIPT.name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    return out


def test_kernels_come_from_the_installed_folder(report):
    assert Path(report["fla_path"]).is_relative_to(FLA_INTERP)


@pytest.mark.parametrize("case", ["chunk_grouped", "chunk_plain_no_state", "decode_step_grouped"])
def test_kernel_through_the_dispatch_equals_the_torch_rule(report, case):
    r = report[case]
    s = r["shape"]
    assert r["kernel_calls"] == 1  # the dispatch took flash-linear-attention's kernel, not the torch fallback
    for name, (got, want) in r["shapes"].items():
        assert got == want, name
    if "dq" in r["shapes"]:  # the gradients of q and k come back at the key heads
        assert r["shapes"]["dq"][0][2] == r["shapes"]["dk"][0][2] == s["hk"]
    for name, err in r["errors"].items():
        assert r["largest"][name] > 1e-3, name  # the comparison means something: the reference is not ~0
        assert err <= TOL, (case, name, err)
