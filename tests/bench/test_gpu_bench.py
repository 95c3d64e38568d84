"""bench/gpu: the prepared GPU benchmark in its CPU dry run (every section reports, a budget too small for a
measurement skips it with the reason instead of overrunning, the FLOP count it divides by is the independent one
written here), its rows surviving a kill of bench/gpu/run.sh, and the environment check that stops a GPU run."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


def _load(name: str):
    sys.path.insert(0, str(GPU))
    try:
        spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(GPU))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_dry_run_reports_every_section(tmp_path):
    res = _load("bench").main(["--dry-run", "--out", str(tmp_path)])
    rows = res["rows"]
    assert _rows(tmp_path) == json.loads(json.dumps(rows))  # everything returned was written, in order
    table = (tmp_path / "table.txt").read_text().splitlines()
    assert len(table) == len(rows) and not [line for line in table if "ERROR" in line or "FAIL" in line]
    by = {}
    for r in rows:
        by.setdefault(r["section"], []).append(r)
    assert list(by) == ["env", "model", "warmup", "parity", "capture", "profile", "step", "decode", "end"]
    assert by["env"][0]["torch"] and by["env"][0]["sdpa"]["choose_kernel"] == "cpu_flash"
    assert len(by["warmup"]) == 3 and all(r["first_s"] > 0 and r["second_s"] > 0 for r in by["warmup"])
    # the CPU path against the reference: each parity row's tensors agree, the fp32 one ran in its own process
    # with IEEE dots asked of Triton
    assert len(by["parity"]) == 5 and all(r["ok"] and r["worst"] <= 1e-4 for r in by["parity"])
    assert set(by["parity"][2]["rel_err"]) == {"o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert "TRITON_F32_DEFAULT=ieee" in by["parity"][-1]["what"]
    assert [r["P"] for r in by["capture"]] == [64, 128] == [r["P"] for r in by["profile"]]
    assert all(r["tokens_per_s"] > 0 and r["state_bytes"] > 0 for r in by["capture"])
    for r in by["profile"]:
        assert r["total_ms"] > 0 and sum(r["share"].values()) == pytest.approx(1.0) and r["share"]["matmul"] > 0
    (s,) = by["step"]
    assert (s["mode"], s["P"], s["checkpoint_layers"]) == ("exact", 128, True) and s["planned_bytes"] > 0
    decoded = [r for r in by["decode"] if "skipped" not in r]
    assert [(r["n"], r["compile"], r["static"]) for r in decoded] == [
        (1, "off", False), (2, "off", False), (1, "eager", True), (2, "eager", True)]
    assert all(r["tokens"] == r["n"] * 8 and r["tokens_per_s"] > 0 for r in decoded)
    assert rows[-1]["section"] == "end"


def test_a_measurement_beyond_the_budget_is_skipped_with_its_reason(tmp_path):
    # a budget that the warm-up alone spends: every later measurement must be predicted not to fit, however fast
    # the machine
    rows = _load("bench").main(["--dry-run", "--budget-s", "0.001", "--out", str(tmp_path)])["rows"]
    skipped = [r for r in rows if "skipped" in r]
    assert {r["section"] for r in skipped} == {"capture", "step", "decode", "parity"}
    assert all("predicted" in r["skipped"] or "left" in r["skipped"] or r["skipped"].startswith("dry run")
               for r in skipped)
    assert not [r for r in rows if r["section"] in ("step", "decode") and "skipped" not in r]


def test_forward_flops_count():
    bench = _load("bench")
    cfg = bench.model_config(True, 1024)
    model = bench.ls.build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    t, c = 100, 50
    embed = cfg["vocab_size"] * cfg["hidden_size"]  # tied: the head is the embedding, once among the parameters
    attention = 1 * 4 * cfg["num_attention_heads"] * cfg["head_dim"] * (t * c + t * (t + 1) / 2)  # 1 of 4 layers
    linear = 3 * 4 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * t
    assert bench.forward_flops(cfg, params, t, c) == 2 * (params - embed) * t + attention + linear
    assert bench.forward_flops(cfg, params, t, c, head=True) == 2 * params * t + attention + linear


def _session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (run.sh and everything it started, `timeout`'s own process groups too)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_a_killed_run_keeps_the_rows_written_so_far(tmp_path):
    """bench/gpu/run.sh --dry-run killed (SIGKILL, all its processes) once some rows are out: each row written
    before is in rows.jsonl, whole, and its line in table.txt."""
    out = tmp_path / "out"
    env = os.environ | {"OUT": str(out), "GPU_TESTS": "0", "PY": sys.executable}
    proc = subprocess.Popen([str(GPU / "run.sh"), "--dry-run"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            jsonl = out / "rows.jsonl"
            if jsonl.exists() and jsonl.read_text().count("\n") >= 5:  # env, model, the warm-ups
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the dry run ended before 5 rows: nothing left to kill"
    finally:
        for pid in _session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    rows = _rows(out)  # every line parses
    assert len(rows) >= 5 and rows[0]["section"] == "env" and all(r["section"] != "end" for r in rows)
    table = (out / "table.txt").read_text().splitlines()
    # each row's table line follows its JSON line: a kill between the two leaves one line fewer
    fmt = _load("rows").format_row
    assert len(rows) - 1 <= len(table) <= len(rows) and table == [fmt(r) for r in rows[:len(table)]]


def test_environment_stops_a_gpu_run_without_the_fla_kernel(monkeypatch):
    """On a CUDA machine where flash-linear-attention does not import (as in the project's .venv), the check
    fails with the exit code run.sh stops on and names the fix."""
    env = _load("env")
    monkeypatch.setattr(env.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(env.torch.cuda, "get_device_properties", lambda i: type(
        "P", (), dict(name="fake H100", total_memory=80e9, major=9, minor=0, multi_processor_count=132))())
    monkeypatch.setattr(env, "sdpa_kernels", lambda device, dtype: {"choose_kernel": "cuda_flash"})
    monkeypatch.setattr(env, "_driver", lambda: None)
    monkeypatch.setattr(env.torch.backends.cudnn, "version", lambda: None)
    real_import = env.importlib.import_module
    monkeypatch.setattr(env.importlib, "import_module", lambda name: (_ for _ in ()).throw(
        ModuleNotFoundError("No module named 'fla'")) if name.startswith("fla") else real_import(name))
    got = env.environment()
    assert got["exit"] == env.NO_FLA and "wheels.sh" in got["problem"] and got["longstraw"] == "ok"
    assert env.environment(dry=True)["exit"] == 0


def test_run_sh_without_a_gpu_stops_with_one_line(tmp_path):
    """bench/gpu/run.sh (not a dry run) where torch sees no GPU: it stops at the environment check, exit 5,
    with one STOP line, before any test or row."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run.sh would go on to the bench")
    env = os.environ | {"OUT": str(tmp_path), "GPU_TESTS": "0", "PY": sys.executable}
    done = subprocess.run([str(GPU / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 5, done.stdout + done.stderr
    stops = [line for line in done.stdout.splitlines() if line.startswith("STOP:")]
    assert len(stops) == 1 and "no CUDA GPU" in stops[0]
    assert (tmp_path / "run.log").read_text() == done.stdout and not (tmp_path / "rows.jsonl").exists()
