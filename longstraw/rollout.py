"""Sample G responses from one captured prefix state, all branches decoded together on the shared prefix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .engine import check_state
from .models.protocol import PrefixLM
from .parallel import ONE_RANK, SequenceGroup
from .segment import DecodeCache, PrefixView, Segment
from .state import LayerState, PrefixState


@dataclass
class Sample:
    """One sampled response: its tokens, the model's log-probability of each (temperature 1, before any top-k /
    top-p filtering: what `score()` returns and GRPO's old_logprobs need), the log-probability of each under the
    distribution it was actually drawn from (tempered, top-k and top-p filtered; 0 for greedy, a point mass: what
    the sampler/trainer mismatch and its correction compare against), and why it ended."""

    tokens: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] fp32
    sampler_logprobs: torch.Tensor  # [R] fp32
    # "stop" (a stop id was sampled, and kept as the last token) or "length"; a multi-turn branch
    # (agents/turns.py): "stop" (its environment said done), "length" (the budget) or "turns" (max_turns)
    finish_reason: str
    # SamplingSettings(record_routing=True): by MoE layer, the experts [R, top_k] each decode step sent its input
    # token to (the inputs a replay feeds: the prompt's last token, then the response but its last token); uint8 up
    # to 256
    routing: dict[int, torch.Tensor] | None = None
    # a multi-turn branch (agents/turns.py): bool [R], True where the model wrote the token (False on the
    # environment's observation tokens, whose sampler log-prob is NaN); None: every token is the model's
    mask: torch.Tensor | None = None
    turns: int = 1  # the turns the model wrote (a turn ends with a stop id, or at the budget)


@dataclass(frozen=True)
class SamplingSettings:
    """How a run samples its answers (the same for every group of the run): the decode length, the distribution
    (`temperature` 0 is greedy; `top_k` 0 and `top_p` 1 filter nothing), the ids that end an answer, and whether
    each answer's MoE routing is recorded (routing replay)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    record_routing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))  # a list given stays hashable and comparable


@dataclass(frozen=True)
class Draw:
    """One call's share of a group: `n` answers, the first being branch `first_branch` of the group, drawn with
    `seed` (branch i from `seed + i`, so that data-parallel slices together draw what one call would; None: a
    fresh random seed)."""

    n: int
    seed: int | None = None
    first_branch: int = 0


@dataclass(frozen=True)
class DecodeOptions:
    """How the decode runs, not what it draws (the same tokens up to float rounding): how often it asks whether
    every branch stopped, and torch.compile (`compile`: True for inductor, or a backend's name; `static_shapes`:
    one graph for all steps). See `rollout`."""

    stop_check_every: int = 8
    compile: bool | str = False
    static_shapes: bool = False


