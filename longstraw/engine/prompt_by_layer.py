"""Exact mode's prompt backward in layer-major order (`EngineConfig.prompt_order`; the default under ZeRO-3):
each layer runs over every prompt chunk between one all-gather of its weights and one reduce-scatter of its
gradient, instead of once per chunk.

Chunk by chunk (engine/prompt.py), a P-token prompt in chunks of c gathers every layer twice per chunk (the
recompute's forward and the backward): 2 P / c times the model's bytes per step. Layer by layer:

1. a forward without autograd over all chunks, layer by layer, keeping the inputs of every k-th layer
   (checkpoints, k ~ sqrt(layers));
2. for each group of k layers, last group first: the group's forward again from its checkpoint, without
   autograd, keeping each of its layers' inputs and each fixed-size state at every chunk start; then, last layer
   first, each layer with autograd over the chunks, last chunk first, fed with its output's gradient (from the
   layer above, same chunk), its rows' dState and its fixed-size state's gradient (from the chunk after);
3. the embeddings' backward.

The gradient is the chunk-by-chunk one: the same per-chunk graphs, cut between layers as well. Memory: (layers /
k + k) hidden states of the rank's tokens (P / C x hidden each) and one layer group's fixed-size states at every
chunk start, in place of the boundary states. Compute: about two more forwards than chunk by chunk (steps 1 and
2's recompute, against one), and 3 whole-model all-gathers per step instead of 2 P / c.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from tqdm.auto import tqdm

from ..models.protocol import PrefixLM
from ..parallel import SequenceGroup
from ..parallel.fsdp import gathered_once
from ..state import LayerState, PrefixState
from .chunks import chunk_segment
from .policy import sqrt_interval

Hold = Callable[..., AbstractContextManager]


def _run(layer, x, rope, seg, last: bool):
    """One layer over one chunk: its output (None for the last layer, which only emits its state)."""
    if last:
        layer.emit_state(x, rope, seg)
        return None
    return layer.capture(x, rope, seg)[0]


class _LayerMajor:
    """The chunks 0..count-1 of `state`, run layer by layer."""

    def __init__(self, model: PrefixLM, state: PrefixState, count: int, parallel: SequenceGroup, hold: Hold) -> None:
        self.model, self.state, self.count, self.parallel, self.hold = model, state, count, parallel, hold
        self.layers = model.decoder_layers
        p = next(model.parameters())
        self.initial = model.empty_state(0, p.dtype, p.device)  # the fixed-size states at the prompt's start
        self.fixed = [s.token_axis is None for s in state.layers]
        self.ids = [self.segment(i)[0] for i in range(count)]
        self.ropes: list = []

    def segment(self, i: int, prefix: list[LayerState] | None = None, grad: dict[int, LayerState] | None = None,
                tiled: bool = False):
        """`tiled`: the layer's MLP runs in token tiles under autograd (models/common/recompute.py)."""
        return chunk_segment(self.state, i, prefix, grad, self.parallel, checkpoint_layers=tiled)

    def embed(self) -> list[torch.Tensor]:
        with torch.no_grad(), self.hold(self.model):
            embedded = [self.model.embed(x, self.segment(i)[1]) for i, x in enumerate(self.ids)]
        self.ropes = [rope for _, rope in embedded]
        return [x for x, _ in embedded]

    def forward(self, first: int, end: int, xs: list, keep: Callable[[int], bool]) -> tuple[dict, dict]:
        """Layers first..end-1 over every chunk without autograd, from their inputs `xs` (advanced in place): the
        inputs of the layers `keep` names, and each fixed-size layer's state at every chunk start."""
        inputs, starts = {}, {}
        last = len(self.layers) - 1
        with torch.no_grad():
            for j in range(first, end):
                if keep(j):
                    inputs[j] = list(xs)
                current = list(self.state.layers)
                if self.fixed[j]:
                    current[j] = self.initial[j]
                    starts[j] = [current[j]]
                with self.hold(self.layers[j]):
                    for i in range(self.count):
                        _, seg = self.segment(i, current)
                        xs[i] = _run(self.layers[j], xs[i], self.ropes[i], seg, j == last)
                        if self.fixed[j]:
                            current[j] = seg.emitted[j].row(0)
                            starts[j].append(current[j])
        return inputs, starts

    def backward(self, j: int, inputs: list, starts: list | None, dx_out: list | None, dstate, output_grads,
                 bar) -> list[torch.Tensor]:
        """Layer j with autograd over every chunk, last chunk first; returns its inputs' gradients per chunk."""
        layer, last = self.layers[j], j == len(self.layers) - 1
        dx: list = [None] * self.count
        with self.hold(layer, backward=True) as last_backward:
            for i in range(self.count - 1, -1, -1):
                prefix = list(self.state.layers)
                leaf = None
                if starts is not None:
                    leaf = prefix[j] = starts[i].leaf()
                _, seg = self.segment(i, prefix, dstate, tiled=True)
                h = inputs[i].detach().requires_grad_()
                with torch.enable_grad():
                    out = _run(layer, h, self.ropes[i], seg, last)
                outputs = ([] if out is None else [out]) + list(seg.emitted[j].differentiable())
                grads = ([] if out is None else [dx_out[i]]) + output_grads(i, dstate[j])
                live = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
                if i == 0:
                    last_backward()  # ZeRO-3: this one reduce-scatters the layer's gradient of all chunks
                if live:
                    torch.autograd.backward(*map(list, zip(*live)))
                dx[i] = h.grad if h.grad is not None else torch.zeros_like(h)
                if leaf is not None:
                    g = leaf.leaf_grad()
                    for t in g.tensors():  # each rank's share of the chunk's starting state's gradient
                        self.parallel.sum_(t)
                    dstate[j] = g
                inputs[i] = None
                bar.update()
        return dx

    def embed_backward(self, dx: list[torch.Tensor]) -> None:
        with self.hold(self.model, backward=True) as last_backward:
            for i, x in enumerate(self.ids):
                with torch.enable_grad():
                    h, _ = self.model.embed(x, self.segment(i)[1])
                if i == len(self.ids) - 1:
                    last_backward()
                if h.requires_grad:
                    h.backward(dx[i])


