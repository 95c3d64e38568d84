"""`Example`: one prompt with its reference answer and what a reward needs to check a response."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)
