"""`longstraw step`: one GRPO step on a synthetic group in each mode; time, memory and gradient agreement.

With `--nproc N` the step runs again on N local processes under torchrun (gloo on CPU, NCCL on GPU), the prefix
state sharded over them, and is compared with the one-process gradient.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import StepConfig, torch_dtype
from ..engine import capture, grpo_backward, score
from ..memory import PeakMeter
from ..parallel import ONE_RANK, SequenceGroup, SequenceParallel, full_tensor, local_shard, shard_model
from ..parallel.launch import torchrun


def synthetic_group(cfg: StepConfig, vocab: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(0, vocab, (cfg.prompt_tokens,), generator=g)
    lo, hi = cfg.response_tokens
    lengths = torch.randint(lo, hi + 1, (cfg.responses,), generator=g).tolist()
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    advantages = torch.randn(cfg.responses, generator=g, dtype=torch.float64)
    return prompt, responses, advantages - advantages.mean()


def synthetic_inputs(cfg: StepConfig, model, prompt: torch.Tensor, responses: list[torch.Tensor],
                     parallel: SequenceGroup = ONE_RANK) -> dict:
    """What the loss options of `cfg.grpo` need besides the responses, made up around the model's own log-probs
    (one capture and scoring, only when an option needs them): a reference and a sampler each 0.05 nats of seeded
    noise away, so the KL term, the sampler correction and the off-policy mask all have something to act on; and
    the responses of the longest length count as truncated."""
    loss, out = cfg.grpo, {}
    if loss.mask_truncated_completions:
        out["truncated"] = [r.numel() == cfg.response_tokens[1] for r in responses]
    if loss.kl_coef > 0 or loss.rollout_correction != "off" or loss.off_policy_mask_threshold is not None:
        logps = score(model, capture(model, prompt, cfg.engine, parallel=parallel), responses, engine=cfg.engine,
                      parallel=parallel)
        g = torch.Generator().manual_seed(cfg.seed + 1)
        noisy = lambda: [lp.cpu() + 0.05 * torch.randn(lp.shape, generator=g, dtype=lp.dtype)  # noqa: E731
                         for lp in logps]
        out["ref_logprobs"], out["sampler_logprobs"] = noisy(), noisy()
    return out


def _modes(cfg: StepConfig, modes: list[str], progress: bool, parallel: SequenceGroup = ONE_RANK,
           device: str = "cpu", zero_stage: int = 0) -> tuple[list[dict], dict[str, torch.Tensor]]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dtype = torch_dtype(cfg.dtype)
    torch.manual_seed(cfg.seed)
    spec = cfg.model
    model = spec.load(dtype, device)
    if zero_stage:
        shard_model(model, zero_stage, parallel)
    param_bytes = sum(local_shard(p).nelement() * p.element_size() for p in model.parameters())
    prompt, responses, adv = synthetic_group(cfg, model.config.vocab_size)
    inputs = synthetic_inputs(cfg, model, prompt, responses, parallel)
    results, grads = [], {}
    for mode in modes:
        model.zero_grad(set_to_none=True)
        with PeakMeter(torch.device(device)) as meter:
            stats = grpo_backward(model, prompt, responses, adv, mode=mode, config=cfg.grpo, engine=cfg.engine,
                                  progress=progress, parallel=parallel, **inputs)
        stats["peak_rss_bytes"], stats["param_bytes"] = meter.peak_bytes, param_bytes
        grads[mode] = torch.cat([full_tensor(p.grad).flatten().double().cpu() for p in model.parameters() if p.grad is not None])
        results.append(stats)
    return results, grads


def _errors(results: list[dict], grads: dict[str, torch.Tensor], reference, key: str) -> None:
    """grad_rel_err_<key> of each result against reference(mode) (None: no reference, no error reported)."""
    for r in results:
        ref = reference(r["mode"])
        if ref is not None:
            r[f"grad_rel_err_{key}"] = float((grads[r["mode"]] - ref).norm() / ref.norm())


def run_step(cfg: StepConfig, progress: bool = True) -> list[dict]:
    results, grads = _modes(cfg, cfg.modes, progress)
    _errors(results, grads, lambda _: grads.get("naive"), "vs_naive")
    return results


PER_RANK = {"per_rank_peak_bytes": "peak_rss_bytes", "per_rank_state_bytes": "state_bytes",
            "per_rank_peak_state_bytes": "peak_state_bytes", "per_rank_param_bytes": "param_bytes"}


def sharded_worker(cfg: StepConfig, out: str | None = None) -> list[dict] | None:
    """One rank of a torchrun job (`--nproc`, or infra/launch.sh): the sharded modes (naive has no state to shard).
    Rank 0 returns what all ranks measured (and writes it, with its gradients, into `out`)."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    sp = SequenceParallel()
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    results, grads = _modes(cfg, [m for m in cfg.modes if m != "naive"], False, sp, device, cfg.zero_stage)
    for r in results:
        mine = torch.tensor([r[k] for k in PER_RANK.values()], dtype=torch.int64, device=sp.device)
        per_rank = torch.stack(sp.gather(mine)).cpu()
        r.update(zip(PER_RANK, per_rank.T.tolist()))
    rank = sp.rank
    dist.destroy_process_group()
    if rank != 0:
        return None
    suffix = f" x{sp.size}" + (f" zero{cfg.zero_stage}" if cfg.zero_stage else "")
    for r in results:
        r["mode"] += suffix
    if out is not None:
        Path(out, "results.json").write_text(json.dumps(results))
        save_file({k + suffix: v for k, v in grads.items()}, str(Path(out, "grads.safetensors")))
    return results


