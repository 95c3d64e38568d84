"""MoE routing replay (R3): the gradient is computed on the experts the rollout chose, not on a re-routing.

A routing is, by MoE decoder layer, the expert ids [tokens, top_k] of a run of tokens:
- the prompt's covers `prompt[:-1]`, the state's rows, in every MoE layer but the last decoder layer (whose MLP
  capture never runs): capture records it (or takes it) and keeps it with the state (`PrefixState.routing`, this
  rank's rows), and every recompute of the prompt's chunks routes as it says;
- a branch's covers its replayed inputs, `[prompt[-1]] + response[:-1]`: one row per response token, the experts
  of the decode step that sampled it (`SamplingSettings(record_routing=True)`, `Sample.routing`).

A router replaying a routing still weighs the experts by its own scores at those ids (normalised as usual), so it
keeps its gradient. Ids are stored in the narrowest integer dtype (`expert_id_dtype`: GLM-5's 256 experts in
uint8, 8 bytes per token and MoE layer at top-8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.common.moe import expert_id_dtype, moe_layers
from ..state import PrefixState

LayerRouting = dict[int, torch.Tensor]  # MoE decoder-layer index -> expert ids [tokens, top_k]


@dataclass(frozen=True)
class Routing:
    """The routing a GRPO step replays: the prompt's (`prompt[:-1]`, [P-1, top_k] per MoE layer) and each
    branch's ([R_i, top_k] per MoE layer); either may be None (that part is routed by the model itself, or in
    exact and detached mode, the prompt's is recorded at capture)."""

    prompt: LayerRouting | None = None
    branches: Sequence[LayerRouting | None] | None = None


def check_routing(model: torch.nn.Module, routing: LayerRouting, tokens: int, what: str, prompt: bool = False
                  ) -> LayerRouting:
    """`routing` checked against the model's MoE layers (every one of them, ids [tokens, top_k] of its experts,
    distinct in a row), in the narrowest dtype; `what` names it in errors. A `prompt`'s needs no routing of the
    last decoder layer (`prompt_moe_layers`), and one given is left out."""
    routers = prompt_moe_layers(model) if prompt else moe_layers(model)
    routing = {j: ids for j, ids in routing.items() if not prompt or j != len(model.decoder_layers) - 1}
    if set(routing) != set(routers):
        raise ValueError(f"{what} has layers {sorted(routing)}, but the model's MoE layers are {sorted(routers)}: "
                         "record it with the same model (SamplingSettings(record_routing=True), "
                         "capture(record_routing=True))")
    out = {}
    for j, ids in sorted(routing.items()):
        router = routers[j]
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{what}, layer {j}: expert ids must be integers, got {ids.dtype}")
        if tuple(ids.shape) != (tokens, router.top_k):
            raise ValueError(f"{what}, layer {j}: expected expert ids of shape ({tokens}, {router.top_k}) (tokens, "
                             f"top_k), got {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= router.experts):
            raise ValueError(f"{what}, layer {j}: expert ids must lie in [0, {router.experts}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        ranked = ids.long().sort(-1).values
        if ids.numel() and bool((ranked[:, 1:] == ranked[:, :-1]).any()):
            raise ValueError(f"{what}, layer {j}: a token names the same expert twice; each row lists top_k "
                             "distinct experts")
        out[j] = ids.to(expert_id_dtype(router.experts))
    return out


def prompt_moe_layers(model: torch.nn.Module) -> dict:
    """The MoE layers whose routing of the prompt counts: all but the last decoder layer, whose MLP never runs on
    the prompt's tokens at capture (only its mixer's state is kept), and whose output there no loss reads."""
    last = len(model.decoder_layers) - 1
    return {j: r for j, r in moe_layers(model).items() if j != last}


def empty_routing(model: torch.nn.Module, rows: int, device: torch.device | str) -> LayerRouting | None:
    """Zeros to record `rows` prompt tokens' routing into, by MoE layer (`prompt_moe_layers`); None for a model
    without such layers."""
    routers = prompt_moe_layers(model)
    if not routers:
        return None
    return {j: torch.zeros(rows, r.top_k, dtype=expert_id_dtype(r.experts), device=device) for j, r in routers.items()}


def held_routing(model: torch.nn.Module, routing: LayerRouting, state: PrefixState) -> LayerRouting:
    """The rows of the whole prompt's routing (`prompt[:-1]`) that `state` holds (a rank's shard: its blocks),
    checked, on the state's device."""
    checked = check_routing(model, routing, state.length, "the prompt's routing", prompt=True)
    positions = state.rows.positions()
    return {j: ids.index_select(0, positions).to(state.prompt_ids.device) for j, ids in checked.items()}


def batch_routing(routings: Sequence[LayerRouting | None], longest: int, device: torch.device | str
                  ) -> LayerRouting | None:
    """One replay batch's routing [B, longest, top_k] by layer, from each sequence's [T_i, top_k]: rows past a
    sequence's end, and sequences without a routing (None, or {}: a filler), are -1 (routed by the model). In
    int16 (for stored ids up to int16; a batch of GLM-5 holds 1.2 KB per token), None when no sequence has one."""
    layers = {j: (ids.shape[-1], torch.promote_types(ids.dtype, torch.int16))
              for r in routings if r for j, ids in r.items()}
    if not layers:
        return None
    out = {j: torch.full((len(routings), longest, k), -1, dtype=dtype, device=device)
           for j, (k, dtype) in layers.items()}
    for b, r in enumerate(routings):
        for j, ids in (r or {}).items():
            out[j][b, : ids.shape[0]] = ids.to(device)
    return out


def joined(prompt: LayerRouting | None, branch: LayerRouting | None, prompt_rows: int, branch_rows: int,
           device: torch.device | str) -> LayerRouting | None:
    """The routing [1, prompt_rows + branch_rows, top_k] (int64) by layer of one whole sequence, prompt[:-1] then
    a branch's inputs, as a segment takes it (naive mode's full forward): a part not given is -1 (routed by the
    model). None when neither is given."""
    parts = [(p, s, n) for p, s, n in ((prompt, 0, prompt_rows), (branch, prompt_rows, branch_rows)) if p]
    if not parts:
        return None
    layers = {j: ids.shape[-1] for p, _, _ in parts for j, ids in p.items()}
    out = {j: torch.full((1, prompt_rows + branch_rows, k), -1, dtype=torch.long, device=device)
           for j, k in layers.items()}
    for p, start, rows in parts:
        for j, ids in p.items():
            out[j][0, start : start + rows] = ids.to(device)
    return out


def check_replay(model: torch.nn.Module, routing: Routing, prompt_rows: int, responses: Sequence[torch.Tensor]
                 ) -> Routing:
    """`routing` checked against the model, a prompt of `prompt_rows` state rows and `responses` (a branch's
    routing has a row per response token; None for a branch: {}, routed by the model), in the narrowest dtype."""
    prompt = None if routing.prompt is None else \
        check_routing(model, routing.prompt, prompt_rows, "the prompt's routing", prompt=True)
    if routing.branches is None:
        return Routing(prompt, None)
    if len(routing.branches) != len(responses):
        raise ValueError(f"the routing has {len(routing.branches)} branches for {len(responses)} responses; give "
                         "one per response (None: routed by the model)")
    return Routing(prompt, [{} if r is None else check_routing(model, r, resp.numel(), f"branch {i}'s routing")
                            for i, (r, resp) in enumerate(zip(routing.branches, responses))])
