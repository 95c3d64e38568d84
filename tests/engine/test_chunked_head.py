"""The chunked LM head (`CausalLM.token_logprobs`, models/common/head.py): the log-probs, entropies and gradients
of the plain head (`forward` then log-softmax over all logits), while the logits of all tokens never exist at once
and autograd keeps nothing of size tokens x vocab.

References: the plain forward with a log-softmax written out here, transformers' model, and naive mode.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import longstraw as ls
from longstraw.engine import capture
from longstraw.engine.replay import score
from longstraw.models.common.head import default_head_chunk
from tests.conftest import GLM, flat_grad, rel_err, tiny_model

ARCHS = ["qwen3", "qwen3_5_text", "glm_moe_dsa"]


def build(arch: str, dtype: torch.dtype = torch.float64, **overrides) -> torch.nn.Module:
    if arch == "glm_moe_dsa":
        torch.manual_seed(0)
        return ls.build_model({**GLM, **overrides}, dtype=dtype)
    return tiny_model(arch, dtype=dtype, **overrides)


def batch(vocab: int = 97, rows: int = 2, length: int = 30, start: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    return ids, torch.randint(0, vocab, (rows, length - start), generator=g), start


def plain(model, ids, targets, start):
    """The reference: all logits at once, then log-softmax, the targets' entries and the entropy."""
    logits = model(ids, logits_from=start)
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[..., None])[..., 0], entropy


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_chunked_values_equal_the_plain_head_fp64(arch, chunk):
    model = build(arch)
    ids, targets, start = batch()
    with torch.no_grad():
        want, want_ent = plain(model, ids, targets, start)
    for grad in (False, True):  # no autograd (score) and with autograd (replay: chunks checkpointed)
        with torch.set_grad_enabled(grad):
            got, ent = model.token_logprobs(ids, targets, logits_from=start, head_chunk=chunk, entropy=True)
        assert got.shape == ent.shape == targets.shape
        assert got.dtype == torch.float64 and got.requires_grad == grad and not ent.requires_grad
        assert float((got.detach() - want).abs().max()) <= 1e-12
        assert float((ent - want_ent).abs().max()) <= 1e-12
    # meaningful: log-probs and entropies vary over the tokens
    assert float(want.std()) > 0.1 and float(want_ent.std()) > 1e-3
    assert torch.equal(model.token_logprobs(ids, targets, logits_from=start, head_chunk=chunk).detach(), got.detach())


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_gradient_equals_the_plain_head_fp64(arch):
    model = build(arch)
    ids, targets, start = batch(seed=1)
    w = torch.randn(targets.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    (plain(model, ids, targets, start)[0] * w).sum().backward()
    want = flat_grad(model)
    for chunk in (1, 3, 10_000):
        model.zero_grad(set_to_none=True)
        (model.token_logprobs(ids, targets, logits_from=start, head_chunk=chunk) * w).sum().backward()
        assert rel_err(flat_grad(model), want) <= 1e-12, chunk
    assert float(model.lm_head.weight.grad.norm()) > 0


def test_chunked_head_matches_transformers():
    from tests.engine.test_exact import hf_twin

    model = build("qwen3", torch.float32)
    hf = hf_twin(model)
    ids, targets, start = batch(seed=3)
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids, use_cache=False).logits[:, start:].float(), dim=-1)
        got, ent = model.token_logprobs(ids, targets, logits_from=start, head_chunk=4, entropy=True)
    assert float((got - logp.gather(-1, targets[..., None])[..., 0]).abs().max()) <= 1e-4
    assert float((ent - -(logp.exp() * logp).sum(-1)).abs().max()) <= 1e-4


def test_head_chunk_setting():
    assert ls.EngineConfig().head_chunk is None
    assert ls.EngineConfig(head_chunk=7).head_chunk == 7
    for bad in (0, True, 2.0, "8"):
        with pytest.raises(ValidationError):
            ls.EngineConfig(head_chunk=bad)
    assert default_head_chunk(248_320) == 270  # ~256 MiB of fp32 logits at Qwen3.5's vocabulary
    assert default_head_chunk(2**30) == 1
    model = build("qwen3")
    ids, targets, start = batch()
    with pytest.raises(ValueError, match="targets"):
        model.token_logprobs(ids, targets[:, 1:], logits_from=start)
    with pytest.raises(ValueError, match=">= 1"):
        model.token_logprobs(ids, targets, logits_from=start, head_chunk=0)


# ---- the engine with a chunked head ------------------------------------------------------------------------


def group(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (40,), generator=g), [torch.randint(0, 97, (n,), generator=g) for n in (5, 1, 9, 4)]


