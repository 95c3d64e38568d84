"""The prepared GPU benchmark (issue 14): one run on one GPU, within a time budget, a table and JSON at the end.

A random Qwen3.5-shaped model of ~4B parameters, bf16, built on the GPU (no downloads):
- parity: a small model's logits and exact-mode gradient on the GPU against the CPU fp32 reference;
- capture: tokens/s and model-FLOPs utilisation at P = 128K, 512K, 1M, 2.1M;
- exact: one GRPO step (G = 8, R = 1K) at the largest P that fits, its peak memory against `longstraw plan`;
- naive: the same step recomputing the prompt per branch, at the largest P it fits, for the ratio;
- rollout: decode tokens/s for n = 1 and 8 branches on one shared prefix, eager, then with the decode step compiled
  (static: one CUDA graph replayed per token; dynamic).

Each measurement is predicted from the ones before it (capture time grows as a P + b P^2) and skipped, with the
reason recorded, when it would not fit the remaining budget; an out-of-memory stops that section's growth. With
`--dry-run` every section runs on the CPU with a tiny model in seconds (`make test` runs it, so the script stays
green without a GPU).

    bench/gpu/run.sh                        # on a GPU machine: writes bench/out/gpu/bench.json + a table
    .venv/bin/python bench/gpu/bench.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import longstraw as ls  # noqa: E402

H200_BF16_FLOPS = 989e12  # dense bf16 peak of one H200 (SXM), the MFU denominator


def model_config(dry: bool, max_pos: int) -> dict:
    """Qwen3.5-4B-shaped (3 Gated DeltaNet layers per gated full-attention layer, head_dim 256), or a tiny one."""
    sizes = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16) if dry else
             dict(vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128))
    return {"model_type": "qwen3_5_text", **sizes, "linear_conv_kernel_dim": 4, "max_position_embeddings": max_pos,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}


def forward_flops(cfg: dict, params: int, tokens: int, context: int) -> float:
    """Model FLOPs of a forward of `tokens` new tokens after `context` earlier ones: 2 per non-embedding
    parameter per token, plus causal attention in the full-attention layers (QK^T and PV), plus the delta
    rule's state read and write in the linear ones. Embedding lookups are free; the LM head is counted."""
    layers = cfg["num_hidden_layers"]
    full = layers // 4  # every 4th layer is full attention (qwen3_5's default pattern)
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    dense = 2 * (params - embed) * tokens + 2 * embed * tokens  # tied head: the embedding matrix again
    pairs = tokens * context + tokens * (tokens + 1) / 2
    attn = full * 4 * cfg["num_attention_heads"] * cfg["head_dim"] * pairs
    linear = (layers - full) * 4 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * \
        cfg["linear_value_head_dim"] * tokens
    return dense + attn + linear


class Clock:
    """The run's time budget."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    @property
    def left(self) -> float:
        return self.end - time.perf_counter()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def parity(device: torch.device, dtype: torch.dtype) -> dict:
    """A small model's logits and exact gradient on `device` in `dtype`, against the CPU fp32 reference."""
    cfg = model_config(True, 4096)
    torch.manual_seed(0)
    ref = ls.build_model(cfg, torch.float32)
    dev = ls.build_model(cfg, dtype, device)
    dev.load_state_dict({k: v.to(device, dtype) for k, v in ref.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg["vocab_size"], (300,), generator=g)
    responses = [torch.randint(0, cfg["vocab_size"], (n,), generator=g) for n in (12, 20, 7, 16)]
    adv = torch.tensor([1.0, -0.5, 0.8, -1.3])
    out = {}
    with torch.no_grad():
        logits = [m(prompt[None].to(next(m.parameters()).device)).float().cpu() for m in (dev, ref)]
    out["logits_rel_err"] = float((logits[0] - logits[1]).norm() / logits[1].norm())
    grads = []
    for m in (dev, ref):
        m.zero_grad(set_to_none=True)
        ls.grpo_backward(m, prompt, responses, adv, mode="exact", engine=ls.EngineConfig(prompt_chunk=64))
        grads.append(torch.cat([p.grad.float().flatten().cpu() for p in m.parameters() if p.grad is not None]))
    out["exact_grad_rel_err"] = float((grads[0] - grads[1]).norm() / grads[1].norm())
    return out


def capture(model, cfg: dict, params: int, lengths: list[int], device, clock: Clock, chunk: int) -> list[dict]:
    rows, per_p2 = [], None  # seconds / P^2 of the longest so far: attention makes time grow as P^2 at length
    for p in lengths:
        if per_p2 is not None and (need := per_p2 * p * p) > clock.left:
            rows.append({"P": p, "skipped": f"predicted {need:.0f} s, {clock.left:.0f} s left"})
            continue
        prompt = torch.randint(0, cfg["vocab_size"], (p,))
        _peak_reset(device)
        try:
            _sync(device)
            t0 = time.perf_counter()
            state = ls.capture(model, prompt, chunk)
            _sync(device)
            sec = time.perf_counter() - t0
        except RuntimeError as e:
            if not _oom(e):
                raise
            rows.append({"P": p, "skipped": "out of memory"})
            break
        flops = forward_flops(cfg, params, p, 0)
        rows.append({"P": p, "seconds": sec, "tokens_per_s": p / sec, "tflops": flops / sec / 1e12,
                     "mfu": flops / sec / H200_BF16_FLOPS, "state_bytes": state.nbytes, "peak_bytes": _peak(device)})
        del state
        per_p2 = sec / p**2
    return rows


def step(model, cfg: dict, p: int, g: int, r: int, mode: str, device, chunk: int) -> dict:
    """One GRPO step's gradient (no optimizer) in `mode`; seconds and peak memory."""
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, cfg["vocab_size"], (p,), generator=gen)
    responses = [torch.randint(0, cfg["vocab_size"], (r,), generator=gen) for _ in range(g)]
    adv = torch.randn(g, generator=gen)
    model.zero_grad(set_to_none=True)
    _peak_reset(device)
    _sync(device)
    t0 = time.perf_counter()
    ls.grpo_backward(model, prompt, responses, adv - adv.mean(), mode=mode,
                     engine=ls.EngineConfig(prompt_chunk=chunk, prompt_graph_budget=0))
    _sync(device)
    out = {"P": p, "G": g, "R": r, "mode": mode, "seconds": time.perf_counter() - t0, "peak_bytes": _peak(device)}
    model.zero_grad(set_to_none=True)
    return out


