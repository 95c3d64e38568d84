"""`longstraw state-size` from config.json alone, against the real configs and against captured states."""

import json
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.cli import main
from longstraw.tools.state_size import state_size
from tests.conftest import tiny_config

# copies of ../shared/reference-configs (real model shapes, no weights), so the tests run from any checkout
REF = Path(__file__).resolve().parents[1] / "fixtures" / "reference-configs"


def test_qwen3_5_27b_attention_kv_is_64_kib_per_token():
    cfg = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    r = state_size(cfg, 2_100_000, "bf16")
    assert r["kinds"]["attention K/V"] == {"layers": 16, "bytes_per_token": 65_536, "fixed_bytes": 0}
    lin = r["kinds"]["Gated DeltaNet conv+recurrent"]
    conv_dim = 2 * 16 * 128 + 48 * 128
    assert lin["layers"] == 48
    assert lin["fixed_bytes"] == 48 * (conv_dim * 3 * 2 + 48 * 128 * 128 * 4)
    assert r["total_bytes"] == 65_536 * 2_100_000 + lin["fixed_bytes"]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("dtype,torch_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_matches_a_captured_state(model_type, dtype, torch_dtype):
    cfg = tiny_config(model_type)
    model = ls.build_model(cfg, dtype=torch_dtype)
    state = ls.capture(model, torch.randint(0, 97, (41,)))
    assert state_size(cfg, 40, dtype)["total_bytes"] == state.nbytes


def test_cli_prints_table(capsys):
    assert main(["state-size", "--config", str(REF / "qwen3_5-27b"), "--tokens", "2100000"]) == 0
    out = capsys.readouterr().out
    assert "65,536" in out and "2,100,000 tokens" in out


def test_cli_errors_name_the_problem(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["state-size", "--config", str(tmp_path), "--tokens", "10"]) == 2
    assert "supported: llama" in capsys.readouterr().err
    assert main(["state-size", "--config", str(REF / "qwen3_5-27b"), "--tokens", "10", "--dtype", "int3"]) == 2
    assert "dtype 'int3' unknown" in capsys.readouterr().err
