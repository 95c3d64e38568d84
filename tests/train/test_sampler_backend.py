"""The rollout seam (`longstraw.sampler`): the worker draws its answers from the sampler `rollout.backend` names.
A fake sampler registered here drives the worker's ops, and its answers are what the run trains on: the stored
rollout holds them and the replay + prompt ops' gradient is `grpo_backward`'s on them. A sampler registered with
`register_sampler` is built with the config's `rollout.options`. An unknown backend fails in the config, naming the
accepted values; so does an option the native sampler does not know."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import longstraw as ls
from longstraw.data.tokenizer import load_tokenizer
from longstraw.files import Artefact
from longstraw.rollout import Sample
import longstraw.sampler as sampler_module
from longstraw.sampler import SAMPLERS, Draw, NativeSampler, Sampler, SamplingSettings, register_sampler
from longstraw.train import inputs
from longstraw.train.data import prompt_ids, step_example
from longstraw.train.worker import Worker
from tests.conftest import flat_grad, rel_err
from tests.train.test_train_inputs import make_cfg
from tests.train.test_worker import ADV, replay, step_group

# answers no decode of the tiny random model would draw: lengths 1..4, the last one ending at the stop id
FAKE = [[7], [11, 12], [20, 21, 22], [30, 31, 32]]


class FakeSampler:
    """Hands out `FAKE` and remembers what it was asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[SamplingSettings, Draw]] = []

    def sample(self, model, state, settings: SamplingSettings, draw: Draw, parallel=ls.ONE_RANK) -> list[Sample]:
        self.calls.append((settings, draw))
        rows = [torch.tensor(t, dtype=torch.long) for t in FAKE[draw.first_branch: draw.first_branch + draw.n]]
        rows[-1][-1] = settings.stop_ids[0]
        return [Sample(r, torch.full((r.numel(),), -1.5), torch.full((r.numel(),), -1.25),
                       "stop" if r[-1] in settings.stop_ids else "length") for r in rows]


@pytest.fixture
def fake(monkeypatch) -> FakeSampler:
    sampler = FakeSampler()
    monkeypatch.setitem(SAMPLERS, "fake", lambda options: sampler)
    return sampler


def test_the_configured_sampler_draws_what_the_run_trains_on(tmp_path, fake):
    cfg = make_cfg(tmp_path, rollout={"backend": "fake"}, temperature=0.7, top_k=5)
    w, init, state, roll, rew = step_group(cfg)
    eos = load_tokenizer(cfg.tokenizer).eos_id
    assert fake.calls == [(SamplingSettings(max_new_tokens=5, temperature=0.7, top_p=1.0, top_k=5, stop_ids=(eos,)),
                           Draw(n=4, seed=fake.calls[0][1].seed, first_branch=0))]
    want = [torch.tensor(t) for t in FAKE]
    want[-1][-1] = eos
    stored = inputs.read_rollout(cfg, Artefact.from_json(roll))
    assert [r.tolist() for r in stored.responses] == [r.tolist() for r in want]
    assert stored.meta["finish_reasons"] == ["length", "length", "length", "stop"]

    replay(w, state, roll, rew, ([0, 1], [2, 3]))
    w.prompt(w.weights_version, state, 0, 0, 0)
    model = ls.load_model(init["checkpoint"])  # the same weights, and the fake's answers given by hand
    tok = load_tokenizer(cfg.tokenizer)
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt_ids(tok, step_example(cfg, tok, 0, 0)), want, ADV, mode="naive", config=cfg.grpo,
                     engine=cfg.engine)
    assert flat_grad(model).norm() > 0
    assert rel_err(flat_grad(w.model), flat_grad(model)) <= 1e-5


def test_the_native_sampler_is_the_default(tmp_path):
    w = Worker(make_cfg(tmp_path))
    assert isinstance(w.sampler, NativeSampler) and isinstance(w.sampler, Sampler)
    assert w.sampler.decode == ls.DecodeOptions()


