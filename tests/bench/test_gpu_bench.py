"""bench/gpu/bench.py, the prepared GPU benchmark, in its CPU dry run: every section runs and reports, a budget
too small for a measurement skips it with the reason instead of overrunning, and the FLOP count it divides by is
the independent one written here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_reports_every_section(tmp_path):
    out = tmp_path / "bench.json"
    res = _bench().main(["--dry-run", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["parity"]["logits_rel_err"] <= 1e-6 and res["parity"]["exact_grad_rel_err"] <= 1e-6
    assert [r["P"] for r in res["capture"]] == [64, 128, 256]
    assert all(r["tokens_per_s"] > 0 and r["state_bytes"] > 0 for r in res["capture"])
    assert res["exact"]["P"] == 256 and res["exact"]["planned_bytes"] > 0
    assert res["naive"]["mode"] == "naive" and res["naive"]["seconds"] > 0
    assert [(r["n"], r["compile"], r["static"]) for r in res["rollout"]] == [
        (1, "off", False), (8, "off", False), (1, "eager", True), (8, "eager", True), (1, "eager", False),
        (8, "eager", False)]
    assert all(r["tokens"] == r["n"] * 16 and r["tokens_per_s"] > 0 for r in res["rollout"])


def test_a_measurement_beyond_the_budget_is_skipped_with_its_reason(tmp_path):
    # a budget the parity check alone spends: every later measurement must be predicted not to fit, however fast
    # the machine (0.5 s was not always spent by then)
    res = _bench().main(["--dry-run", "--budget-s", "0.001", "--out", str(tmp_path / "b.json")])
    skipped = [r for r in res["capture"] if "skipped" in r]
    assert skipped and all("predicted" in r["skipped"] for r in skipped)
    assert res["exact"].get("skipped") or res["exact"]["P"] < 256


def test_forward_flops_count():
    bench = _bench()
    cfg = bench.model_config(True, 1024)
    model = bench.ls.build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    t, c = 100, 50
    attention = 1 * 4 * cfg["num_attention_heads"] * cfg["head_dim"] * (t * c + t * (t + 1) / 2)  # 1 of 4 layers
    linear = 3 * 4 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * t
    assert bench.forward_flops(cfg, params, t, c) == 2 * params * t + attention + linear
