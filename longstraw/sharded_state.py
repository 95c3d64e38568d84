"""Prefix states, stored as one zarr group per sequence-parallel rank: the one state format, a single process's
state included: `save_state` writes it as a one-shard state, `load_state_shard(url)` (rank 0 of 1) reads it.

Layout at `url` (a local path or any fsspec URL):

    shard-000/, shard-001/, ...   rank r's part, a committed zarr group (`store.py`: its own manifest.json with the
                                  crc32c of every file): the rows of its blocks (its block of every prompt chunk,
                                  `blocks` in its manifest) of each per-token layer, the whole prompt's fixed-size
                                  layers, prompt_ids, and the exact mode's boundary states it kept
                                  (`boundaries/{chunk}/{layer}/{field}`)
    manifest.json                 written last, by rank 0: the commit marker

A shard group holds

    prompt_ids                           [P] int64, one chunk (always loaded whole)
    layers/{i}/k, layers/{i}/v           attention: [kv_heads, rows, head_dim]
    layers/{i}/kv, layers/{i}/index_k    MLA latent [rows, kv_lora_rank + rope_dim], DSA indexer key [rows, dim]
    layers/{i}/conv, layers/{i}/ssm      Gated DeltaNet: fixed size, one chunk each
    routing/{j}                          MoE routing replay: the experts [rows, top_k] of MoE layer j (uint8 up
                                         to 256 experts), when capture recorded them

with the per-token arrays chunked along the token axis by `shard_tokens` (`store._write_tensor`).

Why: each shard has exactly one writer, the rank that owns those tokens, so the ranks write in parallel and no
rank ever holds (or sends) another's rows. A shard is committed atomically on its own; the whole state exists
only once rank 0 has gathered every owner's record and written the top manifest. `uncommit` removes that marker
before the owners rewrite their shards, so a capture killed halfway never leaves an old top manifest pointing at
half-rewritten shards. The top manifest's sha256 (`store.manifest_digest`) is what a stage hands on: it covers
each shard manifest's sha256, which covers each file's crc32c, so one digest pins every byte.
Boundary states are stored so that a loaded shard can run exact mode's prompt backward without recapturing the
prompt.
"""

from __future__ import annotations

import json

import fsspec
import torch
import zarr
from torch import nn

from .files import CorruptArtefact, atomic_output
from .state import STATE_KINDS, LayerState, PrefixState, RowMap
from .store import (MANIFEST, _ChecksumStore, _dtype, _to_torch, _write_committed, _write_manifest, _write_tensor,
                    _zarr_store, manifest_digest, read_manifest)

SHARDED_FORMAT = ("longstraw.sharded_prefix_state", 2)
SHARD_FORMAT = ("longstraw.prefix_state_shard", 2)  # 2: a rank holds blocks of every chunk, not one range


def shard_url(url: str, rank: int) -> str:
    return f"{url.rstrip('/')}/shard-{rank:03d}"


def uncommit(url: str, storage_options: dict | None = None) -> None:
    """Remove the top manifest (if any): from here until `commit_sharded_state` no state exists at `url`."""
    fs, path = fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))
    if fs.exists(f"{path}/{MANIFEST}"):
        fs.rm_file(f"{path}/{MANIFEST}")


def _write_layer(group: zarr.Group, layer: LayerState, shard_tokens: int | None) -> dict:
    arrays = {name: _write_tensor(group, name, t, shard_tokens) for name, t in layer.named_tensors().items()}
    return {"kind": layer.kind, "arrays": arrays}


