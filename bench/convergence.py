"""Convergence and gradient fidelity: GRPO runs that differ only in `mode` (naive, exact, detached), issue 13.

Does dropping the gradient through the prompt (`detached`, the published idea) hurt GRPO, and by how much? Every
run starts from the same warm-started weights, trains on the same prompt pool with the same sampling seeds, and
differs only in how the gradient is computed. At every step, on the batch that run trains on, the exact and the
detached gradient are both computed (one exact call: its replay part, read just before the prompt backward, IS
the detached gradient of the same batch), and compared: cosine, relative L2, and which parameters lose it.

    .venv/bin/python bench/convergence.py --quick     # same plots, fewer steps / seeds: 3.7 min from a cold cache
    .venv/bin/python bench/convergence.py --full      # 28 min on the 2-core box from a cold cache (limit: 60)
    .venv/bin/python bench/convergence.py --full --out bench/results/convergence --mlflow sqlite:///bench/out/mlflow.db
    .venv/bin/python bench/convergence.py --full --replot ...   # table and PNGs again from the stored runs
    .venv/bin/python bench/convergence.py --smoke --out DIR --cache DIR   # seconds: the script runs (no numbers)

One process, no Prefect: the library's pieces driven directly (capture, rollout, rewards, group advantages,
grpo_backward, the pipeline's optimizer_step). Warm starts (`longstraw sft`, as `make run` does) are cached under
`--cache` and reused by every seed, mode and prompt length. Output: every step of every run in
`<cache>/convergence-<variant>.json`, `convergence_summary.json` and PNGs in `--out`, a table on stdout, and with
`--mlflow URI` a parent run with one nested run per training run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

import longstraw as ls
from longstraw.config import load_config
from longstraw.data import Example, Tokenizer, load_tokenizer
from longstraw.grpo.rewards import compute_rewards, get_reward
from longstraw.problems import get_problem, make_problem
from longstraw.problems.base import first_word, need
from longstraw.train.config import OptimConfig
from longstraw.train.data import example_seed, prompt_ids
from longstraw.train.optim import build_optimizer, optimizer_step
from longstraw.train.sft import SFTConfig, run_sft

ROOT = Path(__file__).resolve().parent.parent
SFT_CONFIG = ROOT / "configs" / "sft-tiny.yaml"
MODES = ("naive", "exact", "detached")
GROUPS = ("embeddings", "attention", "mlp", "recurrent", "norm")
Grads = dict[str, torch.Tensor]

# The tiny Qwen3.5 hybrid: sft-tiny's dense shape with 3 Gated DeltaNet layers + 1 gated attention layer.
QWEN3_5_TINY = {
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}


# ---- tasks and rewards ---------------------------------------------------------------------------------------


def name_overlap(meta: dict, response_text: str) -> float:
    """multi-hop's partial credit, the analogue of `digit_overlap`: the share of positions at which the answer's
    first word has the name's letter (case-insensitive), over the longer of the two; 1.0 exactly when the
    verifier accepts. A tiny model that writes name-like words gets a signal before it gets the name right."""
    answer = str(need(meta, "answer", "name_overlap")).casefold()
    got = first_word(response_text).casefold()
    if not got:
        return 0.0
    return sum(a == b for a, b in zip(got, answer)) / max(len(got), len(answer))


@dataclass(frozen=True)
class TaskSpec:
    """How a task is trained: the (partial-credit) reward GRPO maximises and the verifier that counts accuracy."""

    reward: Callable[[dict, str], float]
    verify: Callable[[dict, str], float]
    max_new_tokens: int


TASKS = {
    "kv-retrieval": TaskSpec(get_reward("digit_overlap"), get_problem("kv-retrieval").verify, 10),
    "multi-hop": TaskSpec(name_overlap, get_problem("multi-hop").verify, 12),
}


# ---- warm starts (cached) ------------------------------------------------------------------------------------


def warm_start(model: str, task: str, sft: dict[str, Any], cache: Path, progress: bool = True) -> tuple[Path, dict]:
    """`longstraw sft --config configs/sft-tiny.yaml --task <task>` (what `make run` does) with the overrides `sft`
    (steps, curriculum), for the dense model or the tiny Qwen3.5; cached under `cache`, so every seed, mode and
    prompt length reuses it."""
    tag = "-".join([f"{sft.get('steps', 'default')}steps",
                    *(f"{t}x{f:g}" for t, f in sft.get("curriculum", []))])  # e.g. 400steps-190x0.6
    out = cache / "warm" / f"{model}-{task}-{tag}"
    record = out.parent / f"{out.name}.json"
    if (out / "model.safetensors").is_file() and record.is_file():
        return out, json.loads(record.read_text())
    overrides: dict = {"out": str(out), "task": task, "threads": torch.get_num_threads(), **sft}
    if model == "qwen3_5":
        overrides["model"] = {"random": QWEN3_5_TINY}
    elif model != "dense":
        raise ValueError(f"model {model!r} unknown; choose dense or qwen3_5")
    result = run_sft(load_config(SFT_CONFIG, SFTConfig, overrides), progress)
    record.write_text(json.dumps(result, indent=1))
    return out, result


# ---- the gradient on the same batch: exact, and its detached part -------------------------------------------


def grads_of(model: torch.nn.Module) -> Grads:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def exact_and_detached(model, state: ls.PrefixState, branches: ls.Branches, run: "RunConfig"
                       ) -> tuple[Grads, Grads, float]:
    """(exact gradient, detached gradient, seconds) of one group on its exact-captured state: the replay's
    gradient is the detached one, and the prompt backward adds what detaching drops. `param.grad` is left as it
    was before the call; the state's kept graphs are used up."""
    saved = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    dstate = ls.new_dstate(state)
    ls.replay(model, state, branches, run.grpo, dstate, engine=run.engine)
    detached = grads_of(model)
    ls.prompt_backward(model, state, dstate)
    seconds = time.perf_counter() - t0
    exact = grads_of(model)
    for n, p in model.named_parameters():
        p.grad = saved[n]
    return exact, detached, seconds


