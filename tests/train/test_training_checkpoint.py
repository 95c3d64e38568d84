"""Checkpoints are all-or-nothing: a writer that fails leaves the previous checkpoint as the latest one."""

import pytest
import torch

import longstraw.train.checkpoint as ck
from longstraw.train.config import OptimConfig
from longstraw.train.optim import build_optimizer
from tests.conftest import tiny_model


def test_failed_write_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig())
    root = tmp_path / "checkpoints"
    ck.save_checkpoint(root / "update-000000", model, opt, update=0, step=0, extra={"weights_version": "v0"})
    real = ck.save_file

    def dies_on_optimizer(tensors, path, **kw):
        if path.endswith("optimizer.safetensors"):
            raise OSError("disk full")
        return real(tensors, path, **kw)

    monkeypatch.setattr(ck, "save_file", dies_on_optimizer)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(root / "update-000001", model, opt, update=1, step=0, extra={"weights_version": "v1"})
    assert sorted(p.name for p in root.iterdir()) == ["update-000000"]  # no partial or temporary directory
    assert ck.latest_checkpoint(root).name == "update-000000"


def test_restores_rng_and_refuses_unknown_format(tmp_path):
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig())
    torch.manual_seed(7)
    d = ck.save_checkpoint(tmp_path / "update-000003", model, opt, update=3, step=1, extra={"weights_version": "v"})
    want = torch.rand(4)
    torch.manual_seed(99)
    _, _, meta = ck.load_checkpoint(d, lambda m: build_optimizer(m, OptimConfig()))
    assert torch.equal(torch.rand(4), want) and meta["update"] == 3
    (d / "trainer.json").write_text((d / "trainer.json").read_text().replace(ck.FORMAT, "other/9"))
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        ck.read_trainer(d)


def test_a_checkpoint_is_hashed_once_per_process_until_a_file_changes(tmp_path, monkeypatch):
    model = tiny_model()
    d = ck.save_checkpoint(tmp_path / "update-000000", model, build_optimizer(model, OptimConfig()), update=0, step=0,
                           extra={"weights_version": "v0"})
    hashed = []
    real = ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    ck._VERIFIED.clear()
    ck.read_trainer(d)
    files = len(hashed)
    assert files >= 2 and "model.safetensors" in hashed
    ck.read_trainer(d)
    assert len(hashed) == files  # verified already: not hashed again
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors does not match its sha256"):
        ck.read_trainer(d)
    weights.unlink()
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        ck.read_trainer(d)


def test_a_written_checkpoint_is_not_hashed_again_and_names_its_weights(tmp_path, monkeypatch):
    """The writer hashes the files as it writes them: reading the checkpoint back in the same process hashes
    nothing, and `weights_version` (from those checksums) follows the weights, not the optimizer state."""
    hashed = []
    real = ck.sha256_file
    a = tiny_model(seed=0)
    opt = build_optimizer(a, OptimConfig())
    one = ck.save_checkpoint(tmp_path / "a", a, opt, update=0, step=0, extra={})
    monkeypatch.setattr(ck, "sha256_file", lambda p: hashed.append(p) or real(p))
    meta = ck.read_trainer(one)
    assert hashed == []
    same = ck.save_checkpoint(tmp_path / "b", tiny_model(seed=0), build_optimizer(a, OptimConfig(lr=1.0)), update=3,
                              step=1, extra={})
    other = ck.save_checkpoint(tmp_path / "c", tiny_model(seed=1), opt, update=0, step=0, extra={})
    assert ck.read_trainer(same)["weights_version"] == meta["weights_version"]
    assert ck.read_trainer(other)["weights_version"] != meta["weights_version"]
