"""Pure tensor functions of RL post-training (advantages, policy and value losses, KL estimators and
controllers, loss aggregation, rollout/trainer mismatch and off-policy correction, reward shaping), each registered
by name so that a config can pick it.

Importing this package fills the registries (each module registers its functions on import); look a
function up with e.g. ``ADVANTAGE_ESTIMATORS.get("grpo")`` (an `AdvantageEstimator`: callable, and its flags
say what the controller must supply). ``REGISTRY.describe()`` prints a one-line-per-name table.

CONVENTIONS -- where well-known frameworks differ, and what yatt_ray does
--------------------------------------------------------------------------
Group std (GRPO). The DeepSeekMath paper writes ``std`` without saying which. verl, TRL and OpenRLHF call
``torch.std``, whose default is the *unbiased* (N - 1) estimator; the epsilon differs (verl adds 1e-6 to the
std, TRL 1e-4). yatt_ray: unbiased, ``eps = 1e-6`` added to the std, and an all-equal group gives exactly 0.
The same convention holds for every std in this package (batch whitening, `masked_whiten`).

Scope of the std. GRPO scales by each group's std; TRL can scale by the batch std instead (``scale_rewards``),
REINFORCE++ whitens over the batch, Dr. GRPO does not scale at all. yatt_ray has one registered name per
choice ("grpo", "reinforce_pp_baseline", "grpo_no_std"). "Batch" statistics are those of the tensor passed in,
i.e. one controller's share of the step's batch: a single-driver framework sees the whole global batch, so
with several data-parallel groups yatt_ray's batch-whitened advantages use per-group statistics unless the
controller all-reduces them (group-level estimators are unaffected: a prompt's group never spans controllers).
REINFORCE++ as implemented in verl whitens token-level returns over the response mask (a long response
weighs more); "reinforce_pp" whitens one value per sample, which is the same for outcome rewards up to
that weighting.

Where the KL goes. In the reward (per-token penalty ``-beta * KL`` folded into the return; PPO as in Ziegler et
al. and InstructGPT, and REINFORCE++; OpenRLHF's default for PPO, verl's ``use_kl_in_reward``) or in the loss
(``+beta * KL`` per token, the GRPO paper; TRL's GRPO, verl's ``use_kl_loss``). yatt_ray puts it in the loss
by default (GRPO style); `token_rewards_from_outcome` builds the in-reward form (critic-based PPO,
REINFORCE++), and `AdaptiveKLController` / `FixedKLController` steer its coefficient. The estimator also differs: k1 in reward is classic; k3 (or its clamp,
"low_var_kl") is common in the loss because it is non-negative with low variance.

Loss aggregation. The GRPO paper averages tokens within a sequence and then sequences
("seq-mean-token-mean"); DAPO argues for averaging over all tokens ("token-mean", verl's default); Dr. GRPO
uses a constant normaliser ("seq-mean-token-sum-norm"); TRL exposes these as ``loss_type`` values. yatt_ray
defaults to "token-mean" (``algo.loss_agg``). Independently of the mode, frameworks differ in whether a
micro-batch is normalised by its *own* count (then the split into micro-batches changes the weighting) or by
the global count; yatt_ray always uses global denominators, so micro-batches and ranks add up to the
full-batch loss and gradient exactly (see `yatt_ray.algos.aggregation`).

Clipping. "ppo_clip" takes separate ``clip_low`` / ``clip_high`` (DAPO's clip-higher) and an optional dual clip
(off by default, as in most LLM frameworks). GSPO's sequence ratio needs ranges near 3e-4 / 4e-4, not 0.2.
Every ratio is taken from a log-ratio clamped to [-20, 20] before ``exp``; this only prevents overflow.

Off-policy correction. verl (among others) multiplies the policy loss by a truncated importance weight against
the rollout engine's log-probs (TIS); IcePop / masked importance sampling drop tokens whose ratio leaves a band;
AReaL's decoupled PPO clips against a recomputed proximal policy and weights by proximal / behaviour (AReaL drops
tokens above its cap; yatt_ray truncates). yatt_ray: ``algo.off_policy`` (none, tis, mis, icepop, decoupled) in
`yatt_ray.algos.off_policy`, whose docstring has the formulas; a token a band masks stays in the loss normaliser.

Precision. Every function computes in at least float32 (bf16 / fp16 inputs are promoted; float64 stays).
"""

from yatt_ray.algos.advantages import (
    AdvantageEstimator,
    broadcast_to_tokens,
    estimate_advantages,
    gae_advantages,
    grpo_advantages,
    grpo_no_std_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_rewards_from_outcome,
)
from yatt_ray.algos.aggregation import (
    aggregate,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
from yatt_ray.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_low_var,
)
from yatt_ray.algos.losses import cispo_loss, clipped_value_loss, gspo_loss, ppo_clip_loss
from yatt_ray.algos.mismatch import mismatch_stats, tis_weights
from yatt_ray.algos.off_policy import (
    decoupled_ppo_loss,
    importance_ratio,
    importance_weight_stats,
    off_policy_weights,
    staleness_stats,
)
from yatt_ray.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    DuplicateNameError,
    Registry,
)
from yatt_ray.algos.shaping import overlong_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "DuplicateNameError",
    "FixedKLController",
    "Registry",
    "aggregate",
    "broadcast_to_tokens",
    "estimate_advantages",
    "cispo_loss",
    "clipped_value_loss",
    "decoupled_ppo_loss",
    "gae_advantages",
    "grpo_advantages",
    "grpo_no_std_advantages",
    "gspo_loss",
    "importance_ratio",
    "importance_weight_stats",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_low_var",
    "masked_whiten",
    "mismatch_stats",
    "off_policy_weights",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "staleness_stats",
    "tis_weights",
    "token_mean",
    "token_rewards_from_outcome",
]
