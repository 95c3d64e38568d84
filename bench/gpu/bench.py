"""The prepared GPU benchmark (issues 14, 36): one run on one GPU within a time budget, each row written the moment
it is measured (rows.jsonl and table.txt under --out, default $OUT or bench/out/gpu), so a kill loses nothing done.

Sections, in order:
- env: Python, torch, CUDA, driver, GPU, Triton, FLA, the SDPA kernel taken (bench/gpu/env.py);
- warmup: a forward and backward at the model's real head sizes of the attention and Gated DeltaNet kernels and
  of one small exact step, before any timing: first call (Triton's compile and autotune) and second apart;
- parity: the CUDA path against the torch reference at the real head sizes, in bf16 with a scaled tolerance:
  `segment_attention` over a prefix with its gradient (kernel "auto" against "torch"), a one-query
  `part_forward`, the Gated DeltaNet rule with an initial state and its gradient dh0 (the dispatch, i.e. FLA,
  against `chunk_gated_delta_rule` in fp64); a tiny model's logits and exact gradient against the CPU in fp32;
- capture: tokens/s and MFU at P = 128K and 512K (2.1M where the GPU has > 100 GB), each followed by a profiled
  capture whose kernel time is split into attention, FLA, matrix products and the rest;
- step: one exact GRPO step (G = 8, R = 1K) with per-layer checkpointing pinned (--checkpoint-layers), its peak
  memory against `longstraw plan`'s prediction, at the largest P captured that fits time and plan;
- decode: rollout tokens/s for n = 1 and 8, eager, then compiled with static shapes (one CUDA graph replayed per
  token), then dynamic if time is left;
- parity in fp32: FLA against the fp64 rule with IEEE dots (TRITON_F32_DEFAULT=ieee, set in a fresh process
  before Triton compiles anything), last, when the time left covers its compile.
Each measurement is predicted from those before it and skipped with the reason when it would overrun the budget;
a section that fails writes its error as a row and the next one runs.

The model: Qwen3.5-27B's widths (hidden 5120, MLP 17408, gated attention 24 q / 4 kv heads x 256, Gated DeltaNet
16 key / 48 value heads x 128, vocabulary 248320, untied head) with 4 layers instead of 64: one period of its
3 DeltaNet : 1 attention pattern, so every kernel runs at its real size and per-layer time scales to 64 layers
(x 16), while its 4.06B parameters, a 512K state and an exact step fit one 78 GB H100 and a 512K capture takes
seconds. `--dry-run` runs every section on the CPU with a tiny model (`make test` does).

    bench/gpu/run.sh                                  # on the GPU machine (installs the wheels, tests, then this)
    .venv/bin/python bench/gpu/bench.py --dry-run --out /tmp/gpu-dry
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import longstraw as ls  # noqa: E402
from env import environment  # noqa: E402
from profile_split import profiled, split  # noqa: E402
from rows import RowLog  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # dense bf16 peak of one H100 or H200 (SXM): the MFU denominator
BF16_TOL, FP32_TOL, CPU_TOL = 8 * 2**-8, 2e-3, 1e-4  # relative L2 error allowed: bf16 (8 ulps), FLA fp32, CPU fp32


# ------------------------------------------------------------------------------------------------------------------
# the model and its FLOPs
# ------------------------------------------------------------------------------------------------------------------


def model_config(dry: bool, max_pos: int, layers: int = 4) -> dict:
    """Qwen3.5-27B's widths with `layers` layers (3 Gated DeltaNet per gated attention layer), or a tiny one."""
    sizes = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True) if dry else
             dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False))
    if layers % 4:
        raise ValueError(f"--layers {layers}: a multiple of 4 (3 Gated DeltaNet layers per attention layer)")
    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return {"model_type": "qwen3_5_text", **sizes, "num_hidden_layers": layers, "layer_types": types,
            "linear_conv_kernel_dim": 4, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}


