"""The agent warm start: SFT on whole multi-turn transcripts (prompt, the model's call turn, the tool's observation
as ToolTurns renders it, the model's answer turn), the loss on the model's tokens only."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls
from longstraw.agents import ToolChat, ToolTurns
from longstraw.agents.builtin import ENVIRONMENTS
from longstraw.data.tokenizer import ByteTokenizer, HFTokenizer
from longstraw.problems import make_problem
from longstraw.train.sft import SFTConfig, _batch, run_sft, sft_loss, transcript
from tests.agents.test_agent_step import runs
from tests.agents.test_chat import TOOL_TEMPLATE
from tests.conftest import tiny_config, tiny_model
from tests.data.test_tokenizer import build_hf_dir

NAME = "record-lookup"
ENV = ENVIRONMENTS[NAME]
tok = ByteTokenizer()


def call_text(rid: str) -> str:
    return '<tool_call>\n{"name": "lookup", "arguments": {"id": "' + rid + '"}}\n</tool_call>'


def test_transcript_is_call_observation_answer():
    ex = make_problem(NAME, 2, 800, tok)
    chat = ToolChat(tok, ENV.tools)
    prompt, ids, mask = transcript(tok, chat, ENV, ex)
    assert prompt == list(ex.prompt.encode())
    call = tok.encode(call_text(ex.meta["id"])) + [tok.eos_id]
    # the observation, written out by hand in the plain chat format
    observation = list(f"\n<|tool|>\n{ex.answer}\n<|assistant|>\n".encode())
    answer = tok.encode(ex.answer) + [tok.eos_id]
    assert ids == call + observation + answer
    assert runs(mask) == [(True, 0, len(call)), (False, len(call), len(call) + len(observation)),
                          (True, len(call) + len(observation), len(ids))]
    # and what ToolTurns itself answers the same call with
    reply = ToolTurns(ENV.make({"answer": ex.answer, "meta": ex.meta}), chat).step(call)
    assert reply.tokens == observation and not reply.done


def test_hf_transcript_observation_is_tool_turns_rendering(tmp_path):
    pytest.importorskip("jinja2")
    hf = HFTokenizer(build_hf_dir(tmp_path, template=TOOL_TEMPLATE)[0])
    ex = make_problem(NAME, 3, 900, hf)
    chat = ToolChat(hf, ENV.tools)
    _, ids, mask = transcript(hf, chat, ENV, ex)
    (_, a, b), (_, c, d), (_, e, f) = runs(mask)
    assert ids[a:b] == hf.encode(call_text(ex.meta["id"])) + [hf.eos_id]
    reply = ToolTurns(ENV.make({"answer": ex.answer, "meta": ex.meta}), chat).step(ids[a:b])
    assert ids[c:d] == reply.tokens
    # written out by hand: the rest of the template's tool turn after the <|im_end|> the model wrote
    assert ids[c:d] == hf.encode(f"\n<|im_start|>user\n<tool_response>\n{ex.answer}\n</tool_response><|im_end|>\n"
                                 "<|im_start|>assistant\n")
    assert ids[e:f] == hf.encode(ex.answer) + [hf.eos_id]


def reference_loss(model, rows) -> torch.Tensor:
    """The mean cross-entropy of the model's tokens, each whole sequence run through the model alone."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for prompt, ids, mask in rows:
        seq = torch.tensor(prompt + ids)
        logp = torch.log_softmax(model(seq[None, :-1])[0].double(), -1)
        for j, (t, learn) in enumerate(zip(ids, mask)):
            if learn:
                total = total - logp[len(prompt) - 1 + j, t]
                count += 1
    return total / count


def test_loss_is_on_the_model_tokens_only():
    model = tiny_model("qwen3", dtype=torch.float64, vocab_size=tok.vocab_size, max_position_embeddings=2048)
    chat = ToolChat(tok, ENV.tools)
    rows = [transcript(tok, chat, ENV, make_problem(NAME, s, t, tok)) for s, t in ((1, 720), (2, 800))]
    pairs, masks = [(p, i) for p, i, _ in rows], [m for _, _, m in rows]
    inputs, targets = _batch(pairs, tok.pad_id, masks)
    first = min(len(p) for p, _ in pairs) - 1
    loss = sft_loss(model, inputs, targets, first)
    assert loss.item() == pytest.approx(reference_loss(model, rows).item(), rel=1e-10)

    def with_targets(new: list[list[int]]) -> torch.Tensor:
        """The loss with other tokens as the targets (the inputs unchanged)."""
        return sft_loss(model, inputs, _batch([(p, n) for p, n in zip((p for p, _ in pairs), new)], tok.pad_id,
                                              masks)[1], first)

    # other observation tokens as targets: the same loss; another model token: another loss
    observations = [[t if m else (t + 7) % 256 for t, m in zip(ids, mask)] for _, ids, mask in rows]
    assert with_targets(observations).item() == loss.item()
    answer_changed = [list(ids) for _, ids, _ in rows]
    answer_changed[0][-2] = (answer_changed[0][-2] + 1) % 256  # a digit of the answer
    assert with_targets(answer_changed).item() != pytest.approx(loss.item(), rel=1e-6)
    call_changed = [list(ids) for _, ids, _ in rows]
    call_changed[1][3] = (call_changed[1][3] + 1) % 256  # a byte of the call
    assert with_targets(call_changed).item() != pytest.approx(loss.item(), rel=1e-6)
    # and a mask that counted the observations would change it
    unmasked = sft_loss(model, inputs, _batch(pairs, tok.pad_id)[1], first)
    assert unmasked.item() != pytest.approx(loss.item(), rel=1e-6)


def test_agent_sft_smoke(tmp_path):
    cfg = SFTConfig(
        model={"random": tiny_config("qwen3", vocab_size=300, max_position_embeddings=2048)},
        task=NAME, prompt_tokens=720, task_options={"ask_by": "id"},
        agent={"env": NAME, "max_turns": 3, "max_new_tokens": 24},
        steps=3, batch=2, warmup=1, eval_examples=2, out=str(tmp_path / "ckpt"))
    r = run_sft(cfg, progress=False)
    for key in ("reward", "accuracy", "call_rate", "clean_call_rate"):
        assert 0.0 <= r[f"{key}_before"] <= 1.0 and 0.0 <= r[f"{key}_after"] <= 1.0
    assert r["final_loss"] < 6.0  # from about ln(300) = 5.7 at init, and some steps down
    assert torch.isfinite(ls.load_model(r["checkpoint"])(torch.randint(0, 300, (1, 8)))).all()


def test_agent_settings_are_checked():
    base = {"model": {"random": tiny_config("qwen3")}, "task": NAME}
    with pytest.raises(ValueError, match="not a built-in environment"):
        SFTConfig(**base, agent={"env": "nope"})
    with pytest.raises(ValueError, match="set task: record-lookup"):
        SFTConfig(**{**base, "task": "kv-retrieval"}, agent={"env": NAME})
    with pytest.raises(ValueError, match="extra"):
        SFTConfig(**base, agent={"env": NAME, "turns": 2})
