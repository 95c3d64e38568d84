"""Prefix-state store: bitwise round trips, checksums, model/weights checks, atomic commits, token ranges."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest
import torch
import zarr
from zarr.storage import LocalStore

import longstraw as ls
from longstraw import store
from longstraw.state import AttentionState, LatentState, RecurrentState
from longstraw.store import load_state, read_manifest, save_state, weights_version
from tests.conftest import GLM, tiny_model

ARCHS = ["qwen3", "qwen3_5_text", "glm_moe_dsa"]
PROMPT = 40  # state of 39 tokens: 5 shards of 8


def model_for(arch: str, dtype: torch.dtype = torch.float32):
    if arch == "glm_moe_dsa":
        torch.manual_seed(0)
        return ls.build_model(GLM, dtype=dtype)
    return tiny_model(arch, dtype=dtype)


def captured(arch: str, dtype: torch.dtype = torch.float32):
    model = model_for(arch, dtype)
    state = ls.capture(model, torch.randint(0, 97, (PROMPT,)), chunk_size=16)
    return model, state, weights_version(model)


def assert_same(a: ls.PrefixState, b: ls.PrefixState) -> None:
    assert [type(x) for x in a.layers] == [type(y) for y in b.layers]
    for x, y in zip(a.snapshot(), b.snapshot()):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x, y.view(torch.uint8) if y.dtype == torch.bfloat16 else y)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and a.prompt_ids.dtype == b.prompt_ids.dtype
    assert a.chunks == b.chunks and a.model_fingerprint == b.model_fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bitwise_and_scores_identically(tmp_path, arch, dtype):
    model, state, wv = captured(arch, dtype)
    url = str(tmp_path / "state")
    manifest = save_state(state, url, weights_version=wv, shard_tokens=16)
    loaded = load_state(url, model=model, weights_version=wv)
    assert_same(state, loaded)

    kinds = {"qwen3": {"attention"}, "qwen3_5_text": {"attention", "recurrent"}, "glm_moe_dsa": {"latent"}}[arch]
    assert {layer["kind"] for layer in manifest["layers"]} == kinds
    assert manifest["weights_version"] == wv and manifest["model_fingerprint"] == model.config.fingerprint
    if arch == "glm_moe_dsa":  # the DSA indexer keys are stored with the latents
        assert any("index_k" in layer["arrays"] for layer in manifest["layers"])
        assert any(isinstance(s, LatentState) and s.index_k is not None for s in loaded.layers)
    # bf16 is stored as its uint16 view, with the torch dtype beside it; the fp32 delta-rule state stays fp32
    root = zarr.open_group(url, mode="r", zarr_format=3)
    i, field = next((i, f) for i, s in enumerate(manifest["layers"]) for f in s["arrays"] if s["kind"] != "recurrent")
    array = root[f"layers/{i}/{field}"]
    assert (str(array.dtype), array.attrs["torch_dtype"]) == (("uint16", "bfloat16") if dtype == torch.bfloat16 else ("float32", "float32"))
    assert all(s.ssm.dtype == torch.float32 for s in loaded.layers if isinstance(s, RecurrentState))

    responses = [torch.randint(0, 97, (6,)), torch.randint(0, 97, (4,))]
    for a, b in zip(ls.score(model, state, responses), ls.score(model, loaded, responses)):
        assert torch.equal(a, b)


def test_manifest_lists_every_shard_with_its_checksum(tmp_path):
    model, state, wv = captured("qwen3")
    url = tmp_path / "state"
    manifest = save_state(state, str(url), weights_version=wv, shard_tokens=8)
    shards = {k for k in manifest["checksums"] if "/c/" in k}
    assert shards == {p.relative_to(url).as_posix() for p in url.rglob("*") if p.is_file() and "/c/" in p.as_posix()}
    assert len([k for k in shards if k.startswith("layers/0/k/")]) == 5  # 39 tokens / 8 per shard
    on_disk = json.loads((url / "manifest.json").read_text())
    assert on_disk == manifest and on_disk["shard_tokens"] == 8 and on_disk["length"] == PROMPT - 1


def test_flipped_byte_in_a_shard_is_refused_naming_it(tmp_path):
    model, state, wv = captured("qwen3_5_text")
    url = tmp_path / "state"
    save_state(state, str(url), weights_version=wv, shard_tokens=8)
    key = "layers/3/k/c/0/2/0"  # layer 3 is full attention; shard 2 holds positions 16..23
    path = url / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"shard '{key}' is corrupted"):
        load_state(str(url), model=model, weights_version=wv)
    # a range that does not touch the corrupted shard still loads
    part = load_state(str(url), model=model, weights_version=wv, token_range=(0, 16))
    assert torch.equal(part.layers[3].k, state.layers[3].k[:, :16])
    path.unlink()  # a missing shard is an error too, never zeros
    with pytest.raises(ValueError, match=f"shard '{key}' is missing"):
        load_state(str(url), model=model, weights_version=wv, token_range=(16, 17))


def test_state_of_another_model_or_other_weights_is_refused(tmp_path):
    model, state, wv = captured("qwen3")
    url = str(tmp_path / "state")
    save_state(state, url, weights_version=wv)
    other_arch = tiny_model("qwen3", num_hidden_layers=2)
    with pytest.raises(ValueError, match="another model"):
        load_state(url, model=other_arch, weights_version=weights_version(other_arch))
    other_weights = tiny_model("qwen3", seed=1)
    assert weights_version(other_weights) != wv
    with pytest.raises(ValueError, match="other weights"):
        load_state(url, model=other_weights, weights_version=weights_version(other_weights))


def test_weights_version_is_a_content_hash():
    a, b = tiny_model("qwen3"), tiny_model("qwen3")
    assert weights_version(a) == weights_version(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1e-3
    assert weights_version(a) != weights_version(b)
    assert weights_version(a) != weights_version(tiny_model("qwen3", dtype=torch.bfloat16))


def _kill_after(monkeypatch, calls: int) -> None:
    """Make the writer die at its `calls`-th shard write, as a killed process would."""
    real, seen = store._write_shard, []

    def dying(array, index, data):
        seen.append(index)
        if len(seen) >= calls:
            raise KeyboardInterrupt("killed")
        real(array, index, data)

    monkeypatch.setattr(store, "_write_shard", dying)


def test_killed_writer_leaves_nothing_committed(tmp_path, monkeypatch):
    model, state, wv = captured("qwen3")
    url = str(tmp_path / "state")
    _kill_after(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        save_state(state, url, weights_version=wv, shard_tokens=8)
    with pytest.raises(ValueError, match="no committed prefix state"):
        load_state(url, model=model, weights_version=wv)
    assert list(tmp_path.iterdir()) == []  # the temporary sibling is gone too


def test_killed_writer_keeps_the_previous_state(tmp_path, monkeypatch):
    model, old, wv = captured("qwen3")
    new = ls.capture(model, torch.randint(0, 97, (PROMPT,)), chunk_size=16)
    url = str(tmp_path / "state")
    save_state(old, url, weights_version=wv, shard_tokens=8)
    _kill_after(monkeypatch, 12)
    with pytest.raises(KeyboardInterrupt):
        save_state(new, url, weights_version=wv, shard_tokens=8)
    assert_same(old, load_state(url, model=model, weights_version=wv))
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    monkeypatch.undo()
    save_state(new, url, weights_version=wv, shard_tokens=8)  # a finished write replaces it
    assert_same(new, load_state(url, model=model, weights_version=wv))
    assert [p.name for p in tmp_path.iterdir()] == ["state"]


@pytest.mark.parametrize("previous", [False, True])
def test_manifest_is_written_last_and_a_failed_commit_is_undone(tmp_path, monkeypatch, previous):
    model, old, wv = captured("qwen3")
    new = ls.capture(model, torch.randint(0, 97, (PROMPT,)), chunk_size=16)
    url = tmp_path / "state"
    if previous:
        save_state(old, str(url), weights_version=wv, shard_tokens=8)
    seen = []

    def dying_commit(fs, root, manifest):
        # the data is in place, whole, and nothing there is committed yet
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        assert not (url / "manifest.json").exists()
        assert all((url / k).is_file() for k in json.loads(manifest)["checksums"])
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(store, "_write_manifest", dying_commit)
    with pytest.raises(KeyboardInterrupt):
        save_state(new, str(url), weights_version=wv, shard_tokens=8)
    assert len(seen) == 1 and "state" in seen[0]
    assert [p.name for p in tmp_path.iterdir()] == (["state"] if previous else [])
    if previous:
        assert_same(old, load_state(str(url), model=model, weights_version=wv))
    else:
        with pytest.raises(ValueError, match="no committed prefix state"):
            load_state(str(url), model=model, weights_version=wv)


def test_data_without_manifest_is_not_a_state(tmp_path):
    model, state, wv = captured("qwen3")
    url = tmp_path / "state"
    save_state(state, str(url), weights_version=wv)
    (url / "manifest.json").unlink()  # e.g. a writer killed between moving the data in and committing
    with pytest.raises(ValueError, match="no committed prefix state"):
        load_state(str(url), model=model, weights_version=wv)
    (url / "manifest.json").write_text(json.dumps({"format": "longstraw.prefix_state", "format_version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        read_manifest(str(url))


@pytest.mark.parametrize("arch", ["qwen3_5_text", "glm_moe_dsa"])
def test_token_range_reads_only_its_shards(tmp_path, monkeypatch, arch):
    model, state, wv = captured(arch)
    url = str(tmp_path / "state")
    manifest = save_state(state, url, weights_version=wv, shard_tokens=8)
    read: list[str] = []
    real_get = LocalStore.get

    async def counting_get(self, key, *args, **kwargs):
        read.append(key)
        return await real_get(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "get", counting_get)
    for (a, b), shards in {(10, 20): {1, 2}, (8, 16): {1}, (39, 39): set(), (0, 39): {0, 1, 2, 3, 4}}.items():
        read.clear()
        part = load_state(url, model=model, weights_version=wv, token_range=(a, b))
        for i, spec in enumerate(manifest["layers"]):
            for field in spec["arrays"]:
                prefix = f"layers/{i}/{field}/c/"
                got = {int(k.removeprefix(prefix).split("/")[-2]) for k in read if k.startswith(prefix)}
                if spec["kind"] == "recurrent":  # the fixed state is always loaded, one chunk
                    assert got == {0} and torch.equal(getattr(part.layers[i], field), getattr(state.layers[i], field))
                else:
                    assert got == shards, (a, b, prefix)
                    assert torch.equal(getattr(part.layers[i], field), getattr(state.layers[i], field)[..., a:b, :])
        assert torch.equal(part.prompt_ids, state.prompt_ids)
        assert all(isinstance(s, (AttentionState, LatentState, RecurrentState)) for s in part.layers)
    with pytest.raises(ValueError, match="outside"):
        load_state(url, model=model, weights_version=wv, token_range=(5, 40))


def test_memory_url_round_trip_and_checks():
    url = f"memory://longstraw-test-{uuid.uuid4().hex}/state"
    fs, path = fsspec.core.url_to_fs(url)
    try:
        model, state, wv = captured("qwen3_5_text")
        manifest = save_state(state, url, weights_version=wv, shard_tokens=8)
        assert fs.exists(f"{path}/manifest.json")
        assert_same(state, load_state(url, model=model, weights_version=wv))
        part = load_state(url, model=model, weights_version=wv, token_range=(9, 30))
        assert torch.equal(part.layers[3].v, state.layers[3].v[:, 9:30])
        save_state(state, url, weights_version=wv, shard_tokens=8)  # replacing a committed state works there too
        assert [p.rsplit("/", 1)[-1] for p in fs.ls(path.rsplit("/", 1)[0], detail=False)] == ["state"]
        key = next(k for k in manifest["checksums"] if k.startswith("layers/0/conv/c/"))
        data = bytearray(fs.cat_file(f"{path}/{key}"))
        data[-1] ^= 0xFF
        fs.pipe_file(f"{path}/{key}", bytes(data))
        with pytest.raises(ValueError, match=f"shard '{key}' is corrupted"):
            load_state(url, model=model, weights_version=wv)
    finally:
        fs.rm(path.rsplit("/", 1)[0], recursive=True)


def test_rollout_round_trip_corruption_and_bad_input(tmp_path):
    from longstraw.store import load_rollout, save_rollout

    responses = [torch.tensor([5, 2, 258]), torch.tensor([7]), torch.tensor([1, 2, 3, 4])]
    logps = [torch.randn(r.numel()) for r in responses]
    url = str(tmp_path / "rollouts" / "g0")
    save_rollout(url, responses, logps, {"texts": ["a", "b", "c"], "finish_reasons": ["stop", "length", "length"]})
    got_r, got_lp, meta = load_rollout(url)
    assert all(torch.equal(a, b) for a, b in zip(got_r, responses)) and len(got_r) == 3
    assert all(torch.equal(a, b) for a, b in zip(got_lp, logps))
    assert meta["texts"] == ["a", "b", "c"]
    shard = tmp_path / "rollouts" / "g0" / "logprobs" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="rollout at .* shard 'logprobs/c/0' is corrupted"):
        load_rollout(url)
    with pytest.raises(ValueError, match="one log-prob per response token"):
        save_rollout(url, responses, logps[:2], {})
    with pytest.raises(ValueError, match="no committed rollout"):
        load_rollout(str(tmp_path / "nothing"))