def forward_flops(cfg: dict, params: int, tokens: int, context: int, head: bool = False) -> float:
    """Model FLOPs of a forward of `tokens` new tokens after `context` earlier ones: 2 per parameter of the layers
    per token, causal attention in the full-attention layers (QK^T and PV), and the delta rule's state read and
    write in the linear ones. The embedding lookup is free; the LM head (2 x vocab x hidden per token) counts
    only with `head` (a capture runs none)."""
    layers = cfg["num_hidden_layers"]
    full = cfg.get("layer_types", []).count("full_attention") or layers // 4
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    body = params - embed * (1 if cfg.get("tie_word_embeddings") else 2)
    dense = 2 * body * tokens + (2 * embed * tokens if head else 0)
    pairs = tokens * context + tokens * (tokens + 1) / 2
    attn = full * 4 * cfg["num_attention_heads"] * cfg["head_dim"] * pairs
    linear = (layers - full) * 4 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * \
        cfg["linear_value_head_dim"] * tokens
    return dense + attn + linear


# ------------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------------


class Clock:
    """The run's time budget."""

    def __init__(self, seconds: float) -> None:
        self.budget = seconds
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


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius, in fp64)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _parity_row(log: RowLog, what: str, path: str, names: list[str], got: list, want: list, tol: float) -> dict:
    errs = {n: rel_err(a, b) for n, a, b in zip(names, got, want, strict=True)}
    worst = max(errs.values())
    return log.add("parity", what=what, path=path, rel_err=errs, worst=worst, tol=tol, ok=worst <= tol)


@contextlib.contextmanager
def section(log: RowLog, name: str, what: str = ""):
    """Runs a block; an exception (but an interrupt) becomes a row and the run goes on to the next block."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any failure is a result to record, not a reason to lose the rest
        traceback.print_exc()
        log.add(name, what=what, error=f"{type(e).__name__}: {e}".splitlines()[0][:500], oom=_oom(e))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------------------
# kernels at the model's head sizes: warm-up and parity
# ------------------------------------------------------------------------------------------------------------------


def attention_inputs(cfg: dict, b: int, t: int, n: int, device, dtype, seed: int = 0) -> dict:
    """q [b, H, t, d], k, v [b, Hkv, t, d], a prefix of n rows [Hkv, n, d] and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    h, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return {"q": r(b, h, t, d), "k": r(b, hkv, t, d), "v": r(b, hkv, t, d), "pk": r(hkv, n, d),
            "pv": r(hkv, n, d), "do": r(b, h, t, d)}


def attention_step(x: dict, kernel: str, dtype=None) -> list[torch.Tensor]:
    """`segment_attention` over the prefix, forward and backward: [out, dq, dk, dv, dprefix_k, dprefix_v]."""
    from longstraw.ops.attention import SegmentContext, segment_attention

    x = {k: v.to(dtype) if dtype else v for k, v in x.items()}
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    gk, gv = torch.zeros_like(x["pk"]), torch.zeros_like(x["pv"])
    out = segment_attention(q, k, v, q.shape[-1] ** -0.5,
                            SegmentContext(prefix=(x["pk"], x["pv"]), prefix_grad=(gk, gv), kernel=kernel))
    out.backward(x["do"])
    return [out.detach(), q.grad, k.grad, v.grad, gk, gv]


def delta_inputs(cfg: dict, b: int, t: int, device, dtype, seed: int = 0) -> dict:
    """Gated DeltaNet inputs at the model's heads, as its layer passes them (g, initial state fp32, beta in the
    model's dtype), and the upstream gradients of the output and the final state."""
    g = torch.Generator().manual_seed(seed)
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    return {"q": r(b, t, hk, dk), "k": r(b, t, hk, dk), "v": r(b, t, hv, dv),
            "g": (-torch.rand(b, t, hv, generator=g)).to(device), "beta": torch.rand(b, t, hv, generator=g).to(
                device, dtype), "h0": r(b, hv, dk, dv, dt=torch.float32), "do": r(b, t, hv, dv),
            "dht": r(b, hv, dk, dv, dt=torch.float32)}


DELTA_NAMES = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def delta_step(x: dict, fn, dtype=None) -> list[torch.Tensor]:
    """`fn` (gated_delta_rule or the torch chunked rule) forward and backward with the initial state's gradient:
    [o, final, dq, dk, dv, dg, dbeta, dh0]."""
    names = ("q", "k", "v", "g", "beta", "h0")
    leaves = [(x[n].to(dtype) if dtype else x[n]).clone().requires_grad_() for n in names]
    o, final = fn(*leaves[:5], initial_state=leaves[5])
    do, dht = (x[n].to(o.dtype if n == "do" else final.dtype) for n in ("do", "dht"))
    ((o * do).sum() + (final * dht).sum()).backward()
    return [o.detach(), final.detach(), *(p.grad for p in leaves)]


