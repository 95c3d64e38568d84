"""`LastUsed`: the one-slot memory a worker keeps of a stored artefact it last wrote or read (a prefix state, a
rollout's answers, the KL reference's log-probs), so that the next op of the same group takes it from memory and
reads the store only after a resume."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LastUsed(Generic[K, V]):
    """The last value used, under the key that names what it holds (e.g. an artefact's URL and digest)."""

    def __init__(self) -> None:
        self._key: K | None = None
        self._value: V | None = None

    @property
    def value(self) -> V | None:
        """The value held (None: nothing since the worker started, or since `clear`)."""
        return self._value

    def keep(self, key: K, value: V) -> V:
        self._key, self._value = key, value
        return value

    def get(self, key: K, read: Callable[[], V]) -> V:
        """The value held under `key`, else `read()`'s, kept in its place."""
        if self._value is not None and self._key == key:
            return self._value
        return self.keep(key, read())

    def clear(self) -> None:
        self._key = self._value = None
