"""Parameter gradients added up over ranks that each did a share of the work: divide what `param.grad` held
before by the rank count, let each rank add its share, then sum over the ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..models.protocol import PrefixLM
from ..parallel import SequenceGroup, gradient_replicas, is_sharded


@contextmanager
def divided_then_summed(params: list[torch.nn.Parameter], count: int, sum_: Callable[[torch.Tensor], torch.Tensor],
                        device: torch.device | None = None) -> Iterator[None]:
    """Within, each of `count` ranks adds its own share to `param.grad`; on leaving the gradients are summed over
    them (`sum_`, in place), so that every rank holds the whole. What `param.grad` held before (the same on every
    rank) is divided by `count` first, so the sum counts it once. With `device`, a parameter that some rank's share
    left without a gradient still takes part in the sum on every rank (one more collective, on `device`, to learn
    which); without, every rank has the same parameters with a gradient."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(count)
    yield
    present = [p.grad is not None for p in params]
    if device is not None:
        present = sum_(torch.tensor(present, dtype=torch.int64, device=device)).tolist()
    for p, anywhere in zip(params, present):
        if anywhere:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            sum_(p.grad)


@contextmanager
def gradients_summed_over_group(model: PrefixLM, parallel: SequenceGroup, split: bool = True) -> Iterator[None]:
    """Within, when the ranks of a sequence-parallel group each do their share of the work (`split`), each rank's
    parameter gradients are its own share: on leaving they are summed over the group (`divided_then_summed`);
    FSDP sums over all ranks itself and is told these gradients are not replicated."""
    if not split or parallel.size == 1:
        yield
    elif is_sharded(model):
        with gradient_replicas(model, 1, then=parallel.size):
            yield
    else:
        with divided_then_summed([p for p in model.parameters() if p.requires_grad], parallel.size, parallel.sum_,
                                 parallel.device):
            yield


@contextmanager
def gradients_summed_over_dp(model: PrefixLM, parallel: SequenceGroup) -> Iterator[None]:
    """Within, each data-parallel group replays its own branches; on leaving their gradients are summed over the
    groups (`divided_then_summed`), unless FSDP does it itself while it reduce-scatters, or there is one group."""
    if is_sharded(model) or parallel.dp_size == 1:
        yield
    else:
        with divided_then_summed(list(model.parameters()), parallel.dp_size, parallel.dp_sum_):
            yield


def reduce_gradients(model: PrefixLM, parallel: SequenceGroup) -> None:
    """Sum the parameter gradients over the data-parallel groups (each replayed its own branches). FSDP does it
    itself while it reduce-scatters, and one group has nothing to sum."""
    if is_sharded(model) or parallel.dp_size == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            parallel.dp_sum_(p.grad)
