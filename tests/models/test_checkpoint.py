"""Reading HF checkpoint directories: sharded safetensors, and clear errors for broken or unsupported ones."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import longstraw as ls
from tests.conftest import TINY

HF_TINY = TINY  # the shared tiny shape, as transformers config kwargs


def hf_model(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Qwen3Config(**HF_TINY)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 37), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(ids())


def rewrite_single_file(path, edit) -> None:
    """Apply `edit(tensors)` to the single model.safetensors of a checkpoint directory."""
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_sharded_checkpoint_equals_unsharded(tmp_path):
    hf = hf_model()
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf.save_pretrained(single)
    hf.save_pretrained(sharded, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    assert index.is_file()
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2
    weight_map = json.loads(index.read_text())["weight_map"]
    assert set(weight_map.values()) == {s.name for s in shards}
    assert set(weight_map) == set(dict(hf.named_parameters()))

    a = ls.load_model(single)
    b = ls.load_model(sharded)
    assert torch.equal(logits(a), logits(b))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # and it is the transformers model
    with torch.no_grad():
        want = hf(input_ids=ids(), use_cache=False).logits
    assert float((logits(b) - want).abs().max()) <= 1e-4


def test_sharded_index_with_missing_shard(tmp_path):
    hf_model().save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1].name):
        ls.load_model(tmp_path)


def test_missing_tensor(tmp_path):
    hf_model().save_pretrained(tmp_path)
    name = "model.layers.1.self_attn.k_norm.weight"
    rewrite_single_file(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ls.load_model(tmp_path)


def test_truncated_weights_name_the_file(tmp_path):
    hf_model().save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file .* truncated"):
        ls.load_model(tmp_path)


def test_missing_tensor_in_sharded_checkpoint(tmp_path):
    hf_model().save_pretrained(tmp_path, max_shard_size="20KB")
    name = "model.norm.weight"
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = tmp_path / weight_map[name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ls.load_model(tmp_path)


def test_wrong_shape(tmp_path):
    hf_model().save_pretrained(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"

    def edit(t):
        t[name] = torch.zeros(95, 64)

    rewrite_single_file(tmp_path, edit)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        ls.load_model(tmp_path)
    assert "(95, 64)" in str(e.value) and "(96, 64)" in str(e.value)


def test_unexpected_tensor(tmp_path):
    hf_model().save_pretrained(tmp_path)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"

    def edit(t):
        t[name] = torch.zeros(8)

    rewrite_single_file(tmp_path, edit)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ls.load_model(tmp_path)


def test_pytorch_bin_only(tmp_path):
    hf = hf_model()
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ls.load_model(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        ls.load_model(tmp_path / "does-not-exist")


def test_directory_without_config(tmp_path):
    hf_model().save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ls.load_model(tmp_path)