def prompt_backward_by_layer(model: PrefixLM, state: PrefixState, count: int, dstate: dict[int, LayerState],
                             output_grads: Callable[[int, LayerState], list[torch.Tensor]],
                             parallel: SequenceGroup, hold: Hold = gathered_once, progress: bool = False) -> None:
    """Back-propagate dState through chunks 0..count-1 layer by layer (see the module docstring), adding into
    `param.grad` and the dState rows of those chunks. `output_grads(i, grad)` reads chunk i's emitted state's
    gradient from a layer's dState; `hold(module, backward=False)` keeps a ZeRO-3 unit gathered across the
    chunks (with `backward`, yielding what to call before the last backward, which reduces the gradient)."""
    run = _LayerMajor(model, state, count, parallel, hold)
    n_layers = len(run.layers)
    every = sqrt_interval(n_layers)
    groups = list(range(0, n_layers, every))
    xs = run.embed()
    checkpoints, _ = run.forward(0, groups[-1], xs, keep=lambda j: j % every == 0)
    checkpoints[groups[-1]] = xs
    dx = None
    with tqdm(total=count * n_layers, desc="prompt backward (layer-major)", unit="chunk-layer",
              disable=not progress, leave=False) as bar:
        for a in reversed(groups):
            b = min(a + every, n_layers)
            inputs, starts = run.forward(a, b, list(checkpoints.pop(a)), keep=lambda j: True)
            for j in range(b - 1, a - 1, -1):
                dx = run.backward(j, inputs.pop(j), starts.pop(j, None), dx, dstate, output_grads, bar)
    run.embed_backward(dx)
