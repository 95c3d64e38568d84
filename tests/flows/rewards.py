"""A reward that a random tiny model earns unevenly (so advantages and gradients are not zero)."""


def digit_share(prompt_meta: dict, response_text: str) -> float:
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)
