"""Name -> function registries for advantage estimators, policy losses, KL estimators, loss aggregations and
off-policy corrections.

A config names an algorithm by string (``algo.advantage = "grpo"``); the code looks it up here. Registering a
name twice is a programming error and raises at import time; looking up an unknown name raises
`UnknownNameError` whose message lists every valid name, so a typo in a config is fixed from the message alone.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from yatt_ray.errors import UnknownNameError, YattError

T = TypeVar("T")

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
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

    def describe(self) -> str:
        """A plain-text table, one line per name (sorted): the name and the first line of its docstring.

        For an entry that wraps a function (an `AdvantageEstimator`), the wrapped function's docstring is used
        and the entry's requirements are appended, e.g. ``[needs critic, token-level]``.
        """
        width = max((len(n) for n in self._entries), default=0)
        lines = []
        for name in self.names():
            obj = self._entries[name]
            doc = (getattr(obj, "fn", obj).__doc__ or "").strip().splitlines()
            line = f"{name:<{width}}  {doc[0] if doc else ''}"
            needs = getattr(obj, "requirements", None)
            if needs:
                line += f"  [{', '.join(needs)}]"
            lines.append(line.rstrip())
        return "\n".join(lines)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator: the function, and what a controller must supply to call it.

    Calling the descriptor calls ``fn``, so ``ADVANTAGE_ESTIMATORS.get("grpo")(rewards)`` works as before.
    Two calling conventions exist:

    * outcome level (``token_level=False``): ``fn(rewards [P, n], ...) -> advantages [P, n]`` on one scalar
      reward per response, prompt-major groups; broadcast to tokens with `broadcast_to_tokens`;
    * token level (``token_level=True``, "gae"): ``fn(token_rewards [B, T], values [B, T], response_mask [B, T],
      gamma, lam) -> (advantages [B, T], returns [B, T])``.

    Flags (what the controller must provide, checked by the config and the controller, not by ``__call__``):

    * ``needs_group``: n >= 2 samples per prompt (a group baseline; n = 1 raises);
    * ``needs_critic``: a value model's per-token values [B, T] (and a critic to train on the returns);
    * ``needs_greedy_baseline``: one extra greedy (temperature 0) response per prompt, scored, passed as
      ``greedy_rewards`` [P].
    """

    name: str
    fn: Callable[..., Any]
    needs_group: bool = False
    needs_critic: bool = False
    needs_greedy_baseline: bool = False
    token_level: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def requirements(self) -> list[str]:
        """The flags that are set, in words (for tables and error messages)."""
        flags = (
            (self.needs_group, "needs n >= 2"),
            (self.needs_critic, "needs critic"),
            (self.needs_greedy_baseline, "needs greedy rewards"),
            (self.token_level, "token-level"),
        )
        return [text for on, text in flags if on]


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable] = Registry("KL estimator")
LOSS_AGGREGATIONS: Registry[Callable] = Registry("loss aggregation")
OFF_POLICY_CORRECTIONS: Registry[Callable] = Registry("off-policy correction")
