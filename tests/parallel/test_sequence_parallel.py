"""The prefix state sharded over 2, 3 and 4 gloo ranks gives what one process gives: the state itself (each
rank's rows), replay log-probs, greedy rollout tokens, and the exact gradient (equal to naive). GLM-5's DSA
selects its top-20 over the whole sharded prefix (a 40-token prompt: sparse in most chunks and every branch)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import longstraw as ls
from longstraw.engine.chunks import held_rows, prompt_chunks
from longstraw.parallel import SequenceGroup, SequenceParallel
from tests.conftest import GLM, flat_grad, rel_err, tiny_config, tiny_model
from tests.parallel.launch import run_ranks

PROMPTS = {"qwen3": 23, "qwen3_5_text": 23, "glm_moe_dsa": 41}  # states of 22 / 40 tokens: uneven over 3 ranks
CHUNK = 4
LENGTHS = (5, 2, 7)
ADV = [1.0, -0.3, -0.7]
GREEDY = ls.SamplingSettings(max_new_tokens=6, temperature=0)
SAMPLED = ls.SamplingSettings(max_new_tokens=7, stop_ids=[3])


def layout(length: int, world: int) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """The chunks of a `length`-token state on `world` ranks, and the positions of each rank's rows."""
    ranks = []
    for r in range(world):
        g = SequenceGroup()
        g.rank, g.size = r, world
        chunks = prompt_chunks(length, CHUNK, g)
        ranks.append(held_rows(chunks, g).positions())
    return chunks, ranks


def group(arch: str):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (PROMPTS[arch],), generator=g)
    return prompt, [torch.randint(0, 97, (n,), generator=g) for n in LENGTHS]


def model(arch: str):
    if arch == "glm_moe_dsa":
        torch.manual_seed(0)
        return ls.build_model(GLM, dtype=torch.float64)
    return tiny_model(arch, dtype=torch.float64)


def one_rank(rank: int, world: int, arch: str) -> dict[str, torch.Tensor]:
    """Everything a rank computes with the sharded state."""
    sp = SequenceParallel()
    m = model(arch)
    prompt, responses = group(arch)
    cfg = ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0)
    state = ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
    out = {f"state.{i}.{j}": t for i, layer in enumerate(state.layers) for j, t in enumerate(layer.tensors())}
    out |= {f"logp.{i}": lp for i, lp in enumerate(ls.score(m, state, responses, parallel=sp))}
    samples = ls.rollout(m, state, GREEDY, ls.Draw(n=2), parallel=sp)
    out |= {f"greedy.{i}": s.tokens for i, s in enumerate(samples)}
    for mode in ("detached", "exact"):
        m.zero_grad(set_to_none=True)
        ls.grpo_backward(m, prompt, responses, ADV, mode=mode, engine=cfg, parallel=sp)
        out[f"grad.{mode}"] = flat_grad(m)
    # exact again, the last chunks' graphs kept from capture instead of recomputed
    m.zero_grad(set_to_none=True)
    ls.grpo_backward(m, prompt, responses, ADV, mode="exact", engine=cfg.model_copy(update={"prompt_graph_budget": None}),
                     parallel=sp)
    out["grad.exact_kept"] = flat_grad(m)
    # exact with per-layer activation checkpointing: each layer's forward (and its collectives) again in the backward
    m.zero_grad(set_to_none=True)
    ls.grpo_backward(m, prompt, responses, ADV, mode="exact", engine=cfg.model_copy(update={"checkpoint_layers": True}),
                     parallel=sp)
    out["grad.exact_checkpointed"] = flat_grad(m)
    return out


def reference(arch: str) -> tuple[torch.nn.Module, ls.PrefixState, dict[str, torch.Tensor]]:
    m = model(arch)
    prompt, responses = group(arch)
    state = ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK))
    out = {f"logp.{i}": lp for i, lp in enumerate(ls.score(m, state, responses))}
    out |= {f"greedy.{i}": s.tokens for i, s in enumerate(ls.rollout(m, state, GREEDY, ls.Draw(n=2)))}
    for mode in ("naive", "detached", "exact"):
        m.zero_grad(set_to_none=True)
        ls.grpo_backward(m, prompt, responses, ADV, mode=mode, engine=ls.EngineConfig(prompt_chunk=CHUNK))
        out[f"grad.{mode}"] = flat_grad(m)
    return m, state, out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
