"""Long positions (issue 24, item 5): a `rope_scaling` override (run config `model.rope_scaling`, or
`--rope-scaling TYPE:FACTOR`) merged into a checkpoint's config.json extends the positions the model accepts to
original_max_position_embeddings x factor, with the logits transformers computes for a config that has the same
`rope_parameters`; past them, capture and the CLI refuse in one line that names the option.

The references are transformers models built with the scaled `rope_parameters` in their own config and the
weights of the checkpoint our model loads without them (saved unscaled, scaled by the override alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import longstraw as ls
from longstraw.cli import main
from longstraw.config import ModelSpec, StepConfig, load_config
from longstraw.tools.plan import Cluster, EngineChoice, Workload, format_plan, plan

REF = Path(__file__).resolve().parents[1] / "fixtures" / "reference-configs"
ORIGINAL = 64  # max_position_embeddings of the tiny checkpoints
VOCAB = 97
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=ORIGINAL, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
QWEN3_5 = dict(TINY, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4)
DENSE = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
         "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM)}


def hf_model(model_type: str, rope_parameters: dict, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model (eager, fp32, eval) with every parameter random and O(1)-sized."""
    config_cls, model_cls = DENSE[model_type]
    cfg = config_cls(**(QWEN3_5 if model_type == "qwen3_5" else TINY), rope_parameters=dict(rope_parameters))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(0.5 * noise - 1.0)
            elif p.dim() == 1:  # norms (zero-centred in Qwen3.5), dt_bias
                p.add_(0.2 * noise)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model


def scaled_pair(model_type: str, scaling: dict, path: Path, theta: dict | None = None):
    """(an unscaled checkpoint's transformers model, transformers with `scaling` in its config and the same
    weights); the unscaled one is saved to `path`."""
    base = theta or {"rope_theta": 10000.0}
    plain = hf_model(model_type, {"rope_type": "default", **base})
    plain.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    ref = hf_model(model_type, {**base, **scaling})
    ref.load_state_dict(plain.state_dict())
    return plain, ref


def ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, use_cache=False).logits.double()


def max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


# --- parity with transformers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,scaling", [
    ("qwen3", {"rope_type": "yarn", "factor": 4.0}),
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    ("qwen3_5", {"rope_type": "yarn", "factor": 4.0}),
], ids=["qwen3-yarn", "llama-linear", "qwen3_5-yarn"])
def test_override_gives_transformers_logits(model_type, scaling, tmp_path):
    """The checkpoint's config.json says default RoPE and 64 positions; the override makes it the model
    transformers builds from rope_parameters {yarn|linear, factor 4, original_max_position_embeddings 64}."""
    theta = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5} if model_type == "qwen3_5" else None
    plain, ref = scaled_pair(model_type, {**scaling, "original_max_position_embeddings": ORIGINAL}, tmp_path, theta)
    x = ids(200, batch=2)  # past the 64 original positions, within 64 x 4
    want = logits(ref, x)
    ours = ls.load_model(tmp_path, rope_scaling=scaling)
    with torch.no_grad():
        got = ours(x)
    assert max_abs(got, want) <= 1e-4
    assert float(want.abs().max()) > 0.5
    assert max_abs(logits(plain, x), want) > 1e-2  # the scaling matters at these positions
    # the config.json on disk is untouched, and the run config's `model.rope_scaling` loads the same model
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    spec = ModelSpec(path=str(tmp_path), rope_scaling=scaling)
    with torch.no_grad():
        assert max_abs(spec.load()(x), want) <= 1e-4
    assert ours.config.max_positions == 4 * ORIGINAL and ls.load_model(tmp_path).config.max_positions == ORIGINAL


