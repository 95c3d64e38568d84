"""The worker keeps a rollout's sampler log-probs (each token's log-prob under the tempered, filtered distribution
it was drawn from) with its answers: resident after sampling, stored for a resume, and handed to the loss
(`Branches.group`) with each answer's truncation; a rollout stored before they were kept still replays, unless the
loss needs them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import longstraw.train.worker as worker_module
from longstraw.engine import Branches
from longstraw.files import Artefact
from longstraw.store import save_rollout
from longstraw.train import inputs
from longstraw.train.worker import Worker
from tests.train.test_train_inputs import make_cfg
from tests.train.test_worker import step_group


class _Stop(Exception):
    """Raised by the spy in place of the loss: what the replay handed it is all these tests look at."""


@pytest.fixture
def group_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every `Branches.group` call the worker makes (the call then stops the replay)."""
    calls: list[dict] = []

    def group(*args, **kwargs):
        calls.append(kwargs)
        raise _Stop

    monkeypatch.setattr(worker_module, "Branches", SimpleNamespace(group=group))
    return calls


def _replay(w: Worker, state: dict, roll: dict, rew: dict) -> None:
    with pytest.raises(_Stop):
        w.replay(w.weights_version, state, roll, rew, None, 0, 0, 0, [[0, 1, 2, 3]])


def test_sampler_logprobs_are_resident_stored_and_handed_to_the_loss(tmp_path, group_calls):
    cfg = make_cfg(tmp_path, temperature=0.7, top_k=50)
    w, _, state, roll, rew = step_group(cfg)
    stored = inputs.read_rollout(cfg, Artefact.from_json(roll))
    assert stored.sampler_logprobs is not None and len(stored.sampler_logprobs) == 4
    resident = w._rollout.value
    for kept, read, tokens, logps in zip(resident.sampler_logprobs, stored.sampler_logprobs, stored.responses,
                                         stored.logprobs, strict=True):
        assert torch.equal(kept, read) and read.shape == tokens.shape and read.dtype == torch.float32
        assert not torch.allclose(read, logps, atol=1e-3)  # tempered and filtered, not the temperature-1 ones
    assert resident.finish_reasons == stored.meta["finish_reasons"]

    _replay(w, state, roll, rew)
    fresh = Worker(cfg)  # a resumed job: nothing resident, read from the store
    fresh.start()
    _replay(fresh, state, roll, rew)
    for kwargs in group_calls:
        assert all(torch.equal(a, b) for a, b in zip(kwargs["sampler_logprobs"], stored.sampler_logprobs,
                                                     strict=True))
        assert kwargs["truncated"] == [r == "length" for r in stored.meta["finish_reasons"]]
        assert kwargs["old_logprobs"] is None  # one epoch: on-policy ratios


@pytest.mark.parametrize("grpo", [{"rollout_correction": "token_truncate"}, {"off_policy_mask_threshold": 0.5}])
def test_a_rollout_stored_without_them_fails_a_loss_that_needs_them(tmp_path, grpo, group_calls, monkeypatch):
    cfg = make_cfg(tmp_path, grpo=grpo)
    _, _, state, roll, rew = step_group(cfg)
    old = inputs.read_rollout(cfg, Artefact.from_json(roll))
    # the same rollout as an older longstraw stored it: no sampler log-probs
    roll = {"path": roll["path"], "sha256": worker_module.manifest_digest(
        save_rollout(roll["path"], old.responses, old.logprobs, old.meta))}
    fresh = Worker(cfg)
    fresh.start()
    with monkeypatch.context() as real, pytest.raises(ValueError, match=r"needs sampler_logprobs .* a rollout stored by an older longstraw has "
                                         r"none: delete it so that its step samples it again\); pass them, or set "
                                         r"rollout_correction: off"):
        real.setattr(worker_module, "Branches", Branches)  # the group's own check (engine/branches.py)
        fresh.replay(fresh.weights_version, state, roll, rew, None, 0, 0, 0, [[0, 1, 2, 3]])
    assert not group_calls

    off = make_cfg(tmp_path)  # the same run directory, a loss that does not need them
    fresh = Worker(off)
    fresh.start()
    _replay(fresh, state, roll, rew)
    assert group_calls[-1]["sampler_logprobs"] is None
    assert group_calls[-1]["truncated"] == [r == "length" for r in old.meta["finish_reasons"]]