def _gated_delta():
    from longstraw.ops.gated_delta import _fla_kernel, chunk_gated_delta_rule, gated_delta_rule

    return gated_delta_rule, chunk_gated_delta_rule, _fla_kernel


def delta_path(device: torch.device) -> str:
    """Which rule a forward and backward of the Gated DeltaNet layers runs here: FLA refuses its gated backward on
    some GPU and Triton pairs (ops/gated_delta.py: fla_backward_refused), and the dispatch then takes the torch rule."""
    from longstraw.ops.gated_delta import fla_backward_refused

    if device.type != "cuda" or _gated_delta()[2]() is None:
        return "torch chunked rule (no FLA here)"
    return "torch chunked rule (FLA's backward refused here)" if fla_backward_refused() else "FLA chunk kernel"


def warmup(b: "Bench") -> None:
    """First and second call of each kernel at the real head sizes, then of one small exact step of the model."""
    gated_delta_rule = _gated_delta()[0]
    t = b.chunk
    xa = attention_inputs(b.cfg, 1, t, t, b.device, b.dtype)
    xd = delta_inputs(b.cfg, 1, t, b.device, b.dtype)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, b.cfg["vocab_size"], (2 * b.chunk,), generator=gen)
    responses = [torch.randint(0, b.cfg["vocab_size"], (min(b.r, 128),), generator=gen) for _ in range(2)]
    engine = ls.EngineConfig(prompt_chunk=b.chunk, prompt_graph_budget=0, checkpoint_layers=b.ckpt)

    def step():
        b.model.zero_grad(set_to_none=True)
        ls.grpo_backward(b.model, prompt, responses, torch.tensor([1.0, -1.0]), mode="exact", engine=engine)
        b.model.zero_grad(set_to_none=True)

    h, hkv, d = b.cfg["num_attention_heads"], b.cfg["num_key_value_heads"], b.cfg["head_dim"]
    hk, hv, dk = b.cfg["linear_num_key_heads"], b.cfg["linear_num_value_heads"], b.cfg["linear_key_head_dim"]
    for key, what, fn in (
            ("attention", f"attention {h}/{hkv} x {d}, {t} queries over {t} prefix rows, fwd+bwd",
             lambda: attention_step(xa, "auto")),
            ("delta", f"Gated DeltaNet {hk}/{hv} x {dk}, T {t}, h0 and dh0, fwd+bwd ({delta_path(b.device)})",
             lambda: delta_step(xd, gated_delta_rule)),
            ("model", f"model exact step P {2 * b.chunk}, G 2, R {len(responses[0])}", step)):
        with section(b.log, "warmup", what):
            first, second = _timed(fn, b.device), _timed(fn, b.device)
            b.compile_s[key] = max(0.0, first - second)
            b.log.add("warmup", what=what, first_s=first, second_s=second, compile_s=b.compile_s[key])


