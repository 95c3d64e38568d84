"""Data: tokenizers (byte-level or an HF tokenizer.json), examples, and JSONL prompt datasets."""

from .example import Example
from .jsonl import JsonlIndex, iter_jsonl
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, load_tokenizer, stop_ids

__all__ = ["ByteTokenizer", "Example", "HFTokenizer", "JsonlIndex", "Tokenizer", "check_vocab", "iter_jsonl",
           "load_tokenizer", "stop_ids"]
