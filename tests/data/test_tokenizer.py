"""Byte tokenizer, HF tokenizer.json loading (a tiny BPE trained here), dispatch and vocabulary checks."""

from __future__ import annotations

import json

import pytest
import torch

import longstraw.data.tokenizer as tk
from longstraw.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, load_tokenizer, plain_chat

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Keys and values: k1a2b3: 123456, k9f8e7: 654321.",
    "Start at Dravon and follow the links 3 times.",
    "How many times does the sentence appear in the document above?",
] * 20
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_hf_dir(path, template: str | None = TEMPLATE, eos: str | None = "<|im_end|>"):
    """A HF tokenizer directory: byte-level BPE (so any text round-trips) + tokenizer_config.json."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": None, "pad_token": "<|endoftext|>"}
    if eos is not None:
        cfg["eos_token"] = {"content": eos, "__type": "AddedToken"}  # the dict form older configs use
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path, raw


TEXTS = ["hello world", "héllo wörld — 日本語 🙂", "", "line one\nline two\ttab", "k7f3a2: 123456"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_specials():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)
    assert isinstance(tok, Tokenizer)
    ids = [tok.bos_id] + tok.encode("abc") + [tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode(ids) == "abc"
    assert tok.decode(torch.tensor(ids)) == "abc"
    # text that looks like a special is plain bytes, never a special id
    assert max(tok.encode("<eos><pad>")) < 256
    # an id past the vocabulary (a padded model vocab) is skipped, invalid UTF-8 replaced
    assert tok.decode([104, 105, 300]) == "hi"
    assert tok.decode([0xFF]) == "\ufffd"


def test_byte_chat_template():
    text = ByteTokenizer().apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert "What is 2+2?" in text
    assert text.endswith("<|assistant|>\n")
    with pytest.raises(ValueError, match="role"):
        plain_chat([{"content": "no role"}])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return build_hf_dir(tmp_path_factory.mktemp("hf_tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_hf_round_trip(hf_dir, text):
    path, raw = hf_dir
    tok = HFTokenizer(path)
    ids = tok.encode(text)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_hf_specials(hf_dir):
    path, raw = hf_dir
    tok = HFTokenizer(path)
    assert isinstance(tok, Tokenizer)
    assert tok.eos_id == raw.token_to_id("<|im_end|>")
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    assert tok.bos_id is None
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    # specials are skipped on decode
    assert tok.decode(tok.encode("hi") + [tok.eos_id]) == "hi"
    # ids beyond the vocabulary (a padded model vocab) are skipped, as in ByteTokenizer
    assert tok.decode(tok.encode("hi") + [tok.vocab_size + 5, -1]) == "hi"


def test_hf_chat_template(hf_dir):
    path, _ = hf_dir
    tok = HFTokenizer(path)
    messages = [{"role": "user", "content": "count the foxes"}]
    text = tok.apply_chat_template(messages)
    try:
        import jinja2  # noqa: F401
    except ImportError:
        assert text == plain_chat(messages)
        return
    assert text == "<|im_start|>user\ncount the foxes<|im_end|>\n<|im_start|>assistant\n"
    # the special tokens in the rendered text encode as their single ids
    assert tok.encode(text).count(tok.eos_id) == 1


def test_hf_template_fallbacks(tmp_path, hf_dir, monkeypatch):
    messages = [{"role": "user", "content": "hi"}]
    no_template, _ = build_hf_dir(tmp_path / "plain", template=None)
    assert HFTokenizer(no_template).apply_chat_template(messages) == plain_chat(messages)
    # with a template but without jinja2, the plain format is used
    monkeypatch.setattr(tk, "_has_jinja2", lambda: False)
    assert HFTokenizer(hf_dir[0]).apply_chat_template(messages) == plain_chat(messages)


def test_hf_eos_from_common_names(tmp_path):
    path, raw = build_hf_dir(tmp_path / "noeos", eos=None)
    assert HFTokenizer(path).eos_id == raw.token_to_id("<|endoftext|>")


def test_hf_bad_eos_names_the_field(tmp_path):
    path, _ = build_hf_dir(tmp_path / "bad", eos="<|not_a_token|>")
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer(path)


def test_hf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        HFTokenizer(tmp_path)
    assert "tokenizer.json" in str(e.value) and str(tmp_path) in str(e.value)


def test_load_tokenizer_dispatch(hf_dir, tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer("builtin"), ByteTokenizer)
    path, _ = hf_dir
    assert isinstance(load_tokenizer(str(path)), HFTokenizer)
    assert isinstance(load_tokenizer(str(path / "tokenizer.json")), HFTokenizer)
    with pytest.raises(FileNotFoundError, match="byte"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_check_vocab():
    check_vocab([0, 5, 9], 10, "prompt")
    check_vocab([], 10, "prompt")
    check_vocab(torch.tensor([1, 2, 3]), 4, "prompt")
    with pytest.raises(ValueError) as e:
        check_vocab([1, 2, 12, 15], 10, "prompt")
    msg = str(e.value)
    assert "prompt" in msg and "12" in msg and "position 2" in msg and "tokenizer" in msg
    with pytest.raises(ValueError, match="-1"):
        check_vocab(torch.tensor([3, -1]), 10, "response 0")
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="258"):
        check_vocab(tok.encode("ab") + [tok.eos_id], 256, "response")