class OptionsSampler(FakeSampler):
    """A fake built from options, as a server's sampler would be (its address, say)."""

    def __init__(self, options) -> None:
        super().__init__()
        self.options = options
        built.append(self)


built: list[OptionsSampler] = []


@pytest.fixture
def registry(monkeypatch) -> dict:
    """A copy of the registry for the test to register into (the real one is left as it was)."""
    monkeypatch.setattr(sampler_module, "SAMPLERS", dict(SAMPLERS))
    built.clear()
    return sampler_module.SAMPLERS


def test_a_registered_sampler_is_built_with_the_config_options_and_called(tmp_path, registry):
    register_sampler("server", OptionsSampler)
    cfg = make_cfg(tmp_path, rollout={"backend": "server", "options": {"url": "http://x:8000", "batch": 4}})
    w, *_ = step_group(cfg)
    (made,) = built
    assert w.sampler is made and made.options == {"url": "http://x:8000", "batch": 4}
    assert len(made.calls) == 1 and made.calls[0][1].n == 4  # the worker's rollout op drew from it


def test_a_name_taken_is_refused_unless_replaced(registry):
    with pytest.raises(ValueError, match="already registered as 'native'; pick another name or pass replace=True"):
        register_sampler("native", OptionsSampler)
    assert registry["native"] is NativeSampler
    register_sampler("native", OptionsSampler, replace=True)
    assert registry["native"] is OptionsSampler


def test_the_native_sampler_takes_the_decode_options(tmp_path):
    cfg = make_cfg(tmp_path, rollout={"options": {"stop_check_every": 2, "static_shapes": True}})
    assert Worker(cfg).sampler.decode == ls.DecodeOptions(stop_check_every=2, static_shapes=True)
    with pytest.raises(ValidationError) as e:
        make_cfg(tmp_path, rollout={"options": {"stop_every": 2}})
    assert e.value.errors()[0]["msg"].endswith("rollout.options ['stop_every'] are not options of the native "
                                               "sampler; accepted: stop_check_every, compile, static_shapes")
    with pytest.raises(ValidationError, match="stop_check_every is an int >= 1"):
        make_cfg(tmp_path, rollout={"options": {"stop_check_every": 0}})


def test_an_unknown_backend_is_refused_naming_the_accepted_ones(tmp_path):
    with pytest.raises(ValidationError) as e:
        make_cfg(tmp_path, rollout={"backend": "vllm"})
    assert e.value.errors()[0]["msg"].endswith("rollout.backend 'vllm' is not a known sampler; accepted: native, "
                                               "or a factory of your own as 'module:function'")


def make_options_sampler(options) -> OptionsSampler:
    """A factory a config names as `module:function` (what torchrun's ranks import by name)."""
    return OptionsSampler(options)


def not_a_sampler(options) -> object:
    return object()


def test_a_factory_named_module_function_is_built_with_the_options_and_called(tmp_path):
    built.clear()
    cfg = make_cfg(tmp_path, rollout={"backend": f"{__name__}:make_options_sampler", "options": {"url": "u"}})
    w, *_ = step_group(cfg)
    (made,) = built
    assert w.sampler is made and made.options == {"url": "u"} and len(made.calls) == 1


def test_a_named_factory_that_is_missing_or_makes_no_sampler_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="no module named 'no_such_samplers'; check the name and that the "
                                              "module is importable"):
        make_cfg(tmp_path, rollout={"backend": "no_such_samplers:make"})
    with pytest.raises(ValidationError, match="has no attribute 'nope'"):
        make_cfg(tmp_path, rollout={"backend": f"{__name__}:nope"})
    cfg = make_cfg(tmp_path, rollout={"backend": f"{__name__}:not_a_sampler"})
    with pytest.raises(TypeError, match="made a object, which has no sample\\(\\) method"):
        Worker(cfg)