def parity(b: "Bench") -> None:
    """The CUDA path against the torch reference at the model's head sizes (bf16; fp32 on the dry run's CPU)."""
    from longstraw.ops.attention import choose_kernel, part_forward

    gated_delta_rule, chunk_gated_delta_rule, _ = _gated_delta()
    tol = BF16_TOL if b.dtype == torch.bfloat16 else CPU_TOL
    d = b.cfg["head_dim"]
    kind = choose_kernel(b.device.type, b.dtype, d, d)
    rows = 4096 + 512 if not b.dry else 48  # the prefix's gradient in two row blocks on CUDA (4096 a block)
    with section(b.log, "parity", "segment_attention"):
        x = attention_inputs(b.cfg, 2, 256 if not b.dry else 16, rows, b.device, b.dtype, seed=1)
        _parity_row(b.log, f"segment_attention, 2 x {x['q'].shape[2]} queries over {rows} prefix rows, fwd+bwd",
                    f"{kind} vs torch (fp32)", ["out", "dq", "dk", "dv", "dprefix_k", "dprefix_v"],
                    attention_step(x, "auto"), attention_step(x, "torch", torch.float32), tol)
    with section(b.log, "parity", "part_forward, one query"):
        x = attention_inputs(b.cfg, 8, 1, 1, b.device, b.dtype, seed=2)
        keys = attention_inputs(b.cfg, 8, 1000 if not b.dry else 40, 1, b.device, b.dtype, seed=3)
        got = part_forward(x["q"], keys["k"], keys["v"], False, d**-0.5, kernel="auto")
        want = part_forward(*(t.float() for t in (x["q"], keys["k"], keys["v"])), False, d**-0.5, kernel="torch")
        _parity_row(b.log, f"part_forward, 8 x 1 query over {keys['k'].shape[2]} keys (decode)",
                    f"{kind} vs torch (fp32)", ["out", "lse"], list(got), list(want), tol)
    with section(b.log, "parity", "gated delta rule"):
        x = delta_inputs(b.cfg, 1, 1000 if not b.dry else 100, b.device, b.dtype, seed=4)
        _parity_row(b.log, f"Gated DeltaNet T {x['q'].shape[1]}, h0 and dh0, fwd+bwd, {b.dtype}".replace("torch.", ""),
                    f"{delta_path(b.device)} vs torch chunked rule (fp64)", DELTA_NAMES,
                    delta_step(x, gated_delta_rule), delta_step(x, chunk_gated_delta_rule, torch.float64), tol)
    with section(b.log, "parity", "tiny model"):
        model_parity(b, 5e-2 if b.dtype == torch.bfloat16 else CPU_TOL)


