"""Multi-turn rollout from one prefix state: G branches, each a conversation of model turns and environment
observations, all decoded together on the one captured prompt."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from ..engine import check_state
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..rollout import Sample, _all_stopped, _filter_logits, _with_routing, decode_step, sample_no_sync
from ..sampler import Draw, SamplingSettings
from ..segment import DecodeCache
from ..state import PrefixState
from .protocol import TurnEnv, TurnReply

# a reply's status on the wire from rank 0 of the group: what the other ranks need to do the same as rank 0
_CONTINUE, _DONE, _RAISED, _BAD = 0, 1, 2, 3


@dataclass
class _Branch:
    """The host's bookkeeping of one branch: its tokens so far, the turn the model is writing, the observation
    tokens still to feed, and how it ended."""

    count: int = 0  # tokens so far (the model's and the observations')
    turns: int = 0  # turns the model began
    turn: list[int] = field(default_factory=list)  # the model's tokens of the turn it is writing
    pending: deque[int] = field(default_factory=deque)  # observation tokens not fed yet
    closing: str | None = None  # how it ends once its pending tokens are fed (its env said done: "stop")
    finish: str | None = None


@torch.no_grad()
def rollout_turns(
    model: PrefixLM,
    state: PrefixState,
    settings: SamplingSettings,
    draw: Draw,
    envs: Sequence[TurnEnv],
    *,
    max_turns: int,
    parallel: SequenceGroup = ONE_RANK,
) -> list[Sample]:
    """`draw.n` multi-turn branches on the captured prompt, branch i talking with `envs[i]`.

    A turn is the model's tokens up to a stop id (`settings.stop_ids`, kept as the turn's last token). The turn's
    env answers it (`TurnEnv.step`) with tokens the model did not write (a tool's result, ending with the next
    assistant header), which follow it in the branch, and whether the branch is done. A branch ends "stop" when its
    env says done (the done reply's tokens follow it as far as the budget allows), "turns" when `max_turns` turns
    got no done (the last reply's tokens are dropped: no turn would read them), or "length" when its tokens (the
    model's and the observations', together at most `settings.max_new_tokens`) fill the budget; an observation
    that does not fit is cut there. A turn cut by the budget is not sent to its env. Each `Sample` holds all the
    branch's tokens, `mask` True on the model's, the model's log-prob of every token (the observations' too, at
    temperature 1), the sampler's log-prob of the model's tokens (NaN on the observations') and `turns`.

    All branches decode in one batch, one token each per step, as `rollout` does (the shared prefix read by every
    branch, recurrent layers on per-branch state, branch i sampling with the generator seeded `draw.seed +
    draw.first_branch + i`): a branch with observation tokens pending is fed the next one (forced, not sampled),
    so an observation enters only its branch's own tokens and state, never the shared prefix; a finished branch
    decodes on, and what follows its end is cut off. An observation thus costs one decode step per token, and the
    host reads every step's tokens (one device synchronisation per step, where `rollout` waits every few tokens),
    because an env must answer a turn before the step after its stop id. The envs whose turns end at the same
    step run concurrently, in threads. The decode runs eagerly (no torch.compile).

    Over a `parallel` group every rank passes its shard of the state, the same arguments and envs of the same
    branches; only rank 0 of the group calls them and broadcasts their replies, so the ranks stay in step and get
    the same samples. An env that raises, or replies with something other than token ids of the model's vocab, is
    an error naming it, on every rank.
    """
    _check(model, state, settings, draw, envs, max_turns, parallel)
    n, budget, vocab = draw.n, settings.max_new_tokens, model.config.vocab_size
    parallel.check_agree("rollout_turns settings", {
        **asdict(settings), "stop_ids": sorted(set(settings.stop_ids)), "n": n, "max_turns": max_turns,
        "dtype": str(state.layers[0].tensors()[0].dtype)})
    p = next(model.parameters())
    device = state.prompt_ids.device
    seed = int(torch.seed()) if draw.seed is None else draw.seed
    # one seed for the whole group, so that every rank samples the same tokens
    seed = int(parallel.broadcast_(torch.tensor([seed % 2**63], dtype=torch.int64, device=parallel.device), 0))
    gens = [torch.Generator(device=device).manual_seed(seed + draw.first_branch + i) for i in range(n)]
    cache = DecodeCache(model.empty_cache(n, budget, p.dtype, p.device))
    prefix = [s.for_branches(n) for s in state.layers]  # per-token layers shared, fixed-size ones per branch
    stops = set(settings.stop_ids)
    branches = [_Branch() for _ in range(n)]
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="turn-env") if parallel.rank == 0 else None

    tokens = torch.full((n, 1), state.last_token, dtype=torch.long, device=device)
    routed, out_tokens, out_logps, out_sampler, out_mask = [], [], [], [], []
    try:
        for t in range(budget):
            logits, prefix, routing = decode_step(model, tokens, state, prefix, cache, t, parallel,
                                                  settings.record_routing)
            if routing is not None:
                routed.append(routing)
            drawn_from = (None if settings.temperature == 0 else
                          _filter_logits(logits, settings.temperature, settings.top_k, settings.top_p))
            nxt = logits.argmax(-1) if drawn_from is None else sample_no_sync(drawn_from.softmax(-1), gens)
            # rank 0's tokens are the group's (a near-tie may come out differently on two GPUs)
            nxt = parallel.broadcast_(nxt, 0)
            forced = [b.pending.popleft() if b.pending else None for b in branches]
            model_wrote = torch.tensor([f is None for f in forced], device=device)
            if not model_wrote.all():
                fed = torch.tensor([0 if f is None else f for f in forced], device=device)
                nxt = torch.where(model_wrote, nxt, fed)
            out_tokens.append(nxt)
            out_logps.append(torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0])
            if drawn_from is None:  # greedy draws from a point mass
                sampler = torch.zeros_like(out_logps[-1])
            else:
                sampler = drawn_from.gather(-1, nxt[:, None])[:, 0] - drawn_from.logsumexp(-1)
            out_sampler.append(sampler.masked_fill(~model_wrote, float("nan")))
            out_mask.append(model_wrote)

            ended = _advance(branches, nxt.tolist(), forced, stops)
            if ended:  # the envs answer before the next step, which feeds their first tokens
                replies = _replies(pool, envs, ended, [branches[i].turn for i in ended], parallel, vocab)
                for i, reply in zip(ended, replies):
                    _take(branches[i], reply, budget, max_turns)
            for b in branches:
                if b.finish is None and not b.pending and (b.closing or b.count == budget):
                    b.finish = b.closing or "length"
            # every data-parallel group decodes the same number of steps (ZeRO-3 gathers layers in each forward)
            if _all_stopped(torch.tensor([b.finish is not None for b in branches], device=device), parallel):
                break
            tokens = nxt[:, None]
    finally:
        if pool is not None:
            pool.shutdown(wait=True)

    rows = zip(torch.stack(out_tokens, 1), torch.stack(out_logps, 1), torch.stack(out_sampler, 1),
               torch.stack(out_mask, 1), branches)
    samples = [Sample(tok[: b.count].cpu(), lp[: b.count].cpu(), slp[: b.count].cpu(), b.finish,
                      mask=m[: b.count].cpu(), turns=b.turns) for tok, lp, slp, m, b in rows]
    return _with_routing(samples, routed, parallel) if settings.record_routing else samples


def _check(model: PrefixLM, state: PrefixState, settings: SamplingSettings, draw: Draw, envs: Sequence[TurnEnv],
           max_turns: int, parallel: SequenceGroup) -> None:
    check_state(model, state, parallel)
    cfg = model.config
    if draw.n < 1 or settings.max_new_tokens < 1 or draw.first_branch < 0 or max_turns < 1:
        raise ValueError(f"rollout_turns needs n >= 1, max_new_tokens >= 1, first_branch >= 0 and max_turns >= 1, "
                         f"got n={draw.n}, max_new_tokens={settings.max_new_tokens}, "
                         f"first_branch={draw.first_branch}, max_turns={max_turns}")
    if len(envs) != draw.n:
        raise ValueError(f"rollout_turns got {len(envs)} envs for {draw.n} branches; pass one env per branch")
    if not settings.stop_ids:
        raise ValueError("rollout_turns needs settings.stop_ids: the ids that end a turn (e.g. the chat "
                         "format's end-of-turn token)")
    if settings.temperature < 0 or not 0 < settings.top_p <= 1 or settings.top_k < 0:
        raise ValueError(f"bad sampling parameters: temperature={settings.temperature} (>= 0), "
                         f"top_p={settings.top_p} (0, 1], top_k={settings.top_k} (>= 0)")
    if state.length + settings.max_new_tokens > cfg.max_positions:
        raise ValueError(cfg.positions_error(
            f"prompt ({state.length + 1:,}) + max_new_tokens ({settings.max_new_tokens:,})",
            state.length + settings.max_new_tokens))
    bad = [s for s in settings.stop_ids if not 0 <= s < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_ids {bad} are outside the model vocab [0, {cfg.vocab_size})")


def _advance(branches: list[_Branch], tokens: list[int], forced: list[int | None], stops: set[int]) -> list[int]:
    """Count each live branch's new token, add the model's to its turn; the branches whose turn ended (a stop id)."""
    ended = []
    for i, (b, token, f) in enumerate(zip(branches, tokens, forced)):
        if b.finish is not None:
            continue
        b.count += 1
        if f is not None:
            continue
        if not b.turn:
            b.turns += 1
        b.turn.append(token)
        if token in stops:
            ended.append(i)
    return ended


def _take(b: _Branch, reply: TurnReply, budget: int, max_turns: int) -> None:
    """What follows a branch's ended turn: its reply's tokens queued (cut to the budget), or its end."""
    b.turn = []
    if not reply.done and b.turns >= max_turns:
        b.finish = "turns"  # the reply is dropped: no turn would read it
        return
    b.pending.extend(reply.tokens[: budget - b.count])
    if reply.done:
        b.closing = "stop"


def _replies(pool: ThreadPoolExecutor | None, envs: Sequence[TurnEnv], ended: list[int], turns: list[list[int]],
             parallel: SequenceGroup, vocab: int) -> list[TurnReply]:
    """The envs' replies to the turns that just ended (branches `ended`), the same on every rank of the group:
    rank 0 calls the envs (concurrently) and broadcasts the replies, or the error of the first bad one, which every
    rank then raises."""
    k = len(ended)
    header = torch.zeros(2 * k + 1, dtype=torch.long)  # (status, length) by reply, then the error's length
    payload, exc = torch.zeros(0, dtype=torch.long), None
    if parallel.rank == 0:
        futures = [pool.submit(envs[i].step, list(turn)) for i, turn in zip(ended, turns)]
        ids, message = [], ""
        for j, (i, future) in enumerate(zip(ended, futures)):
            status, tokens, problem = _checked(future, vocab)
            if problem and not message:
                message, exc = f"envs[{i}] ({type(envs[i]).__name__}) {problem}", future.exception()
            header[2 * j], header[2 * j + 1] = status, len(tokens)
            ids += tokens
        text = list(message.encode())
        header[-1] = len(text)
        payload = torch.tensor(ids + text, dtype=torch.long)
    header = parallel.broadcast_(header.to(parallel.device), 0).cpu()
    statuses, lengths = header[:-1:2].tolist(), header[1:-1:2].tolist()
    if parallel.rank != 0:
        payload = torch.zeros(sum(lengths) + int(header[-1]), dtype=torch.long)
    if payload.numel():  # (every rank knows its size from the header)
        payload = parallel.broadcast_(payload.to(parallel.device), 0).cpu()
    payload = payload.tolist()
    failed = [s for s in statuses if s in (_RAISED, _BAD)]
    if failed:  # the first failed reply's error
        message = bytes(payload[sum(lengths):]).decode()
        raise (RuntimeError if failed[0] == _RAISED else ValueError)(message) from exc
    replies, at = [], 0
    for status, length in zip(statuses, lengths):
        replies.append(TurnReply(payload[at : at + length], done=status == _DONE))
        at += length
    return replies


def _checked(future, vocab: int) -> tuple[int, list[int], str]:
    """An env's reply as (status, token ids, problem): the problem is '' for a good reply."""
    if future.exception() is not None:
        e = future.exception()
        return _RAISED, [], (f"raised {type(e).__name__}: {e}; an env must answer every turn (a failed tool call "
                             "is an observation for the model, not an exception)")
    reply = future.result()
    if not isinstance(reply, TurnReply):
        return _BAD, [], f"returned {type(reply).__name__} from step(); it must return a TurnReply"
    try:
        ids = [operator.index(t) for t in reply.tokens]
    except TypeError:
        return _BAD, [], f"replied tokens that are not int token ids: {list(reply.tokens)[:8]}"
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        return _BAD, [], (f"replied token ids {outside[:8]} outside the model vocab [0, {vocab}); its reply must "
                          "be token ids of the model's tokenizer")
    return (_DONE if reply.done else _CONTINUE), ids, ""
