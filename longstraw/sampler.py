"""The rollout seam: a `Sampler` draws a GRPO group's answers from a captured prefix state. The training worker
calls the sampler its run config names (`rollout.backend`, built with the config's `rollout.options`), never a
sampling function directly, so that another sampler (an inference server such as vLLM or SGLang) plugs in by
implementing `Sampler.sample` and registering a factory of it with `register_sampler`.

One implementation today: `NativeSampler`, longstraw's own batched decode on the shared prefix (`rollout.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, Protocol, runtime_checkable

from .models.protocol import PrefixLM
from .named import load_named
from .parallel import ONE_RANK, SequenceGroup
from .rollout import DecodeOptions, Draw, Sample, SamplingSettings, rollout
from .state import PrefixState

@runtime_checkable
class Sampler(Protocol):
    """Draws answers to the prompt held by a prefix state. Over a `parallel` group every rank passes its shard of the
    state and the same arguments, and gets the same samples. Each `Sample` carries its tokens, their log-probs at
    temperature 1, their log-probs under the distribution they were drawn from, its finish reason and (with
    `record_routing`) its MoE routing."""

    def sample(self, model: PrefixLM, state: PrefixState, settings: SamplingSettings, draw: Draw,
               parallel: SequenceGroup = ONE_RANK) -> list[Sample]: ...


# A sampler from its options (the run config's `rollout.options`); it refuses options it does not know.
SamplerFactory = Callable[[Mapping[str, Any]], Sampler]


class NativeSampler:
    """longstraw's decode: every branch of the draw in one batch on the one shared prefix state (`rollout`). Its
    options are `DecodeOptions`' fields (stop_check_every, compile, static_shapes)."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        options = dict(options or {})
        known = [f.name for f in fields(DecodeOptions)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"rollout.options {unknown} are not options of the native sampler; "
                             f"accepted: {', '.join(known)}")
        self.decode = DecodeOptions(**options)
        d = self.decode
        if not (type(d.stop_check_every) is int and d.stop_check_every >= 1 and isinstance(d.compile, bool | str)
                and isinstance(d.static_shapes, bool)):
            raise ValueError(f"bad rollout.options for the native sampler: {options}; stop_check_every is an int >= 1, "
                             "compile true, false or a torch.compile backend's name, static_shapes true or false")

    def sample(self, model: PrefixLM, state: PrefixState, settings: SamplingSettings, draw: Draw,
               parallel: SequenceGroup = ONE_RANK) -> list[Sample]:
        return rollout(model, state, settings, draw, parallel=parallel, decode=self.decode)


# The samplers a run config may name (`rollout.backend`), each by its factory (`register_sampler` adds one).
SAMPLERS: dict[str, SamplerFactory] = {"native": NativeSampler}


def register_sampler(name: str, factory: SamplerFactory, *, replace: bool = False) -> None:
    """Make `factory` the sampler a run config names `name` (`rollout.backend`); the worker calls it with the
    config's `rollout.options`. A name already registered is refused unless `replace`."""
    if name in SAMPLERS and not replace:
        raise ValueError(f"a sampler is already registered as {name!r}; pick another name or pass replace=True")
    SAMPLERS[name] = factory


def accepted_backends() -> str:
    return ", ".join(sorted(SAMPLERS))


def check_backend(name: str) -> str:
    """`name` if a sampler is registered under it, or if it names a factory as "module:function" that imports now
    (every rank of a torchrun job imports it by that name: no registration in one process needed); else a one-line
    error naming the accepted values."""
    _factory(name)
    return name


def _factory(name: str) -> SamplerFactory:
    if ":" in name:
        return load_named(name, "rollout.backend", "my_samplers:make_sampler", "factory(options: dict) -> Sampler")
    if name not in SAMPLERS:
        raise ValueError(f"rollout.backend {name!r} is not a known sampler; accepted: {accepted_backends()}, or a "
                         "factory of your own as 'module:function'")
    return SAMPLERS[name]


def build_sampler(name: str, options: Mapping[str, Any] | None = None) -> Sampler:
    """The sampler `name` (`rollout.backend`) gives, built with `options` (`rollout.options`)."""
    sampler = _factory(name)(dict(options or {}))
    if not isinstance(sampler, Sampler):
        raise TypeError(f"rollout.backend {name!r} made a {type(sampler).__name__}, which has no sample() method; "
                        "a sampler factory returns an object with sample(model, state, settings, draw, parallel)")
    return sampler
