"""Prefix-state size of a model from its config alone: bytes per prompt token and fixed bytes, per layer kind."""

from __future__ import annotations

from collections import OrderedDict

from .engine.backward import sqrt_interval
from .models import config_from_hf

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


def state_size(hf_config: dict, tokens: int, dtype: str = "bf16", chunk: int = 2048) -> dict:
    """Sizes for a prompt of `tokens` tokens (the state covers tokens-1 of them; we count `tokens` for round
    figures). Exact mode needs the same again for dState, plus the fixed state at every prompt-chunk boundary."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} unknown; use one of {sorted(DTYPE_BYTES)}")
    if tokens < 1 or chunk < 1:
        raise ValueError("tokens and chunk must be >= 1")
    cfg = config_from_hf(hf_config)
    nbytes = DTYPE_BYTES[dtype]
    kinds: OrderedDict[str, dict] = OrderedDict()
    for spec in cfg.state_spec():
        k = kinds.setdefault(spec.kind, {"layers": 0, "bytes_per_token": 0, "fixed_bytes": 0})
        k["layers"] += 1
        k["bytes_per_token"] += spec.per_token * nbytes
        k["fixed_bytes"] += spec.fixed * nbytes + spec.fixed_fp32 * 4
    per_token = sum(k["bytes_per_token"] for k in kinds.values())
    nograd = sum(spec.per_token_nograd for spec in cfg.state_spec()) * nbytes
    fixed = sum(k["fixed_bytes"] for k in kinds.values())
    chunks = -(-tokens // chunk)
    total = per_token * tokens + fixed
    return {
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "dtype": dtype,
        "tokens": tokens,
        "kinds": dict(kinds),
        "bytes_per_token": per_token,
        "fixed_bytes": fixed,
        "total_bytes": total,
        "bytes_per_token_nograd": nograd,
        "exact_grad_bytes": (per_token - nograd) * tokens + fixed,
        "exact_boundary_bytes": fixed * chunks,
        # with boundary_every = ceil(sqrt(chunks)): stored every n-th plus at most n regenerated at a time
        "exact_sparse_boundary_every": (every := sqrt_interval(chunks)),
        "exact_sparse_boundary_bytes": fixed * (-(-chunks // every) + every),
        "prompt_chunks": chunks,
        "prompt_chunk": chunk,
    }


def _gb(n: int) -> str:
    return f"{n:,} B ({n / 1e9:,.2f} GB, {n / 2**30:,.2f} GiB)"


def format_state_size(r: dict) -> str:
    note = " (delta-rule states fp32)" if r["fixed_bytes"] else ""
    lines = [
        f"{r['model_type']}: {r['layers']} layers, state dtype {r['dtype']}{note}, {r['tokens']:,} tokens",
        f"{'layer kind':<40}{'layers':>7}{'B/token':>12}{'fixed B':>16}",
    ]
    for kind, k in r["kinds"].items():
        lines.append(f"{kind:<40}{k['layers']:>7}{k['bytes_per_token']:>12,}{k['fixed_bytes']:>16,}")
    lines.append(f"{'all layers':<40}{r['layers']:>7}{r['bytes_per_token']:>12,}{r['fixed_bytes']:>16,}")
    lines.append(f"prefix state for {r['tokens']:,} tokens: {_gb(r['total_bytes'])}")
    what = " (indexer keys get no gradient)" if r["bytes_per_token_nograd"] else ""
    lines.append(f"exact mode adds dState{what}: {_gb(r['exact_grad_bytes'])}")
    if r["exact_boundary_bytes"]:
        lines.append(
            f"  and fixed states at {r['prompt_chunks']:,} chunk starts (chunk {r['prompt_chunk']:,}): "
            f"{_gb(r['exact_boundary_bytes'])}"
        )
        lines.append(
            f"  or, with boundary_every={r['exact_sparse_boundary_every']} (one more no-grad prompt forward): "
            f"{_gb(r['exact_sparse_boundary_bytes'])}"
        )
    return "\n".join(lines)
