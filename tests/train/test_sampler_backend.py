"""The rollout seam (`longstraw.sampler`): the worker draws its answers from the sampler `rollout.backend` names.
A fake sampler registered here drives the worker's ops, and its answers are what the run trains on: the stored
rollout holds them and the replay + prompt ops' gradient is `grpo_backward`'s on them. An unknown backend fails in
the config, naming the accepted values."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import longstraw as ls
from longstraw.data.tokenizer import load_tokenizer
from longstraw.files import Artefact
from longstraw.rollout import Sample
from longstraw.sampler import SAMPLERS, Draw, NativeSampler, Sampler, SamplingSettings
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
    monkeypatch.setitem(SAMPLERS, "fake", lambda: sampler)
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


def test_an_unknown_backend_is_refused_naming_the_accepted_ones(tmp_path):
    with pytest.raises(ValidationError) as e:
        make_cfg(tmp_path, rollout={"backend": "vllm"})
    assert e.value.errors()[0]["msg"].endswith("rollout.backend 'vllm' is not a known sampler; accepted: native")
