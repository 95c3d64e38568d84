"""Checkpoints are all-or-nothing: a writer that fails leaves the previous checkpoint as the latest one. One
process here; tests/parallel/test_checkpoint_sharded.py runs the same code on two ranks."""

import json

import pytest
import torch

import longstraw.train.checkpoint as ck
from longstraw.train.config import OptimConfig
from longstraw.train.optim import build_optimizer, optimizer_step
from tests.conftest import tiny_model


def _stepped(model, cfg=OptimConfig()):
    """An AdamW with state: one step on a fixed gradient."""
    opt = build_optimizer(model, cfg)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.sin(torch.arange(p.numel(), dtype=p.dtype) + i).reshape(p.shape)
    optimizer_step(model, opt, cfg, 0, 1)
    return opt


def test_failed_write_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    model = tiny_model()
    opt = _stepped(model)
    root = tmp_path / "checkpoints"
    ck.save_checkpoint(root / "update-000000", model, opt, update=0, step=0, extra={"weights_version": "v0"})

    def dies_on_optimizer(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(ck._ShardWriter, "write_data", dies_on_optimizer)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(root / "update-000001", model, opt, update=1, step=0, extra={"weights_version": "v1"})
    assert sorted(p.name for p in root.iterdir()) == ["update-000000"]  # no partial or temporary directory
    assert ck.latest_checkpoint(root).name == "update-000000"


def test_restores_state_and_rng_and_refuses_unknown_format(tmp_path):
    model = tiny_model()
    opt = _stepped(model, OptimConfig(lr=3e-3, betas=(0.8, 0.95)))
    torch.manual_seed(7)
    d = ck.save_checkpoint(tmp_path / "update-000003", model, opt, update=3, step=1, extra={"weights_version": "v"})
    assert sorted(p.name for p in (d / ck.OPTIMIZER).iterdir()) == ["shard-00001-model-00001-of-00001.safetensors"]
    want = torch.rand(4)
    torch.manual_seed(99)
    m2, opt2, meta = ck.load_checkpoint(d, lambda m: build_optimizer(m, OptimConfig()))
    assert torch.equal(torch.rand(4), want) and meta["update"] == 3
    assert opt2.param_groups[0]["lr"] == 3e-3 and opt2.param_groups[0]["betas"] == (0.8, 0.95)
    names = dict(m2.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(names[n], p)
        for field, value in opt.state[p].items():
            assert torch.equal(opt2.state[names[n]][field], value), (n, field)
    trainer = d / "trainer.json"
    text = trainer.read_text()
    trainer.write_text(text.replace(ck.FORMAT, "other/9"))
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        ck.read_trainer(d)
    trainer.write_text(text.replace(ck.FORMAT, "longstraw-checkpoint/1"))
    with pytest.raises(ValueError, match="format 'longstraw-checkpoint/1' .* not read by this version"):
        ck.read_trainer(d)


def test_a_fresh_optimizer_writes_no_optimizer_state(tmp_path):
    model = tiny_model()
    d = ck.save_checkpoint(tmp_path / "update-000000", model, build_optimizer(model, OptimConfig()), update=0, step=0,
                           extra={})
    meta = json.loads((d / "trainer.json").read_text())
    assert meta["optimizer_state"] == {} and not (d / ck.OPTIMIZER).exists()
    _, opt, _ = ck.load_checkpoint(d, lambda m: build_optimizer(m, OptimConfig()))
    assert len(opt.state) == 0


def test_a_checkpoint_is_hashed_once_per_process_until_a_file_changes(tmp_path, monkeypatch):
    model = tiny_model()
    d = ck.save_checkpoint(tmp_path / "update-000000", model, _stepped(model), update=0, step=0,
                           extra={"weights_version": "v0"})
    hashed = []
    real = ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    ck._VERIFIED.clear()
    ck.read_trainer(d)
    files = len(hashed)
    assert files == 4 and "model.safetensors" in hashed  # config, weights, rng, one optimizer shard
    ck.read_trainer(d)
    assert len(hashed) == files  # verified already: not hashed again
    for name in ("model.safetensors", "shard-00001-model-00001-of-00001.safetensors"):
        f = next(d.rglob(name))
        data = bytearray(f.read_bytes())
        data[-5] ^= 0x01
        f.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=f"{name} does not match its sha256"):
            ck.read_trainer(d)
        f.write_bytes(bytes(data[:-5]) + bytes([data[-5] ^ 0x01]) + bytes(data[-4:]))
        ck.read_trainer(d)  # restored: verifies again
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        ck.read_trainer(d)


def test_a_written_checkpoint_is_not_hashed_again_and_names_its_weights(tmp_path, monkeypatch):
    """The writer hashes the files as it writes them: reading the checkpoint back in the same process hashes
    nothing, and `weights_version` (from those checksums) follows the weights, not the optimizer state."""
    hashed = []
    real = ck.sha256_file
    a = tiny_model(seed=0)
    opt = _stepped(a)
    one = ck.save_checkpoint(tmp_path / "a", a, opt, update=0, step=0, extra={})
    monkeypatch.setattr(ck, "sha256_file", lambda p: hashed.append(p) or real(p))
    meta = ck.read_trainer(one)
    assert hashed == []
    same = ck.save_checkpoint(tmp_path / "b", a, build_optimizer(a, OptimConfig(lr=1.0)), update=3, step=1, extra={})
    b = tiny_model(seed=1)
    other = ck.save_checkpoint(tmp_path / "c", b, _stepped(b), update=0, step=0, extra={})
    named = ck.save_checkpoint(tmp_path / "d", a, opt, update=0, step=0, extra={}, weights_version="mine")
    assert ck.read_trainer(same)["weights_version"] == meta["weights_version"]
    assert ck.read_trainer(other)["weights_version"] != meta["weights_version"]
    assert ck.read_trainer(named)["weights_version"] == "mine"