def group_of(name: str) -> str:
    """embeddings / norm / recurrent / attention / mlp, from the HF parameter name."""
    parts = name.split(".")
    if "embed_tokens" in parts or parts[0] == "lm_head":
        return "embeddings"
    if any("norm" in p for p in parts[:-1]):  # input/post-attention/final norms, q/k norms, DeltaNet's gated norm
        return "norm"
    if "linear_attn" in parts:
        return "recurrent"
    if "self_attn" in parts:
        return "attention"
    if "mlp" in parts:
        return "mlp"
    return "other"


def layer_of(name: str) -> str:
    parts = name.split(".")
    if "layers" in parts:
        return f"L{parts[parts.index('layers') + 1]}"
    return "embed" if group_of(name) == "embeddings" else "final norm"


def _sq(ts: list[torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in ts)) if ts else 0.0


def compare(exact: Grads, detached: Grads) -> dict:
    """How far the detached gradient is from the exact one: cosine, relative L2, |D|/|E|; per parameter group and
    per layer the relative L2 of what is lost (E - D), its share of all that is lost, and the group's share of |E|^2."""
    names = list(exact)
    lost = {n: exact[n].double() - detached[n].double() for n in names}
    e2, d2, l2 = _sq(list(exact.values())), _sq(list(detached.values())), _sq(list(lost.values()))
    dot = float(sum((exact[n].double() * detached[n].double()).sum() for n in names))
    out = {
        "cos": dot / math.sqrt(e2 * d2) if e2 > 0 and d2 > 0 else float("nan"),
        "rel_l2": math.sqrt(l2 / e2) if e2 > 0 else float("nan"),
        "norm_ratio": math.sqrt(d2 / e2) if e2 > 0 else float("nan"),
        "exact_norm": math.sqrt(e2),
    }
    for key, keyfn in (("groups", group_of), ("layers", layer_of)):
        parts: dict[str, list[str]] = {}
        for n in names:
            parts.setdefault(keyfn(n), []).append(n)
        out[key] = {}
        for part, members in parts.items():
            pe, pl = _sq([exact[n] for n in members]), _sq([lost[n] for n in members])
            out[key][part] = {"rel_l2": math.sqrt(pl / pe) if pe > 0 else float("nan"),
                              "lost_share": pl / l2 if l2 > 0 else float("nan"),
                              "norm_share": pe / e2 if e2 > 0 else float("nan")}
    return out


def add_(total: Grads, part: Grads) -> None:
    for n, t in part.items():
        total[n] = total[n] + t if n in total else t.clone()


# ---- one GRPO training run -----------------------------------------------------------------------------------


@dataclass
class RunConfig:
    """What a training run is; two runs that differ only in `mode` see the same prompts and sampling seeds."""

    mode: str
    steps: int = 20
    seed: int = 0
    responses: int = 8  # G
    temperature: float = 1.0
    eval_every: int = 5
    probe: bool = True  # compute exact and detached gradients of every step's batch
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, grad_clip=1.0, warmup_updates=1))
    grpo: ls.GRPOConfig = field(default_factory=lambda: ls.GRPOConfig(clip_low=0.2, clip_high=0.28))
    engine: ls.EngineConfig = field(default_factory=lambda: ls.EngineConfig(prompt_chunk=128))


def prompts_of(tok: Tokenizer, examples: list[Example]) -> list[torch.Tensor]:
    return [torch.tensor(prompt_ids(tok, ex)) for ex in examples]


@torch.no_grad()
def evaluate(model, tok: Tokenizer, examples: list[Example], spec: TaskSpec, engine: ls.EngineConfig) -> dict:
    """Greedy answers to prompts never trained on: exact-match accuracy (verifier) and mean reward."""
    acc = rew = 0.0
    for ex, prompt in zip(examples, prompts_of(tok, examples)):
        state = ls.capture(model, prompt, engine)
        greedy = ls.SamplingSettings(max_new_tokens=spec.max_new_tokens, temperature=0, stop_ids=(tok.eos_id,))
        sample = ls.rollout(model, state, greedy, ls.Draw(n=1))[0]
        text = tok.decode(sample.tokens.tolist())
        acc += spec.verify(ex.meta, text)
        rew += compute_rewards(spec.reward, [ex.meta], [text]).rewards[0]
    n = max(len(examples), 1)
    return {"accuracy": acc / n, "reward": rew / n}


def train_run(model, tok: Tokenizer, pool: list[Example], held_out: list[Example], spec: TaskSpec, run: RunConfig,
              progress: bool = True, desc: str = "") -> list[dict]:
    """GRPO on `pool` (every prompt one group of G answers per step, the same prompts every step) in `run.mode`,
    from `model`'s weights (trained in place). Per step: reward, sampled accuracy, held-out greedy accuracy every
    `eval_every` steps (and after the last), seconds of the step without the probe, and (with `run.probe`) the
    exact/detached comparison on the step's batch. Naive and detached runs also record how far their own gradient
    is from the probe's (naive from exact, detached from the exact call's replay part): both must be ~0."""
    if run.mode not in MODES:
        raise ValueError(f"mode {run.mode!r} unknown; choose one of {MODES}")
    optimizer = build_optimizer(model, run.optim)
    prompts = prompts_of(tok, pool)
    history: list[dict] = []
    bar = tqdm(range(run.steps), desc=desc or run.mode, disable=not progress, leave=False)
    for step in bar:
        rec: dict = {"step": step}
        if step % run.eval_every == 0:
            rec["held_out"] = evaluate(model, tok, held_out, spec, run.engine)
        rec.update(_train_step(model, tok, pool, prompts, spec, run, step))
        t0 = time.perf_counter()
        rec.update(optimizer_step(model, optimizer, run.optim, step, run.steps))
        rec["seconds"] += time.perf_counter() - t0
        history.append(rec)
        bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", cos=f"{rec.get('cos', float('nan')):.2f}")
    history.append({"step": run.steps, "held_out": evaluate(model, tok, held_out, spec, run.engine)})
    return history


