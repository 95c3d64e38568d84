"""Advantages from several rewards (longstraw/grpo/advantages.py) against TRL 1.16's own code and a plain formula.

TRL computes advantages inline in `GRPOTrainer._generate_and_score_completions`, with no function of its own to
call. The TRL test runs that method itself, on a tiny trainer whose generation and reward calls are stubbed to
return fixed answers and a fixed reward table, so everything from the table to the advantages is TRL's code. The
formula test checks the same cases against a plain loop written here (None: the function does not apply)."""

from __future__ import annotations

import math

import pytest
import torch

import longstraw as ls
from longstraw.grpo.advantages import advantages, group_advantages, needs_batch, weighted_rewards
from longstraw.train.config import TrainConfig

SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
EPS = 1e-4


# ---- the plain formula --------------------------------------------------------------------------------------

def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _std(xs):  # unbiased; undefined (None) below two values
    m = _mean(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else None


def _weighted(rows, weights):
    return [sum(w * v for w, v in zip(weights, row) if v is not None) if any(v is not None for v in row) else None
            for row in rows]


def reference(rows: list[list[float | None]], g: int, weights: list[float], scale: str, aggregation: str):
    n, k = len(rows), len(rows[0])
    groups = [range(i, i + g) for i in range(0, n, g)]
    present = lambda xs: [x for x in xs if x is not None]  # noqa: E731
    if aggregation == "sum_then_normalize":
        s = _weighted(rows, weights)
        batch_std = _std(present(s)) if n > 1 else 0.0
        adv = []
        for idx in groups:
            vals = present([s[i] for i in idx])
            m = _mean(vals)
            sd = (_std(vals) if g > 1 else 0.0) if scale == "group" else batch_std
            for i in idx:
                if s[i] is None:
                    adv.append(0.0)
                elif scale == "none":
                    adv.append(s[i] - m)
                else:
                    adv.append(0.0 if sd is None else (s[i] - m) / (sd + EPS))
        return adv
    normalized = [[None] * k for _ in rows]
    for idx in groups:
        for j in range(k):
            vals = present([rows[i][j] for i in idx])
            m, sd = _mean(vals), (_std(vals) if g > 1 else 0.0)
            for i in idx:
                if rows[i][j] is not None and sd is not None:
                    normalized[i][j] = (rows[i][j] - m) / (sd + EPS)
    # an answer some function scores stays in, even when every one of its functions had no std in its group
    s = [(x or 0.0) if any(v is not None for v in row) else None
         for x, row in zip(_weighted(normalized, weights), rows)]
    m, sd = _mean(present(s)), (_std(present(s)) if n > 1 else 0.0)
    return [0.0 if x is None or sd is None else (x - m) / (sd + EPS) for x in s]


def table(g: int = 4, k: int = 3, seed: int = 0) -> list[list[float | None]]:
    """Four groups of g answers x k functions, values on a 1/64 grid (exact in fp32): group 0 random with one
    answer one function skips and one answer no function applies to; group 1 all equal (zero std); group 2 a
    single scorable answer, and a function only one answer has; group 3 random."""
    gen = torch.Generator().manual_seed(seed)
    r = ((torch.randn(4 * g, k, generator=gen) * 64).round() / 64).tolist()
    rows: list[list[float | None]] = [list(row) for row in r]
    if g > 1:
        rows[1][0] = None
        rows[2] = [None] * k
        for i in range(g, 2 * g):
            rows[i] = [0.375] * k
        for i in range(2 * g + 1, 3 * g):
            rows[i] = [None] * k
        rows[3 * g][k - 1] = None
        rows[3 * g + 1][k - 1] = 0.5
        for i in range(3 * g + 2, 4 * g):
            rows[i][k - 1] = None
    return rows


def as_tensor(rows) -> torch.Tensor:
    return torch.tensor([[math.nan if v is None else v for v in row] for row in rows], dtype=torch.float64)


CASES = [(g, k, w) for g, k, w in ((4, 3, [1.0, 0.5, -0.25]), (4, 1, None), (1, 2, [2.0, 1.0]), (3, 2, None))]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("g,k,weights", CASES)
def test_advantages_equal_the_formula(scale, aggregation, g, k, weights):
    rows = table(g, k)
    want = torch.tensor(reference(rows, g, weights or [1.0] * k, scale, aggregation), dtype=torch.float64)
    got = advantages(as_tensor(rows), g, weights, scale, aggregation)
    assert got.dtype == torch.float64 and got.shape == (len(rows),)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if g > 1:
        assert got[2] == 0  # unscorable
        if aggregation == "sum_then_normalize":  # (normalize_then_sum: the batch's mean moves a zero-std group)
            assert (got[g:2 * g] == 0).all()
        assert got.abs().max() > 0.1  # not all zero


def test_the_options_differ():
    """Controls: each option changes the result on this table, so a pass above is not vacuous."""
    x = as_tensor(table())
    w = [1.0, 0.5, -0.25]
    got = {(s, a): advantages(x, 4, w, s, a) for s in SCALES for a in AGGREGATIONS}
    for s, t in (("group", "batch"), ("group", "none"), ("batch", "none")):
        assert not torch.allclose(got[(s, "sum_then_normalize")], got[(t, "sum_then_normalize")])
    assert not torch.allclose(got[("group", "sum_then_normalize")], got[("group", "normalize_then_sum")])
    assert not torch.allclose(advantages(x, 4, w), advantages(x, 4, [1.0, 1.0, 1.0]))
    # normalize_then_sum ignores scale_rewards, as in TRL
    assert torch.equal(got[("group", "normalize_then_sum")], got[("none", "normalize_then_sum")])


def test_group_advantages_is_the_one_group_one_reward_case():
    r = [0.0, 1.0, 0.5, 0.0, 0.25]
    want = torch.tensor(r, dtype=torch.float64)
    want = (want - want.mean()) / (want.std() + EPS)
    torch.testing.assert_close(group_advantages(r), want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(group_advantages(r, scale=False), torch.tensor(r, dtype=torch.float64) - 0.35)
    assert torch.equal(group_advantages([1.0]), torch.zeros(1, dtype=torch.float64))  # G = 1
    assert torch.equal(group_advantages([2.0, 2.0, 2.0]), torch.zeros(3, dtype=torch.float64))  # zero std
    nan = group_advantages([1.0, math.nan, 0.0])  # unscorable: out of the mean and std, advantage 0
    torch.testing.assert_close(nan, torch.tensor([0.5 / (2 ** -0.5 + EPS), 0.0, -0.5 / (2 ** -0.5 + EPS)],
                                                 dtype=torch.float64))
    assert ls.group_advantages is group_advantages


def test_weighted_rewards_and_needs_batch():
    x = as_tensor([[1.0, None], [None, None], [0.5, 2.0]])
    got = weighted_rewards(x, torch.tensor([2.0, -1.0], dtype=torch.float64))
    assert got[0] == 2.0 and math.isnan(got[1]) and got[2] == -1.0
    assert not needs_batch("group", "sum_then_normalize") and not needs_batch("none", "sum_then_normalize")
    assert needs_batch("batch", "sum_then_normalize") and needs_batch("group", "normalize_then_sum")


@pytest.mark.parametrize("bad,match", [
    (dict(rewards=[[1.0, 2.0]] * 4, weights=[1.0]), "1 reward weights for 2 reward functions"),
    (dict(rewards=[1.0] * 5), "5 answers do not split into groups of 2"),
    (dict(rewards=[1.0, math.inf]), "infinite"),
    (dict(rewards=[1.0, 0.0], scale_rewards="std"), "scale_rewards 'std'"),
    (dict(rewards=[1.0, 0.0], aggregation="mean"), "multi_objective_aggregation 'mean'"),
])
def test_bad_input_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        advantages(group_size=2, **bad)


# ---- the run config -----------------------------------------------------------------------------------------

def _config(**kw) -> dict:
    return {"model": {"random": {"model_type": "qwen3"}}, **kw}


def test_run_config_takes_several_rewards_with_weights():
    cfg = TrainConfig.model_validate(_config(reward=["digit_overlap", "number_match"],
                                             grpo={"reward_weights": [1.0, 0.5], "scale_rewards": "batch"}))
    assert cfg.rewards == ["digit_overlap", "number_match"]
    assert TrainConfig.model_validate(_config(reward="digit_overlap")).rewards == ["digit_overlap"]
    assert TrainConfig.model_validate(_config()).rewards == ["kv-retrieval"]  # the task's verifier


@pytest.mark.parametrize("kw,match", [
    (dict(reward=["digit_overlap", "number_match"], grpo={"reward_weights": [1.0, 0.5, 2.0]}),
     r"grpo.reward_weights has 3 weight\(s\) for 2 reward function\(s\) \(digit_overlap, number_match\)"),
    (dict(grpo={"reward_weights": [1.0, 0.5]}), r"2 weight\(s\) for 1 reward function\(s\) \(kv-retrieval\)"),
    (dict(reward=[]), "reward is an empty list"),
    (dict(reward=["digit_overlap", "digit_overlap"]), "lists 'digit_overlap' more than once"),
    (dict(scale_advantages=False), r"scale_advantages is now grpo: \{scale_rewards: group\|none\}"),
])
def test_run_config_errors_name_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.model_validate(_config(**kw))


# ---- TRL's own code -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """A tiny TRL GRPOTrainer whose `_generate` returns fixed answers; the reward table is set per call."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    vocab = {f"t{i}": i for i in range(30)} | {"<pad>": 30, "<eos>": 31}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl")), num_generations=4, per_device_train_batch_size=16,
                     report_to=[], use_cpu=True, max_completion_length=4)
    scorer = lambda prompts, completions, **kw: [0.0] * len(completions)  # noqa: E731 (never called: stubbed)
    trainer = GRPOTrainer(model=model, reward_funcs=[scorer], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["t1 t2"] * 4}))
    trainer._generate = lambda prompts: ([[1, 2]] * len(prompts), [[3, 4, 31]] * len(prompts), None,
                                         ["t3 t4"] * len(prompts), None, {}, None, None)
    trainer.model.train()
    return trainer


