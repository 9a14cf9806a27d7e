"""The step's reduced metrics: throughput under names that say what they count, and MFU from a PerfModel
(one-process gloo world, no cluster)."""

from __future__ import annotations

import pytest
import torch

from yatt_ray.batch import pack
from yatt_ray.config import AlgoConfig
from yatt_ray.metrics.flops import ModelFlops, PerfModel, register_perf_model
from yatt_ray.step import reduce_metrics

FLOPS = ModelFlops(matmul_params=1000, layers=2, attn_width=8)


def batch():
    # prompts of 2 and 1 tokens, responses of 2 and 3 tokens: sequences of 4 tokens each (8 in all; 3 prompt)
    b = pack([[1, 5], [1]], [[9, 2], [8, 7, 6]], [[-0.5, -0.1], [-0.3, -0.2, -0.1]], pad_id=0)
    b.rewards, b.old_logp = torch.tensor([1.0, 0.0]), b.rollout_logp.clone()
    return b


TIMES = {"rollout": 2.0, "train": 4.0, "step": 10.0}


def test_throughput_names_say_what_they_count(single_process_world):
    register_perf_model(None)
    m = reduce_metrics(1, batch(), {}, dict(TIMES), True, AlgoConfig())
    assert m["response_tokens_per_s"] == pytest.approx(5 / 10)
    assert m["total_tokens_per_s"] == pytest.approx(8 / 10)
    assert m["response_tokens_per_s_per_worker"] == m["response_tokens_per_s"]  # a world of 1
    assert m["total_tokens_per_s_per_worker"] == m["total_tokens_per_s"]
    assert "tokens_per_s" not in m and not any(k.startswith("perf/") for k in m)


def test_mfu_of_the_train_and_rollout_phases(single_process_world):
    perf = PerfModel(FLOPS, peak_flops=1e5, peak_source="test")
    m = reduce_metrics(1, batch(), {}, dict(TIMES), True, AlgoConfig(ppo_epochs=2), perf=perf)
    # two sequences of 4 tokens: T = 8, P = 2 * 10 = 20; F = 2 * 1000 * 8 + 4 * 2 * 8 * 20 = 17280
    forward = 17280.0
    assert m["perf/rollout_flops_per_s"] == pytest.approx(forward / 2.0)
    assert m["perf/train_flops_per_s"] == pytest.approx(3 * 2 * forward / 4.0)  # 3 F x 2 epochs over 4 s
    assert m["perf/peak_flops"] == 1e5
    assert m["perf/mfu_rollout"] == pytest.approx(forward / 2.0 / 1e5)
    assert m["perf/mfu_train"] == pytest.approx(3 * 2 * forward / 4.0 / 1e5)


def test_the_rollout_counts_a_groups_prompt_once(single_process_world):
    perf = PerfModel(FLOPS, peak_flops=1e5, peak_source="test")
    # one prompt of 2 tokens, two samples of 2 and 3 tokens: T = 2 + 5 = 7; P = 3 (prompt) + (3 + 4) + (3 + 4 + 5)
    b = pack(
        [[1, 5], [1, 5]], [[9, 2], [8, 7, 6]], [[-0.5, -0.1], [-0.3, -0.2, -0.1]], pad_id=0, group_size=2
    )
    b.rewards, b.old_logp = torch.tensor([1.0, 0.0]), b.rollout_logp.clone()
    m = reduce_metrics(1, b, {}, dict(TIMES), True, AlgoConfig(), perf=perf)
    shared = 2 * 1000 * 7 + 4 * 2 * 8 * 22
    assert m["perf/rollout_flops_per_s"] == pytest.approx(shared / 2.0)
    # training is not credited the sharing this way: its packed token count says what it ran (next test)
    unshared = 2 * 1000 * 9 + 4 * 2 * 8 * (10 + 15)
    assert m["perf/train_flops_per_s"] == pytest.approx(3 * unshared / 4.0)


def test_the_trainers_token_count_replaces_the_batchs(single_process_world):
    perf = PerfModel(FLOPS, peak_flops=None, peak_source="unknown")
    # the trainer ran 6 tokens per optimizer step (a shared prompt packed once) for 8 real ones, 2 x 2 steps
    stats = {"forward_tokens": 6.0}
    algo = AlgoConfig(ppo_epochs=2, ppo_mini_batches=2)
    m = reduce_metrics(1, batch(), stats, dict(TIMES), True, algo, perf=perf)
    assert m["perf/train_flops_per_s"] == pytest.approx(3 * 17280.0 * (6 * 4 / 8) / 4.0)
    assert "perf/peak_flops" not in m and "perf/mfu_train" not in m  # no peak known: achieved FLOP/s only


def test_the_registered_model_is_used(single_process_world):
    register_perf_model(PerfModel(FLOPS, peak_flops=1e6, peak_source="test"))
    try:
        m = reduce_metrics(1, batch(), {}, dict(TIMES), True, AlgoConfig())
    finally:
        register_perf_model(None)
    assert m["perf/peak_flops"] == 1e6 and "perf/mfu_train" in m and "perf/mfu_rollout" in m


def test_overlong_penalty_mean_is_reported_only_with_a_buffer(single_process_world):
    register_perf_model(None)
    b = batch()
    b.overlong_penalty = torch.tensor([0.0, -0.5])  # compute_advantages sets it with algo.overlong_buffer > 0
    m = reduce_metrics(1, b, {}, dict(TIMES), True, AlgoConfig(overlong_buffer=1))
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-0.25)  # (0 - 0.5) / 2 samples
    assert m["reward_mean"] == pytest.approx(0.5)  # the task reward, unshaped
    m = reduce_metrics(1, batch(), {}, dict(TIMES), True, AlgoConfig())
    assert "reward/overlong_penalty_mean" not in m