def _train_step(model, tok: Tokenizer, pool: list[Example], prompts: list[torch.Tensor], spec: TaskSpec,
                run: RunConfig, step: int) -> dict:
    """Rollout, reward and the mode's gradient (into param.grad) for every group of the pool; the probe beside."""
    seconds = probe_seconds = 0.0
    rewards_all: list[float] = []
    accuracy = length = 0.0
    tokens = hashlib.sha256()
    exact_sum: Grads = {}
    detached_sum: Grads = {}
    vs_probe: list[float] = []  # naive: |N - E| / |E|, detached: |D - D_probe| / |D_probe|, per group
    for g, (ex, prompt) in enumerate(zip(pool, prompts)):
        t0 = time.perf_counter()
        # one capture serves the rollout and the mode's gradient (exact mode: with its kept graphs)
        state = ls.capture(model, prompt, run.engine, exact=run.mode == "exact")
        samples = ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=spec.max_new_tokens,
                                                               temperature=run.temperature, stop_ids=(tok.eos_id,)),
                             ls.Draw(n=run.responses, seed=example_seed(run.seed, step, g)))
        texts = [tok.decode(s.tokens.tolist()) for s in samples]
        rewards = compute_rewards(spec.reward, [ex.meta] * len(texts), texts).rewards
        adv = ls.group_advantages(rewards)
        responses = [s.tokens for s in samples]
        branches = ls.Branches.group(responses, adv, run.grpo, vocab_size=model.config.vocab_size)
        seconds += time.perf_counter() - t0
        rewards_all += rewards
        accuracy += sum(spec.verify(ex.meta, t) for t in texts)
        length += sum(len(r) for r in responses)
        for r in responses:
            tokens.update(r.numpy().tobytes())
        if not bool(adv.abs().gt(0).any()):
            continue  # all answers scored alike: no gradient in any mode
        if run.mode == "exact" or run.probe:
            t0 = time.perf_counter()
            probed = state if run.mode == "exact" else ls.capture(model, prompt, run.engine, exact=True)
            capture_seconds = time.perf_counter() - t0
            exact, detached, t = exact_and_detached(model, probed, branches, run)
            add_(exact_sum, exact)
            add_(detached_sum, detached)
            if run.mode == "exact":
                seconds += t
                add_grads(model, exact)
                continue
            probe_seconds += capture_seconds + t
        before = grads_of(model) if run.probe else None
        t0 = time.perf_counter()
        if run.mode == "detached":
            ls.replay(model, state, branches, run.grpo, engine=run.engine)
        else:
            ls.naive_backward(model, prompt, branches, run.grpo)
        seconds += time.perf_counter() - t0
        if before is not None:  # the mode's own gradient against the probe's of the same mode (a check)
            own = {n: p.grad - before[n] for n, p in model.named_parameters()}
            vs_probe.append(_distance(own, exact if run.mode == "naive" else detached))
    for p in model.parameters():  # a step whose groups all scored alike still steps AdamW, as the pipeline does
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    n = len(rewards_all)
    out = {"reward_mean": statistics.fmean(rewards_all), "reward_std": statistics.pstdev(rewards_all),
           "accuracy": accuracy / n, "response_len": length / n,
           "prompt_len": statistics.fmean(len(p) for p in prompts), "seconds": seconds,
           "probe_seconds": probe_seconds, "tokens_sha256": tokens.hexdigest()}
    out["p_over_r"] = out["prompt_len"] / out["response_len"]
    if exact_sum:
        out.update(compare(exact_sum, detached_sum))
    if vs_probe:
        out["grad_vs_probe"] = max(vs_probe)
    return out


def add_grads(model, grads: Grads) -> None:
    for n, p in model.named_parameters():
        p.grad = grads[n].clone() if p.grad is None else p.grad + grads[n]


def _distance(a: Grads, b: Grads) -> float:
    num = _sq([a[n] - b[n] for n in b])
    den = _sq(list(b.values()))
    return math.sqrt(num / den) if den > 0 else 0.0


# ---- the study: cells (model, task, prompt length) x seeds x modes ------------------------------------------


@dataclass(frozen=True)
class Cell:
    model: str  # dense | qwen3_5
    task: str
    prompt_tokens: int  # task text; the chat template adds ~24 tokens
    modes: tuple[str, ...] = MODES
    seeds: tuple[int, ...] = (0, 1, 2)

    @property
    def name(self) -> str:
        return f"{self.model} {self.task} P~{self.prompt_tokens}"


@dataclass(frozen=True)
class Plan:
    """One variant of the study (`--quick` or `--full`)."""

    warm: dict[tuple[str, str], dict]  # (model, task) -> `longstraw sft` overrides (steps, curriculum)
    cells: tuple[Cell, ...]
    steps: int
    pool: int  # prompts per step (one group each), the same every step
    held_out: int
    eval_every: int
    sweep_tokens: tuple[int, ...]  # P of the gradient-fidelity sweep at the warm-started weights
    sweep_prompts: int


def _cells(seeds: tuple[int, ...], spec: list[tuple[str, str, int, tuple[int, ...]]]) -> tuple[Cell, ...]:
    """(model, task, P, naive seeds): exact and detached on every seed; naive, whose curve is exact's by
    construction (tests/bench/test_convergence.py) at G times the prompt work, on the seeds given."""
    out = []
    for model, task, tokens, naive_seeds in spec:
        out.append(Cell(model, task, tokens, ("exact", "detached"), seeds))
        if naive_seeds:
            out.append(Cell(model, task, tokens, ("naive",), naive_seeds))
    return tuple(out)


