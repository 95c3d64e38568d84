"""Supervised warm start: teach a tiny model a built-in task's answer format so GRPO starts with non-zero reward.

Trains on (chat-formatted prompt, answer + eos) pairs with the loss on the answer tokens only, measures the task
reward of greedy answers before and after, and writes an HF-layout checkpoint (config.json + model.safetensors,
loadable by `load_model`) atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .config import ModelSpec
from .engine.capture import capture
from .models import build_model, load_model
from .rollout import rollout
from .tasks import TaskExample, get_task, make_task
from .tokenizer import Tokenizer, check_vocab, load_tokenizer


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSpec
    tokenizer: str = "byte"
    task: str = "kv-retrieval"
    prompt_tokens: int = Field(256, ge=16, description="length of the generated task prompts")
    steps: int = Field(800, ge=1)
    batch: int = Field(16, ge=1)
    lr: float = Field(2e-3, gt=0)
    warmup: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    eval_examples: int = Field(32, ge=1)
    seed: int = 0
    threads: int | None = Field(None, ge=1)
    out: str = "runs/sft-tiny"


def encode(tok: Tokenizer, ex: TaskExample) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + eos) of one example, the prompt in the tokenizer's chat format."""
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ex.prompt}]))
    return prompt, tok.encode(ex.answer) + [tok.eos_id]


def _batch(pairs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs [B, T] and targets [B, T] with -100 outside the answers."""
    seqs = [p + a for p, a in pairs]
    width = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), width), pad, dtype=torch.long)
    targets = torch.full_like(inputs, -100)
    for i, ((p, a), s) in enumerate(zip(pairs, seqs)):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        targets[i, len(p) - 1 : len(s) - 1] = torch.tensor(a)
    return inputs, targets


@torch.no_grad()
def task_reward(model, tok: Tokenizer, task: str, examples: list[TaskExample]) -> float:
    """Mean verifier reward of greedy answers (captured prompt, one branch each)."""
    verify = get_task(task).verify
    total = 0.0
    for ex in examples:
        prompt, answer = encode(tok, ex)
        state = capture(model, prompt)
        sample = rollout(model, state, n=1, max_new_tokens=len(answer) + 8, temperature=0, stop_ids=[tok.eos_id])[0]
        total += verify(ex.meta, tok.decode(sample.tokens.tolist()))
    return total / len(examples)


def save_checkpoint(model, out: str | Path) -> Path:
    """config.json + model.safetensors, written beside the target and renamed into place (atomic)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(model.config.raw, indent=2))
    old = out.with_name(out.name + ".old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def run_sft(cfg: SFTConfig, progress: bool = True) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg.tokenizer)
    model = load_model(cfg.model.path) if cfg.model.path else build_model(cfg.model.random)
    check_vocab([tok.vocab_size - 1], model.config.vocab_size, "tokenizer vocab")
    evals = [make_task(cfg.task, 10_000_000 + i, cfg.prompt_tokens, tok) for i in range(cfg.eval_examples)]
    before = task_reward(model, tok, cfg.task, evals)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)) * max(0.0, 1 - s / cfg.steps)
    )
    t0, losses = time.perf_counter(), []
    model.train()
    for step in tqdm(range(cfg.steps), desc=f"sft {cfg.task}", disable=not progress):
        pairs = [encode(tok, make_task(cfg.task, cfg.seed * 1_000_003 + step * cfg.batch + i, cfg.prompt_tokens, tok))
                 for i in range(cfg.batch)]
        inputs, targets = _batch(pairs, tok.pad_id)
        # the LM head only where some row has an answer token (prompts are most of the sequence)
        first = min(len(p) for p, _ in pairs) - 1
        logits = model(inputs, logits_from=first)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), targets[:, first:].flatten(), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    after = task_reward(model, tok, cfg.task, evals)
    path = save_checkpoint(model, cfg.out)
    tail = losses[-20:]
    return {"task": cfg.task, "reward_before": before, "reward_after": after, "final_loss": sum(tail) / len(tail),
            "steps": cfg.steps, "seconds": time.perf_counter() - t0, "checkpoint": str(path)}
