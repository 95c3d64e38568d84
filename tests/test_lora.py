"""LoRA adapters (PEFT) on LongStraw's modules.

The reference is independent of our code: transformers' model of the same checkpoint, with the same adapter loaded
by PEFT (`PeftModel.from_pretrained` of the adapter we save), recomputing the prompt for every branch; its adapter
gradients must equal ours from exact mode. Also: base weights get no gradient and do not move in a training step,
a checkpoint's adapter loads with PEFT and gives our logits, `longstraw export --merge` gives them too, and bad
targets or ranks are clear errors.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

import longstraw as ls
from longstraw.grpo import GRPOConfig, branch_loss, token_weights
from longstraw.lora import add_lora, save_adapter
from tests.conftest import GLM, rel_err, tiny_model
from tests.models import test_dense, test_qwen3_5

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
ADV = [1.0, -0.6, 0.9, -1.3]


def hf_model(model_type: str):
    return test_dense.hf_model("qwen3") if model_type == "qwen3" else test_qwen3_5.hf_causal_lm()


def with_adapter(tmp_path, model_type: str):
    """(transformers + PEFT model, ours), the same checkpoint and the same adapter (B random, so A gets gradient)."""
    hf = hf_model(model_type)
    hf.save_pretrained(tmp_path / "base")
    ours = add_lora(ls.load_model(tmp_path / "base"), r=4, alpha=8.0, target_modules=TARGETS)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    (tmp_path / "adapter").mkdir()
    save_adapter(ours, tmp_path / "adapter", str(tmp_path / "base"))
    return PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).eval(), ours


def group(vocab: int):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (70,), generator=gen)
    return prompt, [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 9, 3, 7)]


def reference_grads(peft_model, prompt, responses, cfg: GRPOConfig) -> dict[str, torch.Tensor]:
    """PEFT on transformers, every branch recomputing the whole prompt (naive), the same GRPO loss."""
    weights = token_weights([r.numel() for r in responses], cfg)
    for i, r in enumerate(responses):
        ids = torch.cat([prompt, r[:-1]])[None]
        logits = peft_model(input_ids=ids, use_cache=False).logits[0, prompt.numel() - 1:]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None])[:, 0]
        loss, _ = branch_loss(logp, ADV[i], weights[i], cfg)
        loss.backward()
    prefix = "base_model.model."
    return {n.removeprefix(prefix): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_exact_mode_adapter_gradients_equal_peft_on_transformers(tmp_path, model_type):
    peft_model, ours = with_adapter(tmp_path, model_type)
    prompt, responses = group(ours.config.vocab_size)
    cfg = GRPOConfig()
    ls.grpo_backward(ours, prompt, responses, ADV, mode="exact", config=cfg, engine=ls.EngineConfig(prompt_chunk=16))
    want = reference_grads(peft_model, prompt, responses, cfg)
    got = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    # qwen3: 5 targets x 3 layers; qwen3_5: the MLP's 2 in all 8 layers, q/v/o_proj in its 2 attention layers
    assert set(got) == set(want) and len(got) == 2 * (15 if model_type == "qwen3" else 2 * 8 + 3 * 2)
    err = rel_err(torch.cat([got[n].flatten() for n in sorted(got)]), torch.cat([want[n].flatten() for n in sorted(got)]))
    assert err <= 1e-5, err
    assert all(p.grad is None for n, p in ours.named_parameters() if not p.requires_grad)  # base: no gradient


def test_adapters_only_train_and_checkpoints_load_in_peft(tmp_path):
    """A worker's step with LoRA: base weights unchanged, adapters moved, the optimizer holds adapters only; the
    checkpoint's adapter loads with PEFT on transformers' model of update 0 and gives our logits; export --merge
    gives them too."""
    import transformers

    from longstraw.cli import main as cli
    from longstraw.train.worker import Worker
    from tests.train.test_train_inputs import make_cfg
    from tests.train.test_worker import replay

    cfg = make_cfg(tmp_path, lora={"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
                   optim={"lr": 1e-2})
    w = Worker(cfg)
    v = w.start()["weights_version"]
    base = {n: p.detach().clone() for n, p in w.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in w.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert {id(p) for g in w.optim.param_groups for p in g["params"]} == {
        id(p) for p in w.model.parameters() if p.requires_grad}
    cap = w.capture(v, 0, 0, 0)
    state = {"url": cap["url"], "sha256": cap["sha256"]}
    roll = w.rollout(v, state, 0, 0)
    replay(w, state, {"path": roll["path"], "sha256": roll["sha256"]}, ADV, ([0, 1, 2, 3],))
    w.prompt(w.weights_version, state, 0, 0, 0)
    out = w.optimizer(w.weights_version, 0, 0, {})
    after = dict(w.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())  # frozen
    assert any(not torch.equal(after[n], t) for n, t in adapters.items())  # trained

    ckpt, first = out["checkpoint"], str(cfg.paths().checkpoint(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(first, attn_implementation="eager").eval()
    peft_model = PeftModel.from_pretrained(hf, ckpt).eval()
    ids = torch.randint(0, 260, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = w.model(ids), peft_model(input_ids=ids, use_cache=False).logits
    assert float((ours - theirs).abs().max()) <= 1e-5
    assert cli(["export", ckpt, "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    with torch.no_grad():
        assert float((merged.eval()(input_ids=ids, use_cache=False).logits - ours).abs().max()) <= 1e-5


def test_bad_targets_and_ranks_are_clear_errors(tmp_path):
    from pydantic import ValidationError

    from longstraw.train import inputs
    from tests.train.test_train_inputs import make_cfg

    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match=r"LoRA target 'qproj' matches no linear module .*: .*q_proj"):
        add_lora(model, target_modules=["qproj"])
    with pytest.raises(ValueError, match="rank r must be a positive integer, got 0"):
        add_lora(model, r=0)
    with pytest.raises(ValueError, match="dropout .* is not supported"):
        add_lora(model, dropout=0.1)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="'kv_b_proj' cannot be adapted: MLA's absorbed attention reads"):
        add_lora(ls.build_model(GLM), target_modules=["kv_b_proj"])
    with pytest.raises(ValidationError, match=r"lora\.r\n.*greater than 0"):
        make_cfg(tmp_path, lora={"r": 0})
    with pytest.raises(ValueError, match="LoRA target 'q_prj' matches no linear module"):
        inputs.preflight(make_cfg(tmp_path, lora={"target_modules": ["q_prj"]}))  # before any work
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arch,targets", [
    ("qwen3", ["q_proj", "v_proj", "gate_proj"]),
    ("qwen3_5_text", ["q_proj", "in_proj_qkv", "out_proj", "down_proj"]),  # Gated DeltaNet's projections too
    ("glm_moe_dsa", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj"]),  # MLA, MLPs
])
def test_all_modes_with_adapters_in_every_family(arch, targets):
    """exact equals naive for the adapters (float64, 1e-10), detached differs; base weights get no gradient."""
    torch.manual_seed(0)
    base = ls.build_model(GLM, dtype=torch.float64) if arch == "glm_moe_dsa" else tiny_model(arch, torch.float64)
    add_lora(base, r=4, target_modules=targets)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    prompt, responses = group(base.config.vocab_size)
    grads = {}
    for mode in ("naive", "exact", "detached"):
        base.zero_grad(set_to_none=True)
        ls.grpo_backward(base, prompt, responses, ADV, mode=mode, engine=ls.EngineConfig(prompt_chunk=16))
        assert all(p.grad is None for p in base.parameters() if not p.requires_grad)
        grads[mode] = torch.cat([p.grad.flatten() for p in base.parameters() if p.requires_grad])
    assert rel_err(grads["exact"], grads["naive"]) <= 1e-10
    assert rel_err(grads["detached"], grads["naive"]) > 1e-3