# Warm starts: configs/sft-tiny.yaml as it is (the dense kv-retrieval one is `make run`'s), with fewer steps where
# noted. Neither multi-hop (200 steps) nor the Qwen3.5 hybrid (300 steps; 400 with 60% of them on one-pair prompts
# did no better) learns to read its prompt within the budget: they learn the answer format, and their answers do
# not depend on the prompt. bench/RESULTS.md reports what that means for the study.
PLANS = {
    "quick": Plan(
        warm={("dense", "kv-retrieval"): {"steps": 120}, ("dense", "multi-hop"): {"steps": 40},
              ("qwen3_5", "kv-retrieval"): {"steps": 40}},
        cells=_cells((0, 1), [("dense", "kv-retrieval", 205, (0,)), ("dense", "kv-retrieval", 1600, ()),
                              ("dense", "multi-hop", 448, (0,)), ("dense", "multi-hop", 1600, ()),
                              ("qwen3_5", "kv-retrieval", 205, (0,))]),
        steps=5, pool=2, held_out=4, eval_every=5, sweep_tokens=(205, 1024, 4096), sweep_prompts=1,
    ),
    "full": Plan(
        warm={("dense", "kv-retrieval"): {"steps": 700}, ("dense", "multi-hop"): {"steps": 200},
              ("qwen3_5", "kv-retrieval"): {"steps": 300}},
        cells=_cells((0, 1, 2), [("dense", "kv-retrieval", 205, (0,)), ("dense", "kv-retrieval", 1600, (0,)),
                                 ("dense", "multi-hop", 448, (0,)), ("dense", "multi-hop", 1600, ()),
                                 ("qwen3_5", "kv-retrieval", 205, (0,))]),
        steps=16, pool=4, held_out=16, eval_every=4, sweep_tokens=(205, 448, 1024, 2048, 4096), sweep_prompts=2,
    ),
    # the CLI end to end in well under a minute (tests/bench/test_smokes.py): a 2-step warm start, one seed of each
    # mode for 2 steps, a one-prompt sweep. It measures nothing worth reading: it checks the script still runs.
    "smoke": Plan(
        warm={("dense", "kv-retrieval"): {"steps": 2}},
        cells=_cells((0,), [("dense", "kv-retrieval", 205, (0,))]),
        steps=2, pool=1, held_out=1, eval_every=2, sweep_tokens=(205,), sweep_prompts=1,
    ),
}


def plan_json(plan: Plan) -> dict:
    d = asdict(plan)
    d["warm"] = {f"{m} {t}": sft for (m, t), sft in plan.warm.items()}
    return d


MIN_TOKENS = {"kv-retrieval": 190, "multi-hop": 448}  # the tasks' shortest prompts (1 pair; 1 distractor chain)


def pool_of(task: str, tokens: int, seed: int, n: int, tok: Tokenizer) -> list[Example]:
    """A run's training prompts: its own for each seed, disjoint from the warm start's and the held-out ones."""
    return [make_problem(task, 20_000_000 + 1_000 * seed + k, tokens, tok) for k in range(n)]


def held_out_of(task: str, tokens: int, n: int, tok: Tokenizer) -> list[Example]:
    return [make_problem(task, 30_000_000 + k, tokens, tok) for k in range(n)]


def run_cell(cell: Cell, warm: Path, plan: Plan, tok: Tokenizer, progress: bool) -> list[dict]:
    """Every (seed, mode) of a cell, each from the warm-started weights."""
    spec = TASKS[cell.task]
    held = held_out_of(cell.task, cell.prompt_tokens, plan.held_out, tok)
    out = []
    for seed in cell.seeds:
        pool = pool_of(cell.task, cell.prompt_tokens, seed, plan.pool, tok)
        for mode in cell.modes:
            t0 = time.perf_counter()
            run = RunConfig(mode=mode, steps=plan.steps, seed=seed, eval_every=plan.eval_every)
            history = train_run(ls.load_model(warm), tok, pool, held, spec, run, progress,
                                desc=f"{cell.name} {mode} seed {seed}")
            out.append({"model": cell.model, "task": cell.task, "prompt_tokens": cell.prompt_tokens, "mode": mode,
                        "seed": seed, "seconds": time.perf_counter() - t0, "history": history})
    return out


def random_model(model: str) -> torch.nn.Module:
    """The warm start's architecture at its random initialisation (seed 0)."""
    torch.manual_seed(0)
    config = QWEN3_5_TINY if model == "qwen3_5" else load_config(SFT_CONFIG, SFTConfig).model.random
    return ls.build_model(config)