def largest_step(model, cfg, lengths, g, r, mode, device, clock, chunk, cost) -> dict:
    """The step at the largest P (of `lengths`, tried from the top) that fits memory and, by `cost(P)`, time."""
    for p in sorted(lengths, reverse=True):
        if (need := cost(p)) > clock.left:
            continue
        try:
            return step(model, cfg, p, g, r, mode, device, chunk) | {"predicted_seconds": need}
        except RuntimeError as e:
            if not _oom(e):
                raise
            _peak_reset(device)
    return {"mode": mode, "skipped": "no P fits the time left or the memory"}


def rollout(model, cfg: dict, p: int, ns: list[int], tokens: int, device, compile: bool | str = False,
            static: bool = False) -> list[dict]:
    """Decode tokens/s of n branches on one P-token prefix. Each n runs twice and the second run is timed, so
    neither the first call's kernel loading nor, with `compile`, the compilation (`warm_s` holds both) is counted.
    `cudagraph_skips`: inductor's count of graphs it could not replay as CUDA graphs (static decode)."""
    from torch._dynamo.utils import counters

    state = ls.capture(model, torch.randint(0, cfg["vocab_size"], (p,)), 2048)
    rows = []
    for n in ns:
        runs = []
        skips = counters["inductor"]["cudagraph_skips"]
        for _ in range(2):
            _sync(device)
            t0 = time.perf_counter()
            samples = ls.rollout(model, state, n=n, max_new_tokens=tokens, temperature=1.0, seed=0, compile=compile,
                                 static_shapes=static)
            _sync(device)
            runs.append(time.perf_counter() - t0)
        made = sum(len(s.tokens) for s in samples)
        rows.append({"P": p, "n": n, "compile": compile or "off", "static": static, "tokens": made,
                     "seconds": runs[1], "warm_s": runs[0], "tokens_per_s": made / runs[1],
                     "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips})
    return rows


def planned_peak(cfg: dict, p: int, g: int, r: int, chunk: int, gpu_gb: float) -> float:
    """`longstraw plan`'s bytes for one exact step on one GPU of the bench's bf16 model (checkpointing off), with
    its weights and gradients but no optimizer (the bench takes no step)."""
    from longstraw.tools.plan import plan

    pl = plan(cfg, p, 1, gpu_gb, zero=0, chunk=chunk, checkpoint_layers=False, responses=g, response_tokens=r,
              precision="bf16")
    return pl["exact_bytes"] - pl["per_rank"]["weights, gradients, optimizer"] + (2 + 2) * pl["parameters"]


def table(res: dict) -> str:
    gib = 2**30
    lines = [f"device {res['device']}, {res['parameters'] / 1e9:.2f}B parameters, dtype {res['dtype']}",
             f"parity vs CPU fp32: logits rel err {res['parity']['logits_rel_err']:.2e}, exact grad rel err "
             f"{res['parity']['exact_grad_rel_err']:.2e}", "", f"{'capture P':>10} {'s':>8} {'tok/s':>10} "
             f"{'TFLOP/s':>8} {'MFU':>6} {'state GiB':>10} {'peak GiB':>9}"]
    for r in res["capture"]:
        if "skipped" in r:
            lines.append(f"{r['P']:>10} skipped: {r['skipped']}")
        else:
            lines.append(f"{r['P']:>10} {r['seconds']:>8.2f} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} "
                         f"{r['mfu']:>6.1%} {r['state_bytes'] / gib:>10.2f} {r['peak_bytes'] / gib:>9.2f}")
    lines.append("")
    for key in ("exact", "naive"):
        r = res[key]
        if "skipped" in r:
            lines.append(f"{key}: skipped: {r['skipped']}")
        else:
            plan = f", plan {r['planned_bytes'] / gib:.1f} GiB" if "planned_bytes" in r else ""
            lines.append(f"{key}: P {r['P']}, G {r['G']}, R {r['R']}: {r['seconds']:.2f} s, peak "
                         f"{r['peak_bytes'] / gib:.1f} GiB{plan}")
    if "seconds" in res["naive"] and "seconds" in res["exact"] and res["naive"]["P"] == res["exact"]["P"]:
        lines.append(f"naive / exact at P {res['exact']['P']}: {res['naive']['seconds'] / res['exact']['seconds']:.2f}x")
    def decode(r: dict) -> str:
        how = f"compile {r['compile']}{', static' if r['static'] else ''}"
        if "skipped" in r:
            return f"rollout {how}: skipped: {r['skipped']}"
        return (f"rollout n {r['n']}, {how}: {r['tokens_per_s']:.0f} tokens/s ({r['tokens']} tokens at P {r['P']}; "
                f"first run {r['warm_s']:.1f} s; CUDA graph skips {r['cudagraph_skips']})")
    lines += [decode(r) for r in res["rollout"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU with a tiny model")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget (default 420, dry run 60)")
    ap.add_argument("--out", default="bench/out/gpu/bench.json")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/bench.py needs a CUDA GPU; --dry-run runs it on the CPU with a tiny model")
    clock = Clock(args.budget_s or (60 if dry else 420))
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    lengths = [64, 128, 256] if dry else [131072, 524288, 1048576, 2097152]
    g, r, chunk = (2, 8, 64) if dry else (8, 1024, 8192)
    gpu_gb = 141.0 if dry else torch.cuda.get_device_properties(device).total_memory / 1e9
    cfg = model_config(dry, max(lengths) + r + 8)
    from longstraw.ops.gated_delta import _fla_kernel

    res: dict = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(device), "dtype": str(dtype),
                 "gated_delta_kernel": "flash-linear-attention" if _fla_kernel() and not dry else "torch reference",
                 "budget_s": clock.left, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    res["parity"] = parity(device, dtype)
    torch.manual_seed(0)
    model = ls.build_model(cfg, dtype, device)
    params = sum(p.numel() for p in model.parameters())
    res["parameters"] = params
    rollout_tokens = 16 if dry else 256
    res["rollout"] = rollout(model, cfg, lengths[0], [1, 8], rollout_tokens, device)
    res["capture"] = capture(model, cfg, params, lengths, device, clock, chunk)
    seconds = {c["P"]: c["seconds"] for c in res["capture"] if "seconds" in c}
    per_p = max((s / p**2 for p, s in seconds.items()), default=0.0)  # seconds / P^2 of the captures
    # exact mode: capture + branches + the prompt backward (about 3 more forwards), naive: G forwards + backwards
    res["exact"] = largest_step(model, cfg, list(seconds), g, r, "exact", device, clock, chunk,
                                lambda p: 4 * seconds.get(p, per_p * p * p) + 1)
    if "P" in res["exact"]:
        res["exact"]["planned_bytes"] = planned_peak(cfg, res["exact"]["P"], g, r, chunk, gpu_gb)
    res["naive"] = largest_step(model, cfg, list(seconds), g, r, "naive", device, clock, chunk,
                                lambda p: 3 * g * seconds.get(p, per_p * p * p) + 1)
    # last, as they may spend minutes compiling: the same rollout with the decode step under torch.compile, first
    # the static decode (one graph, replayed as a CUDA graph), then the dynamic one (the dry run traces with the
    # "eager" backend, which checks the capture without generating code)
    backend = "eager" if dry else "inductor"
    for static in (True, False):
        if clock.left > (0 if dry else 150):
            res["rollout"] += rollout(model, cfg, lengths[0], [1, 8], rollout_tokens, device, backend, static)
        else:
            res["rollout"].append({"compile": backend, "static": static,
                                   "skipped": f"{clock.left:.0f} s left, compiling needs about 150"})
    res["seconds_used"] = (args.budget_s or (60 if dry else 420)) - clock.left
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(table(res))
    return res


if __name__ == "__main__":
    main()
