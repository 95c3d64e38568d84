"""Multi-turn branches: tokens the model did not write (a tool's output) carry `masks` False; they are replayed (the
model attends to them) but weigh 0 in the loss and count in no statistic. Exact mode == naive (fp64 <= 1e-10),
dense and hybrid, on one process and on 2 gloo ranks (sequence-parallel and data-parallel); the mask changes the
gradient; what is passed on the masked tokens (random log-probs, NaN sampler log-probs) changes nothing. TRL's
`tool_mask` is the independent reference of the loss itself (tests/grpo/test_trl_parity.py, "..., tool_mask").
"""

from __future__ import annotations

import math

import pytest
import torch

import longstraw as ls
from longstraw.engine import Branches
from longstraw.grpo import branch_loss
from longstraw.parallel import SequenceParallel
from tests.conftest import flat_grad, rel_err, tiny_model
from tests.parallel.launch import run_ranks

MODEL_TYPES = ("qwen3", "qwen3_5_text")
PROMPT_LEN = 23
# each branch: model turn, tool output, model turn ...; branch 1 is a plain one-turn answer
MASKS = [[1, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1], [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 1]]
ADV = [1.0, -0.6, 0.8, -1.1]
ENGINE = ls.EngineConfig(prompt_chunk=5, branch_batch=2)
# the options whose terms reduce over a whole branch or the group, all at once, on two normalisations
LOSSES = {
    "grpo sequence correction": dict(clip_low=0.2, clip_high=0.28, rollout_correction="sequence_truncate",
                                     rollout_correction_min=0.5, rollout_correction_max=3.0),
    "dapo everything": dict(loss_type="dapo", clip_low=0.2, clip_high=0.28, importance_sampling_level="sequence",
                            kl_coef=0.2, off_policy_mask_threshold=0.3, rollout_correction="token_truncate",
                            rollout_correction_min=0.5, rollout_correction_max=2.0, top_entropy_quantile=0.5,
                            entropy_coef=0.3),
    "vespo token correction": dict(loss_type="vespo", rollout_correction="token_mask", rollout_correction_min=0.5,
                                   rollout_correction_max=3.0),
}


def masks() -> list[torch.Tensor]:
    return [torch.tensor(m, dtype=torch.bool) for m in MASKS]


