"""Supervised warm start: teach a tiny model a built-in task's answer format so GRPO starts with non-zero reward.

Trains on (chat-formatted prompt, answer + eos) pairs with the loss on the answer tokens only, measures the task
reward of greedy answers before and after, and writes an HF-layout checkpoint (config.json + model.safetensors,
loadable by `load_model`) atomically.

With `agent` (a built-in environment, e.g. record-lookup) it learns whole transcripts instead: the prompt, the
model's turns of the environment's demonstration (a tool call, then the answer), and between them the tool's
observation tokens exactly as `ToolTurns` renders them (the real tool is run), which are attended to but carry
no loss. Its eval decodes multi-turn with the real tool (`rollout_turns` + `ToolTurns`, greedy) and reports the
call rate and the answer accuracy beside the environment's mean reward.

A tiny byte-level model does not learn content-based retrieval from scratch in a few hundred steps, but it does
learn to copy an answer whose place is fixed. So a `curriculum` first trains on the shortest prompts (one
`key: value` pair: the answer always sits at the same offset) and then grows them to `prompt_tokens`, where
the copying skill carries over.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm.auto import tqdm

from ..agents import ToolChat, ToolTurns, rollout_turns
from ..agents.builtin import ENVIRONMENTS, BuiltinEnv
from ..config import ModelSpec
from ..data import Example, Tokenizer, check_vocab, load_tokenizer
from ..engine import capture
from ..files import atomic_output
from ..models import write_weights
from ..problems import get_problem, make_problem
from ..rollout import Draw, SamplingSettings, rollout
from .data import prompt_ids
from .inputs import example_record


Stage = tuple[int, float]  # (prompt tokens, fraction of the steps)


def _check_curriculum(curriculum: list[Stage], prompt_tokens: int, where: str) -> None:
    total = sum(f for _, f in curriculum)
    if any(t < 16 or f <= 0 for t, f in curriculum) or total >= 1:
        raise ValueError(f"{where}curriculum must be [prompt_tokens >= 16, fraction > 0] stages whose fractions sum "
                         f"to less than 1 (the rest of the steps use prompt_tokens={prompt_tokens}), got {curriculum}")


class TaskSettings(BaseModel):
    """Per-task overrides of prompt_tokens / curriculum (tasks differ in their shortest prompt) and the task's own
    task_options (none unless given here)."""

    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int | None = Field(None, ge=16)
    curriculum: list[Stage] | None = None
    task_options: dict | None = None


class AgentSFT(BaseModel):
    """The multi-turn warm start: learn a built-in environment's demonstrations as transcripts."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field("record-lookup", description="a built-in environment (longstraw/agents/builtin.py)")
    max_turns: int = Field(3, ge=1, description="turns of the eval's multi-turn decode")
    max_new_tokens: int = Field(160, ge=1, description="the eval's budget: the model's and the observations' tokens")

    @model_validator(mode="after")
    def _check(self) -> "AgentSFT":
        if self.env not in ENVIRONMENTS or ENVIRONMENTS[self.env].demonstration is None:
            known = sorted(k for k, b in ENVIRONMENTS.items() if b.demonstration is not None)
            raise ValueError(f"agent.env {self.env!r} is not a built-in environment with a demonstration to learn; "
                             f"use one of {known}")
        return self


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSpec
    tokenizer: str = "byte"
    task: str = "kv-retrieval"
    prompt_tokens: int = Field(256, ge=16, description="length of the generated task prompts (and of the evals)")
    task_options: dict = Field(default_factory=dict, description="keyword options of the task's make, e.g. "
                               "kv-retrieval's key_chars / value_digits")
    curriculum: list[Stage] = Field(default_factory=list, description="[prompt_tokens, fraction of steps] stages "
                                    "trained first, in order; the remaining steps use prompt_tokens")
    per_task: dict[str, TaskSettings] = Field(default_factory=dict, description="overrides for the task named, "
                                              "so that one config serves `--task` of each built-in task")
    steps: int = Field(800, ge=1)
    batch: int = Field(16, ge=1)
    lr: float = Field(2e-3, gt=0)
    lr_schedule: Literal["linear", "constant"] = "linear"  # after the warmup: decay to 0, or keep lr
    warmup: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    eval_examples: int = Field(32, ge=1)
    seed: int = 0
    threads: int | None = Field(None, ge=1)
    out: str = "runs/sft-tiny"
    agent: AgentSFT | None = Field(None, description="learn multi-turn transcripts of this built-in environment "
                                   "(the task's prompt lists its tools) instead of prompt -> answer pairs")

    @model_validator(mode="after")
    def _check(self) -> "SFTConfig":
        _check_curriculum(self.curriculum, self.prompt_tokens, "")
        if self.agent is not None and self.task != self.agent.env:  # the built-in env's task lists its tools
            raise ValueError(f"agent.env {self.agent.env!r} learns the transcripts of task {self.agent.env!r}, but "
                             f"task is {self.task!r}; set task: {self.agent.env}")
        for name, ts in self.per_task.items():
            get_problem(name)  # unknown names fail here, listing the known tasks
            if ts.curriculum is not None:
                _check_curriculum(ts.curriculum, ts.prompt_tokens or self.prompt_tokens, f"per_task.{name}.")
        return self

    def settings(self) -> tuple[int, list[Stage], dict]:
        """(prompt_tokens, curriculum, task_options) of `task`, per_task overrides applied."""
        if self.task not in self.per_task:
            return self.prompt_tokens, self.curriculum, self.task_options
        ts = self.per_task[self.task]
        # task options are task-specific: a per_task entry never inherits the top-level ones
        return (self.prompt_tokens if ts.prompt_tokens is None else ts.prompt_tokens,
                self.curriculum if ts.curriculum is None else ts.curriculum, ts.task_options or {})