def save_state_shard(state: PrefixState, url: str, rank: int, *, weights_version: str, shard_tokens: int = 65536,
                     storage_options: dict | None = None) -> dict:
    """Write this rank's part of `state` at `shard_url(url, rank)`, committed atomically (the owner only).

    Returns the record rank 0 needs to commit: {"rank", "blocks": [[a, b], ...], "sha256": digest of the shard
    manifest}.
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    blocks = [list(b) for b in state.rows.blocks]
    for i, layer in enumerate(state.layers):
        if layer.token_axis is not None and (rows := layer.tensors()[0].shape[-2]) != state.rows.rows:
            raise ValueError(f"layer {i} holds {rows} rows, but the state's blocks have {state.rows.rows}")
    for j, ids in (state.routing or {}).items():
        if ids.shape[0] != state.rows.rows:
            raise ValueError(f"the routing of MoE layer {j} holds {ids.shape[0]} rows, but the state's blocks have "
                             f"{state.rows.rows}")

    def write(root: zarr.Group) -> dict:
        prompt = _write_tensor(root, "prompt_ids", state.prompt_ids.to(torch.int64), None)
        layers = [_write_layer(root.require_group(f"layers/{i}"), layer,
                               None if layer.token_axis is None else shard_tokens)  # fixed-size: one chunk
                  for i, layer in enumerate(state.layers)]
        boundaries = {str(c): {str(j): _write_layer(root.require_group(f"boundaries/{c}/{j}"), s, None)
                               for j, s in sorted(states.items())}
                      for c, states in sorted(state.boundaries.items())}
        routing = None if state.routing is None else \
            {str(j): _write_tensor(root, f"routing/{j}", t, shard_tokens) for j, t in sorted(state.routing.items())}
        name, version = SHARD_FORMAT
        return {"format": name, "format_version": version, "model_fingerprint": state.model_fingerprint,
                "weights_version": weights_version, "shard_tokens": shard_tokens, "length": state.length,
                "rank": rank, "blocks": blocks, "prompt_ids": prompt, "chunks": [list(c) for c in state.chunks],
                "layers": layers, "boundary_every": state.boundary_every, "boundaries": boundaries,
                "routing": routing}

    manifest = _write_committed(shard_url(url, rank), storage_options, write)
    return {"rank": rank, "blocks": blocks, "sha256": manifest_digest(manifest)}


def commit_sharded_state(url: str, shards: list[dict], *, state: PrefixState, weights_version: str,
                         storage_options: dict | None = None, extra: dict | None = None) -> dict:
    """Rank 0, once every owner's `save_state_shard` returned: check that their blocks tile [0, state.length),
    then write the top manifest, the commit marker. Returns it (`manifest_digest` of it is the hand-over
    digest)."""
    manifest = _top_manifest(shards, state, weights_version, extra)
    fs, path = fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))
    _write_manifest(fs, path, json.dumps(manifest, indent=1).encode())
    return manifest


def _top_manifest(shards: list[dict], state: PrefixState, weights_version: str, extra: dict | None) -> dict:
    if [record["rank"] for record in shards] != list(range(len(shards))) or not shards:
        raise ValueError(f"shard records are not ranks 0..{len(shards) - 1} in order: "
                         f"{[record['rank'] for record in shards]}")
    end = 0
    blocks = sorted(tuple(block) for record in shards for block in record["blocks"])
    if state.length == 0 and blocks == [(0, 0)]:  # a one-token prompt: no rows at all
        blocks = []
    for a, b in blocks:
        if a != end or b <= a:
            raise ValueError(f"the shards' blocks do not tile [0, {state.length}): [{a}, {b}) where a block "
                             f"starting at {end} was expected")
        end = b
    if end != state.length:
        raise ValueError(f"the shards' blocks cover [0, {end}), not the state's [0, {state.length})")
    name, version = SHARDED_FORMAT
    return {"format": name, "format_version": version, "model_fingerprint": state.model_fingerprint,
            "weights_version": weights_version, "length": state.length,
            "chunks": [list(c) for c in state.chunks], "shards": shards, "extra": extra or {}}


def save_state(state: PrefixState, url: str, *, weights_version: str, shard_tokens: int = 65536,
               storage_options: dict | None = None, extra: dict | None = None) -> dict:
    """Store a single process's `state` (all its rows) at `url` as a one-shard state, and return its
    top manifest (with `extra`, JSON-able). `load_state_shard(url, ...)` (rank 0 of 1) reads it back.

    The whole state (shard-000 and the top manifest) is written under a temporary sibling and swapped in at `url`
    as `store._write_committed` swaps a group: a writer that dies leaves the state committed there before, if any,
    readable (or nothing committed), never a mix of the two.
    """
    if state.sharded:
        raise ValueError(f"this prefix state is one rank's shard ({state.rows.rows} of {state.length} tokens); each "
                         "rank stores its own with save_state_shard, and rank 0 commits them with "
                         "commit_sharded_state")
    fs, final = fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))
    top: dict = {}

    def commit(root: str) -> None:
        _write_manifest(fs, root, json.dumps(top, indent=1).encode())

    with atomic_output(final, fs=fs, commit=commit) as tmp:
        record = save_state_shard(state, fs.unstrip_protocol(tmp), 0, weights_version=weights_version,
                                  shard_tokens=shard_tokens, storage_options=storage_options)
        top.update(_top_manifest([record], state, weights_version, extra))
    return top


def read_sharded_manifest(url: str, storage_options: dict | None = None, digest: str | None = None) -> dict:
    """The top manifest of the committed sharded state at `url` (see `store.read_manifest`)."""
    return read_manifest(url, storage_options, SHARDED_FORMAT, "sharded prefix state", digest)


def _check_model(manifest: dict, where: str, model: nn.Module, weights_version: str) -> None:
    if manifest["model_fingerprint"] != model.config.fingerprint:
        raise ValueError(f"prefix state at {where} was captured with another model (architecture fingerprint "
                         f"{manifest['model_fingerprint']} != this model's {model.config.fingerprint})")
    if manifest["weights_version"] != weights_version:
        raise ValueError(f"prefix state at {where} was captured with other weights (weights_version "
                         f"{manifest['weights_version']} != {weights_version})")


def load_state_shard(url: str, rank: int = 0, ranks: int = 1, *, model: nn.Module, weights_version: str,
                     storage_options: dict | None = None, digest: str | None = None) -> PrefixState:
    """Rank `rank`'s part of the committed sharded state at `url`, on the model's device, every file verified.
    The defaults read a single process's state (`save_state`): all rows.

    ValueError for a state of another architecture or other weights, or one stored by another number of ranks.
    CorruptArtefact (`where` = `url`: drop the whole state and recapture) when the top manifest is not `digest`,
    the shard's manifest not the one committed, or a file not the bytes written."""
    url = url.rstrip("/")
    top = read_sharded_manifest(url, storage_options, digest)
    _check_model(top, url, model, weights_version)
    if len(top["shards"]) != ranks:
        raise ValueError(f"prefix state at {url} was stored by {len(top['shards'])} sequence-parallel ranks, not "
                         f"{ranks}; run with the same sequence-parallel size, or delete the state to recapture it")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of the {ranks} ranks")
    record, where = top["shards"][rank], shard_url(url, rank)
    try:  # any corruption below invalidates the whole state: report the top url, the artefact to recompute
        manifest = read_manifest(where, storage_options, SHARD_FORMAT, "prefix state shard", record["sha256"])
        store = _ChecksumStore(_zarr_store(where, storage_options, read_only=True), manifest["checksums"], where,
                               verify=True, what="prefix state shard")
        root = zarr.open_group(store, mode="r", zarr_format=3)
        device = next(model.parameters()).device

        def layer(name: str, spec: dict) -> LayerState:
            if spec["kind"] not in STATE_KINDS:
                raise ValueError(f"prefix state shard at {where}: {name} has unknown state kind {spec['kind']!r}; "
                                 f"known: {', '.join(STATE_KINDS)}")
            tensors = {f: read(f"{name}/{f}", s) for f, s in spec["arrays"].items()}
            return STATE_KINDS[spec["kind"]].from_tensors(tensors)

        def read(name: str, spec: dict) -> torch.Tensor:
            array = root[name]
            if list(array.shape) != spec["shape"] or array.attrs.get("torch_dtype") != spec["dtype"]:
                raise ValueError(f"prefix state shard at {where}: array {name} does not match the manifest")
            return _to_torch(array[...], _dtype(spec["dtype"]), device)

        prompt_ids = read("prompt_ids", manifest["prompt_ids"])
        layers = [layer(f"layers/{i}", spec) for i, spec in enumerate(manifest["layers"])]
        boundaries = {int(c): {int(j): layer(f"boundaries/{c}/{j}", spec) for j, spec in states.items()}
                      for c, states in manifest["boundaries"].items()}
        # a shard stored before routing replay existed has no "routing": none recorded
        stored_routing = manifest.get("routing")
        routing = None if stored_routing is None else \
            {int(j): read(f"routing/{j}", spec) for j, spec in stored_routing.items()}
    except CorruptArtefact as e:
        raise CorruptArtefact(str(e), url) from e
    chunks = [tuple(c) for c in manifest["chunks"]]
    rows = RowMap(tuple(tuple(block) for block in manifest["blocks"]))
    return PrefixState(layers, prompt_ids, chunks, manifest["model_fingerprint"], boundaries=boundaries,
                       rows=rows, boundary_every=manifest["boundary_every"], routing=routing)



