"""`longstraw plan`: per-rank bytes from the config alone, activations from one-layer proxies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.cli import main
from longstraw.engine import activation_bytes_per_token
from longstraw.tools.plan import measured_activation_bytes, plan, smallest_fit
from longstraw.tools.state_size import state_size
from tests.conftest import GLM, tiny_config

REF = Path(__file__).resolve().parents[1] / "fixtures" / "reference-configs"


@pytest.mark.parametrize("cfg", [tiny_config("qwen3"), tiny_config("qwen3_5_text"), GLM], ids=["dense", "qwen3_5", "glm"])
def test_proxies_measure_what_the_whole_model_saves(cfg):
    torch.manual_seed(0)
    whole = activation_bytes_per_token(ls.build_model(cfg, dtype=torch.bfloat16))
    assert measured_activation_bytes(cfg) == pytest.approx(whole, rel=0.1)


def test_per_rank_bytes_follow_zero_and_sequence_parallel():
    cfg = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    size = state_size(cfg, 2_100_000, "bf16")
    one = plan(cfg, 2_100_000, 8, 96, zero=1, activation_bytes=10_000)
    three = plan(cfg, 2_100_000, 8, 96, zero=3, activation_bytes=10_000)
    psi = one["parameters"]
    assert 26e9 < psi < 28e9
    assert one["per_rank"]["parameters"] == 2 * psi and three["per_rank"]["parameters"] == 2 * psi / 8
    assert one["per_rank"]["optimizer"] == three["per_rank"]["optimizer"] == 12 * psi / 8
    assert one["per_rank"]["state shard"] == pytest.approx(size["bytes_per_token"] * 2_100_000 / 8 + size["fixed_bytes"])
    assert three["exact_bytes"] < one["exact_bytes"] and three["detached_bytes"] < three["exact_bytes"]
    n = smallest_fit(cfg, 2_100_000, 96, "exact", zero=3, activation_bytes=10_000)
    assert plan(cfg, 2_100_000, n, 96, zero=3, activation_bytes=10_000)["exact_fits"]
    assert not plan(cfg, 2_100_000, n // 2, 96, zero=3, activation_bytes=10_000)["exact_fits"]


def test_cli_prints_the_plan(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_5_text")))
    assert main(["plan", "--config", str(tmp_path), "--tokens", "100000", "--gpus", "4", "--gpu-mem-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "state shard" in out and "smallest N for exact" in out
    assert main(["plan", "--config", str(tmp_path), "--tokens", "10", "--gpus", "4", "--gpu-mem-gb", "1",
                 "--sp", "3"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_boundary_states_follow_the_engines_sparse_rule():
    """All of a rank's boundaries while they take at most 1/8 of the GPU, else 1 in k = ceil(sqrt(chunks per rank))
    plus up to k regenerated ones (engine/backward.py)."""
    cfg = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    fixed = state_size(cfg, 2_100_000, "bf16", 512)["fixed_bytes"]
    mine = -(-state_size(cfg, 2_100_000, "bf16", 512)["prompt_chunks"] // 8)
    roomy = plan(cfg, 2_100_000, 8, 10_000, zero=3, chunk=512, activation_bytes=10_000)
    tight = plan(cfg, 2_100_000, 8, 96, zero=3, chunk=512, activation_bytes=10_000)
    assert roomy["boundary_every"] == 1 and roomy["per_rank"]["boundary states"] == fixed * mine
    k = tight["boundary_every"]
    assert k == math.isqrt(mine - 1) + 1 > 1
    assert tight["per_rank"]["boundary states"] == fixed * (-(-mine // k) + k) < fixed * mine / 4
