"""Reward registry, built-in rewards, user rewards as module:function, and failure handling."""

from __future__ import annotations

import logging
import math

import pytest

from longstraw.grpo.rewards import compute_rewards, get_reward, register_reward
from longstraw.problems import PROBLEMS


@pytest.mark.parametrize("text,answer,expected", [
    ("42", "42", 1.0),
    ("  42\n", "42", 1.0),
    ("1,000", "1000", 1.0),
    ("1000.0", "1,000", 1.0),
    ("1000.0", 1000, 1.0),
    ("The answer is 7 apples.", "7", 1.0),
    ("-3", "-3", 1.0),
    ("3.50", "3.5", 1.0),
    ("42.", "42", 1.0),
    ("43", "42", 0.0),
    ("4.2", "42", 0.0),
    ("1,0000", "10000", 0.0),
    ("no number here", "1", 0.0),
    ("", "1", 0.0),
])
def test_number_match(text, answer, expected):
    assert get_reward("number_match")({"answer": answer}, text) == expected


def test_exact_and_regex_match():
    exact = get_reward("exact_match")
    assert exact({"answer": "Paris"}, "  Paris\n") == 1.0
    assert exact({"answer": "Paris"}, "paris") == 0.0
    assert exact({"answer": "Paris"}, "Paris, France") == 0.0
    regex = get_reward("regex_match")
    assert regex({"pattern": r"\bfox(es)?\b"}, "two foxes ran") == 1.0
    assert regex({"pattern": r"^\d+$"}, "12a") == 0.0
    with pytest.raises(KeyError, match="pattern"):
        regex({"answer": "x"}, "x")


def test_task_verifiers_are_rewards():
    for name, task in PROBLEMS.items():
        assert get_reward(name) is task.verify
    assert get_reward("needle-count")({"answer": "4"}, " 4 ") == 1.0


def test_register_reward():
    @register_reward("test_always_half")
    def half(meta, text):
        return 0.5

    assert get_reward("test_always_half") is half
    assert register_reward("test_always_half")(half) is half  # registering the same function again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_always_half")(lambda m, t: 1.0)


def test_module_function_spec(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_mod.py").write_text(
        "def length_reward(meta, text):\n    return len(text) / 10\n"
        "class Scorer:\n    @staticmethod\n    def score(meta, text):\n        return 1.0\n"
        "NOT_A_FUNCTION = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("user_rewards_mod:length_reward")
    assert fn({}, "abcde") == 0.5
    assert get_reward("user_rewards_mod:Scorer.score")({}, "") == 1.0
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        get_reward("user_rewards_mod:missing")
    with pytest.raises(ValueError, match="not a function"):
        get_reward("user_rewards_mod:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="module:function"):
        get_reward(":fn")


def test_unknown_name_lists_known():
    with pytest.raises(ValueError) as e:
        get_reward("exact_matches")
    msg = str(e.value)
    assert "exact_matches" in msg and "exact_match" in msg and "number_match" in msg and "module:function" in msg


def test_compute_rewards_survives_bad_rewards(caplog):
    def flaky(meta, text):
        if text == "boom":
            raise RuntimeError("reward server down")
        return {"nan": math.nan, "inf": math.inf, "str": "1.0", "none": None}.get(text, len(text))

    texts = ["ab", "boom", "nan", "inf", "str", "none", "abcd"]
    with caplog.at_level(logging.WARNING, logger="longstraw"):
        rewards, failed, nan = compute_rewards(flaky, [{}] * len(texts), texts)
    # None: the reward does not apply to that answer (TRL's meaning): NaN, neither a failure nor a 0
    assert math.isnan(rewards[5]) and rewards[:5] + rewards[6:] == [2.0, 0.0, 0.0, 0.0, 0.0, 4.0]
    assert failed == 4 and nan == 1
    # NaN is counted, for the caller's one summary per group (reward_nan_max_share), not logged per answer
    records = [r for r in caplog.records if r.name == "longstraw" and r.levelno == logging.WARNING]
    assert len(records) == 3
    assert any("reward server down" in r.getMessage() for r in records)
    assert not any("nan" in r.getMessage() for r in records)


def test_compute_rewards_counts_missing_meta(caplog):
    with caplog.at_level(logging.WARNING, logger="longstraw"):
        rewards, failed, _ = compute_rewards(get_reward("exact_match"), [{"answer": "a"}, {}], ["a", "a"])
    assert rewards == [1.0, 0.0] and failed == 1
    assert "answer" in caplog.text


def test_compute_rewards_length_mismatch():
    with pytest.raises(ValueError, match="one meta per text"):
        compute_rewards(get_reward("exact_match"), [{}], ["a", "b"])


def test_digit_overlap_gives_partial_credit_and_full_credit_only_when_exact():
    from longstraw.grpo.rewards import get_reward

    fn = get_reward("digit_overlap")
    meta = {"answer": "123456"}
    assert fn(meta, "123456") == 1.0
    assert fn(meta, "the value is 123956.") == pytest.approx(5 / 6)
    assert fn(meta, "12345") == pytest.approx(5 / 6)  # a missing digit costs its share
    assert fn(meta, "1234567") == pytest.approx(6 / 7)  # so does an extra one
    assert fn(meta, "no number") == 0.0 and fn(meta, "654321") == 0.0
    with pytest.raises(ValueError, match="not a non-negative integer"):
        fn({"answer": "abc"}, "1")
