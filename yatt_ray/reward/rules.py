"""Rule-based rewards: `fn(response: str, ground_truth: str, data_source: str) -> float` (or an async fn).

Built-ins are found by name in REWARD_FUNCTIONS; a user's own function is named by dotted path,
`package.module:function` (or `package.module.function`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from yatt_ray.algos.registry import Registry
from yatt_ray.errors import ConfigError

RewardFn = Callable[[str, str, str], Any]  # -> float, or an awaitable of one
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(response: str, ground_truth: str, data_source: str = "") -> float:
    """1.0 when the response, stripped of surrounding white space, equals the ground truth; else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


def resolve_reward_fn(name: str) -> RewardFn:
    """A registered name, or a dotted path `pkg.mod:fn` / `pkg.mod.fn` to a user function (sync or async)."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS.get(name)
    if "." not in name and ":" not in name:
        REWARD_FUNCTIONS.get(name)  # raises UnknownNameError listing the built-ins
    return import_object(name, "reward.function", f"a built-in ({', '.join(REWARD_FUNCTIONS.names())}) or ")


def import_object(name: str, key: str, alternatives: str = "") -> Callable:
    """The callable at dotted path `pkg.mod:attr` (or `pkg.mod.attr`); ConfigError naming `key` otherwise."""
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"{key}={name!r} cannot be imported ({exc}); give {alternatives}an importable 'package.module:function'"
        ) from exc
    if not callable(fn):
        raise ConfigError(f"{key}={name!r} resolves to a {type(fn).__name__}, not a function")
    return fn


def score_with_rule(fn: RewardFn, items: list[tuple[str, str, str]]) -> list[float]:
    """`fn(response, ground_truth, data_source)` for each item; an async `fn` runs its calls concurrently."""
    if inspect.iscoroutinefunction(fn):

        async def run_all() -> list[float]:
            return list(await asyncio.gather(*(fn(*item) for item in items)))

        return [float(x) for x in asyncio.run(run_all())]
    return [float(fn(*item)) for item in items]
