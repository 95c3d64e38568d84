"""Checksummed zarr v3 groups over fsspec, committed atomically: what prefix states and rollouts are stored as.

A group at `url` (a local path or any fsspec URL, e.g. ``s3://bucket/run/step-3/state`` with `storage_options`) is
written under a temporary sibling name, moved into place, and committed by its `manifest.json`, written last: a
group without it does not exist. The manifest holds the group's format and version, what its writer recorded, and
`checksums`: the crc32c of every file written (the zarr metadata files and every chunk file).

Per-token arrays (token axis -2) are chunked along the token axis by `shard_tokens`; each chunk file is a *shard*,
written whole by one call. crc32c, not sha256: it guards against corruption (torn writes, bit rot, truncation), not
forgery, and it is 5x faster (`bench/hashes.py`: 4.7 against 0.96 GB/s on one core), which at 2.1M tokens is 4 s
instead of 18 s for each rank's 17 GB shard of a 27B hybrid's state, on every read. What a stage hands to the next
is `manifest_digest`, a sha256 over the whole manifest (these checksums included).
bf16 (and fp8) tensors are stored as their unsigned-integer view, with the torch dtype in the array's attribute
`torch_dtype`; other dtypes natively. Chunks are zstd-compressed (zarr's default), which also makes the padding of
the last, partial shard cost next to nothing.

Prefix states (one zarr group per sequence-parallel rank, one rank for a single process) are `sharded_state.py`;
rollouts are below.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import NamedTuple

import fsspec
import google_crc32c
import numpy as np
import torch
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from .files import CorruptArtefact, atomic_output, sha256_bytes, write_bytes

MANIFEST = "manifest.json"
_UINT_VIEW = {torch.bfloat16: torch.uint16}
_UINT_VIEW.update({getattr(torch, n): torch.uint8 for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)})


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    return (t.view(_UINT_VIEW[t.dtype]) if t.dtype in _UINT_VIEW else t).numpy()


def _to_torch(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return (t.view(dtype) if t.dtype != dtype else t).to(device)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in a stored array")
    return dtype


def _checksum(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


class _ChecksumStore(WrapperStore):
    """Records the crc32c of every file written; on read, verifies the files the manifest lists before use."""

    def __init__(self, store: Store, sums: dict[str, str], url: str, verify: bool = False,
                 what: str = "prefix state") -> None:
        super().__init__(store)
        self.sums, self.url, self.verify, self.what = sums, url, verify, what

    def _with_store(self, store: Store) -> _ChecksumStore:
        return type(self)(store, self.sums, self.url, self.verify, self.what)

    async def set(self, key, value) -> None:
        self.sums[key] = _checksum(value.to_bytes())
        await self._store.set(key, value)

    async def set_if_not_exists(self, key, value) -> None:
        if not await self._store.exists(key):
            await self.set(key, value)

    async def _set_many(self, values: Iterable) -> None:
        for key, value in values:
            await self.set(key, value)

    async def get(self, key, prototype, byte_range=None):
        if not self.verify or key not in self.sums:
            return await self._store.get(key, prototype, byte_range)
        buf = await self._store.get(key, prototype)  # whole file: a checksum covers all of it
        what = f"{'shard' if '/c/' in key else 'metadata file'} {key!r}"
        if buf is None:
            raise ValueError(f"{self.what} at {self.url}: {what} is missing")
        if _checksum(buf.to_bytes()) != self.sums[key]:
            raise CorruptArtefact(f"{self.what} at {self.url}: {what} is corrupted (crc32c differs from the "
                                  "manifest)", self.url)
        return buf if byte_range is None else await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]


def _zarr_store(url: str, storage_options: dict | None, read_only: bool) -> Store:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if _is_local(fs):
        return LocalStore(path, read_only=read_only)
    return FsspecStore.from_url(url, storage_options=storage_options, read_only=read_only)


def _is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


def _write_shard(array: zarr.Array, index: tuple, data: np.ndarray) -> None:
    """Write one shard (one chunk file) whole. Every byte of array data goes through here, one shard per call."""
    array[index] = data


def _write_tensor(group: zarr.Group, name: str, t: torch.Tensor, shard_tokens: int | None) -> dict:
    """One zarr array; per-token tensors (token axis -2) are written shard by shard (each copied to the host on its
    own), fixed ones in one chunk."""
    shape = tuple(t.shape)
    chunks = shape if shard_tokens is None else (*shape[:-2], shard_tokens, shape[-1])
    array = group.create_array(
        name,
        shape=shape,
        chunks=tuple(max(1, c) for c in chunks),
        dtype=_to_numpy(t.new_empty(0)).dtype,
        fill_value=0,
        attributes={"torch_dtype": _dtype_name(t.dtype)},
        config={"write_empty_chunks": True},  # every shard exists: a missing file is an error, never zeros
    )
    if shard_tokens is None:
        if t.numel():
            _write_shard(array, (...,), _to_numpy(t))
    else:
        for s in range(0, shape[-2], shard_tokens):
            index = (..., slice(s, s + shard_tokens), slice(None))
            _write_shard(array, index, _to_numpy(t[index]))
    return {"shape": list(shape), "dtype": _dtype_name(t.dtype)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_committed(url: str, storage_options: dict | None, write) -> dict:
    """Run `write(root_group) -> manifest` into a temporary sibling, swap it in at `url`, and commit the manifest
    (with the checksums of every file written) as the last step, inside the swap (`files.atomic_output`).

    Everything is written under `.{name}.tmp-*`, moved into place, and only then `manifest.json` is written there as
    the commit marker. A writer that dies leaves nothing committed at `url`. A group already committed there stays
    readable while the new one is written beside it; then it is moved aside (`{url}.old-*`), the new one moved in
    and committed, and the old one deleted. A writer killed inside that swap (two renames and one small write)
    leaves the previous group, committed, at `{url}.old-*`; one that fails there with an exception puts it back. On
    object stores a "move" is copy-and-delete: still never a committed partial group, but the swap takes longer.
    One writer per `url` at a time.
    """
    fs, final = fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))
    sums: dict[str, str] = {}
    out: dict = {}

    def commit(root: str) -> None:
        _write_manifest(fs, root, json.dumps(out, indent=1).encode())

    with atomic_output(final, fs=fs, commit=commit) as tmp:
        store = _ChecksumStore(_zarr_store(fs.unstrip_protocol(tmp), storage_options, read_only=False), sums, url)
        out.update(write(zarr.open_group(store, mode="w", zarr_format=3)))
        out["checksums"] = dict(sorted(sums.items()))
    return out


def _write_manifest(fs, root: str, manifest: bytes) -> None:
    """The commit marker, written whole: readers never see a partial manifest."""
    write_bytes(f"{root}/{MANIFEST}", manifest, fs)


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's whole content (the file checksums and every other field: chunks, meta, ...): what a
    stage hands on, so that the next one notices any edit of the manifest itself."""
    return sha256_bytes(json.dumps(manifest, sort_keys=True).encode())


