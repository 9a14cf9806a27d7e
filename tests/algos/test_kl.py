import math

import pytest
import torch

from yatt_ray.algos import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimate, kl_low_var
from yatt_ray.errors import UnknownNameError

F64 = torch.float64


def test_hand_computed_2x3():
    # logp - ref_logp = [[0, 1, -1], [2, -2, 0.5]];  d = ref_logp - logp = -(that)
    logp = torch.tensor([[0.0, -1.0, -0.5], [-1.0, -3.0, -0.5]], dtype=F64)
    ref = torch.tensor([[0.0, -2.0, 0.5], [-3.0, -1.0, -1.0]], dtype=F64)
    # k1 = logp - ref
    k1 = torch.tensor([[0.0, 1.0, -1.0], [2.0, -2.0, 0.5]], dtype=F64)
    # k2 = 0.5 * k1^2
    k2 = torch.tensor([[0.0, 0.5, 0.5], [2.0, 2.0, 0.125]], dtype=F64)
    # k3 = exp(d) - d - 1 with d = -k1:
    #   d=0 -> 0;  d=-1 -> e^-1 + 1 - 1 = e^-1;  d=1 -> e - 2;  d=-2 -> e^-2 + 1;  d=2 -> e^2 - 3;
    #   d=-0.5 -> e^-0.5 - 0.5
    e = math.e
    k3 = torch.tensor([[0.0, 1 / e, e - 2], [e**-2 + 1, e**2 - 3, e**-0.5 - 0.5]], dtype=F64)
    for kind, expected in (("k1", k1), ("k2", k2), ("k3", k3)):
        torch.testing.assert_close(kl_estimate(logp, ref, kind), expected, rtol=0, atol=1e-14)
        torch.testing.assert_close(KL_ESTIMATORS.get(kind)(logp, ref), expected, rtol=0, atol=1e-14)


def test_k1_and_k3_are_unbiased_exactly():
    # pi = [1/2, 1/4, 1/4], ref = [1/4, 1/2, 1/4]:  KL(pi || ref) = 1/2 ln 2 + 1/4 ln(1/2) + 0 = ln(2) / 4.
    # The expectation under pi is an exact weighted sum over the three outcomes, no sampling needed.
    pi = torch.tensor([[0.5, 0.25, 0.25]], dtype=F64)
    ref = torch.tensor([[0.25, 0.5, 0.25]], dtype=F64)
    true_kl = math.log(2) / 4
    for kind in ("k1", "k3"):
        expectation = (pi * kl_estimate(pi.log(), ref.log(), kind)).sum().item()
        assert expectation == pytest.approx(true_kl, abs=1e-15)
    # k2 is biased: E = 1/2 * (1/2 ln^2 2 + 1/4 ln^2 2) = 3/8 ln^2 2
    assert (pi * kl_estimate(pi.log(), ref.log(), "k2")).sum().item() == pytest.approx(
        3 / 8 * math.log(2) ** 2, abs=1e-15
    )


def test_k3_clamps_log_ratio_to_20():
    logp = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[100.0, -100.0, 1.0]], dtype=F64)
    out = kl_estimate(logp, ref, "k3")
    # d = 100 -> 20: e^20 - 21;  d = -100 -> -20: e^-20 + 20 - 1;  d = 1: e - 2 (inside the clamp)
    expected = torch.tensor([[math.exp(20) - 21, math.exp(-20) + 19, math.e - 2]], dtype=F64)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-15, atol=0)
    out.sum().backward()
    # d k3 / d logp = 1 - e^d inside the clamp, 0 outside
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, 0.0, 1 - math.e]], dtype=F64), rtol=0, atol=1e-15
    )
    assert torch.isfinite(kl_estimate(torch.zeros(1, 1), torch.full((1, 1), 1e4), "k3")).all()  # fp32


def test_k3_is_nonnegative_and_accurate_near_zero_in_float32():
    # |d| from 1e-8 to 10, both signs. In float32 exp(d) - d - 1 (or expm1(d) - d) cancels catastrophically
    # for small d; the estimator must stay >= 0 and match a float64 reference to ~1e-6 relative.
    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    d = sign * torch.logspace(-8, 1, 4096)
    out = kl_estimate(torch.zeros(1, 4096), d.view(1, -1), "k3").view(-1)
    assert out.dtype == torch.float32
    assert (out >= 0).all()
    d64 = d.double()
    reference = torch.expm1(d64) - d64  # float64: accurate to ~1e-8 relative even at |d| = 1e-8
    torch.testing.assert_close(out.double(), reference, rtol=3e-6, atol=0)
    # the direct float32 form fails this, so the check above is not vacuous
    naive = (torch.exp(d) - d - 1).double()
    assert not torch.allclose(naive, reference, rtol=3e-6, atol=0)


