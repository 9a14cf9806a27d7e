"""Pure tensor functions of RL post-training (advantages, policy losses, KL estimators, loss aggregation),
each registered by name so that a config can pick it.

Importing this package fills the registries (each module registers its functions on import); look a
function up with e.g. ``ADVANTAGE_ESTIMATORS.get("grpo")``.
"""

from yatt_ray.algos.advantages import broadcast_to_tokens, grpo_advantages, grpo_no_std_advantages
from yatt_ray.algos.aggregation import aggregate, token_mean
from yatt_ray.algos.kl import kl_estimate, kl_k1, kl_k2, kl_k3
from yatt_ray.algos.losses import ppo_clip_loss
from yatt_ray.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    DuplicateNameError,
    Registry,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "DuplicateNameError",
    "Registry",
    "aggregate",
    "broadcast_to_tokens",
    "grpo_advantages",
    "grpo_no_std_advantages",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "ppo_clip_loss",
    "token_mean",
]