def run_step_nproc(cfg: StepConfig, config_path: str, nproc: int, progress: bool = True,
                   extra_args: list[str] = ()) -> list[dict]:
    """The one-process step, then the sharded one on `nproc` local ranks (`extra_args`: the command line's options
    that the config file lacks), compared."""
    one, ref = _modes(cfg, cfg.modes, progress)
    _errors(one, ref, lambda _: ref.get("naive"), "vs_naive")
    with tempfile.TemporaryDirectory() as d:
        done = torchrun("longstraw.cli", ["step", "--config", config_path, "--zero", str(cfg.zero_stage),
                                          "--sharded-worker", d, *extra_args], nproc, cfg.threads,
                        capture_output=True, text=True)
        if done.returncode or not Path(d, "results.json").is_file():
            raise RuntimeError(f"the {nproc}-rank step failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        sharded = json.loads(Path(d, "results.json").read_text())
        grads = load_file(str(Path(d, "grads.safetensors")))
    _errors(sharded, grads, lambda mode: ref.get(mode.split(" ")[0]), "vs_one_process")
    _errors(sharded, grads, lambda _: ref.get("naive"), "vs_naive")
    return one + sharded


def format_table(results: list[dict]) -> str:
    head = (f"{'mode':<16} {'seconds':>8} {'peak MiB':>9} {'params MiB/rank':>16} {'state MiB/rank':>15} {'loss':>12} "
            f"{'grad err vs naive':>18} {'vs 1 process':>13}")
    lines = [head, "-" * len(head)]
    for r in results:
        err, one = r.get("grad_rel_err_vs_naive"), r.get("grad_rel_err_vs_one_process")
        peak = max(r.get("per_rank_peak_bytes", [r["peak_rss_bytes"]]))
        params = max(r.get("per_rank_param_bytes", [r["param_bytes"]]))
        state = max(r.get("per_rank_peak_state_bytes", [r["peak_state_bytes"]]))
        lines.append(
            f"{r['mode']:<16} {r['seconds']:>8.2f} {peak / 2**20:>9.1f} {params / 2**20:>16.2f} {state / 2**20:>15.1f} "
            f"{r['loss']:>12.4e} {'-' if err is None else f'{err:.2e}':>18} {'-' if one is None else f'{one:.2e}':>13}"
        )
    lines.append("peak MiB: RSS (CUDA allocator on GPU) above the start, the largest rank's; state: state + dState; "
                 "params: the largest rank's share (all of them without --zero)")
    return "\n".join(lines)
