"""Rule-based rewards: `fn(response: str, ground_truth: str, data_source: str) -> float`.

Built-ins are found by name in REWARD_FUNCTIONS; a user's own function is named by dotted path,
`package.module:function` (or `package.module.function`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from yatt_ray.algos.registry import Registry
from yatt_ray.errors import ConfigError

RewardFn = Callable[[str, str, str], float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(response: str, ground_truth: str, data_source: str = "") -> float:
    """1.0 when the response, stripped of surrounding white space, equals the ground truth; else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


def resolve_reward_fn(name: str) -> RewardFn:
    """A registered name, or a dotted path `pkg.mod:fn` / `pkg.mod.fn` to a user function."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS.get(name)
    if "." not in name and ":" not in name:
        REWARD_FUNCTIONS.get(name)  # raises UnknownNameError listing the built-ins
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"reward.function={name!r} cannot be imported ({exc}); give a built-in "
            f"({', '.join(REWARD_FUNCTIONS.names())}) or an importable 'package.module:function'"
        ) from exc
    if not callable(fn):
        raise ConfigError(f"reward.function={name!r} resolves to a {type(fn).__name__}, not a function")
    return fn