def group(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Prompt, responses and log-probs near a tiny model's (old, ref, sampler); the sampler's are NaN where the
    model did not write (it never scored those tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (PROMPT_LEN,), generator=g)
    responses = [torch.randint(0, 97, (len(m),), generator=g) for m in MASKS]
    base = [-4.6 + 0.3 * torch.randn(len(m), generator=g, dtype=torch.float64) for m in MASKS]
    old = [b + 0.4 * torch.randn(b.shape, generator=g, dtype=torch.float64) for b in base]
    ref = [b + 0.3 * torch.randn(b.shape, generator=g, dtype=torch.float64) for b in base]
    # branch 3 (A < 0) drifts 1.2 from the sampler: the off-policy mask drops it, and keeps branch 1 (A < 0)
    sampler = [o + shift + 0.3 * torch.randn(o.shape, generator=g, dtype=torch.float64)
               for o, shift in zip(old, (0.0, 0.0, 0.0, 1.2))]
    sampler = [s.masked_fill(~m, math.nan) for s, m in zip(sampler, masks())]
    return prompt, responses, dict(old_logprobs=old, ref_logprobs=ref, sampler_logprobs=sampler)


def step(model, mode: str, loss: str, *, with_masks: bool = True, data: dict | None = None,
         parallel=None, count: int = len(MASKS)) -> tuple[torch.Tensor, dict]:
    """grpo_backward on the group's first `count` branches."""
    prompt, responses, logps = group()
    model.zero_grad(set_to_none=True)
    stats = ls.grpo_backward(model, prompt, responses[:count], ADV[:count], mode=mode,
                             config=ls.GRPOConfig(**LOSSES[loss]), engine=ENGINE,
                             masks=masks()[:count] if with_masks else None,
                             **{k: v[:count] for k, v in (data or logps).items()},
                             **({} if parallel is None else {"parallel": parallel}))
    return flat_grad(model), stats


def unmasked_data() -> dict:
    """The same log-probs with finite sampler values everywhere (the unmasked control needs them)."""
    _, _, logps = group()
    return logps | {"sampler_logprobs": [s.nan_to_num(-4.0) for s in logps["sampler_logprobs"]]}


STATS = ("loss", "clip_frac", "kl", "entropy", "entropy_kept_frac", "off_policy_masked", "sampler_logp_diff_mean",
         "sampler_logp_diff_max", "sampler_kl", "correction_weight_mean")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_exact_equals_naive_with_masked_tool_tokens(model_type, loss):
    model = tiny_model(model_type, dtype=torch.float64)
    g_naive, s_naive = step(model, "naive", loss)
    g_exact, s_exact = step(model, "exact", loss)
    assert rel_err(g_exact, g_naive) <= 1e-10
    assert s_exact["off_policy_masked"] == (1.0 if "off_policy_mask_threshold" in LOSSES[loss] else 0.0)
    for key in STATS:
        assert math.isfinite(s_exact[key]), key
        assert s_exact[key] == pytest.approx(s_naive[key], rel=1e-9, abs=1e-12), key
    # the mask matters: the same tokens and log-probs, every token the model's
    g_unmasked, _ = step(model, "exact", loss, with_masks=False, data=unmasked_data())
    assert rel_err(g_unmasked, g_exact) > 1e-3


@pytest.mark.parametrize("loss", list(LOSSES))
def test_values_on_masked_tokens_change_nothing(loss):
    """Random old/ref/sampler log-probs (and entropies) where the model did not write: the same loss, gradient
    and statistics as with NaN sampler log-probs and the model-token values copied there."""
    model = tiny_model("qwen3", dtype=torch.float64)
    g, s = step(model, "exact", loss)
    _, _, logps = group()
    noise = torch.Generator().manual_seed(7)
    scrambled = {k: [torch.where(m, v, -10.0 * torch.rand(v.shape, generator=noise, dtype=v.dtype))
                     for v, m in zip(vs, masks())] for k, vs in logps.items()}
    g2, s2 = step(model, "exact", loss, data=scrambled)
    assert torch.equal(g, g2)
    assert {k: s[k] for k in STATS} == {k: s2[k] for k in STATS}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_branch_loss_ignores_masked_values(loss):
    """One branch's loss and statistics, alone: masked tokens with other log-probs and entropies give the same
    values and the same gradient, which is zero on the masked tokens of the log-probs."""
    cfg = ls.GRPOConfig(**LOSSES[loss])
    g = torch.Generator().manual_seed(3)
    m = torch.tensor(MASKS[2], dtype=torch.bool)
    n = m.numel()
    cur = -2.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    old, ref, sampler = (cur + 0.3 * torch.randn(n, generator=g, dtype=torch.float64) for _ in range(3))
    ent = torch.rand(n, generator=g, dtype=torch.float64)
    keep = torch.rand(n, generator=g) > 0.3

    def run(old, ref, sampler, ent):
        logp, entropy = cur.clone().requires_grad_(), ent.clone().requires_grad_()
        loss_, stats = branch_loss(logp, -0.7, 0.1, cfg, old, ref, sampler, entropy, keep, 0.05, mask=m)
        loss_.backward()
        return loss_.detach(), stats, logp.grad, entropy.grad

    def elsewhere(x, value):
        return torch.where(m, x, value)

    a = run(old, ref, sampler, ent)
    b = run(elsewhere(old, 3.0), elsewhere(ref, -30.0), elsewhere(sampler, math.nan), elsewhere(ent, 9.0))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    assert not a[2][~m].any() and not a[3][~m].any()
    assert a[2][m].abs().sum() > 0


def test_bad_masks_fail_clearly():
    prompt, responses, logps = group()
    model = tiny_model("qwen3", dtype=torch.float64)
    bad = {
        "masks\\[1\\] has 2 values for a response of 3 tokens": dict(masks=[*masks()[:1], torch.ones(2, dtype=bool),
                                                                            *masks()[2:]]),
        "masks\\[0\\] has dtype torch.int64; a mask is bool": dict(masks=[m.long() for m in masks()]),
        "masks has 3 entries for 4 responses": dict(masks=masks()[:3]),
        "sampler_logprobs\\[0\\] holds non-finite values \\(NaN or inf\\) at token 3, which the model wrote": dict(
            masks=[torch.ones(len(m), dtype=torch.bool) for m in MASKS]),
        "sampler_logprobs\\[0\\] holds non-finite values \\(NaN or inf\\) at token 3": dict(masks=None),
    }
    for message, kw in bad.items():
        with pytest.raises(ValueError, match=message):
            ls.grpo_backward(model, prompt, responses, ADV, mode="exact", engine=ENGINE, **logps, **kw)


def test_slices_and_fillers_carry_the_masks():
    _, responses, _ = group()
    b = Branches.group(responses, ADV, ls.GRPOConfig(), vocab_size=97, masks=masks())
    assert [m.tolist() for m in b.select([2, 0]).masks] == [[bool(x) for x in MASKS[i]] for i in (2, 0)]
    padded = b.padded(6)
    assert len(padded.masks) == 6 and padded.masks[4].tolist() == [True]
    # grpo's weights: 1 / (G x the branch's model tokens)
    assert b.token_weights == pytest.approx([1 / (4 * sum(m)) for m in MASKS])
    assert b.model_token_count == sum(map(sum, MASKS))


# ---- 2 ranks --------------------------------------------------------------------------------------------------


def two_rank_step(rank: int, world: int, model_type: str, dp: int, loss: str, count: int
                  ) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "sp"))
    grad, stats = step(tiny_model(model_type, dtype=torch.float64), "exact", loss,
                       parallel=SequenceParallel.from_mesh(mesh), count=count)
    return {"grad": grad, "stats": torch.tensor([stats[k] for k in STATS], dtype=torch.float64)}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("dp", [1, 2], ids=["sequence-parallel", "data-parallel"])
def test_two_ranks_equal_one_process_naive(model_type, dp):
    """Sequence-parallel: the ranks replay their own share of 3 branches (rank 1's padded with a filler), on a
    sharded state; data-parallel: each group replays half of 4. Both == one-process naive."""
    loss, count = "dapo everything", 3 if dp == 1 else 4
    want, stats = step(tiny_model(model_type, dtype=torch.float64), "naive", loss, count=count)
    for r in run_ranks(2, two_rank_step, model_type, dp, loss, count, timeout=120):
        assert rel_err(r["grad"], want) <= 1e-10
        assert r["stats"].tolist() == pytest.approx([stats[k] for k in STATS], rel=1e-9, abs=1e-12)
