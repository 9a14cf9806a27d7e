"""The mathematics of one RL step around the trainer: advantages, the loss closures and metric reduction.

Kept apart from the controller so that each piece is a small function with tensors in and tensors out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from yatt_ray.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    clipped_value_loss,
    estimate_advantages,
    kl_estimate,
    masked_whiten,
    off_policy_weights,
    overlong_penalty,
    tis_weights,
)
from yatt_ray.algos.losses import ADVANTAGE_PROPORTIONAL
from yatt_ray.batch import RolloutBatch
from yatt_ray.config import AlgoConfig
from yatt_ray.metrics.flops import PerfModel, causal_pairs, registered_perf_model, shared_prompt_work


def compute_advantages(
    batch: RolloutBatch,
    algo: AlgoConfig,
    kl_coef: float,
    whiten: Callable = masked_whiten,
    max_new_tokens: int | None = None,
) -> None:
    """Fill `batch.advantages` [N, R] (and, for GAE, the critic's `batch.returns` [N, R]).

    With `algo.overlong_buffer` > 0 (DAPO's overlong shaping; `max_new_tokens` = rollout.max_new_tokens is then
    required) each reward first gets `overlong_penalty(|y|, max_new_tokens, buffer, algo.overlong_penalty)`
    added, |y| = the response's tokens (`response_mask` row sum); the penalties [N] are kept in
    `batch.overlong_penalty` for the metrics and `batch.rewards` stays the task reward (reward_mean, accuracy
    and dynamic sampling see it unshaped). ReMax's greedy baseline is not shaped (its length is not kept).

    Outcome estimators (grpo, rloo, reinforce_pp, remax) turn rewards [N] into one advantage per sample,
    broadcast over its response tokens. GAE places the outcome reward on the last response token and runs
    over the critic's values; its advantages are whitened with `whiten` (the controller passes one with
    statistics over every data-parallel group's tokens). With `algo.kl_in_reward`, the per-token KL to the
    reference is a reward penalty: r_t -= kl_coef * KL_t (GAE), or r -= kl_coef * sum_t KL_t (outcome
    estimators). For REINFORCE++ that is a departure from its paper, which places the KL on each token and
    takes the reward-to-go.
    """
    assert batch.rewards is not None, "the reward phase runs before the advantages"
    estimator = ADVANTAGE_ESTIMATORS.get(algo.estimator)
    rewards = batch.rewards
    if algo.overlong_buffer > 0:
        if max_new_tokens is None:
            raise ValueError(
                f"algo.overlong_buffer={algo.overlong_buffer} needs the generation limit: pass "
                "max_new_tokens=config.rollout.max_new_tokens to compute_advantages"
            )
        lengths = batch.response_mask.sum(dim=-1).round().to(torch.int64)
        penalty = overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        batch.overlong_penalty = penalty.to(rewards.device)
        rewards = rewards + batch.overlong_penalty.to(rewards.dtype)
    kl = None
    if algo.kl_in_reward and kl_coef > 0:
        assert batch.old_logp is not None and batch.ref_logp is not None
        kl = kl_estimate(batch.old_logp, batch.ref_logp, algo.kl_estimator)
    advantages, returns = estimate_advantages(
        estimator, rewards, batch.response_mask, group_size=batch.group_size, values=batch.values,
        greedy_rewards=batch.greedy_rewards, kl=kl, kl_coef=kl_coef, gamma=algo.gamma, lam=algo.lam,
    )  # fmt: skip
    batch.advantages = whiten(advantages, batch.response_mask) if estimator.token_level else advantages
    batch.returns = returns


def is_on_policy(algo: AlgoConfig, kl_coef: float) -> bool:
    """True when the step makes one optimizer step on the whole batch (one epoch, one mini-batch) and the
    advantages need no log-probs of the sampling policy (no KL reward penalty). The old log-probs are then the
    current ones, detached, and come out of the training forward: no separate pass over the batch."""
    return algo.ppo_epochs == 1 and algo.ppo_mini_batches == 1 and not (algo.kl_in_reward and kl_coef > 0)


def zero_gradient_rows(batch: RolloutBatch, algo: AlgoConfig, kl_coef: float) -> torch.Tensor | None:
    """[N] bool, True for the rows whose policy loss and gradient are exactly 0, so the policy's train step
    may leave them out (`train.skip_zero_advantage`); None when no row can be (the loss acts at A = 0).

    A row qualifies when every advantage of its group (`batch.group_size` consecutive rows: the unit the
    trainer packs) is 0 on the response tokens, e.g. a GRPO group whose samples all scored the same, and the
    loss is A times a factor: a loss in `ADVANTAGE_PROPORTIONAL`, no entropy bonus (entropy_coef = 0) and no
    KL term in the loss (kl_coef = 0 or `algo.kl_in_reward`). The loss normalisers stay those of the whole
    batch, so the update is the same with or without them (the optimizer still steps: AdamW's moments move).
    """
    kl_in_loss = kl_coef > 0 and not algo.kl_in_reward
    if kl_in_loss or algo.entropy_coef != 0 or algo.policy_loss not in ADVANTAGE_PROPORTIONAL:
        return None
    assert batch.advantages is not None, "the advantages are computed before the update"
    zero = ((batch.advantages != 0) & (batch.response_mask > 0)).sum(dim=1) == 0  # [N]
    return zero.view(-1, batch.group_size).all(dim=1).repeat_interleave(batch.group_size)


def policy_loss_fn(
    algo: AlgoConfig,
    prompt_width: int,
    global_tokens: float,
    global_seqs: float,
    kl_coef: float,
    norm_len: int,
    record_old_logp: torch.Tensor | None = None,
    metric_tokens: float | None = None,
):
    """The per-micro-batch policy loss for MegatronPolicy.train_step.

    loss = agg( w * pg(logp, old_logp, A) - entropy_coef * H + kl_coef * KL_k(logp || ref) ), where the
    KL term is present only when KL is not already a reward penalty. w is the off-policy correction
    (`algo.off_policy`, `yatt_ray.algos.off_policy`): with "none", w_tis (truncated importance weights for the
    rollout/trainer mismatch, `mb["tis_weights"]` or, on-policy, taken here) only when `algo.tis_cap` is set,
    exactly as before the other modes existed; any other mode takes `off_policy_weights` of old_logp and
    `mb["rollout_logp"]` here (the controller's `tis_weights` unused) and logs `off_policy/*` token-mean shares
    (ratio_mean, weight_mean, clipped_frac, masked_frac; a masked token stays in the normaliser). Aggregated with
    `algo.loss_agg` over the *global* token / sequence counts, so micro-batch and data-parallel shares sum to
    the full-batch loss. Logged values are token-mean shares too (they sum to batch means). `norm_len` is the
    constant length of "seq-mean-token-sum-norm" (the configured maximum response length).

    On-policy (`is_on_policy`), pass `record_old_logp` [N, R]: old_logp = logp.detach() (ratio 1, gradient
    that of the plain policy gradient), the truncated-IS weights are taken against it, and each micro-batch's
    detached log-probs are written into the buffer at its rows (`mb["row"]`) for the step's metrics (a buffer
    on the trainer's device takes them without a copy to the host).
    `metric_tokens` (default `global_tokens`) normalises the logged token means: the trained tokens when the
    controller leaves zero-gradient rows out (`zero_gradient_rows`), so pg_loss, entropy and clipfrac are means
    over the rows that ran.
    """
    shares_over = global_tokens if metric_tokens is None else metric_tokens
    policy_loss = POLICY_LOSSES.get(algo.policy_loss)
    kl_in_loss = kl_coef > 0 and not algo.kl_in_reward
    options: dict = {} if algo.dual_clip is None else {"dual_clip": algo.dual_clip}

    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor, mb: dict[str, torch.Tensor]):
        """`mb`: a micro-batch of `RolloutBatch.tensors()` (old_logp and advantages set)."""
        lp, ent = logp[:, prompt_width - 1 :], entropy[:, prompt_width - 1 :]
        mask = mb["response_mask"]
        old, weights = mb.get("old_logp"), mb.get("tis_weights")
        if record_old_logp is not None:
            old, weights = _on_policy_old_logp(algo, lp, mb, record_old_logp, weights)
        pg, stats = policy_loss(
            lp, old, mb["advantages"], algo.clip_low, algo.clip_high, response_mask=mask, **options
        )
        pg, corrected = _off_policy_corrected(algo, pg, old, weights, mb, shares_over)
        per_token = pg - algo.entropy_coef * ent
        share = {"pg_loss": pg.detach(), "entropy": ent.detach(), "clipfrac": stats["clipped"]}
        if kl_in_loss:
            per_token = per_token + kl_coef * kl_estimate(lp, mb["ref_logp"], algo.kl_estimator)
        loss = aggregate(
            per_token, mask, algo.loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
            norm_len=float(norm_len) if algo.loss_agg == "seq-mean-token-sum-norm" else None,
        )  # fmt: skip
        return loss, {**_token_mean_shares(share, mask, shares_over), **corrected}

    return loss_fn


def _on_policy_old_logp(
    algo: AlgoConfig,
    lp: torch.Tensor,
    mb: dict[str, torch.Tensor],
    record: torch.Tensor,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """On-policy `policy_loss_fn`: (old_logp = this forward's log-probs `lp`, detached and written into
    `record` at the micro-batch's rows for the step's metrics; the truncated-IS weights, taken against them
    when `algo.off_policy` is "none" with `algo.tis_cap` set, else `weights`)."""
    old = lp.detach()
    record[mb["row"].to(record.device)] = old.to(record.device)  # on the device when the record is (no wait)
    if algo.tis_cap is not None and algo.off_policy == "none":
        weights = tis_weights(old, mb["rollout_logp"], algo.tis_cap)
    return old, weights


def _off_policy_corrected(
    algo: AlgoConfig,
    pg: torch.Tensor,
    old: torch.Tensor | None,
    weights: torch.Tensor | None,
    mb: dict[str, torch.Tensor],
    shares_over: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(The per-token policy-gradient loss `pg` times the off-policy correction, its logged shares): with
    `algo.off_policy` "none", the truncated-IS `weights` when `algo.tis_cap` is set (no shares); otherwise
    `off_policy_weights` of old_logp and the rollout's log-probs, with this micro-batch's share (over
    `shares_over` tokens) of the `off_policy/*` token means."""
    if algo.off_policy == "none":
        if algo.tis_cap is None:
            return pg, {}
        assert weights is not None, "the controller's tis_weights, or on-policy taken from this forward"
        return pg * weights, {}
    assert old is not None, "old_logp comes from the controller, or on-policy from this forward"
    weights, _, w_stats = off_policy_weights(
        algo.off_policy,
        old,
        mb["rollout_logp"],
        mb["response_mask"],
        algo.tis_cap,
        algo.is_band_low,
        algo.is_band_high,
    )
    # this micro-batch's share of the global token mean (shares sum to the step's mean)
    scale = float(w_stats["tokens"]) / max(shares_over, 1.0)
    corrected = {
        f"off_policy/{k}": float(w_stats[k]) * scale
        for k in ("ratio_mean", "weight_mean", "clipped_frac", "masked_frac")
    }
    return pg * weights, corrected


def value_loss_fn(value_clip: float | None, prompt_width: int, global_tokens: float):
    """The per-micro-batch critic loss for MegatronCritic.train_step: token-mean of
    0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, -c, c) (PPO value clipping;
    plain 0.5 (V - R)^2 when `value_clip` is None), over the global token count."""

    def loss_fn(values: torch.Tensor, mb: dict[str, torch.Tensor]):
        v = values[:, prompt_width - 1 :]
        mask = mb["response_mask"]
        per_token, stats = clipped_value_loss(v, mb["values"], mb["returns"], value_clip)
        loss = aggregate(per_token, mask, "token-mean", global_tokens=global_tokens)
        shares = {"value_loss": per_token.detach(), "value_clipfrac": stats["clipped"]}
        return loss, _token_mean_shares(shares, mask, global_tokens)

    return loss_fn


def _token_mean_shares(per_token: dict[str, torch.Tensor], mask: torch.Tensor, global_tokens: float):
    """Logged values as this micro-batch's share of the global token mean (shares sum to batch means), as 0-d
    tensors on the device: the trainer sums them and reads them once a step."""
    return {
        k: aggregate(v, mask, "token-mean", global_tokens=global_tokens).detach()
        for k, v in per_token.items()
    }


_SUMS = (
    "reward", "correct", "samples", "response_tokens", "prompt_tokens", "truncated", "logp_diff", "prompts_clipped",
    "kl", "greedy_reward", "causal_pairs", "overlong_penalty", "logp_tokens", "shared_tokens", "shared_pairs",
)  # fmt: skip


def local_sums(batch: RolloutBatch, algo: AlgoConfig) -> torch.Tensor:
    """This group's additive statistics, in the order of _SUMS (token sums over the response mask)."""
    assert batch.rewards is not None and batch.old_logp is not None
    mask = batch.response_mask
    prompt_lengths = batch.attention_mask[:, : batch.prompt_width].sum(dim=1)
    lengths = batch.attention_mask.sum(dim=1)
    seen = ~batch.old_logp.isnan()  # on-policy, a row the train step left out has no log-probs (NaN)
    diff = ((batch.old_logp - batch.rollout_logp).abs() * mask).where(seen, 0.0).sum()
    kl: float | torch.Tensor = 0.0
    if batch.ref_logp is not None:
        kl = (kl_estimate(batch.old_logp, batch.ref_logp, algo.kl_estimator) * mask).where(seen, 0.0).sum()
    greedy = batch.greedy_rewards.sum() if batch.greedy_rewards is not None else 0.0
    overlong = batch.overlong_penalty.sum() if batch.overlong_penalty is not None else 0.0
    values: list[float | int | torch.Tensor] = [
        batch.rewards.sum(),
        (batch.rewards >= 1.0).sum(),
        batch.size,
        mask.sum(),
        prompt_lengths.sum(),
        batch.truncated,
        diff,
        batch.prompts_clipped,
        kl,
        greedy,
        causal_pairs(lengths),
        overlong,
        (mask * seen).sum(),
        *shared_prompt_work(prompt_lengths, lengths, batch.group_size),
    ]
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def reduce_metrics(
    step: int,
    batch: RolloutBatch,
    train_stats: dict[str, float],
    times: dict[str, float],
    is_controller: bool,
    algo: AlgoConfig,
    perf: PerfModel | None = None,
) -> dict[str, float]:
    """All-reduce the step's statistics over every worker: sums over controllers, max of times.

    `times` holds each phase's seconds, "step" (the step's wall time on this worker), "other" (the part of
    the step outside every phase: batching, broadcasts, bookkeeping) and "orchestration" (the step less
    rollout, reward, log-prob and train compute: weight sync, offload and "other").
    Every rank must call it. Non-controller ranks hold copies of their group's batch and add zeros.
    "kl" is the mean per-token KL(pi_old || ref) with `algo.kl_estimator`; "kl_per_sequence" its sum over a
    response, averaged over samples (what an adaptive KL controller tracks). Throughput: `throughput`;
    `perf/*` (achieved FLOP/s and MFU, `perf_metrics`) from `perf`, else the PerfModel this process
    registered (`yatt_ray.metrics.flops.register_perf_model`, done by `roles.build_roles`), else none.
    """
    sums = local_sums(batch, algo) if is_controller else torch.zeros(len(_SUMS), dtype=torch.float64)
    dist.all_reduce(sums)
    s = dict(zip(_SUMS, sums.tolist()))
    phase_names = sorted(times)
    phase = torch.tensor([times[k] for k in phase_names], dtype=torch.float64)
    dist.all_reduce(phase, op=dist.ReduceOp.MAX)
    maxima = dict(zip(phase_names, phase.tolist()))
    step_time = maxima.pop("step")
    samples, tokens = max(s["samples"], 1.0), max(s["response_tokens"], 1.0)
    metrics = {
        "step": float(step),
        "samples": s["samples"],
        "reward_mean": s["reward"] / samples,
        "accuracy": s["correct"] / samples,
        "response_length": s["response_tokens"] / samples,
        "truncated_fraction": s["truncated"] / samples,
        "prompts_clipped": s["prompts_clipped"],
        "rollout_logp_diff": s["logp_diff"] / max(s["logp_tokens"], 1.0),
        **throughput(s["response_tokens"], s["prompt_tokens"], step_time, dist.get_world_size()),
        "time/step": step_time,
    }
    if batch.ref_logp is not None:
        metrics.update(kl=s["kl"] / tokens, kl_per_sequence=s["kl"] / samples)
    if batch.greedy_rewards is not None:
        metrics["greedy_reward_mean"] = s["greedy_reward"] / (samples / batch.group_size)
    if algo.overlong_buffer > 0:
        metrics["reward/overlong_penalty_mean"] = s["overlong_penalty"] / samples
    metrics.update({f"time/{k}": v for k, v in maxima.items()})
    metrics.update(train_stats)
    metrics.update(_reduce_counters(batch.counters, is_controller))
    perf = registered_perf_model() if perf is None else perf
    if perf is not None:
        metrics.update(perf_metrics(perf, s, maxima, train_stats, algo, dist.get_world_size()))
    return metrics


def throughput(response_tokens: float, prompt_tokens: float, step_s: float, workers: int) -> dict[str, float]:
    """Tokens per second of step wall time: `response_tokens_per_s` (generated tokens only) and
    `total_tokens_per_s` (prompt + response tokens), each also per worker (= per accelerator: dp x tp)."""
    rates = {
        "response_tokens_per_s": response_tokens / max(step_s, 1e-9),
        "total_tokens_per_s": (response_tokens + prompt_tokens) / max(step_s, 1e-9),
    }
    return {**rates, **{f"{k}_per_worker": v / max(workers, 1) for k, v in rates.items()}}


def perf_metrics(
    perf: PerfModel,
    sums: dict[str, float],
    maxima: dict[str, float],
    train_stats: dict[str, float],
    algo: AlgoConfig,
    workers: int,
) -> dict[str, float]:
    """Achieved model FLOP/s per accelerator in the rollout and train phases, and MFU against the peak
    (formulas in `yatt_ray.metrics.flops`). Collective: the peak is averaged over every rank's PerfModel.

    F = forward FLOPs of the step's sequences (all groups, prompt + response tokens): train = 3 F x
    algo.ppo_epochs, or, when the policy's train step reports `forward_tokens` (the tokens it ran through
    the model per optimizer step, summed over data-parallel ranks, after its shared-prompt packing; the
    controller averages it over the step's algo.ppo_epochs x algo.ppo_mini_batches optimizer steps),
    3 F x ran / real tokens with ran = forward_tokens x optimizer steps. Rollout = the forward FLOPs of each
    group's prompt once and every response (`flops.shared_prompt_work`). Achieved = FLOPs / (phase time x
    workers), the phase time being the slowest worker's; MFU = achieved / peak. A critic's train step is in
    `time/train` but not counted.
    """
    peaks = torch.tensor([perf.peak_flops or 0.0, float(perf.peak_flops is not None)], dtype=torch.float64)
    dist.all_reduce(peaks)
    real_tokens = sums["prompt_tokens"] + sums["response_tokens"]
    forward = perf.flops.forward(real_tokens, sums["causal_pairs"])
    per_step = train_stats.get("forward_tokens")
    if per_step is not None:
        ran = per_step * algo.ppo_epochs * algo.ppo_mini_batches
        train = 3.0 * forward * ran / max(real_tokens, 1.0)
    else:
        train = 3.0 * forward * algo.ppo_epochs
    out: dict[str, float] = {}
    rollout = perf.flops.forward(sums.get("shared_tokens", 0.0), sums.get("shared_pairs", 0.0))
    for phase, flops in (("train", train), ("rollout", rollout)):  # a phase that took no time: not reported
        seconds = maxima.get(phase, 0.0)
        if seconds > 0:
            out[f"perf/{phase}_flops_per_s"] = flops / (seconds * max(workers, 1))
    if peaks[1] > 0:
        peak = float(peaks[0] / peaks[1])
        out["perf/peak_flops"] = peak
        for phase in ("train", "rollout"):
            if f"perf/{phase}_flops_per_s" in out:
                out[f"perf/mfu_{phase}"] = out[f"perf/{phase}_flops_per_s"] / peak
    return out


def _reduce_counters(counters: dict[str, float], is_controller: bool) -> dict[str, float]:
    """Controllers' counters: counts summed over groups, memory figures and the async means averaged
    per controller, `*_max` figures the largest. Every controller holds the same keys (they follow from the
    config)."""
    keys = sorted(counters)
    values = [counters[k] if is_controller else 0.0 for k in keys] + [float(is_controller)]
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    largest = torch.tensor(values, dtype=torch.float64)
    if any(k.endswith("_max") for k in keys):
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    controllers = max(total[-1].item(), 1.0)
    averaged = ("memory/", "async/staleness_mean", "async/versions_per_sample_mean")
    return {
        k: largest[i].item() if k.endswith("_max") else v / controllers if k.startswith(averaged) else v
        for i, (k, v) in enumerate(zip(keys, total[:-1].tolist()))
    }
