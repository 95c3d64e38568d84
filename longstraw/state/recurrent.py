"""Gated DeltaNet (Qwen3.5 linear layers): causal-conv tail and delta-rule state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import FixedState


@dataclass
class RecurrentState(FixedState):
    """conv: the last kernel-1 inputs of the causal depthwise conv, [conv_dim, kernel-1] (model dtype);
    ssm: the delta-rule state, [v_heads, k_dim, v_dim] in fp32. With a batch dim in front inside a forward."""

    kind = "recurrent"
    label = "Gated DeltaNet conv+recurrent"
    grad_fields = ("conv", "ssm")

    conv: torch.Tensor
    ssm: torch.Tensor