def read_manifest(url: str, storage_options: dict | None, fmt: tuple[str, int], what: str,
                  digest: str | None = None) -> dict:
    """The manifest of the committed `what` at `url` in format `fmt` (name, version); ValueError if there is none
    (never committed, or killed) or it has another format.
    With `digest` (a `manifest_digest` handed on by the stage that wrote it), CorruptArtefact unless it matches."""
    url = url.rstrip("/")
    name, version = fmt
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        manifest = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))
    except FileNotFoundError:
        raise ValueError(f"no committed {what} at {url} ({MANIFEST} missing)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} at {url}: unreadable {MANIFEST} ({e})") from None
    if manifest.get("format") != name or manifest.get("format_version") != version:
        raise ValueError(
            f"{what} at {url} has format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
            f"this longstraw reads {name!r} version {version}"
        )
    if digest is not None and manifest_digest(manifest) != digest:
        raise CorruptArtefact(f"{what} at {url} is not the one this stage was given (its manifest changed); it is "
                              "recomputed on the next attempt", url)
    return manifest


# ---- rollouts ---------------------------------------------------------------------------------------------------

# Version 2 with optional arrays added since: the sampler's log-probs, the MoE routing, and the masks of multi-turn
# branches (agents: True where the model wrote the token). A rollout stored before them still reads (its
# `sampler_logprobs` / `routing` / `masks` None; no masks: every token is the model's), and an older reader of a
# newer rollout reads what it knows and ignores the rest.
ROLLOUT_FORMAT = ("longstraw.rollout", 2)

BranchRouting = dict[int, torch.Tensor]  # MoE decoder-layer index -> expert ids [response tokens, top_k]


class StoredRollout(NamedTuple):
    """A group's sampled answers as stored: token ids, their log-probs at temperature 1 (GRPO's old log-probs), the
    log-probs under the distribution they were drawn from (None in a rollout stored before they were kept), the
    JSON meta (texts, finish reasons, the example; an agent's turns), each answer's MoE routing (None: not recorded)
    and each answer's bool mask, True where the model wrote the token (None: every token is the model's)."""

    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    sampler_logprobs: list[torch.Tensor] | None
    meta: dict
    routing: list[BranchRouting] | None = None
    masks: list[torch.Tensor] | None = None