def test_old_format_config_keeps_its_theta(tmp_path):
    """An old config.json (top-level rope_theta, no rope_parameters): the override lands in `rope_scaling` and
    the checkpoint's rope_theta stays, as transformers reads that layout."""
    plain, _ = scaled_pair("llama", {}, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 50000.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref = hf_model("llama", {"rope_theta": 50000.0, "rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": ORIGINAL})
    ref.load_state_dict(plain.state_dict())
    x = ids(200)
    with torch.no_grad():
        got = ls.load_model(tmp_path, rope_scaling={"type": "yarn", "factor": 4.0})(x)
    assert max_abs(got, logits(ref, x)) <= 1e-4


# --- what capture accepts and refuses ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("rope-scaling")
    _, ref = scaled_pair("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
                         path)
    return path, ref


def test_capture_accepts_the_scaled_positions(checkpoint):
    """A 150-token prompt on a 64-position checkpoint with yarn x4: capture and score run, and give the log-probs
    of transformers' full forward over prompt + response."""
    path, ref = checkpoint
    ours = ls.load_model(path, rope_scaling={"rope_type": "yarn", "factor": 4})
    prompt = ids(150, seed=1)[0]
    responses = [ids(n, seed=2 + n)[0] for n in (3, 40)]
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=64))
    assert state.length == 149
    got = ls.score(ours, state, responses)
    for r, g in zip(responses, got):
        full = logits(ref, torch.cat([prompt, r[:-1]])[None])[0, len(prompt) - 1:]
        want = torch.log_softmax(full, -1).gather(-1, r[:, None])[:, 0]
        assert max_abs(g, want) <= 1e-4


def test_positions_past_the_model_are_refused_with_the_option(checkpoint):
    path, _ = checkpoint
    plain = ls.load_model(path)
    with pytest.raises(ValueError) as e:
        ls.capture(plain, ids(150)[0], ls.EngineConfig(prompt_chunk=64))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("prompt of 150 tokens exceeds the model's 64 positions; extend them with RoPE scaling: "
                   "`rope_scaling: {rope_type: yarn, factor: 4}` in the run config's model section "
                   "(or --rope-scaling yarn:4)")
    scaled = ls.load_model(path, rope_scaling={"rope_type": "yarn", "factor": 4})
    with pytest.raises(ValueError, match=r"prompt of 300 tokens exceeds the model's 256 positions; .*"
                                         r"factor: 8\}.*--rope-scaling yarn:8\)$"):
        ls.capture(scaled, ids(300)[0], ls.EngineConfig(prompt_chunk=64))
    # prompt + response past the scaled positions: the GRPO step refuses before any compute
    with pytest.raises(ValueError, match=r"= 260 tokens exceeds the model's 256 positions; .*--rope-scaling yarn:8"):
        ls.grpo_backward(scaled, ids(200)[0], [ids(60)[0], ids(5)[0]], torch.tensor([1.0, -1.0]))


def test_rollout_refuses_past_the_positions(checkpoint):
    path, _ = checkpoint
    scaled = ls.load_model(path, rope_scaling={"rope_type": "yarn", "factor": 4})
    state = ls.capture(scaled, ids(250)[0], ls.EngineConfig(prompt_chunk=64))
    with pytest.raises(ValueError, match=r"exceeds the model's 256 positions; .*--rope-scaling yarn:8"):
        ls.rollout(scaled, state, ls.SamplingSettings(max_new_tokens=10), ls.Draw(n=1))


# --- the run config and the command line ---------------------------------------------------------------------------


def step_yaml(tmp_path: Path, **model) -> Path:
    f = tmp_path / "step.yaml"
    f.write_text(yaml.safe_dump({
        "model": {"random": {"model_type": "qwen3", **TINY}, **model}, "prompt_tokens": 150, "responses": 2,
        "response_tokens": [2, 4], "modes": ["exact"], "threads": 1, "engine": {"prompt_chunk": 64}}))
    return f


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 4}, "rope_type"),
    ({"rope_type": "yarn", "factor": 1.0}, "greater than 1"),
    ({"rope_type": "yarn"}, "factor"),
])
def test_yaml_validation(tmp_path, rope, match):
    with pytest.raises(ValueError, match=match) as e:
        load_config(step_yaml(tmp_path, rope_scaling=rope), StepConfig)
    assert "rope_scaling" in str(e.value)