def model_parity(b: "Bench", tol: float) -> None:
    """A tiny Qwen3.5 model's logits and exact-mode gradient on the device in its dtype, against the CPU in fp32."""
    cfg = model_config(True, 4096)
    torch.manual_seed(0)
    ref = ls.build_model(cfg, torch.float32)
    dev = ls.build_model(cfg, b.dtype, b.device)
    dev.load_state_dict({k: v.to(b.device, b.dtype) for k, v in ref.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    p, lens = (96, (12, 7)) if b.dry else (300, (12, 20, 7, 16))
    prompt = torch.randint(0, cfg["vocab_size"], (p,), generator=g)
    responses = [torch.randint(0, cfg["vocab_size"], (n,), generator=g) for n in lens]
    adv = torch.tensor([1.0, -0.5, 0.8, -1.3][:len(lens)])
    with torch.no_grad():
        logits = [m(prompt[None].to(next(m.parameters()).device)).float().cpu() for m in (dev, ref)]
    grads = []
    for m in (dev, ref):
        m.zero_grad(set_to_none=True)
        ls.grpo_backward(m, prompt, responses, adv, mode="exact", engine=ls.EngineConfig(prompt_chunk=32))
        grads.append(torch.cat([p.grad.float().flatten().cpu() for p in m.parameters() if p.grad is not None]))
    _parity_row(b.log, f"tiny Qwen3.5 model, logits and exact gradient (P {p}, G {len(lens)})",
                f"{b.device.type} {b.dtype} vs cpu float32".replace("torch.", ""), ["logits", "exact_grad"],
                [logits[0], grads[0]], [logits[1], grads[1]], tol)


def fp32_delta_parity(dry: bool) -> dict:
    """The Gated DeltaNet rule in fp32 (FLA on CUDA) against the fp64 torch rule: run by --fla-fp32-parity in a
    process started with TRITON_F32_DEFAULT=ieee, so that every fp32 dot Triton compiles is IEEE, not TF32."""
    gated_delta_rule, chunk_gated_delta_rule, _ = _gated_delta()
    device = torch.device("cpu" if dry else "cuda")
    cfg = model_config(dry, 4096)
    x = delta_inputs(cfg, 1, 1000 if not dry else 100, device, torch.float32, seed=4)
    got, want = delta_step(x, gated_delta_rule), delta_step(x, chunk_gated_delta_rule, torch.float64)
    errs = {n: rel_err(a, w) for n, a, w in zip(DELTA_NAMES, got, want, strict=True)}
    worst = max(errs.values())
    return {"what": f"Gated DeltaNet T {x['q'].shape[1]}, h0 and dh0, fwd+bwd, float32, "
                    f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT')}",
            "path": f"{delta_path(device)} vs torch chunked rule (fp64)", "rel_err": errs, "worst": worst,
            "tol": FP32_TOL, "ok": worst <= FP32_TOL}


def fp32_parity_subprocess(b: "Bench") -> None:
    # a fresh process compiles the fp32 kernels (about twice the bf16 warm-up's compile, and its start)
    need = 2.0 if b.dry else 20 + 2 * b.compile_s.get("delta", 30.0)
    if need > b.clock.left:
        b.log.add("parity", what="Gated DeltaNet float32, IEEE dots",
                  skipped=f"predicted {need:.0f} s (its compile), {b.clock.left:.0f} s left")
        return
    with section(b.log, "parity", "Gated DeltaNet float32, IEEE dots"):
        cmd = [sys.executable, __file__, "--fla-fp32-parity"] + (["--dry-run"] if b.dry else [])
        done = subprocess.run(cmd, env=os.environ | {"TRITON_F32_DEFAULT": "ieee"}, capture_output=True, text=True,
                              timeout=max(30.0, b.clock.left + 30))
        if done.returncode:
            raise RuntimeError(f"--fla-fp32-parity exited {done.returncode}: {done.stderr.strip()[-400:]}")
        b.log.add("parity", **json.loads(done.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------------------------------------------
# capture, step, decode
# ------------------------------------------------------------------------------------------------------------------


def capture(b: "Bench", reserve: float) -> dict[int, float]:
    """Timed captures at each length, each followed by a profiled one (to 512K); {P: seconds}."""
    done: dict[int, float] = {}
    per_p2 = None  # seconds / P^2 of the longest so far: attention makes time grow as P^2 at length
    for p in b.lengths:
        if per_p2 is not None and (need := per_p2 * p * p) > b.clock.left - reserve:
            b.log.add("capture", P=p, skipped=f"predicted {need:.0f} s, {b.clock.left - reserve:.0f} s left for it")
            continue
        with section(b.log, "capture", f"P {p}"):
            prompt = torch.randint(0, b.cfg["vocab_size"], (p,))
            _peak_reset(b.device)
            out: dict = {}
            engine = ls.EngineConfig(prompt_chunk=b.chunk)
            sec = _timed(lambda: out.setdefault("state", ls.capture(b.model, prompt, engine)), b.device)
            state_bytes = out.pop("state").nbytes
            flops = forward_flops(b.cfg, b.params, p, 0)
            b.log.add("capture", P=p, seconds=sec, tokens_per_s=p / sec, tflops=flops / sec / 1e12,
                      mfu=flops / sec / PEAK_BF16_FLOPS, state_bytes=state_bytes, peak_bytes=_peak(b.device))
            done[p], per_p2 = sec, sec / p**2
            if p <= 524288 and 1.3 * sec <= b.clock.left - reserve:
                with profiled(b.device) as prof:
                    wall = _timed(lambda: ls.capture(b.model, prompt, ls.EngineConfig(prompt_chunk=b.chunk)), b.device)
                b.log.add("profile", P=p, seconds=wall, **split(prof, b.device))
    return done


def planned_peak(b: "Bench", p: int) -> tuple[float, float]:
    """`longstraw plan`'s bytes for one exact step on one GPU of the bench's model (ZeRO-0, checkpointing as
    pinned), with its weights and gradients but no optimizer (the bench takes no optimizer step); and the seconds
    the plan took (its activation profile, measured once, is most of it)."""
    from longstraw.tools.activations import activation_profile
    from longstraw.tools.plan import Cluster, EngineChoice, Workload, plan

    t0 = time.perf_counter()
    if b.profile is None:
        b.profile = activation_profile(b.cfg)
    pl = plan(b.cfg, Workload(p, responses=b.g, response_tokens=b.r), Cluster(1, b.gpu_gb, zero=0, precision="bf16"),
              EngineChoice(chunk=b.chunk, checkpoint_layers=b.ckpt, profile=b.profile))
    weights_grads = (2 + 2) * pl["parameters"]
    return pl["exact_bytes"] - pl["per_rank"]["weights, gradients, optimizer"] + weights_grads, \
        time.perf_counter() - t0


def step(b: "Bench", captured: dict[int, float], reserve: float) -> None:
    """One exact step at the largest captured P whose predicted time fits and whose plan fits the GPU."""
    gen = torch.Generator().manual_seed(2)
    for p in sorted(captured, reverse=True):
        # capture, replay, prompt backward (+ recompute): 4-5 captures; the first plan measures its activation
        # profile on the CPU (some seconds)
        pred = (5 if b.ckpt else 4) * captured[p] + 3
        need = pred + (20 if b.profile is None and not b.dry else 0)
        if need > b.clock.left - reserve:
            b.log.add("step", P=p, skipped=f"predicted {need:.0f} s, {b.clock.left - reserve:.0f} s left for it")
            continue
        planned, plan_s = planned_peak(b, p)
        if not b.dry and planned > 0.92 * b.gpu_gb * 1e9:
            b.log.add("step", P=p, skipped=f"plan {planned / 1e9:.1f} GB over 92% of {b.gpu_gb:.0f} GB")
            continue
        prompt = torch.randint(0, b.cfg["vocab_size"], (p,), generator=gen)
        responses = [torch.randint(0, b.cfg["vocab_size"], (b.r,), generator=gen) for _ in range(b.g)]
        adv = torch.randn(b.g, generator=gen)
        engine = ls.EngineConfig(prompt_chunk=b.chunk, prompt_graph_budget=0, checkpoint_layers=b.ckpt)
        b.model.zero_grad(set_to_none=True)
        _peak_reset(b.device)
        try:
            sec = _timed(lambda: ls.grpo_backward(b.model, prompt, responses, adv - adv.mean(), mode="exact",
                                                  engine=engine), b.device)
        except RuntimeError as e:
            if not _oom(e):
                raise
            b.model.zero_grad(set_to_none=True)
            _peak_reset(b.device)
            b.log.add("step", P=p, skipped=f"out of memory (plan {planned / 1e9:.1f} GB)")
            continue
        peak = _peak(b.device)
        b.model.zero_grad(set_to_none=True)
        b.log.add("step", mode="exact", P=p, G=b.g, R=b.r, chunk=b.chunk, checkpoint_layers=b.ckpt, seconds=sec,
                  predicted_s=pred, peak_bytes=peak, planned_bytes=planned,
                  peak_over_plan=peak / planned if planned else 0.0, plan_s=plan_s)
        return
    b.log.add("step", what="exact", skipped="no captured P fits the time left or the plan")


def decode(b: "Bench", p: int) -> None:
    """Decode tokens/s of n branches on one P-token prefix: eager, compiled static (one CUDA graph replayed per
    token on CUDA), compiled dynamic. Each n runs twice and the second run is timed: `warm_s`, the first, holds
    the kernels' first use and the compile. `cudagraph_skips`: inductor's graphs it could not replay as CUDA
    graphs. Each run is predicted from the one before of its kind (a first compile: about a minute)."""
    from torch._dynamo.utils import counters

    state = ls.capture(b.model, torch.randint(0, b.cfg["vocab_size"], (p,)), ls.EngineConfig(prompt_chunk=b.chunk))
    backend = "eager" if b.dry else True  # the dry run traces with the eager backend: the capture, no codegen
    first = (0.2, 2.0) if b.dry else (10.0, 90.0)  # seconds of a first eager / compiled pair of runs
    for compile, static in ((False, False), (backend, True), (backend, False)):
        how = "eager" if not compile else f"compiled {'static' if static else 'dynamic'}"
        if b.dry and compile and not static:
            b.log.add("decode", what=how, skipped="dry run: the static compile checks the capture")
            continue
        need = first[bool(compile)]
        for n in b.ns:
            if need > b.clock.left:
                b.log.add("decode", what=f"{how}, n {n}", skipped=f"predicted {need:.0f} s, {b.clock.left:.0f} s left")
                continue
            with section(b.log, "decode", f"{how}, n {n}"):
                skips, runs = counters["inductor"]["cudagraph_skips"], []
                for _ in range(2):
                    out: dict = {}
                    runs.append(_timed(lambda: out.setdefault("s", ls.rollout(
                        b.model, state, ls.SamplingSettings(max_new_tokens=b.decode_tokens, temperature=1.0),
                        ls.Draw(n=n, seed=0), decode=ls.DecodeOptions(compile=compile, static_shapes=static))),
                        b.device))
                made = sum(len(s.tokens) for s in out["s"])
                b.log.add("decode", P=p, n=n, compile="inductor" if compile is True else compile or "off",
                          static=static, tokens=made, seconds=runs[1], warm_s=runs[0],
                          tokens_per_s=made / runs[1],
                          cudagraph_skips=counters["inductor"]["cudagraph_skips"] - skips)
                need = 1.2 * sum(runs)  # another n compiles again (static shapes: its own graph)


# ------------------------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------------------------


class Bench:
    """What every section reads: the settings, the model, the clock and the row log."""

    def __init__(self, args: argparse.Namespace, log: RowLog) -> None:
        self.dry, self.log = args.dry_run, log
        self.clock = Clock(args.budget_s or (120 if self.dry else 330))
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.dtype = torch.float32 if self.dry else torch.bfloat16
        self.gpu_gb = 80.0 if self.dry else torch.cuda.get_device_properties(self.device).total_memory / 1e9
        self.lengths = [64, 128] if self.dry else [131072, 524288] + ([2097152] if self.gpu_gb > 100 else [])
        self.g, self.r, self.chunk = (2, 8, 64) if self.dry else (8, 1024, 8192)
        self.ns, self.decode_tokens = ([1, 2], 8) if self.dry else ([1, 8], 256)
        self.ckpt = args.checkpoint_layers == "on"
        self.cfg = model_config(self.dry, max(self.lengths) + self.r + 8, args.layers)
        self.compile_s: dict[str, float] = {}
        self.profile = None  # the planner's activation profile, measured once
        self.model, self.params = None, 0

    def build(self) -> None:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device(self.device):  # built where it runs: no host copy of 4B fp32 parameters
            self.model = ls.build_model(self.cfg, self.dtype, self.device)
        self.params = sum(p.numel() for p in self.model.parameters())
        _sync(self.device)
        self.log.add("model", layers=self.cfg["num_hidden_layers"], parameters=self.params,
                     dtype=str(self.dtype).replace("torch.", ""), build_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU with a tiny model")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget (default 330, dry run 120)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/out/gpu", help="folder for rows.jsonl, table.txt")
    ap.add_argument("--checkpoint-layers", choices=("on", "off"), default="on",
                    help="per-layer checkpointing of the exact step (pinned, so the plan counts the same)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the bench model (a multiple of 4)")
    ap.add_argument("--fla-fp32-parity", action="store_true", help=argparse.SUPPRESS)  # the fp32 parity's process
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/bench.py needs a CUDA GPU; --dry-run runs it on the CPU with a tiny model")
    threads = torch.get_num_threads()
    if args.dry_run:  # the tiny model's ops are too small to split: threads only wait on each other (seconds a step)
        torch.set_num_threads(1)
    try:
        if args.fla_fp32_parity:
            print(json.dumps(fp32_delta_parity(args.dry_run)))
            return {}
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> dict:
    log = RowLog(args.out)
    b = Bench(args, log)
    with section(log, "env"):
        env = environment(b.dry)
        log.add("env", **env, dtype=str(b.dtype).replace("torch.", ""), budget_s=b.clock.budget,
                model=f"Qwen3.5-27B widths, {args.layers} layers" if not b.dry else "tiny Qwen3.5")
    with section(log, "model"):
        b.build()
    if b.model is not None:
        warmup(b)
        parity(b)
        # each section leaves the later ones a share: the step ~60 s, eager decode ~20 s (none on the dry run)
        captured = {}
        with section(log, "capture"):
            captured = capture(b, 0 if b.dry else 90)
        with section(log, "step"):
            step(b, captured, 0 if b.dry else 30)
        with section(log, "decode"):
            decode(b, b.lengths[0])
    fp32_parity_subprocess(b)
    log.add("end", seconds_used=b.clock.budget - b.clock.left, budget_s=b.clock.budget)
    log.close()
    return {"rows": log.rows}


if __name__ == "__main__":
    main()
