"""The worker's engine calls take the run's `EngineConfig`: naive mode's replay, its entropy pre-pass and the KL
reference's scoring run the LM head in chunks of `engine.head_chunk` tokens, as the captured modes do; and each op
runs the plan it reports."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

import longstraw.engine.policy as policy
import longstraw.models.common.decoder as decoder
from tests.train.test_train_inputs import make_cfg
from tests.train.test_worker import step_group

HEAD_CHUNK = 3  # far below the default (2**26 // vocab): a head run whole would show


@pytest.fixture
def head_chunks(monkeypatch) -> list[int]:
    """The chunk size of every chunked LM head the model runs."""
    seen: list[int] = []
    real = decoder.chunked_logprobs

    def chunked(head, hidden, targets, chunk, entropy=False):
        seen.append(chunk)
        return real(head, hidden, targets, chunk, entropy)

    monkeypatch.setattr(decoder, "chunked_logprobs", chunked)
    return seen


def test_naive_mode_and_reference_scoring_use_the_engines_head_chunk(tmp_path, head_chunks):
    cfg = make_cfg(tmp_path, mode="naive", engine={"prompt_chunk": 96, "head_chunk": HEAD_CHUNK},
                   grpo={"kl_coef": 0.1, "top_entropy_quantile": 0.5})
    w, init, state, roll, rew = step_group(cfg)
    head_chunks.clear()  # the rollout's decoding is not the engine's
    out = w.reference(init["reference_version"], state, roll, 0, 0)
    assert head_chunks and set(head_chunks) == {HEAD_CHUNK}
    assert out["plan"]["head_chunk"] == HEAD_CHUNK
    head_chunks.clear()
    ref = {"path": out["path"], "sha256": out["sha256"]}
    got = w.replay(w.weights_version, state, roll, rew, ref, 0, 0, 0, [[0, 1, 2, 3]])
    # the entropy pre-pass and the four branches' loss forwards
    assert len(head_chunks) == 8 and set(head_chunks) == {HEAD_CHUNK}
    assert got["plan"]["head_chunk"] == HEAD_CHUNK


@pytest.fixture
def distinct_plans(monkeypatch) -> None:
    """Every plan resolved gets a head chunk of its own (3, 4, 5, ...): an op running another plan than the one it
    reports shows."""
    real, chunks = policy.resolve, itertools.count(HEAD_CHUNK)
    monkeypatch.setattr(policy, "resolve", lambda *a, **kw: replace(real(*a, **kw), head_chunk=next(chunks)))


def test_naive_replay_and_reference_scoring_run_the_plan_they_report(tmp_path, head_chunks, distinct_plans):
    cfg = make_cfg(tmp_path, mode="naive", grpo={"kl_coef": 0.1})
    w, init, state, roll, rew = step_group(cfg)
    head_chunks.clear()
    out = w.reference(init["reference_version"], state, roll, 0, 0)
    assert head_chunks and set(head_chunks) == {out["plan"]["head_chunk"]}
    assert out["plan"]["checkpoint_above"] is None  # resolved as run: without autograd
    head_chunks.clear()
    ref = {"path": out["path"], "sha256": out["sha256"]}
    got = w.replay(w.weights_version, state, roll, rew, ref, 0, 0, 0, [[0, 1, 2, 3]])
    assert len(head_chunks) == 4 and set(head_chunks) == {got["plan"]["head_chunk"]}
