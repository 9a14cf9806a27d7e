"""Rewards: rule functions (in the controller's process) and, later, the GenRM service."""

from yatt_ray.reward import math as _math  # noqa: F401  (registers gsm8k, math_verify and math)
from yatt_ray.reward.rules import REWARD_FUNCTIONS, exact_match, resolve_reward_fn

__all__ = ["REWARD_FUNCTIONS", "exact_match", "resolve_reward_fn"]
