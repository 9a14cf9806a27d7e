"""Off-policy corrections, their statistics, the decoupled PPO loss and staleness statistics, against values
worked out by hand in the comments."""

import math
import typing

import pytest
import torch

from yatt_ray.algos import (
    OFF_POLICY_CORRECTIONS,
    decoupled_ppo_loss,
    importance_ratio,
    importance_weight_stats,
    off_policy_weights,
    staleness_stats,
    tis_weights,
)
from yatt_ray.errors import UnknownNameError

F64 = torch.float64

# rho = pi_old / pi_rollout per token; rollout_logp = 0, so old_logp = log(rho). The last token of row 1 is
# padding (mask 0): its rho (0.25, outside the band) must not show in any statistic.
RHO = [[0.25, 1.0, 1.5], [3.0, 4.0, 0.25]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# the 5 real tokens: rho 0.25, 1, 1.5, 3, 4 -> sum 9.75, mean 1.95, max 4


def _logps(ratios=RHO):
    old = torch.tensor(ratios, dtype=F64).log()
    return old, torch.zeros_like(old)


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=1e-12)


def test_tis_truncates_at_the_cap_and_masks_nothing():
    old, rollout = _logps()
    weights, keep, stats = off_policy_weights("tis", old, rollout, MASK, cap=2.0)
    # min(rho, 2): 3 -> 2, 4 -> 2; the padding token keeps its own value (the aggregation masks it)
    _close(weights, [[0.25, 1.0, 1.5], [2.0, 2.0, 0.25]])
    assert keep.tolist() == [[True, True, True], [True, True, False]]  # = the mask
    # real tokens: weights 0.25 + 1 + 1.5 + 2 + 2 = 6.75 -> 6.75 / 5 = 1.35; 2 of 5 above the cap
    _close(stats["ratio_mean"], 1.95)
    _close(stats["ratio_max"], 4.0)
    _close(stats["weight_mean"], 1.35)
    _close(stats["clipped_frac"], 0.4)
    _close(stats["masked_frac"], 0.0)
    _close(stats["tokens"], 5.0)


def test_tis_and_decoupled_are_the_mismatch_tis_weight_bit_for_bit():
    old, rollout = _logps()
    expected = tis_weights(old, rollout, 2.0)
    for mode in ("tis", "decoupled", "none"):
        weights, _, _ = off_policy_weights(mode, old, rollout, MASK, cap=2.0)
        assert torch.equal(weights, expected), mode


def test_none_without_a_cap_weighs_every_token_one():
    old, rollout = _logps()
    weights, keep, stats = off_policy_weights("none", old, rollout, MASK, cap=None)
    assert torch.equal(weights, torch.ones(2, 3, dtype=F64))
    assert torch.equal(keep, MASK.bool())
    _close(stats["weight_mean"], 1.0)
    _close(stats["clipped_frac"], 0.0)  # no cap, nothing truncated


def test_mis_keeps_the_ratio_inside_the_band_and_masks_the_rest():
    old, rollout = _logps()
    weights, keep, stats = off_policy_weights("mis", old, rollout, MASK, cap=2.0, low=0.5, high=2.0)
    # band [0.5, 2]: 0.25 out, 1 in, 1.5 in | 3 out, 4 out, (padding 0.25 out)
    _close(weights, [[0.0, 1.0, 1.5], [0.0, 0.0, 0.0]])
    assert keep.tolist() == [[False, True, True], [False, False, False]]
    # real tokens: weights 0 + 1 + 1.5 + 0 + 0 = 2.5 -> 0.5; 3 of 5 masked; mis uses no cap
    _close(stats["weight_mean"], 0.5)
    _close(stats["masked_frac"], 0.6)
    _close(stats["clipped_frac"], 0.0)
    _close(stats["ratio_mean"], 1.95)


