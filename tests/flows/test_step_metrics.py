"""A step's sampler/trainer mismatch metrics (`flows.train._sampler_mismatch`, part of every step's `_metrics`:
tests/flows/test_train_flow.py sees them in MLflow) from the replays' sums, against the per-token means written
out here."""

from __future__ import annotations

import pytest

from flows.train import _sampler_mismatch
from longstraw.train.config import TrainConfig
from tests.flows.test_train_flow import config


def _step(tmp_path, replays: list[dict], **grpo) -> dict:
    cfg = TrainConfig.model_validate(config(tmp_path, grpo=grpo))
    return _sampler_mismatch(cfg, replays)


def test_sampler_mismatch_is_averaged_over_the_compared_tokens(tmp_path):
    # two replay tasks of 3 and 5 sampled tokens: |d| sums 0.3 and 0.5 (max 0.2, 0.4), k3 sums 0.03 and 0.07,
    # correction weights summing to 2.7 and 5.5
    replays = [dict(mismatch_abs_sum=0.3, mismatch_abs_max=0.2, mismatch_kl_sum=0.03, sampler_tokens=3,
                    correction_weight_sum=2.7),
               dict(mismatch_abs_sum=0.5, mismatch_abs_max=0.4, mismatch_kl_sum=0.07, sampler_tokens=5,
                    correction_weight_sum=5.5)]
    m = _step(tmp_path, replays, rollout_correction="token_truncate")
    assert m["sampler_logp_diff_mean"] == pytest.approx(0.8 / 8)
    assert m["sampler_logp_diff_max"] == 0.4
    assert m["sampler_kl"] == pytest.approx(0.1 / 8)
    assert m["correction_weight_mean"] == pytest.approx(8.2 / 8)
    off = _step(tmp_path, replays)  # no correction: the weight is not a metric of the step
    assert "correction_weight_mean" not in off and off["sampler_kl"] == m["sampler_kl"]


def test_no_mismatch_metrics_when_nothing_was_compared(tmp_path):
    """Replays of a rollout stored without the sampler's log-probs compare no token (their sums are 0, or absent):
    the step has no mismatch metrics, rather than a mismatch of 0."""
    zeros = dict(mismatch_abs_sum=0.0, mismatch_abs_max=0.0, mismatch_kl_sum=0.0, sampler_tokens=0.0,
                 correction_weight_sum=0.0)
    for replays in ([zeros], [{}]):
        assert _step(tmp_path, replays) == {}
    # one task compared tokens, the other (its answers' sums are 0) did not: the mean runs over the compared ones
    m = _step(tmp_path, [zeros, dict(zeros, mismatch_abs_sum=0.6, mismatch_abs_max=0.3, sampler_tokens=4)])
    assert m["sampler_logp_diff_mean"] == pytest.approx(0.15) and m["sampler_logp_diff_max"] == 0.3
