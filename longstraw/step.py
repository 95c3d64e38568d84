"""`longstraw step`: one GRPO step on a synthetic group in each mode; time, memory and gradient agreement."""

from __future__ import annotations

import torch

from .config import StepConfig, torch_dtype
from .engine.backward import grpo_backward
from .memory import PeakMeter
from .models import build_model, load_model


def synthetic_group(cfg: StepConfig, vocab: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(0, vocab, (cfg.prompt_tokens,), generator=g)
    lo, hi = cfg.response_tokens
    lengths = torch.randint(lo, hi + 1, (cfg.responses,), generator=g).tolist()
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    advantages = torch.randn(cfg.responses, generator=g, dtype=torch.float64)
    return prompt, responses, advantages - advantages.mean()


def run_step(cfg: StepConfig, progress: bool = True) -> list[dict]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dtype = torch_dtype(cfg.dtype)
    torch.manual_seed(cfg.seed)
    spec = cfg.model
    model = load_model(spec.path, dtype=dtype) if spec.path else build_model(spec.random, dtype=dtype)
    prompt, responses, adv = synthetic_group(cfg, model.config.vocab_size)
    results, grads = [], {}
    for mode in cfg.modes:
        model.zero_grad(set_to_none=True)
        with PeakMeter() as meter:
            stats = grpo_backward(model, prompt, responses, adv, mode=mode, config=cfg.grpo, progress=progress)
        stats["peak_rss_bytes"] = meter.peak_bytes
        grads[mode] = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
        results.append(stats)
    if "naive" in grads:
        ref = grads["naive"]
        for r in results:
            r["grad_rel_err_vs_naive"] = float((grads[r["mode"]] - ref).norm() / ref.norm())
    return results


def format_table(results: list[dict]) -> str:
    head = f"{'mode':<9} {'seconds':>8} {'peak RSS MiB':>13} {'state MiB':>10} {'loss':>12} {'grad rel err vs naive':>22}"
    lines = [head, "-" * len(head)]
    for r in results:
        err = r.get("grad_rel_err_vs_naive")
        lines.append(
            f"{r['mode']:<9} {r['seconds']:>8.2f} {r['peak_rss_bytes'] / 2**20:>13.1f} "
            f"{r['peak_state_bytes'] / 2**20:>10.1f} {r['loss']:>12.4e} {'-' if err is None else f'{err:.2e}':>22}"
        )
    return "\n".join(lines)