def sample_no_sync(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [n, V], row i drawn with `generators[i]`, without waiting for the device:
    argmax(p / E) with E ~ Exp(1) picks token j with probability p_j (the exponential race; gpt-fast's
    `multinomial_sample_one_no_sync`), where `torch.multinomial` synchronises with the host on CUDA."""
    race = torch.empty_like(probs)
    for row, g in zip(race, generators):
        row.exponential_(generator=g)
    return (probs / race).argmax(-1)


def compiled_decoder(model: PrefixLM, backend: str = "inductor", static_shapes: bool = False) -> nn.Module:
    """`model`'s forward under torch.compile, for decode steps. The graphs are cached by torch (on the forward's
    code, under guards), so a new wrapper per rollout compiles nothing the last one did.

    The dynamic decode grows the branches' own tokens by one each step and moves the position, so sizes are
    symbolic from the first call: a decode of any length compiles at most three graphs (tested). The static decode
    (`static_shapes`) has the same shapes every step and the position on the device: one graph, which inductor
    records as a CUDA graph and replays each step ("reduce-overhead"; on a CPU it just runs the graph). The
    collectives of a sequence-parallel group break the graph there, which costs speed, not correctness.
    """
    if static_shapes and backend == "inductor":
        return torch.compile(model, dynamic=False, mode="reduce-overhead")
    return torch.compile(model, dynamic=not static_shapes, backend=backend)


def _filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling distribution's logits [n, V]: tempered, then top-k, then nucleus (top-p) filtered."""
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def rollout(
    model: PrefixLM,
    state: PrefixState,
    settings: SamplingSettings,
    draw: Draw,
    *,
    parallel: SequenceGroup = ONE_RANK,
    decode: DecodeOptions = DecodeOptions(),
) -> list[Sample]:
    """Generate `draw.n` responses to the captured prompt, sampled as `settings` says.

    All branches decode in one batch: attention layers read the one shared prefix state plus each branch's own
    tokens (merged by log-sum-exp; the prefix is never copied per branch); recurrent layers get a per-branch copy
    of their fixed-size state. Branch i samples with its own generator seeded `draw.seed + draw.first_branch + i`,
    so a branch's tokens do not depend on the others, and data-parallel groups that each sample a slice of a GRPO
    group (`first_branch`: the slice's first index) together draw what one call would. `temperature == 0` is
    greedy. Sampling never waits for the device, and whether every branch has stopped is asked every
    `decode.stop_check_every` tokens. Over a `parallel` group, every rank of the group passes its shard of the
    state and the same arguments (a seed included), and gets the same samples.

    `decode.compile`: run each decode step's forward under torch.compile (`compiled_decoder`): True for inductor,
    or a backend's name. The first call of a model pays the compilation (about a minute of CPU); the tokens drawn
    are the same as without it up to the kernels' float rounding. `decode.static_shapes`: each step reads the
    branches' whole preallocated own-token buffers behind a mask, at a position kept on the device, so all steps
    are one graph (with inductor on CUDA, replayed as a CUDA graph); the same tokens up to rounding, for a little
    more attention work over the not yet written rows (at most `max_new_tokens` of them, against a prefix of
    millions).

    `settings.record_routing` (MoE routing replay, engine/routing.py): each sample's `routing` holds the experts
    every decode step routed its input token to, which a replay of the sample then takes instead of re-routing.
    """
    check_state(model, state, parallel)
    n, seed, first_branch = draw.n, draw.seed, draw.first_branch
    max_new_tokens, temperature, top_p, top_k = (settings.max_new_tokens, settings.temperature, settings.top_p,
                                                 settings.top_k)
    stop_ids, record_routing = settings.stop_ids, settings.record_routing
    stop_check_every, compile, static_shapes = decode.stop_check_every, decode.compile, decode.static_shapes
    if stop_check_every < 1:
        raise ValueError(f"stop_check_every must be >= 1, got {stop_check_every}")
    if n < 1 or max_new_tokens < 1 or first_branch < 0:
        raise ValueError(f"rollout needs n >= 1, max_new_tokens >= 1 and first_branch >= 0, got n={n}, "
                         f"max_new_tokens={max_new_tokens}, first_branch={first_branch}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"bad sampling parameters: temperature={temperature} (>= 0), top_p={top_p} (0, 1], top_k={top_k} (>= 0)")
    cfg = model.config
    if state.length + max_new_tokens > cfg.max_positions:
        raise ValueError(cfg.positions_error(f"prompt ({state.length + 1:,}) + max_new_tokens ({max_new_tokens:,})",
                                             state.length + max_new_tokens))
    bad = [s for s in stop_ids if not 0 <= s < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_ids {bad} are outside the model vocab [0, {cfg.vocab_size})")

    parallel.check_agree("rollout settings", {
        "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "stop_ids": sorted(set(stop_ids)), "stop_check_every": stop_check_every, "static_shapes": static_shapes,
        "compile": compile, "dtype": str(state.layers[0].tensors()[0].dtype),
        "record_routing": record_routing})
    p = next(model.parameters())
    forward = compiled_decoder(model, "inductor" if compile is True else compile, static_shapes) if compile else model
    device = state.prompt_ids.device
    seed = int(torch.seed()) if seed is None else seed
    # one seed for the whole group, so that every rank samples the same tokens
    seed = int(parallel.broadcast_(torch.tensor([seed % 2**63], dtype=torch.int64, device=parallel.device), 0))
    gens = [torch.Generator(device=device).manual_seed(seed + first_branch + i) for i in range(n)]
    cache = DecodeCache(model.empty_cache(n, max_new_tokens, p.dtype, p.device))
    # per-token layers: the shared state itself; fixed-size ones: a per-branch view that each step replaces
    prefix = [s.for_branches(n) for s in state.layers]
    step = torch.zeros((), dtype=torch.long, device=p.device) if static_shapes else None
    if static_shapes:
        prefix = _dense(prefix)
        for t in (t for s in cache.layers.values() for t in s.tensors()):
            t.zero_()  # the masked rows are read too (their weight is 0, and 0 x a NaN of raw memory is NaN)
        # inputs at fixed addresses: a CUDA graph reads them in place instead of copying them every step
        for t in [step, *(t for s in [*state.layers, *cache.layers.values()] for t in s.tensors())]:
            torch._dynamo.mark_static_address(t)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)

    tokens = torch.full((n, 1), state.last_token, dtype=torch.long, device=device)
    routed = []
    out_tokens, out_logps, out_sampler = [], [], []
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        logits, prefix, routing = decode_step(forward, tokens, state, prefix, cache, t if step is None else step,
                                              parallel, record_routing)
        if routing is not None:
            routed.append(routing)
        if step is not None:
            prefix = _dense(prefix)
        logp = torch.log_softmax(logits, dim=-1)
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            drawn_from = _filter_logits(logits, temperature, top_k, top_p)
            nxt = sample_no_sync(drawn_from.softmax(-1), gens)
        # the group decodes on in step only if its ranks hold the same tokens; kernels that are not bitwise
        # deterministic can make a near-tie come out differently on two GPUs: rank 0's tokens are the group's
        nxt = parallel.broadcast_(nxt, 0)
        out_tokens.append(nxt)
        out_logps.append(logp.gather(-1, nxt[:, None])[:, 0])
        if temperature == 0:
            out_sampler.append(torch.zeros_like(out_logps[-1]))  # greedy draws from a point mass
        else:  # the drawn token's logit minus the log-normaliser: no [n, V] log-softmax kept
            out_sampler.append(drawn_from.gather(-1, nxt[:, None])[:, 0] - drawn_from.logsumexp(-1))
        done = done | torch.isin(nxt, stops)
        # asking whether all rows stopped waits for the device: ask every `stop_check_every` tokens (rows that
        # stopped decode on meanwhile; what follows their stop token is cut off below)
        if (t + 1) % stop_check_every == 0 and _all_stopped(done, parallel):
            break
        tokens = nxt[:, None]
        if step is not None:
            step.add_(1)
    samples = _samples(torch.stack(out_tokens, 1), torch.stack(out_logps, 1), torch.stack(out_sampler, 1), stops)
    return _with_routing(samples, routed, parallel) if record_routing else samples


def decode_step(forward: nn.Module, tokens: torch.Tensor, state: PrefixState, prefix: list[LayerState],
                cache: DecodeCache, filled: int | torch.Tensor, parallel: SequenceGroup, record_routing: bool
                ) -> tuple[torch.Tensor, list[LayerState], dict[int, torch.Tensor] | None]:
    """One decode step of the branches' next tokens `tokens` [n, 1] after `filled` tokens of their own (for the
    static decode a device tensor): the next-token logits [n, V] (fp32), the per-branch states of `prefix`
    advanced past them, and (`record_routing`) the experts each MoE layer routed them to."""
    cache.filled = filled
    view = PrefixView(prefix, state.length, rows=state.rows, parallel=parallel)
    seg = Segment(start=state.length + filled, prefix=view, cache=cache, collect=True, record_routing=record_routing)
    logits = forward(tokens, seg)[:, -1].float()
    routing = _step_routing(seg) if record_routing else None
    return logits, [s.advance(seg.emitted[i]) for i, s in enumerate(prefix)], routing


def _dense(states: list[LayerState]) -> list[LayerState]:
    """Fixed-size states made contiguous (per-token ones as they are): the static decode's every step then passes
    the same strides (broadcast views at the first step, slices of the conv window after it), so one graph serves."""
    return [s.map(torch.Tensor.contiguous) if s.token_axis is None else s for s in states]


def _all_stopped(done: torch.Tensor, parallel: SequenceGroup) -> bool:
    """Whether every branch has stopped, in the other data-parallel groups' slices too: all groups decode the same
    number of steps, because under ZeRO-3 every step's forward gathers each layer's parameters from every rank."""
    left = (~done).sum().reshape(1)
    return int(parallel.dp_sum_(left)) == 0


def _samples(tokens: torch.Tensor, logps: torch.Tensor, sampler_logps: torch.Tensor, stops: torch.Tensor
             ) -> list[Sample]:
    samples = []
    for row, lp, slp in zip(tokens, logps, sampler_logps):
        hit = torch.isin(row, stops).nonzero()
        end = int(hit[0]) + 1 if len(hit) else row.numel()
        samples.append(Sample(row[:end].cpu(), lp[:end].cpu(), slp[:end].cpu(), "stop" if len(hit) else "length"))
    return samples


def _step_routing(seg: Segment) -> dict[int, torch.Tensor]:
    """A decode step's routing of its one input token per branch, [n, top_k] by MoE layer, copied out (a CUDA
    graph's outputs are overwritten by its next replay)."""
    return {j: ids[:, -1].clone() for j, ids in seg.routed.items()}


def _with_routing(samples: list[Sample], steps: list[dict[int, torch.Tensor]], parallel: SequenceGroup
                  ) -> list[Sample]:
    """The samples with their routing [R, top_k] by MoE layer, from each step's [n, top_k]; rank 0's on every rank
    of the group (as its tokens: a near-tie of a router may fall differently on two GPUs)."""
    layers = {j: parallel.broadcast_(torch.stack([s[j] for s in steps], 1).long(), 0).to(steps[0][j].dtype)
              for j in steps[0]} if steps else {}
    for i, sample in enumerate(samples):
        sample.routing = {j: t[i, : sample.tokens.numel()].cpu() for j, t in layers.items()}
    return samples
