"""Tokenizers: a built-in byte tokenizer for the tiny default model and a loader for HF `tokenizer.json` files.

transformers is not needed: HF tokenizers load with the `tokenizers` package, chat templates render with `jinja2`
when it is installed (both imported only when an HF tokenizer is used).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

log = logging.getLogger("longstraw")


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer. `encode` adds no special tokens: the chat template owns them."""

    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str: ...


# how the plain format asks for tool calls: the same <tool_call> JSON as Qwen3's templates
PLAIN_TOOL_FORMAT = ('To call a tool, write <tool_call>\n{"name": <tool name>, "arguments": {<arguments>}}\n'
                     '</tool_call>. The tools:')


def _plain_tool_call(call: dict) -> str:
    """An assistant message's structured tool call ({"function": {"name", "arguments"}}) as <tool_call> JSON."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or "name" not in fn:
        raise ValueError(f"tool call {call!r} must be {{'type': 'function', 'function': {{'name': ..., "
                         f"'arguments': {{...}}}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # HF allows the arguments as a JSON string
        args = json.loads(args)
    call_json = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{call_json}\n</tool_call>"


def plain_chat(messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The fixed chat format used when a tokenizer has no (renderable) template of its own. With `tools` (function
    schemas), a `<|tools|>` block first lists them; tool results are messages of role "tool"."""
    parts = []
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        parts.append(f"<|tools|>\n{PLAIN_TOOL_FORMAT}\n{listed}\n")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
            raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [_plain_tool_call(c) for c in m["tool_calls"]])
        parts.append(f"<|{m['role']}|>\n{content}\n")
    # ends with the assistant header so that generation continues as the assistant
    return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, then <pad>=256, <bos>=257, <eos>=258. Needs no files."""

    PAD, BOS, EOS = 256, 257, 258
    vocab_size = 259
    pad_id = PAD
    bos_id: int | None = BOS
    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        # text never maps to special ids, so a prompt cannot smuggle in an <eos>
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # anything that is not a byte is skipped: specials, and ids from a model whose embedding table is padded
        # beyond the tokenizer's vocabulary (a sampled padding id must not crash a rollout)
        data = bytes(i for i in (int(x) for x in ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str:
        return plain_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove the file") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


# tried in order when no config names the end-of-sequence token
_COMMON_EOS = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class HFTokenizer:
    """A HF tokenizer directory: `tokenizer.json`, optionally `tokenizer_config.json` and `chat_template.jinja`."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {self.directory}: pass the directory of a HF tokenizer or checkpoint that "
                f"holds tokenizer.json, or 'byte' for the built-in byte tokenizer"
            )
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError("loading a HF tokenizer needs the `tokenizers` package: pip install tokenizers") from e
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        cfg_path = self.directory / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}

        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_id: int = self._find_eos()
        self.bos_id: int | None = self._id_of(self.bos_token, "bos_token") if self.bos_token else None
        pad = _token_text(cfg.get("pad_token"))
        # many causal-LM tokenizers define no pad token; padding is masked out, so eos serves
        self.pad_id: int = self._id_of(pad, "pad_token") if pad else self.eos_id
        self.chat_template = self._read_template(cfg)
        self._compiled = None
        if self.chat_template is not None and not _has_jinja2():
            log.warning("%s has a chat template but jinja2 is not installed; using the plain chat format "
                        "(pip install jinja2 to use the model's own template)", self.directory)

    def _id_of(self, token: str, field: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.directory}: {field} {token!r} from tokenizer_config.json is not in the "
                             f"vocabulary of tokenizer.json; the two files do not belong together")
        return i

    def _find_eos(self) -> int:
        if self.eos_token:
            return self._id_of(self.eos_token, "eos_token")
        # a checkpoint directory may name the eos id in its model or generation config instead
        for name in ("generation_config.json", "config.json"):
            p = self.directory / name
            if p.is_file():
                eos = _read_json(p).get("eos_token_id")
                eos = eos[0] if isinstance(eos, list) and eos else eos
                if isinstance(eos, int):
                    self.eos_token = self._tok.id_to_token(eos)
                    return eos
        for tok in _COMMON_EOS:
            i = self._tok.token_to_id(tok)
            if i is not None:
                self.eos_token = tok
                return i
        raise ValueError(f"{self.directory}: cannot tell the end-of-sequence token; set \"eos_token\" in "
                         f"{self.directory / 'tokenizer_config.json'}")

    def _read_template(self, cfg: dict) -> str | None:
        # newer HF checkpoints store the template in its own file
        jinja_file = self.directory / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
        return tpl if isinstance(tpl, str) else None

    def encode(self, text: str) -> list[int]:
        # no post-processor specials: the chat template already writes BOS etc. as text
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        # like ByteTokenizer: ids the vocabulary lacks are skipped (tokenizers skips large ones, not negative ones)
        return self._tok.decode([i for i in (int(x) for x in ids) if i >= 0], skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str:
        if self.chat_template is None or not _has_jinja2():
            return plain_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        # `tools` is passed only when given, so renderings without tools stay what they were
        extra = {"tools": tools} if tools else {}
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except Exception as e:
            raise ValueError(f"the chat template of {self.directory} failed to render these messages: {e}") from e

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r})"


def _has_jinja2() -> bool:
    try:
        import jinja2  # noqa: F401
    except ImportError:
        return False
    return True


def _compile_template(source: str):
    """Compiled like transformers does (sandboxed, trim/lstrip blocks), so HF templates render the same text."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(spec: str) -> Tokenizer:
    """"byte" (or "builtin") for the built-in byte tokenizer; otherwise a directory holding tokenizer.json."""
    if spec in ("byte", "builtin"):
        return ByteTokenizer()
    path = Path(spec)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer {spec!r} is neither 'byte'/'builtin' nor an existing directory; give "
                                f"the directory of a HF tokenizer (with tokenizer.json)")
    return HFTokenizer(path)


def stop_ids(tok: Tokenizer, stop_tokens: Sequence[str] = ()) -> tuple[int, ...]:
    """The ids that end an answer (an agent's turn): the tokenizer's end of sequence, then each of `stop_tokens`,
    which must be one token each (e.g. a base model's `<|im_end|>`, where its eos is `<|endoftext|>`)."""
    ids = [tok.eos_id]
    for text in stop_tokens:
        got = tok.encode(text)
        if len(got) != 1:
            raise ValueError(f"stop_tokens: {text!r} is {len(got)} tokens of {tok!r}, not one; list single tokens "
                             "of its vocabulary (e.g. '<|im_end|>', a special token of its chat template)")
        ids.append(got[0])
    return tuple(dict.fromkeys(ids))


def check_vocab(ids: Iterable[int], vocab_size: int, what: str) -> None:
    """Raise if any id lies outside [0, vocab_size): the tokenizer and the model do not belong together."""
    if hasattr(ids, "tolist"):  # tensors and arrays: one conversion instead of a Python call per element
        ids = ids.tolist()
    ids = list(ids)
    if not ids or (0 <= min(ids) and max(ids) < vocab_size):
        return
    pos, bad = next((i, x) for i, x in enumerate(ids) if not 0 <= x < vocab_size)
    raise ValueError(
        f"{what}: token id {bad} at position {pos} is outside the vocabulary (0..{vocab_size - 1}); the tokenizer "
        f"does not match the model: use the tokenizer that belongs to the model (its checkpoint directory) or a "
        f"model whose vocab_size covers the tokenizer's"
    )