def prompt_length(step: int, steps: int, prompt_tokens: int, curriculum: list[Stage]) -> int:
    """The prompt length of a step: the curriculum's stages in order, then prompt_tokens."""
    end = 0.0
    for tokens, fraction in curriculum:
        end += fraction
        if step < round(end * steps):
            return tokens
    return prompt_tokens


def encode(tok: Tokenizer, ex: Example) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + eos) of one example, the prompt in the tokenizer's chat format."""
    return prompt_ids(tok, ex), tok.encode(ex.answer) + [tok.eos_id]


def _batch(pairs: list[tuple[list[int], list[int]]], pad: int,
           masks: list[list[bool]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs [B, T] and targets [B, T] with -100 outside the answers; with `masks` (one per answer,
    True on the model's tokens) also -100 on the answer's tokens the model did not write (observations)."""
    seqs = [p + a for p, a in pairs]
    width = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), width), pad, dtype=torch.long)
    targets = torch.full_like(inputs, -100)
    for i, ((p, a), s) in enumerate(zip(pairs, seqs)):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        answer = torch.tensor(a)
        if masks is not None:
            answer = answer.masked_fill(~torch.tensor(masks[i], dtype=torch.bool), -100)
        targets[i, len(p) - 1 : len(s) - 1] = answer
    return inputs, targets


def sft_loss(model, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> torch.Tensor:
    """Mean cross-entropy of the target tokens (-100: none); the LM head only from position `first` on (prompts
    are most of the sequence), in chunks (no [B, T, vocab] logits at once)."""
    answer = targets[:, first:]
    scored = answer != -100
    logp = model.token_logprobs(inputs, answer.clamp(min=0), logits_from=first)
    return -torch.where(scored, logp, 0.0).sum() / scored.sum()


# ---- multi-turn transcripts (agent) ----------------------------------------------------------------------------

def transcript(tok: Tokenizer, chat: ToolChat, env: BuiltinEnv, ex: Example) -> tuple[list[int], list[int], list[bool]]:
    """(prompt ids, the branch's ids, mask True on the model's) of the demonstration of `ex`: each model turn's
    text + eos, followed by what `ToolTurns` answers it with (the real tools run), until the environment is done.
    A demonstration that is not done by its last turn, or does not earn reward 1.0, is an error (a broken
    built-in)."""
    turns = ToolTurns(env.make(example_record(ex)), chat)
    ids: list[int] = []
    mask: list[bool] = []
    demo = env.demonstration(example_record(ex))
    for k, text in enumerate(demo):
        said = tok.encode(text) + [tok.eos_id]
        reply = turns.step(said)
        ids += said + reply.tokens
        mask += [True] * len(said) + [False] * len(reply.tokens)
        if reply.done != (k == len(demo) - 1):
            raise RuntimeError(f"demonstration of {ex.meta.get('task')!r} seed {ex.meta.get('seed')}: the "
                               f"environment said done={reply.done} after turn {k + 1} of {len(demo)}")
    if turns.reward != 1.0 or turns.tool_errors:
        raise RuntimeError(f"demonstration of {ex.meta.get('task')!r} seed {ex.meta.get('seed')} earned reward "
                           f"{turns.reward} with {turns.tool_errors} tool errors; it must solve the example")
    return prompt_ids(tok, ex), ids, mask


@torch.no_grad()
def agent_eval(model, tok: Tokenizer, chat: ToolChat, env: BuiltinEnv, examples: list[Example], max_turns: int,
               max_new_tokens: int) -> dict:
    """Greedy multi-turn decode with the real tools, one branch per example: the share of branches that called a
    tool (`call_rate`), called one without an error on every call (`clean_call_rate`), answered exactly
    (`accuracy`: reward 1.0), and the mean reward (none given: 0)."""
    settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0, stop_ids=(tok.eos_id,))
    called = clean = exact = 0
    total = 0.0
    for ex in examples:
        turns = ToolTurns(env.make(example_record(ex)), chat)
        state = capture(model, torch.tensor(prompt_ids(tok, ex)))
        rollout_turns(model, state, settings, Draw(n=1), [turns], max_turns=max_turns)
        called += turns.tool_calls > 0
        clean += turns.tool_calls > 0 and turns.tool_errors == 0
        reward = turns.reward or 0.0
        exact += reward == 1.0
        total += reward
    n = len(examples)
    return {"reward": total / n, "accuracy": exact / n, "call_rate": called / n, "clean_call_rate": clean / n}


@torch.no_grad()
def task_reward(model, tok: Tokenizer, task: str, examples: list[Example]) -> float:
    """Mean verifier reward of greedy answers (captured prompt, one branch each)."""
    verify = get_problem(task).verify
    total = 0.0
    for ex in examples:
        prompt, answer = encode(tok, ex)
        state = capture(model, prompt)
        greedy = SamplingSettings(max_new_tokens=len(answer) + 8, temperature=0, stop_ids=(tok.eos_id,))
        sample = rollout(model, state, greedy, Draw(n=1))[0]
        total += verify(ex.meta, tok.decode(sample.tokens.tolist()))
    return total / len(examples)


def save_model(model: torch.nn.Module, out: str | Path) -> Path:
    """config.json + model.safetensors at `out`, written atomically (an earlier checkpoint there is replaced)."""
    with atomic_output(out) as tmp:
        Path(tmp).mkdir()
        write_weights(model, tmp)
    return Path(out)


def run_sft(cfg: SFTConfig, progress: bool = True) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg.tokenizer)
    model = cfg.model.load()
    check_vocab([tok.vocab_size - 1], model.config.vocab_size, "tokenizer vocab")
    prompt_tokens, curriculum, options = cfg.settings()
    evals = [make_problem(cfg.task, 10_000_000 + i, prompt_tokens, tok, **options) for i in range(cfg.eval_examples)]
    if cfg.agent is not None:
        env = ENVIRONMENTS[cfg.agent.env]
        chat = ToolChat(tok, env.tools)

        def evaluate() -> dict:
            return agent_eval(model, tok, chat, env, evals, cfg.agent.max_turns, cfg.agent.max_new_tokens)

        def rows(examples: list[Example]) -> tuple[list[tuple[list[int], list[int]]], list[list[bool]]]:
            done = [transcript(tok, chat, env, ex) for ex in examples]
            return [(p, r) for p, r, _ in done], [m for _, _, m in done]
    else:
        def evaluate() -> dict:
            return {"reward": task_reward(model, tok, cfg.task, evals)}

        def rows(examples: list[Example]) -> tuple[list[tuple[list[int], list[int]]], None]:
            return [encode(tok, ex) for ex in examples], None
    before = evaluate()

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    decay = (lambda s: max(0.0, 1 - s / cfg.steps)) if cfg.lr_schedule == "linear" else (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)) * decay(s))
    t0, losses = time.perf_counter(), []
    model.train()
    for step in tqdm(range(cfg.steps), desc=f"sft {cfg.task}", disable=not progress):
        length = prompt_length(step, cfg.steps, prompt_tokens, curriculum)
        pairs, masks = rows([make_problem(cfg.task, cfg.seed * 1_000_003 + step * cfg.batch + i, length, tok,
                                          **options) for i in range(cfg.batch)])
        inputs, targets = _batch(pairs, tok.pad_id, masks)
        # the LM head only where some row has an answer token
        loss = sft_loss(model, inputs, targets, first=min(len(p) for p, _ in pairs) - 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    after = evaluate()
    path = save_model(model, cfg.out)
    tail = losses[-20:]
    evals_out = {f"{k}_{when}": v for when, d in (("before", before), ("after", after)) for k, v in d.items()}
    return {"task": cfg.task, "prompt_tokens": prompt_tokens, "task_options": options, **evals_out,
            "final_loss": sum(tail) / len(tail), "steps": cfg.steps, "seconds": time.perf_counter() - t0,
            "checkpoint": str(path)}
