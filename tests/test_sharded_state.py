"""Sharded prefix-state store: one zarr shard per sequence-parallel rank, with exact mode's boundary states.

Round trips are bitwise (rows, fixed-size states, boundaries), and the exact prompt backward run from a loaded
state, without recapturing, equals naive mode (fp64, 1e-10), in one process and on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

import longstraw as ls
from longstraw.files import CorruptArtefact
from longstraw.engine.chunks import held_rows, prompt_chunks
from longstraw.parallel import SequenceGroup, SequenceParallel
from longstraw.parallel.objects import gather_json
from longstraw.sharded_state import (commit_sharded_state, load_state_shard, read_sharded_manifest,
                                     save_state, save_state_shard, shard_url, uncommit)
from longstraw.state import RowMap
from longstraw.store import manifest_digest
from tests.conftest import flat_grad, rel_err, state_tensors, tiny_model
from tests.parallel.launch import run_ranks

PROMPT = 40  # a state of 39 tokens in chunks of 8: 5 chunks, on one process or over N ranks (a block of each)
CHUNK = 8
EVERY = 2
LENGTHS = (5, 2, 7)
ADV = [1.0, -0.3, -0.7]
WV = "weights-0"  # the pipeline names weights by a lineage id: any string here
# keep the boundary states at every EVERY-th chunk start, and no chunk graphs (the state holds every boundary)
EXACT = ls.EngineConfig(prompt_chunk=CHUNK, boundary_every=EVERY, prompt_graph_budget=0)


def group():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (PROMPT,), generator=g)
    return prompt, [torch.randint(0, 97, (n,), generator=g) for n in LENGTHS]


def capture_exact(model, prompt, parallel=ls.ONE_RANK) -> ls.PrefixState:
    """A capture for exact mode's prompt backward: boundaries at chunks 0, EVERY, 2 EVERY, ..."""
    return ls.capture(model, prompt, EXACT, parallel=parallel, exact=True)


def rank_of(rank: int, world: int) -> SequenceGroup:
    """A stand-in for rank `rank` of a `world`-rank group: its layout (`chunk_blocks`, `boundary_owner`), no
    collectives."""
    g = SequenceGroup()
    g.rank, g.size = rank, world
    return g


def held(rank: int, world: int, length: int = PROMPT - 1) -> RowMap:
    """The rows rank `rank` of `world` holds of a `length`-token state in chunks of CHUNK: its block of each."""
    g = rank_of(rank, world)
    return held_rows(prompt_chunks(length, CHUNK, g), g)