def sweep(model: str, task: str, warm: Path | None, plan: Plan, tok: Tokenizer, progress: bool) -> list[dict]:
    """Gradient fidelity against P/R without training: G answers sampled per prompt, exact vs detached gradient of
    that group. At the warm-started weights the advantages come from the task's reward (prompts whose answers all
    score alike, which give no gradient, are skipped); at the random initialisation (`warm=None`, labelled
    '<model> init') every answer scores 0, so the advantages are random, as in `longstraw step`."""
    model_ = ls.load_model(warm) if warm is not None else random_model(model)
    label = model if warm is not None else f"{model} init"
    spec, cfg = TASKS[task], RunConfig(mode="exact")
    out = []
    for tokens in tqdm(plan.sweep_tokens, desc=f"sweep {label} {task}", disable=not progress, leave=False):
        if tokens < MIN_TOKENS[task]:  # shorter than the task's shortest prompt
            continue
        found, k = 0, 0
        while found < plan.sweep_prompts and k < 4 * plan.sweep_prompts:
            ex = make_problem(task, 40_000_000 + k, tokens, tok)
            k += 1
            prompt = torch.tensor(prompt_ids(tok, ex))
            state = ls.capture(model_, prompt, cfg.engine, exact=True)  # exact: the prompt backward reuses it
            samples = ls.rollout(model_, state, ls.SamplingSettings(max_new_tokens=spec.max_new_tokens,
                                                                    temperature=cfg.temperature,
                                                                    stop_ids=(tok.eos_id,)),
                                 ls.Draw(n=cfg.responses, seed=1_000 * k))
            if warm is None:
                rewards = torch.randn(len(samples), generator=torch.Generator().manual_seed(k)).tolist()
            else:
                rewards = compute_rewards(spec.reward, [ex.meta] * len(samples),
                                          [tok.decode(s.tokens.tolist()) for s in samples]).rewards
            adv = ls.group_advantages(rewards)
            if not bool(adv.abs().gt(0).any()):
                continue
            responses = [s.tokens for s in samples]
            branches = ls.Branches.group(responses, adv, cfg.grpo, vocab_size=model_.config.vocab_size)
            exact, detached, seconds = exact_and_detached(model_, state, branches, cfg)
            del state
            r = statistics.fmean(len(x) for x in responses)
            out.append({"model": label, "task": task, "prompt_tokens": tokens, "prompt_len": len(prompt),
                        "response_len": r, "p_over_r": len(prompt) / r, "seconds": seconds,
                        **compare(exact, detached)})
            found += 1
    return out


# ---- analysis ------------------------------------------------------------------------------------------------


def _steps(run: dict) -> list[dict]:
    return [h for h in run["history"] if "reward_mean" in h]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _tail(xs: list[float], n: int = 3) -> float:
    return statistics.fmean(xs[-n:])


def steps_to(curve: list[float], threshold: float, window: int = 3) -> int | None:
    """First step whose trailing `window`-step mean reward reaches `threshold` (None: never in this run)."""
    for s in range(len(curve)):
        if statistics.fmean(curve[max(0, s - window + 1): s + 1]) >= threshold:
            return s
    return None


def summarize(runs: list[dict]) -> list[dict]:
    """Per (model, task, P) and mode, over seeds: final reward (mean of the last 3 steps), held-out accuracy after
    the last step, the gap to exact paired by seed (same pool, same sampling seeds), steps to close 80% of exact's
    reward gain, gradient cosine / relative L2, seconds per step; for naive, how long it stays identical to exact."""
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for r in runs:
        cells.setdefault((r["model"], r["task"], r["prompt_tokens"]), {}).setdefault(r["mode"], []).append(r)
    rows = []
    for (model, task, tokens), by_mode in cells.items():
        exact = {r["seed"]: r for r in by_mode.get("exact", [])}
        final = {id(r): _tail([h["reward_mean"] for h in _steps(r)]) for rs in by_mode.values() for r in rs}
        start = statistics.fmean(_steps(r)[0]["reward_mean"] for rs in by_mode.values() for r in rs)
        exact_final = statistics.fmean(final[id(r)] for r in exact.values()) if exact else None
        gain = None if exact_final is None else exact_final - start
        threshold = start + 0.8 * gain if gain is not None and gain > 0.02 else None
        p_over_r = statistics.fmean(h["p_over_r"] for rs in by_mode.values() for r in rs for h in _steps(r))
        for mode in MODES:
            rs = by_mode.get(mode, [])
            if not rs:
                continue
            curves = [[h["reward_mean"] for h in _steps(r)] for r in rs]
            paired = [r for r in rs if r["seed"] in exact]
            row = {"model": model, "task": task, "prompt_tokens": tokens, "mode": mode, "seeds": len(rs),
                   "prompt_len": statistics.fmean(_steps(r)[0]["prompt_len"] for r in rs), "p_over_r": p_over_r,
                   "reward_start": start, "reward_final": _mean_std([final[id(r)] for r in rs]),
                   "gap_to_exact": _mean_std([final[id(exact[r["seed"]])] - final[id(r)] for r in paired]),
                   "accuracy_final": _mean_std([_tail([h["accuracy"] for h in _steps(r)]) for r in rs]),
                   "held_out_start": _mean_std([r["history"][0]["held_out"]["accuracy"] for r in rs]),
                   "held_out_final": _mean_std([r["history"][-1]["held_out"]["accuracy"] for r in rs]),
                   "threshold": threshold,
                   "steps_to_threshold": [steps_to(c, threshold) for c in curves] if threshold is not None else [],
                   "cos": _mean_std([h.get("cos") for r in rs for h in _steps(r)]),
                   "rel_l2": _mean_std([h.get("rel_l2") for r in rs for h in _steps(r)]),
                   "sec_per_step": _mean_std([h["seconds"] for r in rs for h in _steps(r)]),
                   "grad_vs_probe": max((h.get("grad_vs_probe", 0.0) for r in rs for h in _steps(r)), default=0.0)}
            if mode == "naive":
                row["same_as_exact"] = [_same_steps(r, exact.get(r["seed"])) for r in rs]
            rows.append(row)
    return rows


def _same_steps(naive: dict, exact: dict | None) -> dict | None:
    """How long a naive run and the exact run of its seed stay identical: steps with the same sampled answers,
    and the largest reward difference over the run."""
    if exact is None:
        return None
    a, b = _steps(naive), _steps(exact)
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x["tokens_sha256"] != y["tokens_sha256"]), len(a))
    return {"identical_steps": same, "of": len(a),
            "max_reward_diff": max(abs(x["reward_mean"] - y["reward_mean"]) for x, y in zip(a, b))}


def layer_label(model: str, part: str) -> str:
    """'L3' -> 'L3 attn' for the Qwen3.5 hybrid (every 4th layer is full attention, the others Gated DeltaNet)."""
    if not model.startswith("qwen3_5") or not part.startswith("L"):
        return part
    return f"{part} {'attn' if (int(part[1:]) + 1) % 4 == 0 else 'DeltaNet'}"


