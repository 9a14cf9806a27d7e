"""Rule-based rewards: `fn(response: str, ground_truth: str, data_source: str) -> float` (or an async fn).

Built-ins are found by name in REWARD_FUNCTIONS; a user's own function is named by dotted path,
`package.module:function` (or `package.module.function`).

A reward is a finite real number: an int, float or bool, a numpy scalar or a 0-d tensor (anything `float()`
takes, except strings). When the function raises on a sample, `reward.on_error` decides: raise (a RewardError
naming the sample and the exception) or zero (reward 0, counted). A return that is not a finite number (None,
a string, a list, NaN, inf) is a bug in the function, not in the sample: it always raises. `check_reward_fn`
makes one dry call on the driver before any cluster work.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import traceback
from collections.abc import Callable
from typing import Any

from yatt_ray.algos.registry import Registry
from yatt_ray.errors import ConfigError, RewardError

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str, str], Any]  # -> float, or an awaitable of one
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
REWARD_TYPES = "int, float, bool, a numpy scalar or a 0-d tensor"


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(response: str, ground_truth: str, data_source: str = "") -> float:
    """1.0 when the response, stripped of surrounding white space, equals the ground truth; else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


@REWARD_FUNCTIONS.register("repeat_match")
def repeat_match(response: str, ground_truth: str, data_source: str = "") -> float:
    """The longtail task's reward: 1.0 when the response is the ground truth once or several times joined by
    ">" (the warmed-up policy runs on a random number of copies), else `prefix_match` against the ground
    truth repeated as often as the response's length suggests (< 1)."""
    response, ground_truth = response.strip(), ground_truth.strip()
    parts = response.split(">")
    if ground_truth and all(p == ground_truth for p in parts):
        return 1.0
    copies = max(1, round((len(response) + 1) / (len(ground_truth) + 1)))
    return prefix_match(response, ">".join([ground_truth] * copies), data_source)


@REWARD_FUNCTIONS.register("prefix_match")
def prefix_match(response: str, ground_truth: str, data_source: str = "") -> float:
    """Partial credit for long answers (the longtail copy task): 1.0 for an exact match (both stripped of
    surrounding white space), else the length of their common prefix over the longer of the two, which is < 1
    (a response that stops early, goes wrong midway or runs on past the answer all lose credit)."""
    response, ground_truth = response.strip(), ground_truth.strip()
    if response == ground_truth:
        return 1.0
    common = 0
    for a, b in zip(response, ground_truth):
        if a != b:
            break
        common += 1
    return common / max(len(response), len(ground_truth))


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


def as_reward(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (see the module docstring), else None."""
    if value is None or isinstance(value, str | bytes) or getattr(value, "ndim", 0) != 0:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None


def rule_rewards(
    fn: RewardFn, items: list[tuple[str, str, str]], name: str = "reward function", on_error: str = "raise"
) -> tuple[list[float], int]:
    """(`fn(response, ground_truth, data_source)` for each item, the number of items it raised on).

    An async `fn` runs its calls concurrently; one failing call never drops the others' results. A call that
    raises gives a RewardError (`on_error="raise"`) or the reward 0.0 (`"zero"`, counted in the second value);
    a return that is not a finite number is a RewardError whatever `on_error` says (a bug in `fn`). `name` is
    the `reward.function` value the messages quote.
    """
    rewards, errors = [], 0
    for item, (ok, value) in zip(items, _call_all(fn, items)):
        if not ok:
            if on_error == "zero":
                rewards.append(0.0)
                errors += 1
                continue
            raise RewardError(
                _raised_message(name, fn, item, value)
                + "; fix the function so that it returns a number for every response (empty, truncated or "
                "malformed ones too), or set reward.on_error=zero to score such samples 0 (counted in reward/errors)"
            ) from value
        reward = as_reward(value)
        if reward is None:
            raise RewardError(
                _bad_value_message(name, fn, item, value)
                + ". This is a bug in the function, not in the sample: it stops the run whatever reward.on_error says"
            )
        rewards.append(reward)
    return rewards, errors


def score_with_rule(
    fn: RewardFn, items: list[tuple[str, str, str]], name: str = "reward function", on_error: str = "raise"
) -> list[float]:
    """The rewards of `rule_rewards` alone."""
    return rule_rewards(fn, items, name, on_error)[0]


def check_reward_fn(
    fn: RewardFn, name: str, ground_truth: str, data_source: str, on_error: str = "raise"
) -> tuple[float | None, float | None]:
    """A dry call on the driver, before any cluster work: `fn` scores the ground truth itself as the response,
    and an empty response (a policy can produce one). Returns the two rewards (None for a call that raised
    under `on_error="zero"`, which only logs a warning).

    ConfigError naming `reward.function`, the function and the sample when a call raises (`on_error="raise"`),
    or when a return is not a finite number (always: that is a bug in the function).
    """
    items = [(ground_truth, ground_truth, data_source), ("", ground_truth, data_source)]
    whats = ("the ground truth as the response", "an empty response")
    out: list[float | None] = []
    for item, what, (ok, value) in zip(items, whats, _call_all(fn, items)):
        prefix = f"dry call of the reward function on the first data row ({what}): "
        if not ok:
            message = _raised_message(name, fn, item, value)
            if on_error == "zero":
                log.warning("%s%s; with reward.on_error=zero such samples score 0", prefix, message)
                out.append(None)
                continue
            raise ConfigError(
                prefix
                + message
                + "; fix the function (it must return a number for every response, empty ones "
                "too), or set reward.on_error=zero to score the samples it fails on 0"
            ) from value
        reward = as_reward(value)
        if reward is None:
            raise ConfigError(prefix + _bad_value_message(name, fn, item, value))
        out.append(reward)
    log.info("reward.function=%s: ground truth -> %s, empty response -> %s", name, out[0], out[1])
    return out[0], out[1]


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _call_all(fn: RewardFn, items: list[tuple[str, str, str]]) -> list[tuple[bool, Any]]:
    """(True, return value) or (False, the exception) per item; async calls run concurrently."""
    if _is_async(fn):

        async def guarded(item: tuple[str, str, str]) -> tuple[bool, Any]:
            try:
                return True, await fn(*item)
            except Exception as exc:
                return False, exc

        async def run_all() -> list[tuple[bool, Any]]:
            return list(await asyncio.gather(*(guarded(item) for item in items)))

        return asyncio.run(run_all())
    outcomes: list[tuple[bool, Any]] = []
    for item in items:
        try:
            outcomes.append((True, fn(*item)))
        except Exception as exc:
            outcomes.append((False, exc))
    return outcomes


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _sample(item: tuple[str, str, str]) -> str:
    response, ground_truth, data_source = item
    return (
        f"the sample with data_source={data_source!r}, ground_truth={ground_truth[:200]!r} and response "
        f"(first 200 characters) {response[:200]!r}"
    )


def _raised_message(name: str, fn: Callable, item: tuple[str, str, str], exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"reward.function={name!r} ({_describe(fn)}) raised {type(exc).__name__}: {exc}{where} on {_sample(item)}"


def _bad_value_message(name: str, fn: Callable, item: tuple[str, str, str], value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 100 else shown[:100] + "..."
    return (
        f"reward.function={name!r} ({_describe(fn)}) returned {shown} of type {type(value).__name__} for "
        f"{_sample(item)}; a reward must be a finite number ({REWARD_TYPES})"
    )