def test_sharded_state_matches_one_process(arch, world):
    _, state, ref = reference(arch)
    ranks = run_ranks(world, one_rank, arch, timeout=120)
    _, positions = layout(PROMPTS[arch] - 1, world)
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(PROMPTS[arch] - 1))  # the ranks tile it
    for i, layer in enumerate(state.layers):
        for j, whole in enumerate(layer.tensors()):
            if layer.token_axis is None:  # fixed-size: every rank holds the whole prompt's
                parts = [r[f"state.{i}.{j}"] for r in ranks]
                assert all(torch.allclose(p, whole, rtol=1e-10, atol=1e-12) for p in parts)
            else:  # each rank holds exactly its rows (its block of every chunk), the one-process rows
                for r, pos in zip(ranks, positions):
                    assert torch.allclose(r[f"state.{i}.{j}"], whole.index_select(-2, pos), rtol=1e-10, atol=1e-12)
    for r in ranks:
        for key, want in ref.items():
            if key.startswith("logp."):
                assert torch.allclose(r[key], want, rtol=1e-10, atol=1e-12), key
            elif key.startswith("greedy."):
                assert torch.equal(r[key], want), key
        assert rel_err(r["grad.exact"], ref["grad.exact"]) <= 1e-10
        assert rel_err(r["grad.exact"], ref["grad.naive"]) <= 1e-10
        assert rel_err(r["grad.exact_kept"], ref["grad.naive"]) <= 1e-10
        assert rel_err(r["grad.exact_checkpointed"], ref["grad.naive"]) <= 1e-10
        assert rel_err(r["grad.detached"], ref["grad.detached"]) <= 1e-10
        for key in ("grad.exact", "grad.exact_kept", "grad.exact_checkpointed", "grad.detached"):  # replicas stay bitwise in step
            assert torch.equal(r[key], ranks[0][key]), key
    assert rel_err(ref["grad.detached"], ref["grad.naive"]) > 1e-2  # the comparison can tell the modes apart


def sparse_boundary_rank(rank: int, world: int, every: int) -> dict[str, torch.Tensor]:
    m = model("qwen3_5_text")
    prompt, responses = group("qwen3_5_text")
    cfg = ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0, boundary_every=every)
    stats = ls.grpo_backward(m, prompt, responses, ADV, engine=cfg, parallel=SequenceParallel())
    return {"grad": flat_grad(m), "peak_state_bytes": torch.tensor(stats["peak_state_bytes"])}


@pytest.mark.parametrize("world,every", [(2, 2), (3, 4)])
def test_sparse_boundaries_are_regenerated_by_all_ranks(world, every):
    """boundary_every > 1 sharded: each rank keeps every k-th boundary of its own chunks; the others are
    recomputed from the last kept one (sent by its owner) by all ranks together. Same exact gradient, fewer
    boundary bytes per rank."""
    m = model("qwen3_5_text")
    prompt, responses = group("qwen3_5_text")
    ls.grpo_backward(m, prompt, responses, ADV, mode="naive", engine=ls.EngineConfig(prompt_chunk=CHUNK))
    want = flat_grad(m)
    sparse, dense = run_ranks(world, sparse_boundary_rank, every), run_ranks(world, sparse_boundary_rank, 1)
    for s, d in zip(sparse, dense):
        assert rel_err(s["grad"], want) <= 1e-10
        assert torch.equal(s["grad"], sparse[0]["grad"])
    fixed = sum(s.fixed_bytes for s in ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK)).layers)
    # 22 tokens in chunks of 4: boundaries kept at chunks 0, k, 2k, ..., by the ranks in turn
    n = len(layout(22, world)[0])
    for r in range(world):
        dropped = sum(1 for i in range(n) if i % world == r) - sum(1 for i in range(0, n, every) if i // every % world == r)
        assert int(dense[r]["peak_state_bytes"]) - int(sparse[r]["peak_state_bytes"]) == dropped * fixed


def bad_input(rank: int, world: int, case: str) -> dict[str, torch.Tensor]:
    """Each rank reports the error it got (as bytes of its message), or none."""
    sp = SequenceParallel()
    m = model("qwen3")
    prompt, responses = group("qwen3")
    try:
        if case == "different prompts":
            ls.capture(m, prompt if rank else prompt.flip(0), ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
        elif case == "different responses":
            rs = responses if rank else responses[::-1]
            ls.grpo_backward(m, prompt, rs, ADV, engine=ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
        elif case == "prompt shorter than the group":
            ls.capture(m, prompt[:world], ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
        elif case == "different chunk sizes":  # before any collective that depends on it, on every rank
            ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK * 2 if rank == 1 else CHUNK), parallel=sp)
        elif case == "different plans":  # the same settings resolved apart: the plans the ranks run are checked
            engine = ls.EngineConfig(prompt_chunk=CHUNK)
            plan = ls.engine.plan_group(m, engine, prompt.numel(), parallel=sp, exact=False)
            ls.capture(m, prompt, engine, plan=replace(plan, head_chunk=plan.head_chunk + rank), parallel=sp)
        elif case == "different branch batches":
            state = ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
            ls.score(m, state, responses, engine=ls.EngineConfig(branch_batch=1 + rank), parallel=sp)
        elif case == "state of another group":
            state = ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK))
            ls.score(m, state, responses, parallel=sp)
    except ValueError as e:
        return {"error": torch.tensor(list(str(e).encode()), dtype=torch.uint8)}
    return {}