def parameter_loss(runs: list[dict], sweeps: list[dict]) -> dict:
    """Per model: each parameter group's and layer's relative L2 of the lost gradient and its share of all that is
    lost, averaged over every compared batch (all training steps of all runs, and the sweep)."""
    out: dict = {}
    batches = [(r["model"], h) for r in runs for h in _steps(r) if "groups" in h] + [(s["model"], s) for s in sweeps]
    for model in sorted({m for m, _ in batches}):
        hs = [h for m, h in batches if m == model]
        out[model] = {}
        for key in ("groups", "layers"):
            parts = sorted({p for h in hs for p in h[key]}, key=lambda p: (p[0] != "e", p))
            out[model][key] = {layer_label(model, p): {stat: _mean_std([h[key][p][stat] for h in hs if p in h[key]])[0]
                                                       for stat in ("rel_l2", "lost_share", "norm_share")}
                               for p in parts}
    return out


# ---- plots ---------------------------------------------------------------------------------------------------

COLORS = {"naive": "tab:gray", "exact": "tab:blue", "detached": "tab:red"}
STYLES = {"naive": ":", "exact": "-", "detached": "--"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_cell(runs: list[dict]) -> dict[tuple, list[dict]]:
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["model"], r["task"], r["prompt_tokens"]), []).append(r)
    return cells


def _grid(plt, n: int, title: str):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharey=False)
    fig.suptitle(title, fontsize=10)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat)


def _cell_title(runs: list[dict]) -> str:
    r0 = runs[0]
    pr = statistics.fmean(h["p_over_r"] for r in runs for h in _steps(r))
    return f"{r0['model']} {r0['task']}, P={_steps(r0)[0]['prompt_len']:.0f} (P/R~{pr:.0f})"


def _band(ax, xs: list[int], ys: list[list[float]], mode: str) -> None:
    """Mean +- std over seeds (one seed: a line)."""
    mean = [statistics.fmean(col) for col in zip(*ys)]
    std = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in zip(*ys)]
    ax.plot(xs, mean, STYLES[mode], color=COLORS[mode], label=f"{mode} (n={len(ys)})")
    if len(ys) > 1:
        ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=COLORS[mode], alpha=0.15)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def plot_curves(runs: list[dict], out: Path, what: str) -> Path:
    """Training reward (what='reward') or held-out greedy accuracy (what='held_out') per step, per cell."""
    plt = _plt()
    cells = _by_cell(runs)
    title = {"reward": "training-pool reward (digit/name overlap), mean +- std over seeds",
             "held_out": "held-out greedy exact-match accuracy (prompts never trained on)"}[what]
    fig, axes = _grid(plt, len(cells), title)
    for ax, rs in zip(axes, cells.values()):
        for mode in MODES:
            mine = [r for r in rs if r["mode"] == mode]
            if not mine:
                continue
            if what == "reward":
                xs = [h["step"] for h in _steps(mine[0])]
                _band(ax, xs, [[h["reward_mean"] for h in _steps(r)] for r in mine], mode)
            else:
                xs = [h["step"] for h in mine[0]["history"] if "held_out" in h]
                _band(ax, xs, [[h["held_out"]["accuracy"] for h in r["history"] if "held_out" in h] for r in mine],
                      mode)
        ax.set_title(_cell_title(rs), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, out / f"convergence_{what}.png")


def plot_cos_steps(runs: list[dict], out: Path) -> Path:
    """Cosine between the detached and the exact gradient of each step's batch, per cell and training mode."""
    plt = _plt()
    cells = _by_cell(runs)
    fig, axes = _grid(plt, len(cells), "cos(detached grad, exact grad) on each step's batch, mean +- std over seeds")
    for ax, rs in zip(axes, cells.values()):
        for mode in MODES:
            mine = [r for r in rs if r["mode"] == mode and all("cos" in h for h in _steps(r))]
            if mine:
                _band(ax, [h["step"] for h in _steps(mine[0])], [[h["cos"] for h in _steps(r)] for r in mine], mode)
        ax.set_title(_cell_title(rs), fontsize=9)
        ax.set_xlabel("step (legend: the run's training mode)", fontsize=8)
        ax.set_ylim(-0.1, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, out / "convergence_cos_steps.png")


