"""The gated delta rule (Gated DeltaNet) over a segment, from the layer's fixed-size state."""

from __future__ import annotations

import torch

from ..ops.gated_delta import gated_delta_rule, split_gated_delta_rule
from .core import Segment

Tensor = torch.Tensor


def delta_rule(seg: Segment, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
               ) -> tuple[Tensor, Tensor]:
    """(o, final state) of the gated delta rule over the segment from the layer's fixed-size state (`.ssm`; zeros at
    the sequence start), see ops/gated_delta.py. On a split chunk the ranks compose their blocks."""
    init = seg.initial_state(layer)
    ssm0 = None if init is None else init.ssm.expand(q.shape[0], -1, -1, -1)
    if seg.split is None:
        return gated_delta_rule(q, k, v, g, beta, ssm0)
    return split_gated_delta_rule(q, k, v, g, beta, ssm0, seg.split.group, seg.split.order)
