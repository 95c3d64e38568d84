"""A causal convolution's context over a segment: the inputs before it (from the layer's fixed-size state, or on a
split chunk from the earlier blocks) and those at its end (what the layer emits)."""

from __future__ import annotations

import torch

from .core import Segment

Tensor = torch.Tensor


def conv_tail(seg: Segment, layer: int, inputs: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """The last `width` inputs before the segment and those at its end, given the segment's inputs [B, dim, T] and
    the layer's fixed-size state (`.conv` [dim, width]; zeros at the sequence start). On a split chunk, the blocks
    before this rank's supply the first (a halo) and the chunk's last blocks the second, the same on every rank."""
    init = seg.initial_state(layer)
    b, dim, _ = inputs.shape
    start = inputs.new_zeros(b, dim, width) if init is None else init.conv.to(inputs.dtype).expand(b, -1, -1)
    if seg.split is None:
        return start, torch.cat([start, inputs], dim=-1)[..., -width:]
    mine = torch.cat([inputs.new_zeros(b, dim, width), inputs], dim=-1)[..., -width:]
    group, sizes = seg.split.group, seg.split.sizes
    tails = group.gather_blocks(mine, [b] * group.size, dim=0, autograd=True)
    ordered = [tails[r][..., width - min(width, sizes[r]):] for r in seg.split.order]
    before = [tails[r][..., width - min(width, sizes[r]):] for r in seg.split.earlier]
    return (torch.cat([start, *before], dim=-1)[..., -width:], torch.cat([start, *ordered], dim=-1)[..., -width:])