def trl_advantages(trainer, rows, g: int, weights, scale: str, aggregation: str) -> torch.Tensor:
    """TRL's advantages of the reward table `rows` (None -> NaN, as TRL turns a reward function's None)."""
    k = len(rows[0])
    x = as_tensor(rows).float()
    trainer.num_generations = g
    trainer.reward_funcs = [trainer.reward_funcs[0]] * k
    trainer.reward_func_names = [f"r{j}" for j in range(k)]
    trainer.reward_weights = torch.tensor(weights or [1.0] * k, dtype=torch.float32)
    trainer.scale_rewards, trainer.multi_objective_aggregation = scale, aggregation
    trainer._calculate_rewards = lambda *a: x.clone()
    out = trainer._generate_and_score_completions([{"prompt": "t1 t2"} for _ in rows])
    return out["advantages"].double()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("g,k,weights", CASES)
def test_advantages_equal_trls(trl_trainer, scale, aggregation, g, k, weights):
    rows = table(g, k)
    want = trl_advantages(trl_trainer, rows, g, weights, scale, aggregation)
    got = advantages(as_tensor(rows), g, weights, scale, aggregation)
    assert (want == 0).all() if g == 1 else want.abs().max() > 0.1  # a group of one has no signal in any option
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)  # TRL computes in fp32
