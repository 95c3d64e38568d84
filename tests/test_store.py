"""The store: a single process's prefix state (a one-shard state, `sharded_state.save_state` / `load_state_shard`) and
rollouts. Bitwise round trips, checksums, model/weights checks, atomic commits (a killed writer leaves the previous
state readable). Loading one rank's part of an N-rank state is tests/test_sharded_state.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import zarr

import longstraw as ls
from longstraw import sharded_state, store
from longstraw.engine.chunks import held_rows, prompt_chunks
from longstraw.files import CorruptArtefact
from longstraw.parallel import SequenceGroup
from longstraw.sharded_state import load_state_shard, read_sharded_manifest, save_state, shard_url
from longstraw.state import LatentState, RecurrentState, RowMap
from longstraw.store import manifest_digest
from tests.conftest import GLM, state_tensors, tiny_model

ARCHS = ["qwen3", "qwen3_5_text", "glm_moe_dsa"]
PROMPT = 40  # state of 39 tokens: 5 shards of 8
WV = "weights-0"  # what the pipeline names the weights by (any string)


def model_for(arch: str, dtype: torch.dtype = torch.float32):
    if arch == "glm_moe_dsa":
        torch.manual_seed(0)
        return ls.build_model(GLM, dtype=dtype)
    return tiny_model(arch, dtype=dtype)


def captured(arch: str, dtype: torch.dtype = torch.float32):
    model = model_for(arch, dtype)
    state = ls.capture(model, torch.randint(0, 97, (PROMPT,)), ls.EngineConfig(prompt_chunk=16))
    return model, state, WV


def shard_manifest(url) -> dict:
    return json.loads((Path(shard_url(str(url), 0)) / "manifest.json").read_text())


def assert_same(a: ls.PrefixState, b: ls.PrefixState) -> None:
    assert [type(x) for x in a.layers] == [type(y) for y in b.layers]
    for x, y in zip(state_tensors(a), state_tensors(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x, y.view(torch.uint8) if y.dtype == torch.bfloat16 else y)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and a.prompt_ids.dtype == b.prompt_ids.dtype
    assert a.chunks == b.chunks and a.model_fingerprint == b.model_fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bitwise_and_scores_identically(tmp_path, arch, dtype):
    model, state, wv = captured(arch, dtype)
    url = str(tmp_path / "state")
    top = save_state(state, url, weights_version=wv, shard_tokens=16, extra={"step": 3})
    loaded = load_state_shard(url, model=model, weights_version=wv, digest=manifest_digest(top))
    assert_same(state, loaded)
    assert not loaded.sharded and loaded.rows == RowMap.whole(PROMPT - 1)  # all rows: the one-process path's
    assert read_sharded_manifest(url) == top and top["extra"] == {"step": 3}
    assert [(s["rank"], s["blocks"]) for s in top["shards"]] == [(0, [[0, PROMPT - 1]])]
    manifest = shard_manifest(url)

    kinds = {"qwen3": {"attention"}, "qwen3_5_text": {"attention", "recurrent"}, "glm_moe_dsa": {"latent"}}[arch]
    assert {layer["kind"] for layer in manifest["layers"]} == kinds
    for m in (top, manifest):
        assert m["weights_version"] == wv and m["model_fingerprint"] == model.config.fingerprint
    if arch == "glm_moe_dsa":  # the DSA indexer keys are stored with the latents
        assert any("index_k" in layer["arrays"] for layer in manifest["layers"])
        assert any(isinstance(s, LatentState) and s.index_k is not None for s in loaded.layers)
    # bf16 is stored as its uint16 view, with the torch dtype beside it; the fp32 delta-rule state stays fp32
    root = zarr.open_group(shard_url(url, 0), mode="r", zarr_format=3)
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
    top = save_state(state, str(url), weights_version=wv, shard_tokens=8)
    manifest, group = shard_manifest(url), url / "shard-000"
    shards = {k for k in manifest["checksums"] if "/c/" in k}
    assert shards == {p.relative_to(group).as_posix() for p in group.rglob("*") if p.is_file() and "/c/" in str(p)}
    assert len([k for k in shards if k.startswith("layers/0/k/")]) == 5  # 39 tokens / 8 per shard
    assert manifest["shard_tokens"] == 8 and manifest["length"] == PROMPT - 1
    assert manifest["blocks"] == [[0, PROMPT - 1]]
    on_disk = json.loads((url / "manifest.json").read_text())
    assert on_disk == top and on_disk["length"] == PROMPT - 1
    assert top["shards"][0]["sha256"] == manifest_digest(manifest)  # the top manifest pins the shard's
    assert sorted(p.name for p in url.iterdir()) == ["manifest.json", "shard-000"]


def test_flipped_byte_in_a_shard_is_refused_naming_it(tmp_path):
    model, state, wv = captured("qwen3_5_text")
    url = tmp_path / "state"
    save_state(state, str(url), weights_version=wv, shard_tokens=8)
    key = "layers/3/k/c/0/2/0"  # layer 3 is full attention; shard 2 holds positions 16..23
    path = url / "shard-000" / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptArtefact, match=f"shard '{key}' is corrupted") as e:
        load_state_shard(str(url), model=model, weights_version=wv)
    assert e.value.where == str(url)  # the whole state is what to recompute
    path.unlink()  # a missing shard is an error too, never zeros
    with pytest.raises(ValueError, match=f"shard '{key}' is missing"):
        load_state_shard(str(url), model=model, weights_version=wv)


def test_state_of_another_model_or_other_weights_is_refused(tmp_path):
    model, state, wv = captured("qwen3")
    url = str(tmp_path / "state")
    save_state(state, url, weights_version=wv)
    with pytest.raises(ValueError, match="another model"):
        load_state_shard(url, model=tiny_model("qwen3", num_hidden_layers=2), weights_version=wv)
    with pytest.raises(ValueError, match="other weights"):
        load_state_shard(url, model=tiny_model("qwen3", seed=1), weights_version="weights-1")


def rank_part(state: ls.PrefixState, rank: int, world: int) -> ls.PrefixState:
    """What rank `rank` of a `world`-rank group holds of a one-process state: its block of every chunk."""
    g = SequenceGroup()
    g.rank, g.size = rank, world
    chunks = prompt_chunks(state.length, state.chunks[0][1], g)  # the group's chunks: the captured ones
    assert chunks == state.chunks
    rows = held_rows(chunks, g)
    layers = [s if s.token_axis is None else
              type(s).from_tensors({n: t.index_select(-2, rows.positions()) for n, t in s.named_tensors().items()})
              for s in state.layers]
    return ls.PrefixState(layers, state.prompt_ids, state.chunks, state.model_fingerprint, rows=rows)


def test_one_rank_shard_is_refused_and_a_many_rank_state_not_loaded_whole(tmp_path):
    model, state, wv = captured("qwen3")
    url = str(tmp_path / "state")
    parts = [rank_part(state, r, 2) for r in range(2)]
    assert all(p.sharded for p in parts) and parts[0].rows.blocks == ((0, 8), (24, 32), (32, 36))
    for part in (ls.PrefixState(state.layers, state.prompt_ids, state.chunks, state.model_fingerprint,
                                rows=RowMap(((0, PROMPT // 2),))), *parts):
        with pytest.raises(ValueError, match="one rank's shard.*save_state_shard"):
            save_state(part, url, weights_version=wv)
        assert not (tmp_path / "state").exists()
    records = [sharded_state.save_state_shard(p, url, r, weights_version=wv) for r, p in enumerate(parts)]
    sharded_state.commit_sharded_state(url, records, state=state, weights_version=wv)
    with pytest.raises(ValueError, match="stored by 2 sequence-parallel ranks, not 1"):
        load_state_shard(url, model=model, weights_version=wv)
    assert load_state_shard(url, 1, 2, model=model, weights_version=wv).rows == parts[1].rows



def test_the_whole_prompts_routing_is_read_back_from_every_shard(tmp_path):
    """`load_state_routing`: a 2-rank state's MoE routing (each shard its blocks' rows) put back in prompt order,
    whatever the weights, each file verified; None for a state captured without it."""
    from longstraw.sharded_state import load_state_routing

    model = model_for("glm_moe_dsa")
    prompt = torch.randint(0, 97, (PROMPT,), generator=torch.Generator().manual_seed(1))
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=16), record_routing=True)
    assert set(state.routing) == {1, 2} and state.routing[1].shape == (PROMPT - 1, GLM["num_experts_per_tok"])
    url = str(tmp_path / "state")
    parts = []
    for r in range(2):
        part = rank_part(state, r, 2)
        part.routing = {j: ids.index_select(0, part.rows.positions()) for j, ids in state.routing.items()}
        parts.append(part)
    records = [sharded_state.save_state_shard(p, url, r, weights_version=WV, shard_tokens=8)
               for r, p in enumerate(parts)]
    top = sharded_state.commit_sharded_state(url, records, state=state, weights_version=WV)
    got = load_state_routing(url, digest=manifest_digest(top))
    assert set(got) == set(state.routing)
    assert all(got[j].dtype == torch.uint8 and torch.equal(got[j], ids) for j, ids in state.routing.items())
    assert not torch.equal(parts[1].routing[1], state.routing[1][: parts[1].rows.rows])  # rank 1's rows: not a prefix

    shard = Path(shard_url(url, 1)) / "routing" / "2" / "c" / "0" / "0"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 0x01]))
    with pytest.raises(CorruptArtefact, match="routing/2/c/0/0' is corrupted") as e:
        load_state_routing(url)
    assert e.value.where == url  # the whole state is recaptured
    plain = tmp_path / "plain"
    save_state(ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=16)), str(plain), weights_version=WV)
    assert load_state_routing(str(plain)) is None

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
    with pytest.raises(ValueError, match="no committed"):
        load_state_shard(url, model=model, weights_version=wv)
    assert list(tmp_path.iterdir()) == []  # the temporary sibling is gone too


def test_killed_writer_keeps_the_previous_state(tmp_path, monkeypatch):
    model, old, wv = captured("qwen3")
    new = ls.capture(model, torch.randint(0, 97, (PROMPT,)), ls.EngineConfig(prompt_chunk=16))
    url = str(tmp_path / "state")
    save_state(old, url, weights_version=wv, shard_tokens=8)
    _kill_after(monkeypatch, 12)
    with pytest.raises(KeyboardInterrupt):
        save_state(new, url, weights_version=wv, shard_tokens=8)
    assert_same(old, load_state_shard(url, model=model, weights_version=wv))
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    monkeypatch.undo()
    save_state(new, url, weights_version=wv, shard_tokens=8)  # a finished write replaces it
    assert_same(new, load_state_shard(url, model=model, weights_version=wv))
    assert [p.name for p in tmp_path.iterdir()] == ["state"]


@pytest.mark.parametrize("which", ["shard", "top"])
@pytest.mark.parametrize("previous", [False, True])
def test_manifest_is_written_last_and_a_failed_commit_is_undone(tmp_path, monkeypatch, previous, which):
    """`which` commit marker dies: the shard's (inside the temporary) or the state's (the swap's last step)."""
    model, old, wv = captured("qwen3")
    new = ls.capture(model, torch.randint(0, 97, (PROMPT,)), ls.EngineConfig(prompt_chunk=16))
    url = tmp_path / "state"
    if previous:
        save_state(old, str(url), weights_version=wv, shard_tokens=8)
    seen = []

    def dying_commit(fs, root, manifest):
        # the data is in place, whole, and nothing there is committed yet
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        assert not (Path(root) / "manifest.json").exists()
        if which == "shard":
            assert Path(root).parent.name.startswith(".state.tmp-")  # written inside the state's temporary
            assert all((Path(root) / k).is_file() for k in json.loads(manifest)["checksums"])
        else:
            assert root == str(url)
            shard = shard_manifest(url)  # the shard is committed, and is the one the top manifest names
            assert json.loads(manifest)["shards"][0]["sha256"] == manifest_digest(shard)
            assert all((url / "shard-000" / k).is_file() for k in shard["checksums"])
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(store if which == "shard" else sharded_state, "_write_manifest", dying_commit)
    with pytest.raises(KeyboardInterrupt):
        save_state(new, str(url), weights_version=wv, shard_tokens=8)
    assert len(seen) == 1 and ("state" in seen[0]) == (previous or which == "top")
    assert [p.name for p in tmp_path.iterdir()] == (["state"] if previous else [])
    if previous:
        assert_same(old, load_state_shard(str(url), model=model, weights_version=wv))
    else:
        with pytest.raises(ValueError, match="no committed"):
            load_state_shard(str(url), model=model, weights_version=wv)


def test_data_without_manifest_is_not_a_state(tmp_path):
    model, state, wv = captured("qwen3")
    url = tmp_path / "state"
    save_state(state, str(url), weights_version=wv)
    (url / "manifest.json").unlink()  # e.g. a writer killed between moving the data in and committing
    with pytest.raises(ValueError, match="no committed"):
        load_state_shard(str(url), model=model, weights_version=wv)
    (url / "manifest.json").write_text(json.dumps({"format": "longstraw.sharded_prefix_state", "format_version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        read_sharded_manifest(str(url))


def test_memory_url_round_trip_and_checks():
    url = f"memory://longstraw-test-{uuid.uuid4().hex}/state"
    fs, path = fsspec.core.url_to_fs(url)
    try:
        model, state, wv = captured("qwen3_5_text")
        save_state(state, url, weights_version=wv, shard_tokens=8)
        assert fs.exists(f"{path}/manifest.json") and fs.exists(f"{path}/shard-000/manifest.json")
        assert_same(state, load_state_shard(url, model=model, weights_version=wv))
        save_state(state, url, weights_version=wv, shard_tokens=8)  # replacing a committed state works there too
        assert [p.rsplit("/", 1)[-1] for p in fs.ls(path.rsplit("/", 1)[0], detail=False)] == ["state"]
        assert_same(state, load_state_shard(url, model=model, weights_version=wv))
        manifest = json.loads(fs.cat_file(f"{path}/shard-000/manifest.json"))
        key = next(k for k in manifest["checksums"] if k.startswith("layers/0/conv/c/"))
        data = bytearray(fs.cat_file(f"{path}/shard-000/{key}"))
        data[-1] ^= 0xFF
        fs.pipe_file(f"{path}/shard-000/{key}", bytes(data))
        with pytest.raises(CorruptArtefact, match=f"shard '{key}' is corrupted"):
            load_state_shard(url, model=model, weights_version=wv)
    finally:
        fs.rm(path.rsplit("/", 1)[0], recursive=True)


def test_rollout_round_trip_corruption_and_bad_input(tmp_path):
    from longstraw.store import load_rollout, save_rollout

    responses = [torch.tensor([5, 2, 258]), torch.tensor([7]), torch.tensor([1, 2, 3, 4])]
    logps = [torch.randn(r.numel()) for r in responses]
    url = str(tmp_path / "rollouts" / "g0")
    save_rollout(url, responses, logps, {"texts": ["a", "b", "c"], "finish_reasons": ["stop", "length", "length"]})
    got_r, got_lp, got_sampler, meta, got_routing, got_masks = load_rollout(url)
    assert all(torch.equal(a, b) for a, b in zip(got_r, responses)) and len(got_r) == 3
    assert all(torch.equal(a, b) for a, b in zip(got_lp, logps))
    assert meta["texts"] == ["a", "b", "c"] and got_sampler is None and got_routing is None  # none given
    assert got_masks is None
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


def test_rollout_keeps_the_sampler_logprobs_and_verifies_them(tmp_path):
    """The sampler's log-probs round-trip bitwise beside the others, the checksums and the digest cover them, and
    they must match the responses' lengths."""
    from longstraw.store import load_rollout, save_rollout

    responses = [torch.tensor([5, 2, 258]), torch.tensor([7]), torch.tensor([1, 2, 3, 4])]
    logps = [torch.randn(r.numel()) for r in responses]
    sampler = [torch.randn(r.numel()) for r in responses]
    url = str(tmp_path / "g0")
    manifest = save_rollout(url, responses, logps, {"finish_reasons": ["stop", "length", "length"]},
                            sampler_logprobs=sampler)
    assert manifest["arrays"]["sampler_logprobs"] == {"shape": [8], "dtype": "float32"}
    got = load_rollout(url, digest=manifest_digest(manifest))
    assert all(torch.equal(a, b) for a, b in zip(got.sampler_logprobs, sampler, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.logprobs, logps, strict=True))
    assert [r.tolist() for r in got.responses] == [r.tolist() for r in responses]
    assert got.meta["finish_reasons"] == ["stop", "length", "length"]

    shard = tmp_path / "g0" / "sampler_logprobs" / "c" / "0"
    clean = shard.read_bytes()
    shard.write_bytes(clean[:-1] + bytes([clean[-1] ^ 0x04]))
    with pytest.raises(CorruptArtefact, match="shard 'sampler_logprobs/c/0' is corrupted"):
        load_rollout(url)
    shard.write_bytes(clean)
    edited = json.loads((tmp_path / "g0" / "manifest.json").read_text())
    edited["arrays"]["sampler_logprobs"]["dtype"] = "float64"
    with pytest.raises(CorruptArtefact, match="manifest changed"):
        load_rollout(url, digest=manifest_digest(edited))
    with pytest.raises(ValueError, match="one sampler log-prob per response token"):
        save_rollout(url, responses, logps, {}, sampler_logprobs=[sampler[0], sampler[1], sampler[2][:3]])



def test_rollout_keeps_the_moe_routing_and_verifies_it(tmp_path):
    """Each response's MoE routing (by layer, the experts [tokens, top_k]) round-trips bitwise through one uint8
    array [tokens, layers, top_k] with the layers in the manifest; the checksums and the digest cover both; a
    routing that does not fit the responses is refused."""
    from longstraw.store import load_rollout, save_rollout

    responses = [torch.tensor([5, 2, 258]), torch.tensor([7]), torch.tensor([1, 2, 3, 4])]
    logps = [torch.randn(r.numel()) for r in responses]
    g = torch.Generator().manual_seed(0)
    routing = [{j: torch.stack([torch.randperm(256, generator=g)[:8] for _ in range(r.numel())]).to(torch.uint8)
                for j in (3, 1)} for r in responses]  # ids up to 255: all of uint8
    url = str(tmp_path / "g0")
    manifest = save_rollout(url, responses, logps, {}, routing=routing)
    assert manifest["arrays"]["routing"] == {"shape": [8, 2, 8], "dtype": "uint8"}
    assert manifest["routing_layers"] == [1, 3]
    got = load_rollout(url, digest=manifest_digest(manifest))
    for a, b in zip(got.routing, routing, strict=True):
        assert sorted(a) == [1, 3] and all(a[j].dtype == torch.uint8 and torch.equal(a[j], b[j]) for j in b)

    shard = tmp_path / "g0" / "routing" / "c" / "0" / "0" / "0"  # one chunk of the 3-d array
    clean = shard.read_bytes()
    shard.write_bytes(clean[:-1] + bytes([clean[-1] ^ 0x02]))
    with pytest.raises(CorruptArtefact, match="shard 'routing/c/0/0/0' is corrupted"):
        load_rollout(url)
    shard.write_bytes(clean)
    edited = json.loads((tmp_path / "g0" / "manifest.json").read_text())
    edited["routing_layers"].reverse()  # the layers' order is the manifest's: an edit swaps them
    with pytest.raises(CorruptArtefact, match="manifest changed"):
        load_rollout(url, digest=manifest_digest(edited))
    bad = {
        "one row per response token": [routing[0], {j: ids[:0] for j, ids in routing[1].items()}, routing[2]],
        "has MoE layers \\[1\\], response 0's \\[1, 3\\]": [*routing[:2], {1: routing[2][1]}],
        "expected integer expert ids": [*routing[:2], {j: ids.float() for j, ids in routing[2].items()}],
        "routing of 2 responses for 3": routing[:2],
        "without MoE layers": [{}, {}, {}],
    }
    for message, r in bad.items():
        with pytest.raises(ValueError, match=message):
            save_rollout(url, responses, logps, {}, routing=r)
    assert load_rollout(url).routing is not None  # refused before anything was written

# A rollout as longstraw stored it before the sampler's log-probs were kept (tests/fixtures/rollout-v2-no-sampler,
# written by that version's save_rollout): these responses and log-probs, meta {"finish_reasons", "texts"}.
OLD_ROLLOUT = ([[5, 2, 258], [7]], [[-0.5, -1.25, -2.0], [-0.75]])


def test_a_rollout_stored_before_the_sampler_logprobs_still_loads():
    from longstraw.store import load_rollout

    url = Path(__file__).parent / "fixtures" / "rollout-v2-no-sampler"
    got = load_rollout(str(url))
    assert got.sampler_logprobs is None and got.routing is None
    assert [r.tolist() for r in got.responses] == OLD_ROLLOUT[0]
    assert [lp.tolist() for lp in got.logprobs] == OLD_ROLLOUT[1]
    assert got.meta == {"finish_reasons": ["stop", "length"], "texts": ["a", "b"]}