ADV = [1.0, -0.5, 0.7, -1.2]


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_with_a_chunked_head_equals_naive_fp64(arch):
    """exact (head in chunks of 2 tokens, with and without per-layer checkpointing, 1 and 2 branches a batch)
    == naive with the plain head; the entropy statistic == the mean entropy of the plain logits."""
    model = build(arch)
    prompt, responses = group()
    model.zero_grad(set_to_none=True)
    s_naive = ls.grpo_backward(model, prompt, responses, ADV, mode="naive", engine=ls.EngineConfig(head_chunk=10_000))
    want = flat_grad(model)
    with torch.no_grad():
        ents = [plain(model, torch.cat([prompt, r[:-1]])[None], r[None], prompt.numel() - 1)[1] for r in responses]
    entropy = float(sum(e.sum() for e in ents)) / sum(r.numel() for r in responses)
    assert s_naive["entropy"] == pytest.approx(entropy, rel=1e-12, abs=0)
    for checkpoint_layers, branch_batch in ((False, 2), (True, 1)):
        engine = ls.EngineConfig(prompt_chunk=8, head_chunk=2, checkpoint_layers=checkpoint_layers,
                                 branch_batch=branch_batch)
        for mode in ("exact", "naive"):
            model.zero_grad(set_to_none=True)
            s = ls.grpo_backward(model, prompt, responses, ADV, mode=mode, engine=engine)
            assert rel_err(flat_grad(model), want) <= 1e-10, (mode, checkpoint_layers)
            assert s["loss"] == pytest.approx(s_naive["loss"], rel=1e-10, abs=1e-14)
            assert s["entropy"] == pytest.approx(entropy, rel=1e-10, abs=0)


def test_score_with_a_chunked_head():
    model = build("qwen3_5_text")
    prompt, responses = group(1)
    state = capture(model, prompt, ls.EngineConfig(prompt_chunk=8))
    want = score(model, state, responses, engine=ls.EngineConfig(branch_batch=2, head_chunk=10_000))
    got = score(model, state, responses, engine=ls.EngineConfig(branch_batch=2, head_chunk=3))
    with torch.no_grad():
        ref = [plain(model, torch.cat([prompt, r[:-1]])[None], r[None], prompt.numel() - 1)[0][0] for r in responses]
    for g, w, r in zip(got, want, ref):
        assert float((g - w).abs().max()) <= 1e-12 and float((g - r).abs().max()) <= 1e-10


# ---- memory ------------------------------------------------------------------------------------------------

VOCAB, TOKENS, CHUNK = 32768, 256, 32
LOGITS = TOKENS * VOCAB * 4  # one fp32 tensor of every token's logits: 32 MiB


def saved_bytes(model, fn) -> tuple[int, int, torch.Tensor]:
    """The storages autograd keeps for the backward of fn() (summed, and the largest), as engine/budget.py counts,
    leaving out the model's parameters."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), max(storages.values()), out


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops inside it made (forward and backward) alive at once; the model's
    parameters (which views of them would name) left out."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (s := t.untyped_storage()).data_ptr() not in self.weights:
                self.live.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def test_chunked_head_saves_and_holds_no_tokens_by_vocab_tensor():
    """What the head adds to the saved tensors and to the peak of forward + backward, over the layers alone (a
    head over no position): the plain head saves its log-softmax (tokens x vocab) and holds several such tensors at
    once; the chunked one saves nothing of that size and holds one chunk's (an eighth) beside the head's
    gradient."""
    model = build("qwen3", torch.float32, vocab_size=VOCAB)
    ids, targets, _ = batch(VOCAB, rows=1, length=TOKENS, start=0)
    w = torch.randn(targets.shape)
    runs = {"layers": lambda: model(ids, logits_from=TOKENS).sum(),
            "plain": lambda: (plain(model, ids, targets, 0)[0] * w).sum(),
            "chunked": lambda: (model.token_logprobs(ids, targets, head_chunk=CHUNK) * w).sum()}
    saved, largest, peak = {}, {}, {}
    for name, fn in runs.items():
        saved[name], largest[name], _ = saved_bytes(model, fn)
        model.zero_grad(set_to_none=True)
        with LiveBytes(model) as mode:
            fn().backward()
        peak[name] = mode.peak
    assert saved["plain"] - saved["layers"] >= LOGITS and largest["plain"] >= LOGITS  # the reference's log-softmax
    assert saved["chunked"] - saved["layers"] < LOGITS / 1000, saved
    assert largest["chunked"] == largest["layers"] < LOGITS / 8, largest
    assert peak["plain"] - peak["layers"] >= 2 * LOGITS, peak
    head_grad = VOCAB * model.config.hidden_size * 4  # a chunk's gradient of the head's weight, then added
    assert peak["chunked"] - peak["layers"] < head_grad + LOGITS / 4, peak


# ---- ZeRO-3 ------------------------------------------------------------------------------------------------


def zero3_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    from longstraw.parallel import SequenceParallel, full_tensor, shard_model

    m = shard_model(build("qwen3"), 3, SequenceParallel())
    prompt, responses = group()
    stats = ls.grpo_backward(m, prompt, responses, ADV, mode="exact", parallel=SequenceParallel(),
                             engine=ls.EngineConfig(prompt_chunk=8, head_chunk=2))
    grads = [full_tensor(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype) for p in m.parameters()]
    entropy = torch.tensor(stats["entropy"], dtype=torch.float64)
    return {"grad": torch.cat([g.flatten() for g in grads]), "entropy": entropy}


def test_zero3_exact_with_a_chunked_head_equals_one_process_naive():
    """The chunked head under FSDP2's ZeRO-3 (2 gloo ranks): the root unit (embedding, norm, head) is gathered
    for `token_logprobs` and its recompute in the backward; the gradient is one process's naive one."""
    from tests.parallel.launch import run_ranks

    model = build("qwen3")
    prompt, responses = group()
    s = ls.grpo_backward(model, prompt, responses, ADV, mode="naive")
    want = flat_grad(model)
    for r in run_ranks(2, zero3_rank, timeout=120):
        assert rel_err(r["grad"], want) <= 1e-10
        assert float(r["entropy"]) == pytest.approx(s["entropy"], rel=1e-10)
