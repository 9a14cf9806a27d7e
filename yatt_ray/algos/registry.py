"""Name -> function registries for advantage estimators, policy losses, KL estimators and loss aggregations.

A config names an algorithm by string (``algo.advantage = "grpo"``); the code looks it up here. Registering a
name twice is a programming error and raises at import time; looking up an unknown name raises
`UnknownNameError` whose message lists every valid name, so a typo in a config is fixed from the message alone.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from yatt_ray.errors import UnknownNameError, YattError

T = TypeVar("T")

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "DuplicateNameError",
    "Registry",
]


class DuplicateNameError(YattError, ValueError):
    """Two objects were registered under one name in the same registry."""


class Registry(Generic[T]):
    """A small mapping from names to objects (usually functions) of one kind.

    ``kind`` is the human name used in error messages, e.g. ``"advantage estimator"``. Example::

        LOSSES: Registry[Callable] = Registry("policy loss")

        @LOSSES.register("my_loss")
        def my_loss(logp, old_logp, advantages): ...

        assert LOSSES.get("my_loss") is my_loss
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers its target under ``name`` and returns the target unchanged.

        Raises `DuplicateNameError` (a `YattError` and a `ValueError`) if ``name`` is already taken, and
        `ValueError` if ``name`` is not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        self._check_free(name)

        def decorator(obj: T) -> T:
            self._check_free(name)  # again: the name may have been taken between register() and this call
            self._entries[name] = obj
            return obj

        return decorator

    def _check_free(self, name: str) -> None:
        if name in self._entries:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is already registered (to {self._entries[name]!r}); "
                f"pick another name, or remove the other registration"
            )

    def get(self, name: str) -> T:
        """The object registered as ``name``; raises `UnknownNameError` listing the valid names (sorted)."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            pass
        valid = self.names()
        message = f"unknown {self.kind} {name!r}; valid: {', '.join(valid) if valid else '(none registered)'}"
        close = difflib.get_close_matches(str(name), valid, n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
        raise UnknownNameError(message)

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable] = Registry("KL estimator")
LOSS_AGGREGATIONS: Registry[Callable] = Registry("loss aggregation")
