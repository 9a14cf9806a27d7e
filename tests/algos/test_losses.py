import math

import pytest
import torch

from yatt_ray.algos import POLICY_LOSSES, ppo_clip_loss

F64 = torch.float64


def _logp_from_ratios(ratios):
    # old_logp = 0, so logp = log(ratio)
    logp = torch.tensor(ratios, dtype=F64).log().requires_grad_(True)
    return logp, torch.zeros_like(logp)


def test_hand_computed_2x3_with_gradient():
    # ratios r = [[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]], clip range [0.8, 1.2]
    # row 0, A = 1:  r=1.5: min(1.5, 1.2) = 1.2 (clipped) -> loss -1.2, grad 0
    #                r=0.5: min(0.5, 0.8) = 0.5            -> loss -0.5, grad -r*A = -0.5
    #                r=1.1: min(1.1, 1.1) = 1.1            -> loss -1.1, grad -1.1
    # row 1, A = [-1, -1, -2]:
    #                r=1.5: min(-1.5, -1.2) = -1.5          -> loss 1.5,  grad -r*A = 1.5
    #                r=0.5: min(-0.5, -0.8) = -0.8 (clipped) -> loss 0.8, grad 0
    #                r=1.1: min(-2.2, -2.2) = -2.2          -> loss 2.2,  grad 2.2
    logp, old = _logp_from_ratios([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -2.0]], dtype=F64)
    loss, stats = ppo_clip_loss(logp, old, adv)
    torch.testing.assert_close(
        loss, torch.tensor([[-1.2, -0.5, -1.1], [1.5, 0.8, 2.2]], dtype=F64), rtol=0, atol=1e-14
    )
    assert torch.equal(stats["clipped"], torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=F64))
    torch.testing.assert_close(
        stats["ratio"], torch.tensor([[1.5, 0.5, 1.1]] * 2, dtype=F64), rtol=0, atol=1e-14
    )
    assert not stats["ratio"].requires_grad and not stats["clipped"].requires_grad
    loss.sum().backward()
    # d loss / d logp = d(-r A)/d logp = -r A where unclipped (dr/dlogp = r), 0 where clipped
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 2.2]], dtype=F64), rtol=0, atol=1e-14
    )


def test_asymmetric_clip_higher():
    # clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]: r=1.5, A=1 -> min(1.5, 1.28) = 1.28; r=0.5, A=-1 -> -0.8
    logp, old = _logp_from_ratios([[1.5, 0.5, 1.25]])
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=F64)
    loss, stats = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, -1.25]], dtype=F64), rtol=0, atol=1e-14)
    assert stats["clipped"].tolist() == [[1.0, 1.0, 0.0]]


def test_loop_matches_vectorised():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=gen, dtype=F64) * 0.3 - 1
    old = logp + torch.randn(4, 6, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    loss, stats = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.3)
    n_clipped = 0
    for b in range(4):
        for t in range(6):
            r = math.exp(logp[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            surrogate, clipped = r * a, min(max(r, 0.8), 1.3) * a
            assert loss[b, t].item() == pytest.approx(-min(surrogate, clipped), abs=1e-14)
            assert stats["clipped"][b, t].item() == float(clipped < surrogate)
            n_clipped += clipped < surrogate
    assert 0 < n_clipped < 24  # the data exercises both branches


def test_log_ratio_clamp_keeps_loss_finite():
    logp = torch.tensor([[0.0, -500.0]])
    old = torch.tensor([[-500.0, 0.0]])
    loss, stats = ppo_clip_loss(logp, old, torch.tensor([[-1.0, -1.0]]))
    assert torch.isfinite(loss).all()
    # ratio = exp(20) for the first token (log-ratio clamped to 20), exp(-20) for the second
    torch.testing.assert_close(
        stats["ratio"], torch.tensor([[math.exp(20), math.exp(-20)]]), rtol=1e-6, atol=0
    )


def test_registered_and_validation():
    assert POLICY_LOSSES.get("ppo_clip") is ppo_clip_loss
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="broadcast_to_tokens"):
        ppo_clip_loss(z, z, torch.zeros(2))
    with pytest.raises(ValueError, match="clip_low must be in"):
        ppo_clip_loss(z, z, z, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high must be >= 0"):
        ppo_clip_loss(z, z, z, clip_high=-0.1)
    assert ppo_clip_loss(z.bfloat16(), z.bfloat16(), z.bfloat16())[0].dtype == torch.float32