def load_state_routing(url: str, *, storage_options: dict | None = None, digest: str | None = None
                       ) -> dict[int, torch.Tensor] | None:
    """The MoE routing (engine/routing.py) recorded with the committed sharded state at `url`: by MoE layer, the
    experts [length, top_k] of the whole `prompt[:-1]`, every shard's rows put back at their positions, on the
    CPU; None when its capture recorded none. What a later capture of the same prompt forces (`capture(routing=)`),
    whatever the weights now: only the routing arrays are read, every file verified (CorruptArtefact names `url`,
    as `load_state_shard`)."""
    url = url.rstrip("/")
    top = read_sharded_manifest(url, storage_options, digest)
    whole: dict[int, torch.Tensor] = {}
    try:
        for rank, record in enumerate(top["shards"]):
            where = shard_url(url, rank)
            manifest = read_manifest(where, storage_options, SHARD_FORMAT, "prefix state shard", record["sha256"])
            if manifest.get("routing") is None:  # recorded by every shard or by none
                return None
            root = zarr.open_group(_ChecksumStore(_zarr_store(where, storage_options, read_only=True),
                                                  manifest["checksums"], where, verify=True,
                                                  what="prefix state shard"), mode="r", zarr_format=3)
            positions = RowMap(tuple(tuple(block) for block in manifest["blocks"])).positions()
            for j, spec in manifest["routing"].items():
                ids = _to_torch(root[f"routing/{j}"][...], _dtype(spec["dtype"]), torch.device("cpu"))
                if list(ids.shape) != spec["shape"] or ids.shape[0] != positions.numel():
                    raise ValueError(f"prefix state shard at {where}: routing/{j} holds {tuple(ids.shape)}, not the "
                                     f"manifest's {spec['shape']} of {positions.numel()} rows")
                layer = whole.setdefault(int(j), ids.new_zeros(top["length"], ids.shape[1]))
                layer[positions] = ids
    except CorruptArtefact as e:
        raise CorruptArtefact(str(e), url) from e
    return whole