@pytest.mark.parametrize("case,message", [
    ("different prompts", "passed different prompt"),
    ("different responses", "passed different responses"),
    ("prompt shorter than the group", "without a token"),
    ("state of another group", "one rank's shard|not rank"),
    ("different chunk sizes", r"different engine settings \(prompt_chunk: rank 0 has 4, rank 1 has 8, rank 2 has 4\)"),
    ("different plans", r"different capture settings \(head_chunk: rank 0 has (\d+), rank 1 has (?!\1)\d+"),
    ("different branch batches", r"different engine settings \(branch_batch: rank 0 has 1, rank 1 has 2, rank 2 has 3\)"),
])
def test_bad_input_fails_clearly_on_every_rank(case, message):
    import re

    ranks = run_ranks(3, bad_input, case, timeout=90)
    for r in ranks:
        assert "error" in r, case
        assert re.search(message, bytes(r["error"].tolist()).decode())


def branch_parallel_rank(rank: int, world: int, arch: str, dp: int, mode: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    sp = SequenceParallel.from_mesh(init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "sp")))
    m = model(arch)
    prompt, responses = group(arch)
    responses = responses + responses[:1]  # G = 4: divisible by the data-parallel groups
    stats = ls.grpo_backward(m, prompt, responses, ADV + [0.4], mode=mode, engine=ls.EngineConfig(prompt_chunk=CHUNK),
                             parallel=sp)
    return {"grad": flat_grad(m), "loss": torch.tensor(stats["loss"], dtype=torch.float64)}


@pytest.mark.parametrize("world,dp,arch,mode", [(4, 2, "qwen3_5_text", "exact"), (2, 2, "qwen3", "exact"),
                                                (4, 4, "glm_moe_dsa", "exact"), (4, 2, "qwen3", "detached")])
def test_branch_groups_split_the_branches(world, dp, arch, mode):
    """N ranks as N/C sequence-parallel groups, each replaying a quarter or half of the branches."""
    m = model(arch)
    prompt, responses = group(arch)
    stats = ls.grpo_backward(m, prompt, responses + responses[:1], ADV + [0.4], mode="naive",
                             engine=ls.EngineConfig(prompt_chunk=CHUNK))
    want = flat_grad(m)
    if mode == "detached":
        m.zero_grad(set_to_none=True)
        ls.grpo_backward(m, prompt, responses + responses[:1], ADV + [0.4], mode=mode,
                         engine=ls.EngineConfig(prompt_chunk=CHUNK))
        want = flat_grad(m)
    ranks = run_ranks(world, branch_parallel_rank, arch, dp, mode, timeout=120)
    for r in ranks:
        assert rel_err(r["grad"], want) <= 1e-10
        assert float(r["loss"]) == pytest.approx(stats["loss"], abs=1e-12)
        assert torch.equal(r["grad"], ranks[0]["grad"])


def uneven_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    sp = SequenceParallel.from_mesh(init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "sp")))
    prompt, responses = group("qwen3")
    try:
        ls.grpo_backward(model("qwen3"), prompt, responses, ADV, parallel=sp)
    except ValueError as e:
        return {"error": torch.tensor(list(str(e).encode()), dtype=torch.uint8)}
    return {}


def test_group_size_must_split_over_branch_groups():
    for r in run_ranks(2, uneven_rank, timeout=60):
        assert "does not split evenly over 2" in bytes(r["error"].tolist()).decode()