def test_icepop_masks_outside_the_band_with_weight_one_inside():
    old, rollout = _logps()
    weights, keep, stats = off_policy_weights("icepop", old, rollout, MASK, cap=2.0, low=0.5, high=2.0)
    _close(weights, [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert keep.tolist() == [[False, True, True], [False, False, False]]
    _close(stats["weight_mean"], 0.4)  # 2 / 5
    _close(stats["masked_frac"], 0.6)


def test_band_bounds_are_included_and_a_wider_band_keeps_more():
    # exp(log(0.5)) and exp(log(2)) are exactly 0.5 and 2 in float64 (checked here, as the test relies on it)
    assert float(torch.tensor(0.5, dtype=F64).log().exp()) == 0.5
    assert float(torch.tensor(2.0, dtype=F64).log().exp()) == 2.0
    old, rollout = _logps([[0.5, 2.0, 3.0]])
    mask = torch.ones(1, 3)
    weights, keep, _ = off_policy_weights("mis", old, rollout, mask, low=0.5, high=2.0)
    _close(weights, [[0.5, 2.0, 0.0]])
    assert keep.tolist() == [[True, True, False]]
    weights, keep, _ = off_policy_weights("mis", old, rollout, mask, low=0.25, high=4.0)
    _close(weights, [[0.5, 2.0, 3.0]])
    assert keep.all()


def test_weights_are_detached_and_at_least_float32():
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    rollout = torch.tensor([[-1.5, -2.0]], dtype=torch.bfloat16)
    for mode in OFF_POLICY_CORRECTIONS:
        weights, _, _ = off_policy_weights(mode, old, rollout, torch.ones(1, 2))
        assert weights.dtype == torch.float32 and not weights.requires_grad, mode


def test_extreme_log_ratios_do_not_overflow():
    old = torch.tensor([[500.0, -500.0]])
    rollout = torch.zeros(1, 2)
    ratio = importance_ratio(old, rollout)
    assert torch.isfinite(ratio).all()
    _close(ratio, [[math.exp(20.0), math.exp(-20.0)]])  # the log-ratio is clamped to [-20, 20]
    weights, keep, _ = off_policy_weights("mis", old, rollout, torch.ones(1, 2))
    assert weights.tolist() == [[0.0, 0.0]] and not keep.any()


def test_errors_name_the_problem():
    old, rollout = _logps()
    with pytest.raises(UnknownNameError, match="valid: decoupled, icepop, mis, none, tis"):
        off_policy_weights("pop", old, rollout, MASK)
    with pytest.raises(ValueError, match=r"'tis' and 'decoupled' need a cap > 0 \(algo.tis_cap\), got None"):
        off_policy_weights("tis", old, rollout, MASK, cap=None)
    with pytest.raises(ValueError, match=r"'tis' and 'decoupled' need a cap > 0 \(algo.tis_cap\), got None"):
        off_policy_weights("decoupled", old, rollout, MASK, cap=None)
    with pytest.raises(ValueError, match=r"0 <= low < 1 < high, got \[1.0, 2.0\]"):
        off_policy_weights("icepop", old, rollout, MASK, low=1.0, high=2.0)
    with pytest.raises(ValueError, match="share one shape"):
        off_policy_weights("tis", old, rollout, MASK[:, :2])


def test_the_config_names_are_the_registered_corrections():
    from yatt_ray.config import OffPolicy

    assert sorted(typing.get_args(OffPolicy)) == OFF_POLICY_CORRECTIONS.names()


def test_importance_weight_stats_with_nothing_selected_is_zero():
    ratio = torch.tensor([[5.0, 0.1]])
    stats = importance_weight_stats(ratio, ratio, torch.zeros(1, 2), keep=torch.zeros(1, 2), cap=2.0)
    assert all(float(v) == 0.0 for v in stats.values())


def test_decoupled_ppo_loss_by_hand_with_gradient():
    # current / proximal ratio r = [1.5, 0.9, 1.1] (proximal = 0, logp = log r), A = [1, -1, 1], clip [0.8, 1.2]
    #   r=1.5, A=1:  min(1.5, 1.2)   = 1.2  (clipped)  -> pg -1.2, d/dlogp 0
    #   r=0.9, A=-1: min(-0.9, -0.9) = -0.9            -> pg  0.9, d/dlogp -r A = 0.9
    #   r=1.1, A=1:  min(1.1, 1.1)   = 1.1             -> pg -1.1, d/dlogp -1.1
    # proximal / behaviour rho = [3, 0.5, 1] (behaviour = -log rho), cap 2 -> w = [2, 0.5, 1]
    # loss = w * pg = [-2.4, 0.45, -1.1]; gradient w * d pg = [0, 0.45, -1.1]
    logp = torch.tensor([[1.5, 0.9, 1.1]], dtype=F64).log().requires_grad_(True)
    proximal = torch.zeros(1, 3, dtype=F64)
    behaviour = -torch.tensor([[3.0, 0.5, 1.0]], dtype=F64).log()
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=F64)
    loss, stats = decoupled_ppo_loss(logp, proximal, behaviour, adv, 0.2, 0.2, cap=2.0)
    _close(loss.detach(), [[-2.4, 0.45, -1.1]])
    _close(stats["behaviour_weight"], [[2.0, 0.5, 1.0]])
    assert stats["clipped"].tolist() == [[1.0, 0.0, 0.0]]
    loss.sum().backward()
    _close(logp.grad, [[0.0, 0.45, -1.1]])


# ---- staleness ---------------------------------------------------------------------------------------------
VERSIONS = torch.tensor([[5, 5, 4, 0], [6, 6, 6, 6], [3, 4, 5, 9], [7, 7, 7, 7]])
VERSION_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]])
# trainer version 6. row 0: versions {5, 4} (the padding 0 ignored) -> oldest 4, staleness 2, 2 distinct
# row 1: {6} -> staleness 0, 1 distinct; row 2: {3, 4, 5} (padding 9 ignored) -> staleness 3, 3 distinct
# row 3: no real token -> not counted. Staleness [2, 0, 3]: histogram [1, 0, 1, 1], mean 5/3, max 3;
# distinct versions (2 + 1 + 3) / 3 = 2; 3 samples