def plot_cos_pr(runs: list[dict], sweeps: list[dict], out: Path) -> Path:
    """Cosine and relative L2 against P/R: the sweep (lines; each point the mean over its prompts at one P) and the
    training runs' batches (squares: mean over steps, seeds and modes)."""
    plt = _plt()
    fig, (ax_cos, ax_l2) = plt.subplots(1, 2, figsize=(9, 3.4))
    keys = sorted({(s["model"], s["task"]) for s in sweeps} | {(r["model"], r["task"]) for r in runs})
    for i, (model, task) in enumerate(keys):
        color = f"C{i}"
        mine = [s for s in sweeps if (s["model"], s["task"]) == (model, task)]
        pts = sorted(tuple(statistics.fmean(s[k] for s in mine if s["prompt_tokens"] == p)
                           for k in ("p_over_r", "cos", "rel_l2")) for p in {s["prompt_tokens"] for s in mine})
        if pts:
            style = "o--" if model.endswith("init") else "o-"  # random initialisation, random advantages
            ax_cos.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, ms=3, label=f"{model} {task}")
            ax_l2.plot([p[0] for p in pts], [p[2] for p in pts], style, color=color, ms=3, label=f"{model} {task}")
        for rs in _by_cell([r for r in runs if (r["model"], r["task"]) == (model, task)]).values():
            hs = [h for r in rs for h in _steps(r) if "cos" in h]
            if hs:
                pr = statistics.fmean(h["p_over_r"] for h in hs)
                ax_cos.plot(pr, statistics.fmean(h["cos"] for h in hs), "s", color=color, ms=8, mfc="none")
                ax_l2.plot(pr, statistics.fmean(h["rel_l2"] for h in hs), "s", color=color, ms=8, mfc="none")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax, label in ((ax_cos, "cos(detached, exact)"), (ax_l2, "|exact - detached| / |exact|")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("P / R (prompt tokens / mean response tokens)", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3, which="both")
    ax_cos.legend(fontsize=7)
    fig.suptitle("gradient fidelity vs P/R: lines = warm-started weights (dashed: random init, random advantages), "
                 "squares = training runs", fontsize=8)
    return _save(plt, fig, out / "convergence_cos_pr.png")


def plot_parameters(loss: dict, out: Path) -> Path:
    """Which parameters lose their gradient: per group and per layer, relative L2 of (exact - detached) and the
    share of all that is lost."""
    plt = _plt()
    models = list(loss)
    fig, axes = plt.subplots(len(models), 2, figsize=(9, 2.8 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        for ax, key in zip(row, ("groups", "layers")):
            parts = list(loss[model][key])
            x = range(len(parts))
            ax.bar([i - 0.2 for i in x], [loss[model][key][p]["rel_l2"] for p in parts], 0.4, label="rel. L2 lost")
            ax.bar([i + 0.2 for i in x], [loss[model][key][p]["lost_share"] for p in parts], 0.4,
                   label="share of all lost")
            ax.set_xticks(list(x))
            ax.set_xticklabels(parts, fontsize=7, rotation=20)
            ax.set_title(f"{model}: per parameter {key[:-1]}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
    return _save(plt, fig, out / "convergence_parameters.png")


# ---- output: table, JSON, MLflow -----------------------------------------------------------------------------


def _pm(ms: tuple[float, float], digits: int = 3) -> str:
    m, s = ms
    return "-" if math.isnan(m) else f"{m:.{digits}f}+-{s:.{digits}f}"


def _reach(row: dict) -> str:
    if row["threshold"] is None:
        return "n/a"
    hit = [s for s in row["steps_to_threshold"] if s is not None]
    return f"{statistics.fmean(hit):.1f} ({len(hit)}/{len(row['steps_to_threshold'])})" if hit else \
        f"never (0/{len(row['steps_to_threshold'])})"


def table(rows: list[dict]) -> str:
    head = (f"{'model':8} {'task':12} {'P':>5} {'P/R':>4} {'mode':8} {'n':>2} {'reward 0':>8} {'reward end':>12} "
            f"{'gap to exact':>13} {'held-out end':>12} {'steps to 80%':>13} {'cos(D,E)':>11} {'relL2(D,E)':>11} "
            f"{'s/step':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        gap = "" if r["mode"] == "exact" else _pm(r["gap_to_exact"])
        if r.get("same_as_exact") and all(r["same_as_exact"]):  # naive: steps identical to exact's
            gap = "same " + ",".join(f"{x['identical_steps']}/{x['of']}" for x in r["same_as_exact"])
        lines.append(f"{r['model']:8} {r['task']:12} {r['prompt_len']:5.0f} {r['p_over_r']:4.0f} {r['mode']:8} "
                     f"{r['seeds']:2d} {r['reward_start']:8.3f} {_pm(r['reward_final']):>12} {gap:>13} "
                     f"{_pm(r['held_out_final']):>12} {_reach(r):>13} {_pm(r['cos'], 2):>11} "
                     f"{_pm(r['rel_l2'], 2):>11} {r['sec_per_step'][0]:6.2f}")
    return "\n".join(lines)


def _rounded(x, digits: int = 5):
    """Floats to `digits` significant digits, so the JSON stays small."""
    if isinstance(x, float):
        return x if not math.isfinite(x) or x == 0 else float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x


def write_json(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_rounded(result), indent=None, separators=(",", ":")))
    tmp.replace(path)


def log_mlflow(uri: str, result: dict, files: list[Path]) -> str:
    """One parent run (the plan as params, the summary as metrics, PNGs and JSON as artefacts) and one nested run
    per training run with its per-step metrics."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("longstraw-convergence")
    # artefacts beside a sqlite store (as the pipeline keeps them), not in ./mlruns of whatever the cwd is
    where = (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri() \
        if uri.startswith("sqlite:///") else None
    exp_id = exp.experiment_id if exp else client.create_experiment("longstraw-convergence", artifact_location=where)
    parent = client.create_run(exp_id, run_name=f"convergence-{result['meta']['variant']}").info.run_id
    now = int(time.time() * 1000)

    def batch(run_id: str, metrics: list[Metric], params: list[Param] = ()) -> None:
        for i in range(0, max(len(metrics), 1), 900):  # MLflow takes up to 1000 metrics per call
            client.log_batch(run_id, metrics=metrics[i: i + 900], params=list(params) if i == 0 else [])

    plan = {k: json.dumps(v) if not isinstance(v, (int, float, str)) else v
            for k, v in result["meta"]["plan"].items() if k != "cells"}
    summary = []
    for row in result["summary"]:
        key = f"{row['model']}.{row['task']}.P{row['prompt_tokens']}.{row['mode']}"
        summary += [Metric(f"{key}.reward_final", row["reward_final"][0], now, 0),
                    Metric(f"{key}.held_out_final", row["held_out_final"][0], now, 0)]
        if not math.isnan(row["cos"][0]):
            summary.append(Metric(f"{key}.cos", row["cos"][0], now, 0))
    batch(parent, summary, [Param(k, str(v)[:500]) for k, v in plan.items()])
    for run in result["runs"]:
        child = client.create_run(exp_id, run_name=f"{run['model']} {run['task']} P{run['prompt_tokens']} "
                                  f"{run['mode']} seed {run['seed']}", tags={"mlflow.parentRunId": parent}).info.run_id
        metrics = []
        for h in run["history"]:
            flat = {k: h[k] for k in ("reward_mean", "accuracy", "cos", "rel_l2", "seconds", "grad_norm", "p_over_r")
                    if k in h}
            flat |= {f"lost_share.{g}": v["lost_share"] for g, v in h.get("groups", {}).items()}
            if "held_out" in h:
                flat["held_out_accuracy"] = h["held_out"]["accuracy"]
            metrics += [Metric(k, float(v), now, h["step"]) for k, v in flat.items()
                        if v is not None and math.isfinite(v)]
        batch(child, metrics, [Param(k, str(run[k])) for k in ("model", "task", "prompt_tokens", "mode", "seed")])
        client.set_terminated(child)
    for f in files:
        client.log_artifact(parent, str(f))
    client.set_terminated(parent)
    return parent


# ---- main ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="<= 5 min: the same cells at fewer steps, seeds and prompts (the default)")
    size.add_argument("--full", action="store_true", help="<= 60 min on the 2-core box, warm starts included")
    size.add_argument("--smoke", action="store_true", help="seconds: a 2-step run of each mode and a one-prompt "
                      "sweep, which checks that the script runs and measures nothing worth reading")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "convergence",
                    help="where convergence_summary.json and the PNGs go")
    ap.add_argument("--cache", type=Path, default=ROOT / "bench" / "out" / "convergence",
                    help="where warm starts are cached and every step's record goes (convergence-<variant>.json)")
    ap.add_argument("--mlflow", metavar="URI", help="log to MLflow, e.g. sqlite:///bench/out/mlflow.db")
    ap.add_argument("--steps", type=int, help="override the plan's GRPO steps per run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--replot", action="store_true", help="measure nothing: summary, table, PNGs (and MLflow) again "
                    "from <cache>/convergence-<variant>.json")
    args = ap.parse_args(argv)

    variant = "full" if args.full else "smoke" if args.smoke else "quick"
    plan = PLANS[variant]
    if args.steps:
        plan = Plan(**{**plan.__dict__, "steps": args.steps})
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    # every step of every run (large) beside the warm starts; the summary (small) beside the plots
    json_path = args.cache / f"convergence-{variant}.json"
    if args.replot:
        result = json.loads(json_path.read_text())
    else:
        torch.set_num_threads(args.threads)
        result = measure(variant, plan, args.cache, json_path, args.threads, not args.no_progress)
    report(result, json_path, args.out, args.mlflow)
    return 0


def measure(variant: str, plan: Plan, cache: Path, json_path: Path, threads: int, progress: bool) -> dict:
    """Warm starts (cached), the P/R sweep, then every cell's runs; `json_path` is rewritten after each cell."""
    tok = load_tokenizer("byte")
    t_start = time.perf_counter()
    meta = {"variant": variant, "plan": plan_json(plan), "torch": torch.__version__,
            "machine": platform.machine(), "python": platform.python_version(), "threads": threads,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    result: dict = {"meta": meta, "warm": {}, "sweeps": [], "runs": []}
    warm: dict[tuple[str, str], Path] = {}
    for (model, task), sft in plan.warm.items():
        t0 = time.perf_counter()
        warm[model, task], record = warm_start(model, task, sft, cache, progress)
        result["warm"][f"{model} {task}"] = {**record, "sft": sft, "seconds_here": time.perf_counter() - t0}
        print(f"warm start {model} {task}: {record['steps']} sft steps, greedy reward {record['reward_before']:.3f} -> "
              f"{record['reward_after']:.3f} ({record['seconds']:.0f} s; {time.perf_counter() - t0:.0f} s here)",
              flush=True)
    t0 = time.perf_counter()
    for (model, task), path in warm.items():
        result["sweeps"] += sweep(model, task, path, plan, tok, progress)
    for model in sorted({m for m, _ in warm}):  # the same architectures before any training
        result["sweeps"] += sweep(model, "kv-retrieval", None, plan, tok, progress)
    meta["sweep_seconds"] = time.perf_counter() - t0
    for cell in tqdm(plan.cells, desc="cells", disable=not progress):
        result["runs"] += run_cell(cell, warm[cell.model, cell.task], plan, tok, progress)
        write_json(json_path, result)  # after every cell: a killed study keeps what it measured
    meta["seconds"] = time.perf_counter() - t_start
    write_json(json_path, result)
    return result


def report(result: dict, json_path: Path, out: Path, mlflow_uri: str | None) -> None:
    """Summary, table, PNGs and (with a URI) MLflow, from the measured runs (also `--replot`, from the JSON)."""
    result["summary"] = summarize(result["runs"])
    result["parameters"] = parameter_loss(result["runs"], result["sweeps"])
    summary_path = out / "convergence_summary.json"
    write_json(summary_path, {k: v for k, v in result.items() if k != "runs"})
    pngs = [plot_curves(result["runs"], out, "reward"), plot_curves(result["runs"], out, "held_out"),
            plot_cos_steps(result["runs"], out), plot_cos_pr(result["runs"], result["sweeps"], out),
            plot_parameters(result["parameters"], out)]
    print(table(result["summary"]))
    print(parameters_table(result["parameters"]))
    print(f"{result['meta']['variant']}: {result['meta']['seconds']:.0f} s measured; every step in {json_path}; "
          f"{summary_path.name} and {len(pngs)} PNGs in {out}")
    if mlflow_uri:
        print(f"MLflow run {log_mlflow(mlflow_uri, result, [json_path, summary_path, *pngs])} at {mlflow_uri}")


def parameters_table(loss: dict) -> str:
    lines = []
    for model, parts in loss.items():
        lines.append(f"{model}: where the detached gradient loses (rel. L2 of exact - detached / share of all lost "
                     f"/ share of |exact|^2)")
        for key in ("groups", "layers"):
            lines.append("  " + "  ".join(f"{p} {v['rel_l2']:.2f}/{v['lost_share']:.2f}/{v['norm_share']:.2f}"
                                          for p, v in parts[key].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