def test_step_cli_extends_the_positions(tmp_path, capsys):
    """`longstraw step` on a 150-token prompt of a 64-position model: refused in one line naming the option, runs
    with --rope-scaling yarn:4 or with it in the YAML; a bad flag is one line too."""
    f = step_yaml(tmp_path)
    assert main(["step", "--config", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "exceeds the model's 64 positions" in err and "--rope-scaling yarn:4" in err
    assert main(["step", "--config", str(f), "--no-progress", "--rope-scaling", "yarn:4"]) == 0
    assert "exact" in capsys.readouterr().out
    assert main(["step", "--config", str(step_yaml(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4})),
                 "--no-progress"]) == 0
    capsys.readouterr()
    for bad in ("yarn", "ntk:4", "yarn:1", "yarn:x"):
        assert main(["step", "--config", str(f), "--rope-scaling", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"--rope-scaling {bad!r}" in err and "yarn:8" in err


# --- the planner ---------------------------------------------------------------------------------------------------


def test_planner_says_fits_only_when_the_positions_are_accepted(capsys):
    """Qwen3.5-27B (262,144 positions) at 2,100,000 tokens + 1,024-token responses: capture would refuse them;
    yarn x8 gives 2,097,152 positions, still short; yarn x16 gives 4,194,304, and then the plan says "fits"."""
    cfg = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    cluster, engine = Cluster(8, 96, zero=3, offload="cpu"), EngineChoice(activation_bytes=10_000)
    bare = plan(cfg, Workload(2_100_000), cluster, engine)
    assert (bare["positions"], bare["max_positions"]) == (2_101_024, 262_144)
    assert not bare["positions_accepted"] and bare["rope_scaling_needed"] == "yarn:16"
    assert bare["exact_fits"]  # in memory: so only the positions stop it
    text = format_plan(bare, 8, 8)
    assert "positions: 2,101,024 (prompt + response) > 262,144 accepted: capture would refuse this prompt; add " \
           "--rope-scaling yarn:16" in text
    verdicts = [line for line in text.splitlines() if " mode: " in line]
    assert len(verdicts) == 2 and all(v.endswith("capture would refuse the prompt (positions), though it fits in "
                                                 "memory") for v in verdicts)
    short = plan(cfg, Workload(2_100_000, rope_scaling={"rope_type": "yarn", "factor": 8}), cluster, engine)
    assert short["max_positions"] == 8 * 262_144 and not short["positions_accepted"]
    scaled = plan(cfg, Workload(2_100_000, rope_scaling={"rope_type": "yarn", "factor": 16}), cluster, engine)
    assert scaled["max_positions"] == 16 * 262_144 and scaled["positions_accepted"]
    text = format_plan(scaled, 8, 8)
    verdicts = [line for line in text.splitlines() if " mode: " in line]
    assert len(verdicts) == 2 and all(" per rank: fits, " in v for v in verdicts)
    assert "capture would refuse" not in text and "<= 4,194,304 accepted" in text
    # the command line
    argv = ["plan", "--config", str(REF / "qwen3_5-27b"), "--tokens", "2100000", "--gpus", "8", "--gpu-mem-gb", "96",
            "--zero", "3", "--activation-kb", "10"]
    assert main(argv) == 0
    assert "add --rope-scaling yarn:16" in capsys.readouterr().out
    assert main([*argv, "--rope-scaling", "yarn:16"]) == 0
    out = capsys.readouterr().out
    assert "<= 4,194,304 accepted" in out and "detached  mode:" in out and "capture would refuse" not in out
    assert main([*argv, "--rope-scaling", "yarn:0.5"]) == 2
    assert "--rope-scaling 'yarn:0.5'" in capsys.readouterr().err


def test_glm5_at_the_seeds_length():
    cfg = json.loads((REF / "glm5" / "config.json").read_text())
    cluster, engine = Cluster(32, 96, zero=3), EngineChoice(activation_bytes=10_000)
    bare = plan(cfg, Workload(2_100_000), cluster, engine)
    assert bare["max_positions"] == 202_752 and bare["rope_scaling_needed"] == "yarn:16"
    scaled = plan(cfg, Workload(2_100_000, rope_scaling={"rope_type": "yarn", "factor": 16}), cluster, engine)
    assert scaled["max_positions"] == 16 * 202_752 and scaled["positions_accepted"]


def test_multimodal_layout_scales_the_text_config():
    """A `qwen3_5` config keeps the text model's settings in text_config: the override lands there, next to its
    rope_theta and partial_rotary_factor."""
    text = {"model_type": "qwen3_5_text", **QWEN3_5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    cfg = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}
    merged = ls.models.with_rope_scaling(cfg, {"rope_type": "yarn", "factor": 8})
    assert merged["text_config"]["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e7, "factor": 8,
                                                        "partial_rotary_factor": 0.25,
                                                        "original_max_position_embeddings": ORIGINAL}
    assert cfg["text_config"]["rope_parameters"]["rope_type"] == "default"  # the given dict is not changed
    assert ls.models.config_from_hf(merged).max_positions == 8 * ORIGINAL
