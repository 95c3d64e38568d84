"""A rollout's answers on the worker's ranks: `Answers`, what a group's reference and replay ops take of its
rollout, as every rank holds it (rank 0's values, the same as a read of the store gives); the gather of the
data-parallel groups' sampled slices; the routing a replay takes from them (MoE routing replay)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..engine.routing import Routing, check_replay, prompt_moe_layers
from ..files import Artefact
from ..rollout import Sample
from ..state import PrefixState
from ..store import StoredRollout
from .spmd import Ranks


class Answers(NamedTuple):
    """What a group's reference and replay ops take of its rollout (rank 0's values, as the store holds them): the
    answers' token ids, their log-probs at temperature 1, their log-probs under the distribution the sampler drew
    them from (None: a rollout stored before those were kept), why each ended ("stop" or "length"; an agent's
    branch also "turns"), each one's MoE routing: by MoE layer, the experts [tokens, top_k] (None: not recorded),
    and each one's bool mask, True where the model wrote the token (None: every token is the model's)."""

    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    sampler_logprobs: list[torch.Tensor] | None
    finish_reasons: list[str]
    routing: list[dict[int, torch.Tensor]] | None = None
    masks: list[torch.Tensor] | None = None

    @classmethod
    def stored(cls, got: StoredRollout) -> "Answers":
        """The answers of a rollout read from the store."""
        return cls(got.responses, got.logprobs, got.sampler_logprobs, got.meta["finish_reasons"], got.routing,
                   got.masks)


def gather_samples(ranks: Ranks, samples: list[Sample]) -> list[Sample]:
    """Every data-parallel group's samples, in branch order (JSON: fp32 log-probs round-trip exactly, and the NaN
    sampler log-probs of an agent's observation tokens too)."""
    mine = [[s.tokens.tolist(), s.logprobs.tolist(), s.sampler_logprobs.tolist(), s.finish_reason,
             None if s.routing is None else {str(j): ids.tolist() for j, ids in s.routing.items()},
             None if s.mask is None else s.mask.tolist(), s.turns] for s in samples]
    fp32 = lambda values: torch.tensor(values, dtype=torch.float32)  # noqa: E731
    # expert ids in the dtype this rank's own samples hold them in (every group records alike)
    dtypes = {str(j): ids.dtype for j, ids in (samples[0].routing or {}).items()}
    experts = lambda routed: {int(j): torch.tensor(v, dtype=dtypes[j]) for j, v in routed.items()}  # noqa: E731
    return [Sample(torch.tensor(t, dtype=torch.long), fp32(lp), fp32(slp), reason,
                   None if routed is None else experts(routed), None if mask is None else torch.tensor(mask),
                   turns)
            for t, lp, slp, reason, routed, mask, turns in gather_slices(ranks, mine)]


def gather_slices(ranks: Ranks, mine: list) -> list:
    """Every data-parallel group's list (JSON), as rank 0 of each sequence-parallel group holds it, joined in
    branch order."""
    parallel = ranks.parallel
    got = ranks.gather({"dp": parallel.dp_rank, "sp": parallel.rank, "items": mine})
    return [x for r in sorted((r for r in got if r["sp"] == 0), key=lambda r: r["dp"]) for x in r["items"]]


def as_rank0_stored(ranks: Ranks, stored: Artefact | None, lists: list[list[torch.Tensor]]
                    ) -> tuple[Artefact, list[list[torch.Tensor]]]:
    """Rank 0's artefact (`stored`, None on the others) and rank 0's values of the CPU tensors it stored, on every
    rank: what a read of the store would give each of them (a GPU's kernels may differ by rank in the last bit).
    JSON round-trips every float dtype exactly."""
    if not ranks.distributed:
        return stored, lists
    got = ranks.broadcast({"artefact": stored.to_json(), "lists": [[t.tolist() for t in ts] for ts in lists]}
                          if ranks.leader else None)
    return Artefact.from_json(got["artefact"]), [[torch.tensor(v, dtype=t.dtype) for v, t in zip(vs, ts)]
                                                 for vs, ts in zip(got["lists"], lists)]


def sampled_answers(ranks: Ranks, stored: Artefact | None, samples: list[Sample], with_routing: bool
                    ) -> tuple[Artefact, Answers]:
    """The answers of a rollout just sampled, as the store keeps them (rank 0 stored them as `stored`), on every
    rank; `with_routing`: the samples recorded their MoE routing."""
    tokens = [s.tokens.to(torch.int64).cpu() for s in samples]
    logps = [s.logprobs.float().cpu() for s in samples]
    sampler = [s.sampler_logprobs.float().cpu() for s in samples]
    # the routing as one list of tensors per MoE layer (the store's values: its integer ids, in their dtype)
    layers = sorted(samples[0].routing) if with_routing else []
    by_layer = [[s.routing[j].cpu() for s in samples] for j in layers]
    # an agent's masks: where the model wrote (None: a one-turn answer, all of it the model's)
    masked = samples[0].mask is not None
    masks = [[s.mask.cpu() for s in samples]] if masked else []
    stored, (tokens, logps, sampler, *rest) = as_rank0_stored(ranks, stored,
                                                              [tokens, logps, sampler, *masks, *by_layer])
    masks, by_layer = (rest[0], rest[1:]) if masked else (None, rest)
    routing = ([{j: ids[i] for j, ids in zip(layers, by_layer)} for i in range(len(samples))] if with_routing
               else None)
    # finish reasons follow from the tokens (a stop id last or not, the envs' replies, which rank 0 broadcast),
    # and every rank holds rank 0's tokens
    return stored, Answers(tokens, logps, sampler, [s.finish_reason for s in samples], routing, masks)


def replayed_routing(model: nn.Module, answers: Answers, rollout: dict, state: dict, prefix: PrefixState
                     ) -> list[dict[int, torch.Tensor]]:
    """The answers' routing (MoE routing replay), checked against the model; a rollout or a state stored without
    theirs (by an older longstraw, or a run without the option) cannot be replayed as sampled."""
    if answers.routing is None:
        raise ValueError(f"the rollout at {rollout['path']} was stored without its MoE routing, which "
                         "moe_routing_replay replays: delete it so that its step samples it again, or set "
                         "moe_routing_replay: false")
    if prefix.routing is None and prompt_moe_layers(model):
        raise ValueError(f"the prefix state at {state['url']} was captured without its MoE routing, which "
                         "moe_routing_replay keeps with the state: delete it so that its step captures it again, "
                         "or set moe_routing_replay: false")
    return list(check_replay(model, Routing(branches=answers.routing), prefix.length, answers.responses).branches)
