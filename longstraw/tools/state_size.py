"""Prefix-state size of a model from its config alone: bytes per prompt token and fixed bytes, per layer kind."""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..config import torch_dtype
from ..engine import sqrt_interval
from ..models.registry import build


def state_size(hf_config: dict, tokens: int, dtype: str = "bf16", chunk: int = 2048) -> dict:
    """Sizes for a prompt of `tokens` tokens (the state covers tokens-1 of them; we count `tokens` for round
    figures). Exact mode needs the same again for dState, plus the fixed state at every prompt-chunk boundary.

    The layout is the model's own: its layers' `empty_state`, built on the meta device (no memory, no weights)."""
    state_dtype = torch_dtype(dtype)
    if tokens < 1 or chunk < 1:
        raise ValueError("tokens and chunk must be >= 1")
    with torch.device("meta"):
        model = build(hf_config)
    cfg = model.config
    states = model.empty_state(1, state_dtype, "meta")
    kinds: OrderedDict[str, dict] = OrderedDict()
    for st in states:
        k = kinds.setdefault(st.description, {"layers": 0, "bytes_per_token": 0, "fixed_bytes": 0})
        k["layers"] += 1
        k["bytes_per_token"] += st.bytes_per_token
        k["fixed_bytes"] += st.fixed_bytes
    per_token = sum(k["bytes_per_token"] for k in kinds.values())
    grad_per_token = sum(st.grad_buffer().bytes_per_token for st in states)
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
        "bytes_per_token_nograd": per_token - grad_per_token,
        "exact_grad_bytes": grad_per_token * tokens + fixed,
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