def test_staleness_histogram_and_distinct_versions_by_hand():
    s = staleness_stats(VERSIONS, 6, VERSION_MASK)
    assert s["staleness_hist"].tolist() == [1, 0, 1, 1]
    assert s["staleness_hist"].dtype == torch.int64
    assert abs(float(s["staleness_mean"]) - 5 / 3) < 1e-6
    assert int(s["staleness_max"]) == 3
    assert float(s["distinct_versions_mean"]) == 2.0
    assert int(s["samples"]) == 3


def test_staleness_with_fixed_bins_lumps_the_tail():
    # bins=2: staleness 0 -> bin 0; 2 and 3 -> the last bin (>= 1)
    assert staleness_stats(VERSIONS, 6, VERSION_MASK, bins=2)["staleness_hist"].tolist() == [1, 2]
    # bins=5: a fixed length with zeros beyond the largest staleness
    assert staleness_stats(VERSIONS, 6, VERSION_MASK, bins=5)["staleness_hist"].tolist() == [1, 0, 1, 1, 0]


def test_staleness_with_no_sample_is_empty():
    s = staleness_stats(VERSIONS, 9, torch.zeros(4, 4))
    assert s["staleness_hist"].tolist() == [] and int(s["samples"]) == 0
    assert float(s["staleness_mean"]) == 0.0 and float(s["distinct_versions_mean"]) == 0.0


def test_staleness_errors():
    with pytest.raises(ValueError, match="weight version 6, newer than trainer_version=5"):
        staleness_stats(VERSIONS, 5, VERSION_MASK)
    with pytest.raises(ValueError, match="must be an integer tensor"):
        staleness_stats(VERSIONS.float(), 6, VERSION_MASK)
    with pytest.raises(ValueError, match="bins must be >= 1"):
        staleness_stats(VERSIONS, 6, VERSION_MASK, bins=0)
