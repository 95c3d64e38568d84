"""A reward that a random tiny model earns unevenly (so advantages and gradients are not zero)."""


def digit_share(prompt_meta: dict, response_text: str) -> float:
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


def letter_share(prompt_meta: dict, response_text: str) -> float | None:
    """A second reward, which does not apply (None) to an answer without a letter."""
    letters = sum(c.isalpha() for c in response_text)
    return letters / len(response_text) if letters else None
