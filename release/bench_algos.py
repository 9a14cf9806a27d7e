"""Time the algorithm functions of one step (advantages, policy loss + KL + aggregation, forward and backward)
on a realistic batch, on the CPU.

    python release/bench_algos.py                          # 1,024 sequences x 2,048 tokens, float32
    python release/bench_algos.py --seqs 256 --tokens 512  # a smaller batch
    python release/bench_algos.py --repeats 5 --group 16

Each figure is the median over ``--repeats`` timed runs after one untimed warm-up, in milliseconds, for the
whole batch in one call (a trainer would split the loss over micro-batches; the total work is the same).
Response lengths are drawn uniformly from [tokens / 8, tokens]; the batch holds ``seqs / group`` prompts with
``group`` samples each. Loss rows include the k3 KL term and the ``backward()`` to ``logp``; advantage rows
include `broadcast_to_tokens` (outcome estimators) or `token_rewards_from_outcome` (GAE).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from yatt_ray.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageEstimator,
    aggregate,
    broadcast_to_tokens,
    kl_estimate,
    masked_whiten,
    mismatch_stats,
    tis_weights,
    token_rewards_from_outcome,
)

LOSS_CASES: list[tuple[str, str, dict, str]] = [
    # (label, registered loss, options, aggregation)
    ("ppo_clip", "ppo_clip", {}, "token-mean"),
    ("ppo_clip dual_clip=3", "ppo_clip", {"dual_clip": 3.0}, "token-mean"),
    ("gspo", "gspo", {}, "seq-mean-token-mean"),
    ("cispo", "cispo", {}, "token-mean"),
    ("ppo_clip", "ppo_clip", {}, "seq-mean-token-sum"),
    ("ppo_clip", "ppo_clip", {}, "seq-mean-token-mean"),
    ("ppo_clip", "ppo_clip", {}, "seq-mean-token-sum-norm"),
]


def make_batch(seqs: int, tokens: int, group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(tokens // 8, 1), tokens + 1, (seqs,), generator=gen)
    mask = torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)
    logp = -torch.rand(seqs, tokens, generator=gen) * 3.0
    return {
        "mask": mask,
        "logp": logp,
        "old_logp": logp + 0.05 * torch.randn(seqs, tokens, generator=gen),
        "rollout_logp": logp + 0.02 * torch.randn(seqs, tokens, generator=gen),
        "ref_logp": logp + 0.1 * torch.randn(seqs, tokens, generator=gen),
        "values": torch.randn(seqs, tokens, generator=gen),
        "rewards": (torch.rand(seqs // group, group, generator=gen) < 0.4).float(),
        "greedy_rewards": (torch.rand(seqs // group, generator=gen) < 0.4).float(),
    }


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (allocator, first-call overheads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def advantage_rows(b: dict[str, torch.Tensor], repeats: int) -> list[tuple[str, float]]:
    def token_level(est: AdvantageEstimator) -> object:
        token_rewards = token_rewards_from_outcome(b["rewards"].reshape(-1), b["mask"], None)
        adv, _ = est(token_rewards, b["values"], b["mask"], 1.0, 0.95)
        return masked_whiten(adv, b["mask"])

    def outcome(est: AdvantageEstimator) -> object:
        extra = {"greedy_rewards": b["greedy_rewards"]} if est.needs_greedy_baseline else {}
        return broadcast_to_tokens(est(b["rewards"], **extra).reshape(-1), b["mask"])

    rows = []
    for name in ADVANTAGE_ESTIMATORS:
        est = ADVANTAGE_ESTIMATORS.get(name)
        if est.token_level:
            label, fn = f"advantage {name} (+ token rewards, masked_whiten)", token_level
        else:
            label, fn = f"advantage {name} (+ broadcast)", outcome
        rows.append((label, median_ms(functools.partial(fn, est), repeats)))
    return rows


def loss_rows(b: dict[str, torch.Tensor], repeats: int) -> list[tuple[str, float]]:
    seq_adv = ADVANTAGE_ESTIMATORS.get("grpo")(b["rewards"]).reshape(-1)
    adv = broadcast_to_tokens(seq_adv, b["mask"])
    mask = b["mask"]
    denominators = {
        "global_tokens": float(mask.sum()),
        "global_seqs": float(mask.any(1).sum()),
        "norm_len": float(mask.shape[1]),
    }
    rows = []
    for label, name, options, mode in LOSS_CASES:
        loss_fn = POLICY_LOSSES.get(name)
        clip = (3e-4, 4e-4) if name == "gspo" else (0.2, 0.2)

        def run(loss_fn=loss_fn, options=options, mode=mode, clip=clip) -> object:
            logp = b["logp"].clone().requires_grad_(True)
            per_token, _ = loss_fn(logp, b["old_logp"], adv, *clip, response_mask=mask, **options)
            per_token = per_token + 0.001 * kl_estimate(logp, b["ref_logp"], "k3")
            loss = aggregate(per_token, mask, mode, **denominators)
            loss.backward()
            return logp.grad

        rows.append((f"loss {label} + k3 KL, {mode}, fwd+bwd", median_ms(run, repeats)))

    def mismatch() -> object:
        weights = tis_weights(b["old_logp"], b["rollout_logp"], cap=2.0)
        return weights, mismatch_stats(b["old_logp"], b["rollout_logp"], mask)

    rows.append(("tis_weights + mismatch_stats", median_ms(mismatch, repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=1024, help="sequences in the batch (default 1024)")
    parser.add_argument("--tokens", type=int, default=2048, help="response width T (default 2048)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row (default 5)")
    parser.add_argument(
        "--model-params", type=float, default=0.5e9, help="for the step estimate (default 0.5e9)"
    )
    parser.add_argument("--device-tflops", type=float, default=312.0, help="peak TFLOP/s (A100 bf16: 312)")
    args = parser.parse_args()
    if args.seqs % args.group:
        raise SystemExit(f"--seqs={args.seqs} must be a multiple of --group={args.group}")

    start = time.perf_counter()
    batch = make_batch(args.seqs, args.tokens, args.group)
    n_tokens = int(batch["mask"].sum())
    print(
        f"bench_algos: {args.seqs} sequences x {args.tokens} tokens ({n_tokens:,} response tokens), float32, "
        f"{args.seqs // args.group} prompts x {args.group} samples, CPU with {torch.get_num_threads()} threads, "
        f"median of {args.repeats}"
    )
    rows = advantage_rows(batch, args.repeats) + loss_rows(batch, args.repeats)
    width = max(len(label) for label, _ in rows)
    print(f"  {'what':<{width}}  {'ms':>9}")
    for label, ms in rows:
        print(f"  {label:<{width}}  {ms:9.2f}")
    # A training step is at least 6 FLOPs per parameter per token (forward + backward), at peak speed.
    step_s = 6 * args.model_params * n_tokens / (args.device_tflops * 1e12)
    slowest = max(ms for _, ms in rows)
    print(
        f"  a training step of a {args.model_params / 1e9:g}B-parameter model on these tokens takes at least "
        f"{step_s:.1f} s at {args.device_tflops:g} TFLOP/s (6 x params x tokens, at peak); the slowest row "
        f"here, on this CPU, is {100 * slowest / 1000 / step_s:.2f}% of that"
    )
    print(f"  (bench wall time {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