@pytest.mark.parametrize("zero", [None, 3])
def test_step_cli_runs_sharded_under_torchrun(tmp_path, capsys, zero):
    """`longstraw step --nproc 2 [--zero 3]`: torchrun, two gloo ranks, half the state each (and, with ZeRO-3,
    half the parameters each), the one-process gradient."""
    import yaml

    from longstraw.cli import main

    cfg = {"model": {"random": tiny_config("qwen3_5_text")}, "prompt_tokens": 60, "responses": 4,
           "response_tokens": [3, 6], "modes": ["naive", "exact"], "threads": 1, "engine": {"prompt_chunk": 16}}
    path = tmp_path / "step.yaml"
    path.write_text(yaml.safe_dump(cfg))
    extra = [] if zero is None else ["--zero", str(zero)]
    assert main(["step", "--config", str(path), "--nproc", "2", "--json", str(tmp_path / "r.json"),
                 "--no-progress", *extra]) == 0
    rows = {r["mode"]: r for r in __import__("json").loads((tmp_path / "r.json").read_text())}
    name = "exact x2" + ("" if zero is None else f" zero{zero}")
    sharded = rows[name]
    assert sharded["grad_rel_err_vs_one_process"] <= 1e-5 and sharded["grad_rel_err_vs_naive"] <= 1e-5
    assert len(sharded["per_rank_state_bytes"]) == 2
    fixed = sum(s.fixed_bytes for s in ls.capture(ls.build_model(tiny_config("qwen3_5_text")), torch.arange(60)).layers)
    # each rank: half of the per-token rows (uneven by at most one token), all of the fixed-size state
    per_token = (rows["exact"]["state_bytes"] - fixed) / 59
    for got in sharded["per_rank_state_bytes"]:
        assert abs(got - fixed - per_token * 59 / 2) <= per_token
    params = rows["exact"]["param_bytes"]
    if zero is None:
        assert sharded["per_rank_param_bytes"] == [params, params]
    else:
        assert sum(sharded["per_rank_param_bytes"]) == params and max(sharded["per_rank_param_bytes"]) < 0.75 * params
    assert name in capsys.readouterr().out


def disagreeing_sampler_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank 1's sampler draws other tokens than rank 0's (as two GPUs may on a near-tie): the group still decodes
    rank 0's tokens, in step (the same number of steps, no hang)."""
    import importlib

    rollout_module = importlib.import_module("longstraw.rollout")  # `longstraw.rollout` is also the function
    if rank == 1:
        real = rollout_module.sample_no_sync
        rollout_module.sample_no_sync = lambda probs, gens: (real(probs, gens) + 1) % probs.shape[-1]
    m = model("qwen3_5_text")
    prompt, _ = group("qwen3_5_text")
    state = ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK), parallel=SequenceParallel())
    samples = ls.rollout(m, state, SAMPLED, ls.Draw(n=3, seed=5), parallel=SequenceParallel())
    return {f"tokens.{i}": s.tokens for i, s in enumerate(samples)}


def test_sampled_tokens_are_agreed_inside_the_group():
    m = model("qwen3_5_text")
    prompt, _ = group("qwen3_5_text")
    want = ls.rollout(m, ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK)), SAMPLED, ls.Draw(n=3, seed=5))
    ranks = run_ranks(2, disagreeing_sampler_rank, timeout=90)
    for r in ranks:
        assert [r[f"tokens.{i}"].tolist() for i in range(3)] == [s.tokens.tolist() for s in want]


LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj", "down_proj", "q_a_proj",
                "kv_a_proj_with_mqa"]


def lora_model(arch: str) -> torch.nn.Module:
    m = model(arch)
    torch.manual_seed(1)
    ls.add_lora(m, r=4, target_modules=[t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in m.named_modules())])
    for name, p in m.named_parameters():  # PEFT starts B at zero: give every adapter a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return m


def lora_rank(rank: int, world: int, arch: str, zero: int, checkpointed: bool) -> dict[str, torch.Tensor]:
    from longstraw.parallel import full_tensor, shard_model

    sp = SequenceParallel()
    m = lora_model(arch)
    if zero:
        shard_model(m, zero, sp)
    prompt, responses = group(arch)
    engine = ls.EngineConfig(prompt_chunk=CHUNK)
    if checkpointed:
        engine = ls.EngineConfig(prompt_chunk=CHUNK, checkpoint_layers=True, prompt_order="chunks",
                                 prompt_graph_budget=0)
    ls.grpo_backward(m, prompt, responses, ADV, mode="exact", engine=engine, parallel=sp)
    return {"grad": torch.cat([full_tensor(p.grad).flatten() for p in m.parameters() if p.requires_grad])}


@pytest.mark.parametrize("world,zero,checkpointed", [(2, 0, False), (3, 0, False), (2, 3, False), (2, 3, True)])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
def test_lora_exact_gradient_split_over_ranks_equals_naive(arch, world, zero, checkpointed):
    """LoRA under the split schedule (frozen base weights, adapters' gradients summed over the group), with the
    adapters sharded by FSDP too (ZeRO-3), and with per-layer checkpointing of FSDP units chunk by chunk: the
    adapters' one-process naive gradient."""
    m = lora_model(arch)
    prompt, responses = group(arch)
    ls.grpo_backward(m, prompt, responses, ADV, mode="naive")
    want = torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad])
    for r in run_ranks(world, lora_rank, arch, zero, checkpointed, timeout=120):
        assert rel_err(r["grad"], want) <= 1e-10
