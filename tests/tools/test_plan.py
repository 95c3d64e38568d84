"""`longstraw plan`: per-rank bytes from the config alone, activations from one-layer proxies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.cli import main
from longstraw.engine import activation_bytes_per_token
from longstraw.tools.activations import activation_profile
from longstraw.tools.plan import Cluster, EngineChoice, Workload, model_state_bytes, plan, smallest_fit
from longstraw.tools.state_size import state_size
from tests.conftest import GLM, tiny_config

REF = Path(__file__).resolve().parents[1] / "fixtures" / "reference-configs"


@pytest.mark.parametrize("cfg", [tiny_config("qwen3"), tiny_config("qwen3_5_text"), GLM], ids=["dense", "qwen3_5", "glm"])
def test_proxies_measure_what_the_whole_model_saves(cfg):
    torch.manual_seed(0)
    whole = activation_bytes_per_token(ls.build_model(cfg, dtype=torch.bfloat16))
    assert activation_profile(cfg, gpu=False).whole == pytest.approx(whole, rel=0.1)


def test_per_rank_bytes_follow_zero_and_sequence_parallel():
    cfg = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    size = state_size(cfg, 2_100_000, "bf16")
    work, engine = Workload(2_100_000), EngineChoice(activation_bytes=10_000, chunk=2048, checkpoint_layers=False)
    one = plan(cfg, work, Cluster(8, 96, zero=1), engine)
    three = plan(cfg, work, Cluster(8, 96, zero=3), engine)
    psi = one["parameters"]
    assert 26e9 < psi < 28e9
    # bf16 weights and gradients (ZeRO-3: their shards); fp32 master, its gradient at the step, and moments sharded
    assert one["per_rank"]["weights, gradients, optimizer"] == pytest.approx((2 + 2) * psi + 12 * psi / 8)
    assert three["per_rank"]["weights, gradients, optimizer"] == pytest.approx((2 + 16) * psi / 8)
    assert one["per_rank"]["state shard"] == pytest.approx(size["bytes_per_token"] * 2_100_000 / 8 + size["fixed_bytes"])
    assert three["exact_bytes"] < one["exact_bytes"] and three["detached_bytes"] < three["exact_bytes"]
    n = smallest_fit(cfg, work, Cluster(8, 96, zero=3), engine, "exact")
    assert plan(cfg, work, Cluster(n, 96, zero=3), engine)["exact_fits"]
    assert not plan(cfg, work, Cluster(n // 2, 96, zero=3), engine)["exact_fits"]


def test_cli_prints_the_plan(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_5_text")))
    assert main(["plan", "--config", str(tmp_path), "--tokens", "100000", "--gpus", "4", "--gpu-mem-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "state shard" in out and "smallest N for exact" in out
    assert main(["plan", "--config", str(tmp_path), "--tokens", "10", "--gpus", "4", "--gpu-mem-gb", "1",
                 "--sp", "3"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_boundary_states_follow_the_engines_sparse_rule():
    """All of a rank's boundaries while they take at most 1/8 of the GPU, else 1 in k = ceil(sqrt(chunks per rank))
    plus up to k regenerated ones (engine/backward.py)."""
    cfg = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    fixed = state_size(cfg, 2_100_000, "bf16", 512)["fixed_bytes"]
    mine = -(-state_size(cfg, 2_100_000, "bf16", 512)["prompt_chunks"] // 8)
    engine = EngineChoice(chunk=512, activation_bytes=10_000, checkpoint_layers=False)
    roomy = plan(cfg, Workload(2_100_000), Cluster(8, 10_000, zero=3), engine)
    tight = plan(cfg, Workload(2_100_000), Cluster(8, 96, zero=3), engine)
    assert roomy["boundary_every"] == 1 and roomy["per_rank"]["boundary states"] == fixed * mine
    k = tight["boundary_every"]
    assert k == math.isqrt(mine - 1) + 1 > 1
    assert tight["per_rank"]["boundary states"] == fixed * (-(-mine // k) + k) < fixed * mine / 4


def test_a_rank_holds_its_block_of_a_chunk_under_the_split_schedule():
    """Every family splits each chunk over the group: a rank's chunk activations are 1/C of a chunk's."""
    qwen = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    glm = json.loads((REF / "glm5" / "config.json").read_text())
    engine = EngineChoice(activation_bytes=10_000, chunk=2048, checkpoint_layers=False)
    q = plan(qwen, Workload(2_100_000), Cluster(8, 96, zero=1), engine)["per_rank"]["one chunk's activations"]
    g = plan(glm, Workload(2_100_000), Cluster(32, 96, zero=1), engine)["per_rank"]["one chunk's activations"]
    assert q == pytest.approx(10_000 * 2048 / 8, rel=1e-2) and g == pytest.approx(10_000 * 2048 / 32, rel=1e-2)


def test_work_per_rank_of_the_seeds_set_up():
    """The counted model of one exact step: the split schedule gives each of 8 ranks 1/8 of the one-rank work
    (within 2%: Qwen3.5's widened recurrence), where repeating the token-local work cost 2.5x that; GLM-5 on 32
    ranks gets 1/32 of it, where repeating cost 4x, and sends its DSA selection and queries."""
    from longstraw.tools.work import step_time, step_work

    qwen = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    w = step_work(qwen, 2_100_000, 8, 2048, 8, 1024)
    assert w["flops_even"] == pytest.approx(w["flops_one_rank"] / 8)
    assert 1.0 <= w["balance"] <= 1.02 and w["flops_replicated_busiest"] > 2 * w["flops_busiest"]
    assert w["sent_bytes"] > w["sent_bytes_gradients"] > 0
    t = step_time(w, 400, 100)
    assert t["step_s"] == pytest.approx(w["flops_busiest"] / 400e12 + w["sent_bytes"] / 100e9)
    assert step_work(qwen, 2_100_000, 1, 2048, 8, 1024)["sent_bytes"] == 0
    glm = json.loads((REF / "glm5" / "config.json").read_text())
    g = step_work(glm, 2_100_000, 32, 2048, 32, 1024)
    assert g["balance"] == pytest.approx(1.0) and g["flops_replicated_busiest"] > 4 * g["flops_busiest"]
    assert g["sent_bytes"] > 2 * g["sent_bytes_gradients"] > 0  # the gradients' reduction is not all it sends
    with pytest.raises(ValueError, match="--tflops"):
        step_time(w, 0, 100)


def test_zero3_picks_the_prompt_order_and_counts_its_weight_gathers():
    """Under ZeRO-3 the plan takes the layer-major prompt when its checkpoints fit a quarter of the GPU (GLM-5 on
    32 ranks of 141 GB, with LoRA: 18 hidden states of 65,625 tokens), not when they do not (Qwen3.5-27B on 8: 16 of 262,500
    tokens plus the Gated DeltaNet states at every chunk start), and the work model counts the gathers of that
    order."""
    from longstraw.tools.work import step_work

    glm = json.loads((REF / "glm5" / "config.json").read_text())
    lora = {"r": 16, "target_modules": ["q_a_proj", "o_proj"]}
    engine = EngineChoice(activation_bytes=10_000, chunk=2048)
    g = plan(glm, Workload(2_100_000, lora=lora), Cluster(32, 141, zero=3), engine)
    assert g["prompt_order"] == "layers"
    assert g["per_rank"]["layer-major checkpoints"] == pytest.approx(18 * 2_100_000 / 32 * 6144 * 2)
    qwen = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    q = plan(qwen, Workload(2_100_000), Cluster(8, 96, zero=3), engine)
    assert q["prompt_order"] == "chunks" and q["per_rank"]["layer-major checkpoints"] == 0
    assert q["layer_major_bytes"] > 96e9 / 4
    chunks = -(-2_100_000 // 2048)
    by_chunk = step_work(qwen, 2_100_000, 8, 2048, 8, 1024, zero=3, by_layer=False)
    by_layer = step_work(qwen, 2_100_000, 8, 2048, 8, 1024, zero=3, by_layer=True)
    assert by_chunk["weight_gathers"] == 3 * chunks + 2 * 1  # 8 branches spread over 8 ranks: one each
    assert by_layer["weight_gathers"] == 4 + 2 * 1
    assert by_chunk["sent_bytes_weight_gathers"] > 300 * by_layer["sent_bytes_weight_gathers"]
    assert step_work(qwen, 2_100_000, 8, 2048, 8, 1024, zero=1)["weight_gathers"] == 0


def test_search_takes_checkpointing_only_when_the_whole_graph_does_not_fit():
    """Of the (chunk, checkpointing) pairs that fit with a tenth of the GPU left, the plan takes the one without
    checkpointing and the largest chunk; on a smaller GPU it turns checkpointing on; a given pair is kept."""
    qwen = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    work = Workload(2_100_000, rope_scaling={"rope_type": "yarn", "factor": 16})
    engine = EngineChoice(activation_bytes=20_000_000)
    roomy = plan(qwen, work, Cluster(8, 400, zero=3, offload="cpu"), engine)
    assert roomy["searched"] and not roomy["checkpoint_layers"] and roomy["chunk"] == 16384
    tight = plan(qwen, work, Cluster(8, 80, zero=3, offload="cpu"), engine)
    assert tight["checkpoint_layers"] and tight["exact_bytes"] <= 0.9 * 80e9
    hidden = 5120 * 2
    block = tight["chunk"] / 8
    layer = -(-20_000_000 // 64)
    assert tight["per_rank"]["one chunk's activations"] == pytest.approx((64 * hidden + layer) * block)
    given = plan(qwen, work, Cluster(8, 80, zero=3, offload="cpu"),
                 EngineChoice(chunk=1024, checkpoint_layers=False, activation_bytes=20_000_000))
    assert not given["searched"] and given["chunk"] == 1024 and not given["checkpoint_layers"]
    assert given["exact_bytes"] > tight["exact_bytes"]


def test_model_state_by_precision_zero_and_offload():
    """The optimizer's bytes as train/precision.py counts them; LoRA adds the frozen base weights."""
    psi, n = 1_000_000, 8
    assert model_state_bytes(psi, 0, 3, n) == {"device": 18 * psi / n, "host": 0.0}
    off = model_state_bytes(psi, 0, 3, n, offload="cpu")  # master, its gradient and moments on the host
    assert off == {"device": 4 * psi / n, "host": 16 * psi / n}
    assert model_state_bytes(psi, 0, 0, n, precision="fp32")["device"] == 16 * psi
    lora = model_state_bytes(psi, 1000, 3, n)  # frozen bf16 base shards, fp32 adapters trained
    assert lora["device"] == 2 * psi / n + 16 * 1000 / n
    with pytest.raises(ValueError, match="offload"):
        model_state_bytes(psi, 0, 3, n, offload="disk")


@pytest.fixture(scope="module")
def qwen_profile():
    return activation_profile(json.loads((REF / "qwen3_5-27b" / "config.json").read_text()))


def test_goal_qwen3_5_27b_fits_on_8_gpus(qwen_profile):
    """The seeds' set-up on the measured GPU profile: exact at 2.1M tokens on 8 x 96 GB with CPU optimizer offload
    fits with at least 8 GB to spare, and detached at 4.46M positions fits; without RoPE scaling capture would
    refuse the prompt. (The step's code at that size under fake tensors peaks within 10% of the planner's figure:
    bench/rehearse_goal.py, minutes, so not here; tests/tools/test_rehearse.py holds the rehearsal to real runs.)"""
    qwen = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    cluster, engine = Cluster(8, 96, zero=3, offload="cpu"), EngineChoice(profile=qwen_profile)
    rope = {"rope_type": "yarn", "factor": 16}
    r = plan(qwen, Workload(2_100_000, rope_scaling=rope), cluster, engine)
    assert r["positions_accepted"] and r["exact_fits"] and 96e9 - r["exact_bytes"] >= 8e9
    assert r["chunk"] == 16384 and r["checkpoint_layers"] and r["prompt_order"] == "chunks"  # what the bench rehearses
    stress = plan(qwen, Workload(4_460_000, rope_scaling={"rope_type": "yarn", "factor": 32}), cluster, engine)
    assert stress["positions_accepted"] and stress["detached_fits"]
    assert not plan(qwen, Workload(2_100_000), cluster, engine)["positions_accepted"]


def test_glm5_fits_32_gpus_with_lora_by_expert_parallelism():
    """GLM-5 at 2.1M tokens on 32 x 96 GB (ZeRO-3, yarn:16), LoRA on the attention projections: FSDP gathering a
    whole MoE layer (9.7B expert parameters, and the one prefetched) does not fit; each rank keeping its 8 experts
    whole (expert parallelism, the default there) fits, the prompt walked chunk by chunk; layer by layer it fits
    too, holding its checkpoints on top. The flat activation figure stands in for the measured profile (the
    goal's own numbers: docs/planner.md)."""
    glm = json.loads((REF / "glm5" / "config.json").read_text())
    work = Workload(2_100_000, rope_scaling={"rope_type": "yarn", "factor": 16},
                    lora={"r": 16, "target_modules": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]})
    engine = EngineChoice(activation_bytes=40_000_000)
    gathered = plan(glm, work, Cluster(32, 96, zero=3, expert_parallel=False), engine)
    local = plan(glm, work, Cluster(32, 96, zero=3), engine)
    assert local["expert_parallel"] and not gathered["expert_parallel"]
    assert not gathered["exact_fits"] and local["exact_fits"] and local["prompt_order"] == "chunks"
    layers = plan(glm, work, Cluster(32, 96, zero=3), EngineChoice(activation_bytes=40_000_000, prompt_order="layers"))
    assert layers["exact_fits"] and layers["prompt_order"] == "layers"
    assert layers["exact_bytes"] == pytest.approx(local["exact_bytes"] + layers["per_rank"]["layer-major checkpoints"])
    experts = 2 * 2 * 256 * 3 * 6144 * 2048  # two layers' experts, bf16
    drop = gathered["per_rank"]["FSDP gathered units"] - local["per_rank"]["FSDP gathered units"]
    assert 0.95 * experts <= drop <= experts  # the largest unit is then a dense-MLP layer
    with pytest.raises(ValueError, match="split evenly over the 24 GPUs"):
        plan(glm, work, Cluster(24, 96, zero=3, expert_parallel=True), engine)


def test_routing_replay_adds_each_ranks_prompt_experts_to_its_state():
    """GLM-5 under moe_routing_replay: every MoE layer but the last decoder layer keeps top-8 expert ids of 1 byte
    (256 experts) per prompt token, a rank its own share; the count is the config's, not the engine's."""
    cfg = json.loads((REF / "glm5" / "config.json").read_text())
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] - 1  # the last layer's MLP never runs
    assert cfg["n_routed_experts"] <= 256
    cluster, engine = Cluster(8, 141, zero=3), EngineChoice(chunk=4096, checkpoint_layers=True, activation_bytes=10**6)
    off = plan(cfg, Workload(2_100_000), cluster, engine)
    on = plan(cfg, Workload(2_100_000, routing_replay=True), cluster, engine)
    want = moe_layers * cfg["num_experts_per_tok"] * 2_100_000 / 8
    assert on["per_rank"]["MoE routing (replay)"] == pytest.approx(want)
    assert "MoE routing (replay)" not in off["per_rank"]
    assert on["exact_bytes"] - off["exact_bytes"] == pytest.approx(want)