def save_rollout(url: str, responses: list[torch.Tensor], logprobs: list[torch.Tensor], meta: dict, *,
                 sampler_logprobs: list[torch.Tensor] | None = None, routing: list[BranchRouting] | None = None,
                 masks: list[torch.Tensor] | None = None, storage_options: dict | None = None) -> dict:
    """Store a group's sampled responses (token ids), their log-probs (temperature 1), the sampler's log-probs
    (under the tempered, filtered distribution each token was drawn from), their MoE routing (`Sample.routing`:
    by MoE layer, the experts [tokens, top_k] each token's decode step went to) and a JSON-able `meta` (texts,
    finish reasons) at `url`: ragged rows concatenated, with offsets; committed and checksummed like a state. The
    routing is one array [tokens, MoE layers, top_k] (uint8 up to 256 experts), its layers listed in the
    manifest: two files, not two per layer. `masks` (multi-turn branches): one bool per token, True where the
    model wrote it (False on an environment's observation tokens)."""
    per_token = ({"log-prob": logprobs} | ({} if sampler_logprobs is None else {"sampler log-prob": sampler_logprobs})
                 | ({} if masks is None else {"mask": masks}))
    for what, values in per_token.items():
        if len(responses) != len(values) or any(r.numel() != v.numel() for r, v in zip(responses, values)):
            raise ValueError(f"save_rollout needs one {what} per response token")
    layers, packed = (None, None) if routing is None else _pack_routing(responses, routing)
    lengths = torch.tensor([r.numel() for r in responses], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])

    def write(root: zarr.Group) -> dict:
        arrays = {
            "tokens": _write_tensor(root, "tokens", torch.cat(responses).to(torch.int64).cpu(), None),
            "logprobs": _write_tensor(root, "logprobs", torch.cat(logprobs).float().cpu(), None),
            "offsets": _write_tensor(root, "offsets", offsets, None),
        }
        if sampler_logprobs is not None:
            arrays["sampler_logprobs"] = _write_tensor(root, "sampler_logprobs",
                                                       torch.cat(sampler_logprobs).float().cpu(), None)
        if masks is not None:  # as bytes 0/1
            arrays["masks"] = _write_tensor(root, "masks", torch.cat(masks).to(torch.uint8).cpu(), None)
        extra = {}
        if packed is not None:
            arrays["routing"] = _write_tensor(root, "routing", packed, None)
            extra["routing_layers"] = layers
        name, version = ROLLOUT_FORMAT
        return {"format": name, "format_version": version, "responses": len(responses), "arrays": arrays,
                "meta": meta, **extra}

    return _write_committed(url, storage_options, write)


def _pack_routing(responses: list[torch.Tensor], routing: list[BranchRouting]) -> tuple[list[int], torch.Tensor]:
    """(the MoE layers, sorted; the routing as [tokens, layers, top_k] on the CPU), every response's checked: the
    same layers, one integer row of top_k ids per token."""
    if len(routing) != len(responses):
        raise ValueError(f"save_rollout got the routing of {len(routing)} responses for {len(responses)}; give one "
                         "per response")
    layers = sorted(routing[0]) if routing else []
    if routing and not layers:
        raise ValueError("save_rollout got a routing without MoE layers (a dense model routes nothing); pass "
                         "routing=None")
    rows = []
    for i, (r, by_layer) in enumerate(zip(responses, routing)):
        if sorted(by_layer) != layers:
            raise ValueError(f"the routing of response {i} has MoE layers {sorted(by_layer)}, response 0's "
                             f"{layers}; record every response with the same model")
        for j, ids in by_layer.items():
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() != 2 \
                    or ids.shape[0] != r.numel():
                raise ValueError(f"the routing of response {i}, layer {j}: expected integer expert ids [{r.numel()}, "
                                 f"top_k] (one row per response token), got {ids.dtype} {tuple(ids.shape)}")
        if len({ids.shape[1] for ids in by_layer.values()}) > 1:
            raise ValueError(f"the routing of response {i} has layers of different top_k; one array holds them all")
        rows.append(torch.stack([by_layer[j].cpu() for j in layers], 1))
    return layers, torch.cat(rows)


def load_rollout(url: str, *, storage_options: dict | None = None, digest: str | None = None) -> StoredRollout:
    """The committed rollout at `url`; every file's checksum verified (and the manifest against `digest`, see
    `read_manifest`)."""
    url = url.rstrip("/")
    manifest = read_manifest(url, storage_options, ROLLOUT_FORMAT, "rollout", digest)
    store = _ChecksumStore(_zarr_store(url, storage_options, read_only=True), manifest["checksums"], url, True,
                           "rollout")
    root = zarr.open_group(store, mode="r", zarr_format=3)
    arrays = {k: _to_torch(root[k][...], _dtype(spec["dtype"]), torch.device("cpu"))
              for k, spec in manifest["arrays"].items()}
    o = arrays["offsets"].tolist()
    rows = lambda a: [a[o[i] : o[i + 1]] for i in range(manifest["responses"])]  # noqa: E731
    sampler, routed, masks = arrays.get("sampler_logprobs"), arrays.get("routing"), arrays.get("masks")
    routing = None if routed is None else \
        [{j: r[:, l].contiguous() for l, j in enumerate(manifest["routing_layers"])} for r in rows(routed)]
    return StoredRollout(rows(arrays["tokens"]), rows(arrays["logprobs"]), None if sampler is None else rows(sampler),
                         manifest["meta"], routing, None if masks is None else rows(masks.bool()))
