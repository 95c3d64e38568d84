"""`infra/launch.sh --deepspeed ds.json`: the DeepSpeed config's fields LongStraw honours become TrainConfig
overrides (longstraw/train/ds_config.py, read from $LONGSTRAW_DEEPSPEED_CONFIG by train / resume / serve);
engine-tuning fields are ignored with a warning; anything else is refused with what to set instead. Also the
planner's bytes per parameter (`optimizer_bytes`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from longstraw.train.config import TrainConfig
from longstraw.train.ds_config import ENV, deepspeed_overrides, read_deepspeed_config
from longstraw.train.precision import optimizer_bytes, precision_of

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra" / "deepspeed"


def test_every_shipped_config_maps_onto_a_valid_train_config():
    seen = {}
    for path in sorted(INFRA.glob("*.json")):
        over, ignored = read_deepspeed_config(path)
        cfg = TrainConfig.model_validate({"model": {"path": "x"}, "pipeline": {"nproc": 2}, **over})
        seen[path.name] = (cfg, ignored)
    cfg, ignored = seen["zero2.json"]
    assert (cfg.optim.zero_stage, cfg.optim.offload, cfg.optim.mixed_precision, cfg.dtype) == (2, "none", True,
                                                                                              "bfloat16")
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.eps, cfg.optim.weight_decay, cfg.optim.grad_clip) == (
        1e-5, (0.9, 0.999), 1e-8, 0.0, 1.0)
    cfg, _ = seen["zero3-offload-cpu.json"]
    assert (cfg.optim.zero_stage, cfg.optim.offload, cfg.optim.mixed_precision) == (3, "cpu", True)
    cfg, _ = seen["zero3-offload-nvme.json"]
    assert (cfg.optim.offload, cfg.optim.nvme_path) == ("nvme", "/local_nvme/longstraw")


def test_mapping_of_each_honoured_field():
    over, ignored = read_deepspeed_config({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0,
        "bf16": {"enabled": False}, "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 1, "overlap_comm": True,
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": True}},
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                  "weight_decay": 0.01}}})
    assert over == {"optim": {"zero_stage": 1, "offload": "nvme", "nvme_path": "/nvme", "lr": 3e-4,
                              "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.01, "grad_clip": None}}
    assert ignored == ["wall_clock_breakdown", "zero_optimization.offload_optimizer.pin_memory",
                       "zero_optimization.overlap_comm"]


@pytest.mark.parametrize("cfg,field,hint", [
    ({"fp16": {"enabled": True}}, "fp16", "use bf16"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler", "optim.warmup_updates"),
    ({"optimizer": {"type": "Adam", "params": {}}}, "optimizer.type", "set type AdamW"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr", "give a value"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode", "L2"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param",
     "parameter offload is not supported"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "zero_optimization.offload_optimizer.device",
     "not none, cpu or nvme"),
    ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps", "must be 1"),
    ({"train_batch_size": 64}, "train_batch_size", "`groups` prompts"),
    ({"bf16": {"enabled": True, "loss_scale": 0}}, "bf16.loss_scale", "unknown to LongStraw"),
    ({"no_such_field": 1}, "no_such_field", "unknown to LongStraw"),
])
def test_fields_not_honoured_are_refused_by_name(cfg, field, hint):
    with pytest.raises(ValueError, match=f"`{field}` is not honoured by LongStraw") as e:
        read_deepspeed_config(cfg)
    assert hint in str(e.value)


def test_a_bad_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_deepspeed_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 2")
    with pytest.raises(ValueError, match="bad.json is not JSON"):
        read_deepspeed_config(bad)


def test_the_pipeline_commands_read_the_env_var_and_the_command_line_wins(tmp_path, monkeypatch):
    from flows.cli import _overrides  # train / resume / serve build their config with it

    ds = tmp_path / "ds.json"
    monkeypatch.setenv(ENV, str(ds))
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                              "bf16": {"enabled": True}}))

    class Args:
        run_dir, steps, nproc, rope_scaling = str(tmp_path / "run"), 2, 2, None

    over = _overrides(Args())
    assert over["optim"] == {"zero_stage": 3, "offload": "cpu", "mixed_precision": True}
    assert over["dtype"] == "bfloat16" and over["steps"] == 2 and over["pipeline"] == {"nproc": 2}
    monkeypatch.delenv(ENV)
    assert deepspeed_overrides() == {}


def _launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "infra" / "launch.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=60)


def test_launch_sh_exports_the_config_for_train_and_refuses_other_commands():
    out = _launch("--nproc", "2", "--deepspeed", "infra/deepspeed/zero2.json", "--dry-run", "--", "train",
                  "--config", "configs/train-tiny.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"LONGSTRAW_DEEPSPEED_CONFIG={INFRA / 'zero2.json'} ")
    assert "torchrun --standalone --nproc-per-node 2 -m flows.cli train" in out.stdout
    assert "deepspeed --num_gpus" not in out.stdout
    bad = _launch("--nproc", "1", "--deepspeed", "infra/deepspeed/zero2.json", "--dry-run", "--", "step")
    assert bad.returncode == 2 and "configures the optimizer of train, resume and serve" in bad.stderr


def test_optimizer_bytes_per_parameter():
    def per(*a):
        return optimizer_bytes(1, *a)["per_param"]

    assert per("fp32", "none", 0, 1) == {"device": 16.0, "host": 0.0, "nvme": 0.0}  # 4 + 4 + 8
    assert per("bf16", "none", 0, 1)["device"] == 8.0  # 2 + 2 + 4: pure bf16 moments
    # bf16-mixed, ZeRO-0: 2 weights + 8 moments + 4 master + max(2 bf16 grad, 4 fp32 master grad)
    assert per("bf16-mixed", "none", 0, 1)["device"] == 18.0
    # ZeRO-3 over 8: bf16 shards and gradients, fp32 masters, master grads and moments, all 1/8
    assert per("bf16-mixed", "none", 3, 8) == {"device": 18 / 8, "host": 0.0, "nvme": 0.0}
    # ZeRO-1 over 4: whole bf16 weights and gradients; master, its gradient and moments 1/4
    assert per("bf16-mixed", "none", 1, 4)["device"] == 2 + 3 + max(2, 1)
    assert per("bf16-mixed", "cpu", 0, 1) == {"device": 4.0, "host": 16.0, "nvme": 0.0}
    assert per("bf16-mixed", "nvme", 3, 8) == {"device": 0.5, "host": 0.5, "nvme": 1.5}
    full = optimizer_bytes(27e9, "bf16-mixed", "cpu", 3, 8)
    assert full["host"] == pytest.approx(27e9 * 2.0)
    with pytest.raises(ValueError, match="precision 'fp16'"):
        optimizer_bytes(1, "fp16")
    assert precision_of("bfloat16", True) == "bf16-mixed" and precision_of("float32", False) == "fp32"