def blocks(rows: RowMap) -> list[list[int]]:
    """`rows` as the store writes them (a shard record's and a shard manifest's "blocks")."""
    return [list(b) for b in rows.blocks]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def assert_same_state(a: ls.PrefixState, b: ls.PrefixState) -> None:
    """Bitwise: every layer's tensors, the prompt, chunks, rows, and the boundaries (same chunks, same tensors)."""
    assert [type(x) for x in a.layers] == [type(y) for y in b.layers]
    for x, y in zip(state_tensors(a), state_tensors(b)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
    assert torch.equal(a.prompt_ids, b.prompt_ids) and a.prompt_ids.dtype == b.prompt_ids.dtype
    assert (a.chunks, a.rows, a.boundary_every, a.model_fingerprint) == (b.chunks, b.rows, b.boundary_every,
                                                                        b.model_fingerprint)
    assert sorted(a.boundaries) == sorted(b.boundaries)
    for c in a.boundaries:
        assert sorted(a.boundaries[c]) == sorted(b.boundaries[c])
        for j, x in a.boundaries[c].items():
            y = b.boundaries[c][j]
            assert type(x) is type(y)
            for s, t in zip(x.tensors(), y.tensors()):
                assert s.dtype == t.dtype and s.shape == t.shape and torch.equal(bits(s), bits(t))


def save_one(state: ls.PrefixState, url: str, wv: str) -> dict:
    record = save_state_shard(state, url, 0, weights_version=wv, shard_tokens=16)
    return commit_sharded_state(url, [record], state=state, weights_version=wv, extra={"step": 3})


def exact_grad_from(model, state: ls.PrefixState, responses,
                    parallel=ls.ONE_RANK) -> tuple[torch.Tensor, torch.Tensor]:
    """(after the branches only, after the prompt backward too): exact mode run on a given state."""
    loss = ls.GRPOConfig()
    model.zero_grad(set_to_none=True)
    branches = ls.Branches.group(responses, ADV, loss, vocab_size=model.config.vocab_size)
    dstate = ls.new_dstate(state)
    ls.replay(model, state, branches, loss, dstate, engine=EXACT, parallel=parallel)
    after_branches = flat_grad(model).clone()
    ls.prompt_backward(model, state, dstate, parallel=parallel)
    return after_branches, flat_grad(model)


def naive_grad(model, prompt, responses) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses, ADV, mode="naive")
    return flat_grad(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_one_shard_round_trip_is_bitwise_with_boundaries(tmp_path, arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    prompt, responses = group()
    state = capture_exact(model, prompt)
    assert sorted(state.boundaries) == [0, 2, 4] and state.boundary_every == EVERY
    if arch == "qwen3_5":  # the Gated DeltaNet layers: 6 of 8 keep a boundary state
        assert all(len(b) == 6 for b in state.boundaries.values())
    wv = WV
    url = str(tmp_path / "state")
    top = save_one(state, url, wv)
    assert read_sharded_manifest(url) == top and top["extra"] == {"step": 3}
    assert [s["blocks"] for s in top["shards"]] == [[[0, 39]]]
    loaded = load_state_shard(url, 0, 1, model=model, weights_version=wv, digest=manifest_digest(top))
    assert not loaded.sharded and loaded.rows == RowMap.whole(39)
    assert_same_state(state, loaded)
    for a, b in zip(ls.score(model, state, responses), ls.score(model, loaded, responses)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("source", ["captured", "loaded"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_exact_prompt_backward_from_stored_boundaries_equals_naive(tmp_path, arch, source):
    """boundary_every=2: chunks 0, 2, 4 start from stored boundaries, 1 and 3 from regenerated ones."""
    model = tiny_model(arch, dtype=torch.float64)
    prompt, responses = group()
    want = naive_grad(model, prompt, responses)
    state = capture_exact(model, prompt)
    if source == "loaded":
        wv = WV
        save_one(state, str(tmp_path / "state"), wv)
        state = load_state_shard(str(tmp_path / "state"), 0, 1, model=model, weights_version=wv)
    assert sorted(state.boundaries) == [0, 2, 4]
    branches, exact = exact_grad_from(model, state, responses)
    assert sorted(state.boundaries) == [0, 2, 4]  # the prompt backward leaves the state's boundaries as they are
    assert rel_err(exact, want) <= 1e-10
    assert rel_err(branches, want) > 1e-3  # the prompt backward is what closes the gap


def test_save_state_is_the_one_shard_state(tmp_path):
    """A single process's `save_state` / `load_state_shard` (rank 0 of 1 by default) write and read exactly what rank 0 of 1 does (boundaries
    included), and the loaded state holds all rows (RowMap.whole, as the captured one does): the one-process
    engine takes it as is."""
    model = tiny_model("qwen3_5")
    prompt, responses = group()
    state = capture_exact(model, prompt)
    assert state.rows == RowMap.whole(PROMPT - 1) and not state.sharded  # a one-process state: a one-shard one
    one, ranked = str(tmp_path / "one"), str(tmp_path / "ranked")
    top = save_state(state, one, weights_version=WV, shard_tokens=16, extra={"step": 3})
    assert top == save_one(state, ranked, WV) == read_sharded_manifest(one)  # rank 0 of 1 wrote block [0, 39)
    assert [(s["rank"], s["blocks"]) for s in top["shards"]] == [(0, [[0, PROMPT - 1]])]
    assert sorted(p.name for p in Path(one).iterdir()) == ["manifest.json", "shard-000"]
    for url in (one, ranked):
        for loaded in (load_state_shard(url, model=model, weights_version=WV, digest=manifest_digest(top)),
                       load_state_shard(url, 0, 1, model=model, weights_version=WV)):
            assert not loaded.sharded and loaded.rows == RowMap.whole(PROMPT - 1)
            assert_same_state(state, loaded)
    for a, b in zip(ls.score(model, state, responses), ls.score(model, loaded, responses)):
        assert torch.equal(a, b)
    with pytest.raises(CorruptArtefact):
        load_state_shard(one, model=model, weights_version=WV, digest="0" * 64)


def part_of(state: ls.PrefixState, rows: RowMap) -> ls.PrefixState:
    """The part of a one-process state that a sequence-parallel rank holding `rows` has (its boundaries left
    out)."""
    index = rows.positions()
    layers = [s if s.token_axis is None else
              type(s).from_tensors({n: t.index_select(-2, index) for n, t in s.named_tensors().items()})
              for s in state.layers]
    return ls.PrefixState(layers, state.prompt_ids, state.chunks, state.model_fingerprint, rows=rows)


def test_each_rank_reads_only_its_own_shard(tmp_path, monkeypatch):
    """Rank r of N reads shard-00r only (its rows, no other rank's file), so a corrupted file of another rank's
    shard does not stop it; its own does."""
    from zarr.storage import LocalStore

    model = tiny_model("qwen3_5")
    prompt, _ = group()
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK))
    url = str(tmp_path / "state")
    assert all(prompt_chunks(PROMPT - 1, CHUNK, rank_of(r, 3)) == state.chunks for r in range(3))
    parts = [held(r, 3) for r in range(3)]  # each rank's block of each of the 5 chunks, interleaved
    assert all(len(p.blocks) == len(state.chunks) for p in parts)
    cut = [b for i, (s, e) in enumerate(state.chunks) for b in sorted(rank_of(0, 3).chunk_blocks(i, s, e))]
    assert sorted(b for p in parts for b in p.blocks) == cut  # together, every chunk's blocks: [0, 39) once
    records = [save_state_shard(part_of(state, rows), url, r, weights_version=WV, shard_tokens=4)
               for r, rows in enumerate(parts)]
    assert [(s["rank"], s["blocks"]) for s in records] == [(r, blocks(p)) for r, p in enumerate(parts)]
    top = commit_sharded_state(url, records, state=state, weights_version=WV)
    assert [s["blocks"] for s in top["shards"]] == [blocks(p) for p in parts]
    read: list[str] = []
    real_get = LocalStore.get

    async def counting_get(self, key, *args, **kwargs):
        read.append(f"{Path(str(self.root)).name}/{key}")
        return await real_get(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "get", counting_get)
    for r, rows in enumerate(parts):
        read.clear()
        part = load_state_shard(url, r, 3, model=model, weights_version=WV)
        assert {k.split("/")[0] for k in read} == {f"shard-{r:03d}"}
        assert part.rows == rows and part.sharded and torch.equal(part.prompt_ids, state.prompt_ids)
        for x, y in zip(part.layers, state.layers):
            for n, t in x.named_tensors().items():
                want = getattr(y, n) if y.token_axis is None else getattr(y, n).index_select(-2, rows.positions())
                assert t.shape == want.shape and torch.equal(t, want), (r, n)
    monkeypatch.undo()
    shard0 = Path(shard_url(url, 0))
    key = next(k for k in json.loads((shard0 / "manifest.json").read_text())["checksums"] if "/k/c/" in k)
    data = bytearray((shard0 / key).read_bytes())
    data[len(data) // 2] ^= 0x01
    (shard0 / key).write_bytes(bytes(data))
    assert load_state_shard(url, 1, 3, model=model, weights_version=WV).rows == parts[1]
    with pytest.raises(CorruptArtefact, match=f"{key}.*corrupted"):
        load_state_shard(url, 0, 3, model=model, weights_version=WV)


def two_ranks(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """Each rank captures its shard, writes it, rank 0 commits; each loads its own back and runs exact mode."""
    sp = SequenceParallel()
    model = tiny_model("qwen3_5", dtype=torch.float64)
    prompt, responses = group()
    wv = WV
    state = capture_exact(model, prompt, sp)
    if rank == 0:
        uncommit(root)
    dist.barrier()  # the old commit marker is gone before any owner rewrites its shard
    record = save_state_shard(state, root, rank, weights_version=wv, shard_tokens=4)
    records = gather_json(record)
    if rank == 0:
        commit_sharded_state(root, records, state=state, weights_version=wv)
    dist.barrier()
    loaded = load_state_shard(root, rank, world, model=model, weights_version=wv)
    assert_same_state(state, loaded)
    kept = torch.tensor(sorted(loaded.boundaries), dtype=torch.int64)
    branches, exact = exact_grad_from(model, loaded, responses, sp)
    assert sorted(loaded.boundaries) == kept.tolist()  # the prompt backward leaves them as they are
    return {"grad": exact, "branches": branches, "boundaries": kept, "rows": torch.tensor(loaded.rows.blocks),
            "blocks": torch.tensor(record["blocks"]), "chunks": torch.tensor(loaded.chunks)}


def test_two_ranks_write_their_own_shards_and_get_the_exact_gradient(tmp_path):
    model = tiny_model("qwen3_5", dtype=torch.float64)
    prompt, responses = group()
    want = naive_grad(model, prompt, responses)
    url = tmp_path / "state"
    ranks = run_ranks(2, two_ranks, str(url), timeout=180)
    # 5 chunks of [0, 39), each cut in 2 blocks: rank 0 holds the first of even chunks and the second of odd ones
    parts = [held(r, 2) for r in range(2)]
    assert parts[0].blocks == ((0, 4), (12, 16), (16, 20), (28, 32), (32, 36))
    assert parts[1].blocks == ((4, 8), (8, 12), (20, 24), (24, 28), (36, 39))
    for r, out in enumerate(ranks):
        assert out["chunks"].tolist() == [list(c) for c in prompt_chunks(PROMPT - 1, CHUNK)]
        assert out["rows"].tolist() == blocks(parts[r]) == out["blocks"].tolist()
        assert rel_err(out["grad"], want) <= 1e-10
        assert torch.equal(out["grad"], ranks[0]["grad"])
        assert rel_err(out["branches"], want) > 1e-3
    # boundaries at chunks 0, 2, 4 (every EVERY-th), each kept by rank i % 2: all three by rank 0, none by rank 1
    # (chunks 1 and 3 regenerated from the boundaries rank 0 hands on)
    for r, out in enumerate(ranks):
        assert out["boundaries"].tolist() == [i for i in range(0, 5, EVERY) if rank_of(r, 2).boundary_owner(i, EVERY) == r]
    assert ranks[0]["boundaries"].tolist() == [0, 4] and ranks[1]["boundaries"].tolist() == [2]  # in turn
    top = read_sharded_manifest(str(url))
    assert [(s["rank"], s["blocks"]) for s in top["shards"]] == [(r, blocks(p)) for r, p in enumerate(parts)]
    for r in range(2):  # shard r is rank r's: its blocks, its rows only
        shard = json.loads((Path(shard_url(str(url), r)) / "manifest.json").read_text())
        assert shard["rank"] == r and shard["blocks"] == blocks(parts[r])
        k = next(layer for layer in shard["layers"] if layer["kind"] == "attention")["arrays"]["k"]
        assert k["shape"][-2] == parts[r].rows
        assert sorted(shard["boundaries"], key=int) == [str(c) for c in ranks[r]["boundaries"].tolist()]
    assert not list(url.glob(".*.tmp-*"))  # no temporaries left


# ---- refused input ------------------------------------------------------------------------------------------


@pytest.fixture
def stored(tmp_path):
    model = tiny_model("qwen3_5")
    prompt, _ = group()
    state = capture_exact(model, prompt)
    wv = WV
    url = str(tmp_path / "state")
    return model, state, wv, url, save_one(state, url, wv)


def test_flipped_byte_in_a_shard_file_is_named(stored):
    model, _, wv, url, _ = stored
    shard = json.loads((Path(shard_url(url, 0)) / "manifest.json").read_text())
    j = next(j for j, s in shard["boundaries"]["2"].items())
    key = next(k for k in shard["checksums"] if k.startswith(f"boundaries/2/{j}/") and "/c/" in k)
    path = Path(shard_url(url, 0)) / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptArtefact, match=f"{key}.*corrupted") as e:
        load_state_shard(url, 0, 1, model=model, weights_version=wv)
    assert e.value.where == url


def test_edited_shard_manifest_is_refused(stored):
    model, _, wv, url, _ = stored
    path = Path(shard_url(url, 0)) / "manifest.json"
    shard = json.loads(path.read_text())
    shard["boundary_every"] = 1  # would make the backward look for boundaries that are not there
    path.write_text(json.dumps(shard))
    with pytest.raises(CorruptArtefact, match="not the one") as e:
        load_state_shard(url, 0, 1, model=model, weights_version=wv)
    assert e.value.where == url


def test_top_manifest_digest_is_checked(stored):
    model, _, wv, url, top = stored
    assert load_state_shard(url, 0, 1, model=model, weights_version=wv, digest=manifest_digest(top)).length == 39
    with pytest.raises(CorruptArtefact) as e:
        load_state_shard(url, 0, 1, model=model, weights_version=wv, digest="0" * 64)
    assert e.value.where == url


def test_other_sequence_parallel_size_is_refused(stored):
    model, _, wv, url, _ = stored
    with pytest.raises(ValueError, match=r"stored by 1 sequence-parallel ranks, not 2.*same sequence-parallel size"):
        load_state_shard(url, 0, 2, model=model, weights_version=wv)


def test_uncommitted_state_does_not_exist(stored):
    model, state, wv, url, _ = stored
    uncommit(url)
    uncommit(url)  # nothing to remove: no error
    with pytest.raises(ValueError, match="no committed"):
        load_state_shard(url, 0, 1, model=model, weights_version=wv)
    other = str(Path(url).parent / "never")
    save_state_shard(state, other, 0, weights_version=wv)  # a shard written, the state never committed
    with pytest.raises(ValueError, match="no committed"):
        read_sharded_manifest(other)


def test_other_model_or_weights_are_refused(stored):
    model, _, wv, url, _ = stored
    with pytest.raises(ValueError, match="another model"):
        load_state_shard(url, 0, 1, model=tiny_model("qwen3"), weights_version=wv)
    with pytest.raises(ValueError, match="other weights"):
        load_state_shard(url, 0, 1, model=model, weights_version="weights-1")


def records_of(*ranks: tuple[int, list[list[int]]]) -> list[dict]:
    return [{"rank": r, "blocks": b, "sha256": ""} for r, b in ranks]


# two ranks' blocks of [0, 39) in chunks 0-8, 8-16, 16-39: rank 0 first of even chunks, second of odd ones
RANK0, RANK1 = [[0, 4], [12, 16], [16, 28]], [[4, 8], [8, 12], [28, 39]]


@pytest.mark.parametrize("records, error", [
    (records_of((0, [[0, 4], [12, 16], [16, 26]]), (1, RANK1)), "tile"),  # a gap: [26, 28) held by no rank
    (records_of((0, [[0, 4], [12, 20]]), (1, RANK1)), "tile"),  # a gap: [20, 28) held by no rank
    (records_of((0, RANK0), (1, [[4, 8], [8, 14], [28, 39]])), "tile"),  # an overlap: [12, 14) held twice
    (records_of((0, RANK0), (1, [[4, 12], [12, 16], [28, 39]])), "tile"),  # a whole block held by both ranks
    (records_of((0, RANK0), (1, [[4, 8], [8, 12], [28, 39]]), (2, [[30, 35]])), "tile"),  # a third rank overlaps
    (records_of((0, RANK0), (1, [[4, 8], [12, 8], [28, 39]])), "tile"),  # a block that ends before it starts
    (records_of((0, RANK0), (1, [[4, 8], [8, 8], [8, 12], [28, 39]])), "tile"),  # an empty block
    (records_of((0, RANK0), (1, [[4, 8], [8, 12], [28, 38]])), "cover"),  # the last token held by no rank
    (records_of((0, RANK0), (1, [[4, 8], [8, 12], [28, 40]])), "cover"),  # past the state's end
    (records_of((1, RANK1), (0, RANK0)), "in order"),  # the blocks tile, but the records are not in rank order
    (records_of((0, RANK0), (2, RANK1)), "in order"),  # rank 1 missing (the blocks tile)
    (records_of((0, RANK0)), "tile"),  # rank 1 missing: its blocks held by no rank
    (records_of((0, [[0, 20]])), "cover"),  # one rank holding a prefix only
    ([], "in order"),  # no rank at all
])
def test_commit_refuses_records_that_do_not_tile_the_prompt(stored, records, error):
    _, state, wv, url, _ = stored
    assert state.length == 39
    uncommit(url)
    with pytest.raises(ValueError, match=error):
        commit_sharded_state(url, records, state=state, weights_version=wv)
    with pytest.raises(ValueError, match="no committed"):  # nothing was committed by the refused call
        read_sharded_manifest(url)


def test_commit_takes_blocks_that_tile_the_prompt_in_any_order(stored):
    """The same rows as the refused records above, held as blocks that tile [0, 39): committed."""
    _, state, wv, url, _ = stored
    uncommit(url)
    top = commit_sharded_state(url, records_of((0, RANK0), (1, RANK1)), state=state, weights_version=wv)
    assert read_sharded_manifest(url) == top and [s["blocks"] for s in top["shards"]] == [RANK0, RANK1]


def test_capture_refuses_a_bad_boundary_interval():
    model = tiny_model("qwen3")
    prompt, _ = group()
    for bad in (0, -1, 1.5, True):  # EngineConfig refuses it: integers >= 1 only, strictly
        with pytest.raises(ValidationError, match=r"boundary_every\n"):
            ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK, boundary_every=bad), exact=True)
    assert ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK)).boundaries == {}  # the default keeps none