def test_k3_gradient_matches_float64_near_zero():
    # d k3 / d logp = 1 - e^d  (d = ref - logp), on both sides of the series / direct switch at |d| = 0.5
    d = torch.tensor([-0.7, -0.5, -0.3, -1e-3, 1e-6, 0.2, 0.49, 0.5, 2.0])
    logp = torch.zeros(1, d.numel(), requires_grad=True)
    kl_estimate(logp, d.view(1, -1), "k3").sum().backward()
    expected = (1 - torch.exp(d.double())).float().view(1, -1)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-7)


def test_low_precision_promoted_and_shapes_checked():
    bf = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    assert kl_estimate(bf, bf + 0.5, "k3").dtype == torch.float32
    with pytest.raises(ValueError, match=r"same shape \[B, T\]"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(3, 2), "k1")


def test_unknown_kind():
    with pytest.raises(UnknownNameError, match="valid: k1, k2, k3, low_var_kl"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_low_var_kl_is_k3_capped_at_10():
    # d = ref - logp: d = 2 -> k3 = e^2 - 3 = 4.389 (under the cap); d = 3 -> e^3 - 4 = 16.09 -> 10;
    # d = -50 -> clamped to -20 by k3: e^-20 + 19 -> capped at 10;  d = 0.6 -> e^0.6 - 1.6
    logp = torch.zeros(1, 4, dtype=F64, requires_grad=True)
    ref = torch.tensor([[2.0, 3.0, -50.0, 0.6]], dtype=F64)
    out = kl_estimate(logp, ref, "low_var_kl")
    expected = torch.tensor([[math.e**2 - 3, 10.0, 10.0, math.exp(0.6) - 1.6]], dtype=F64)
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=1e-14)
    out.sum().backward()
    # gradient 1 - e^d inside the cap, 0 where capped
    torch.testing.assert_close(
        logp.grad, torch.tensor([[1 - math.e**2, 0.0, 0.0, 1 - math.exp(0.6)]], dtype=F64), rtol=0, atol=1e-14
    )
    assert KL_ESTIMATORS.get("low_var_kl") is kl_low_var
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    k3 = kl_estimate(a, b, "k3")
    inside = k3 < 10
    assert 0 < int(inside.sum()) < 15  # this data is on both sides of the cap
    assert torch.equal(kl_low_var(a, b), torch.where(inside, k3, 10.0))  # identical to k3 inside the cap


def test_adaptive_kl_controller_hand_computed():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    # KL 9: error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; factor 1 + 0.2 * 1000 / 10000 = 1.02 -> 0.102
    ctl.update(9.0, n_steps=1000)
    assert ctl.value == pytest.approx(0.102, abs=1e-15)
    # KL 5.4: error = 0.9 - 1 = -0.1 (inside the clip); factor 1 - 0.1 * 0.2 = 0.98 -> 0.09996
    ctl.update(5.4, n_steps=2000)
    assert ctl.value == pytest.approx(0.09996, abs=1e-15)
    # KL 0: error = clip(-1) = -0.2; factor 1 - 0.2 * 0.05 = 0.99 -> 0.0989604
    ctl.update(0.0, n_steps=500)
    assert ctl.value == pytest.approx(0.0989604, abs=1e-15)
    # n_steps far beyond 5 * horizon: the factor is floored at 0, the coefficient never goes negative
    ctl.update(0.0, n_steps=100_000)
    assert ctl.value == 0.0
    for kwargs, match in (
        ({"init_coef": -1.0, "target": 1.0, "horizon": 1.0}, "init_coef must be >= 0"),
        ({"init_coef": 0.1, "target": 0.0, "horizon": 1.0}, "target must be > 0"),
        ({"init_coef": 0.1, "target": 1.0, "horizon": 0.0}, "horizon must be > 0"),
    ):
        with pytest.raises(ValueError, match=match):
            AdaptiveKLController(**kwargs)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, n_steps=10**6)
    assert ctl.value == 0.05
    with pytest.raises(ValueError, match="must be >= 0"):
        FixedKLController(-0.1)
