"""The MoE's side of routing replay: a router told which experts to take weighs them as the formula written here
says (its sigmoid scores at those ids, normalised, scaled), rows of -1 keep the router's own choice, and a layer
recomputed under activation checkpointing routes as its forward did even when its router would now choose
otherwise."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls
from longstraw.models.common.moe import TopkRouter, expert_id_dtype, moe_layers
from longstraw.segment import Segment
from tests.conftest import GLM, flat_grad, rel_err


def _router() -> TopkRouter:
    torch.manual_seed(0)
    r = TopkRouter(hidden=16, experts=8, top_k=2, groups=4, topk_groups=2, norm_topk=True, scaling=2.5).double()
    with torch.no_grad():
        r.weight.normal_()
    return r


def test_a_replayed_routing_is_weighed_by_the_routers_scores():
    r = _router()
    x = torch.randn(5, 16, dtype=torch.float64)
    forced = torch.tensor([[0, 7], [3, 1], [5, 6], [2, 4], [7, 0]])
    w, idx = r(x, lambda chosen: forced)
    assert torch.equal(idx, forced)
    scores = torch.sigmoid(x @ r.weight.T)
    picked = torch.stack([scores[i, forced[i]] for i in range(5)])
    torch.testing.assert_close(w, 2.5 * picked / picked.sum(-1, keepdim=True), rtol=1e-12, atol=0)
    w.sum().backward()  # the router keeps its gradient
    assert float(r.weight.grad.abs().max()) > 0


def test_segment_replays_rows_it_has_and_leaves_minus_one_rows_to_the_router():
    chosen = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    seg = Segment(routing={2: torch.tensor([[[7, 0], [-1, -1], [4, 2]]])}, record_routing=True)
    got = seg.route(2, chosen)
    assert got.tolist() == [[[7, 0], [3, 4], [4, 2]]]
    assert torch.equal(seg.routed[2], got)
    assert torch.equal(seg.route(1, chosen, torch.uint8), chosen)  # a layer it has no routing for
    assert seg.routed[1].dtype == torch.uint8 and torch.equal(seg.routed[1].long(), chosen)  # kept narrow
    with pytest.raises(ValueError, match="one row of expert ids per token"):
        Segment(routing={2: torch.zeros(1, 2, 2, dtype=torch.long)}).route(2, chosen)


def test_expert_id_dtype():
    assert expert_id_dtype(256) == torch.uint8
    assert expert_id_dtype(257) == torch.int16
    assert expert_id_dtype(2**15 + 1) == torch.int32


def test_checkpointed_recompute_routes_as_its_forward():
    """The routers' bias moves between the forward and the backward (as a nondeterministic kernel may flip a
    near-tie in the recompute): the checkpointed backward still differentiates the forward's routing, so its
    gradient is the unmoved model's."""
    torch.manual_seed(0)
    model = ls.build_model(GLM, dtype=torch.float64)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(0))

    def logp_sum(seg: Segment) -> torch.Tensor:
        return model.token_logprobs(ids[:, :-1], ids[:, 1:], seg).sum()

    model.zero_grad(set_to_none=True)
    logp_sum(Segment()).backward()
    want = flat_grad(model)
    model.zero_grad(set_to_none=True)
    out = logp_sum(Segment(checkpoint_layers=True))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_layers(model).values():
            router.e_score_correction_bias.add_(torch.randn(8, generator=g, dtype=torch.float64))
    out.backward()
    assert rel_err(flat_grad(model), want) <= 1e-12
    # the control: a forward with the moved bias routes elsewhere
    model.zero_grad(set_to_none=True)
    logp_sum(Segment()).backward()
    assert rel_err(flat_grad(model), want) > 1e-3
