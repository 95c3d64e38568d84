"""Loading a ZeRO-2/3 model with one read of the checkpoint (`shard_from_rank0`): rank 0 reads the HF files, the
other ranks build the model on the meta device and take their shards by broadcast. The loaded weights must equal
`load_model` in one process bit for bit, and only rank 0 may open a weight file."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls
import longstraw.models.checkpoint as checkpoint
from longstraw.models import load_model, meta_model, write_weights
from longstraw.parallel import ONE_RANK, shard_from_rank0
from tests.conftest import GLM, tiny_model
from tests.parallel.launch import run_ranks


def _write(path, arch: str, **overrides) -> None:
    if arch == "glm_moe_dsa":
        torch.manual_seed(0)
        model = ls.build_model(GLM, dtype=torch.float32)
    else:
        model = tiny_model(arch, **overrides)
    write_weights(model, path)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(7)  # the adapters' A matrices are drawn; B = 0
    return ls.add_lora(model, r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def load_rank(rank: int, world: int, path: str, stage: int, dtype: str, lora: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dtype = getattr(torch, dtype)
    opened = []
    read = checkpoint.iter_tensors
    checkpoint.iter_tensors = lambda *a, **kw: (opened.append(a[0]), read(*a, **kw))[1]
    skeleton = meta_model(path, dtype)
    full = None
    if rank == 0:
        model = load_model(path, dtype=dtype)
        full = (_lora(model) if lora else model).state_dict()
    if lora:
        skeleton = _lora(skeleton)
    model = shard_from_rank0(skeleton, full, stage, ONE_RANK, torch.device("cpu"))
    local = sum(p.to_local().numel() for p in model.parameters())
    out = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # a collective
    return {**{k: v.clone() for k, v in out.items()}, "_opened": torch.tensor(len(opened)),
            "_local_numel": torch.tensor(local)}


@pytest.mark.parametrize("arch,stage,dtype,lora", [
    ("qwen3", 3, "float32", False),
    ("qwen3_5", 2, "bfloat16", False),
    ("glm_moe_dsa", 3, "bfloat16", False),  # the router and indexer head stay fp32
    ("qwen3", 3, "float32", True),
])
def test_rank0_reads_and_every_rank_gets_its_shard(tmp_path, arch, stage, dtype, lora):
    _write(tmp_path, arch)
    want = load_model(tmp_path, dtype=getattr(torch, dtype))
    if lora:
        want = _lora(want)
    want = want.state_dict()
    results = run_ranks(2, load_rank, str(tmp_path), stage, dtype, lora)
    assert [int(r.pop("_opened")) for r in results] == [1, 0]  # one safetensors file, on rank 0 only
    total = sum(p.numel() for p in want.values() if p.dim() > 0) - sum(
        v.numel() for k, v in want.items() if k.endswith("e_score_correction_bias"))  # buffers are not sharded
    local = [int(r.pop("_local_numel")) for r in results]
    assert sum(local) == total and max(local) < 0.6 * total, (local, total)
    for got in results:
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_tied_embeddings_are_refused_on_the_meta_path(tmp_path):
    _write(tmp_path, "qwen3", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tied word embeddings"):
        shard_from_rank0(meta_model(tmp_path), None, 3, ONE_RANK, torch.device("cpu"))


def test_a_materialised_model_is_refused(tmp_path):
    _write(tmp_path, "qwen3")
    with pytest.raises(ValueError, match="meta device"):
        shard_from_rank0(load_model(tmp_path), None, 3, ONE_RANK, torch.device("cpu"))
