import math

import pytest
import torch

from yatt_ray.algos import (
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    clipped_value_loss,
    gspo_loss,
    mismatch_stats,
    ppo_clip_loss,
    tis_weights,
)

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
    assert POLICY_LOSSES.get("gspo") is gspo_loss and POLICY_LOSSES.get("cispo") is cispo_loss
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="broadcast_to_tokens"):
        ppo_clip_loss(z, z, torch.zeros(2))
    with pytest.raises(ValueError, match="clip_low must be in"):
        ppo_clip_loss(z, z, z, clip_low=1.0)
    for bad in (-0.1, 0.0):  # the same bound as the config's algo.clip_high (one source: check_clip)
        with pytest.raises(ValueError, match="clip_high must be > 0"):
            ppo_clip_loss(z, z, z, clip_high=bad)
    assert ppo_clip_loss(z.bfloat16(), z.bfloat16(), z.bfloat16())[0].dtype == torch.float32


# --- dual clip ------------------------------------------------------------------------------------------------


def test_dual_clip_hand_computed_with_gradient():
    # clip range [0.8, 1.2], dual clip c = 3 (caps the loss of A < 0 tokens at -c * A)
    #   r=1.5, A=-1: ppo = max(1.5, 1.2) = 1.5; cap 3 -> 1.5, grad -r*A = 1.5
    #   r=5.0, A=-1: ppo = max(5.0, 1.2) = 5.0; cap 3 -> 3 (dual clipped), grad 0
    #   r=5.0, A=+1: ppo = -min(5, 1.2) = -1.2 (clipped; A > 0, no cap), grad 0
    #   r=0.5, A=-2: ppo = max(1.0, 1.6) = 1.6 (clipped); cap 6 -> 1.6, grad 0
    logp, old = _logp_from_ratios([[1.5, 5.0, 5.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]], dtype=F64)
    loss, stats = ppo_clip_loss(logp, old, adv, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[1.5, 3.0, -1.2, 1.6]], dtype=F64), rtol=0, atol=1e-14)
    assert stats["dual_clipped"].tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert stats["clipped"].tolist() == [[0.0, 0.0, 1.0, 1.0]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.5, 0.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-14)
    # without dual clip the r=5, A=-1 token costs 5, and the stat is all zeros
    plain, stats = ppo_clip_loss(logp.detach(), old, adv)
    assert plain[0, 1].item() == pytest.approx(5.0, abs=1e-14) and not stats["dual_clipped"].any()
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(logp, old, adv, dual_clip=1.0)


# --- GSPO -----------------------------------------------------------------------------------------------------


def test_gspo_hand_computed_with_gradient():
    # clip range [0.8, 1.2]; old_logp = 0, so the token log-ratios are the logp values
    # row 0: mask [1, 1, 0]: log-ratios [0.1, -0.3] -> mean -0.1 -> s = e^-0.1 = 0.904837...; A = 1, unclipped
    #        loss = -s on both tokens; aggregated seq-mean-token-mean: d(-s)/d logp_t = -s * (1/2) per token
    # row 1: mask [1, 1, 1]: log-ratios [0.5, 0.5, 0.5] -> s = e^0.5 = 1.6487 > 1.2; A = 1 -> clipped: -1.2, grad 0
    logp = torch.tensor([[0.1, -0.3, float("-inf")], [0.5, 0.5, 0.5]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = gspo_loss(logp, old, adv, 0.2, 0.2, response_mask=mask)
    s = math.exp(-0.1)
    torch.testing.assert_close(
        loss, torch.tensor([[-s, -s, 0.0], [-1.2, -1.2, -1.2]], dtype=F64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        stats["ratio"], torch.tensor([[s] * 3, [math.exp(0.5)] * 3], dtype=F64), rtol=0, atol=1e-15
    )
    assert stats["clipped"].tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    # seq-mean-token-mean: (-s + -1.2) / 2 sequences
    total = aggregate(loss, mask, "seq-mean-token-mean")
    assert total.item() == pytest.approx((-s - 1.2) / 2, abs=1e-15)
    total.backward()
    # d total / d logp[0, t] = (1/2 sequences) * (-s / 2 tokens); row 1 clipped: 0; the -inf padding: 0
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )


def test_gspo_token_form_matches_sequence_level_value_and_gradient():
    gen = torch.Generator().manual_seed(6)
    batch, width = 6, 7
    lengths = torch.tensor([7, 2, 5, 1, 4, 6])
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    old = torch.randn(batch, width, generator=gen, dtype=F64) - 2
    # choose each row's mean log-ratio so that both sides of the GSPO clip range [1 - 3e-4, 1 + 4e-4] occur
    target = torch.tensor([1e-4, 1e-3, -1e-3, -2e-4, 6e-4, -5e-4], dtype=F64)
    noise = torch.randn(batch, width, generator=gen, dtype=F64) * 1e-3
    noise_mean = (noise * mask).sum(1, keepdim=True) / lengths.unsqueeze(1)
    logp0 = old + torch.where(mask, noise - noise_mean + target.unsqueeze(1), torch.zeros(()))
    seq_adv = torch.tensor([1.0, 1.0, -1.0, -0.5, 2.0, 1.5], dtype=F64)
    adv = torch.where(mask, seq_adv.unsqueeze(1), torch.zeros(()))

    logp = logp0.clone().requires_grad_(True)
    loss, stats = gspo_loss(logp, old, adv, response_mask=mask)  # defaults 3e-4 / 4e-4
    value = aggregate(loss, mask, "seq-mean-token-mean")
    value.backward()

    # the sequence-level objective, computed directly
    logp_ref = logp0.clone().requires_grad_(True)
    log_s = ((logp_ref - old) * mask).sum(1) / lengths
    s = torch.exp(log_s)
    objective = torch.minimum(s * seq_adv, s.clamp(1 - 3e-4, 1 + 4e-4) * seq_adv)
    direct = -objective.mean()
    direct.backward()

    assert value.item() == pytest.approx(direct.item(), abs=1e-14)
    torch.testing.assert_close(logp.grad, logp_ref.grad, rtol=0, atol=1e-14)
    clipped_rows = stats["clipped"][:, 0].tolist()
    assert clipped_rows == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]  # both branches exercised
    with pytest.raises(ValueError, match="gspo needs response_mask"):
        gspo_loss(logp, old, adv)


def test_gspo_clamp_bounds_loss_and_gradient():
    # old_logp = 0, mask [1, 1, 0], default clip range [1 - 3e-4, 1 + 4e-4]; the clamp is [-10, 10]
    # row 0: token log-ratios [11, 13] -> m = 12 > 10, A = -1: s = e^10 (clamped), unclipped -e^10 < clipped
    #        -(1 + 4e-4), so loss = e^10 = 22026.4658 per token (unclamped it would be e^12 = 162754.8);
    #        gradient 0 (torch.clamp is flat outside its bounds; before the fix it was e^12 per token)
    # row 1: m = 25 (beyond the overflow clamp of 20 too), A = -1: the same loss e^10, gradient 0
    # row 2: m = -12 < -10, A = +1: s = e^-10, loss = -e^-10 = -4.54e-5, gradient 0
    # row 3: m = 12, A = +1: clipped, loss = -(1 + 4e-4), gradient 0 (clip, as without the clamp)
    logp = torch.tensor(
        [[11.0, 13.0, 0.7], [24.0, 26.0, 0.0], [-11.0, -13.0, 0.0], [12.0, 12.0, 0.0]],
        dtype=F64,
        requires_grad=True,
    )
    old = torch.zeros(4, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 0]] * 4)
    seq_adv = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=F64)
    adv = torch.where(mask.bool(), seq_adv.unsqueeze(1), torch.zeros(()))
    loss, stats = gspo_loss(logp, old, adv, response_mask=mask)
    e10 = math.exp(10.0)
    expected = torch.tensor(
        [[e10, e10, 0.0], [e10, e10, 0.0], [-math.exp(-10.0)] * 2 + [0.0], [-(1 + 4e-4)] * 2 + [0.0]],
        dtype=F64,
    )
    torch.testing.assert_close(loss, expected, rtol=1e-15, atol=0)
    assert float(loss.detach().abs().max()) <= e10 * float(seq_adv.abs().max())  # the bound: e^10 * |A|
    torch.testing.assert_close(stats["ratio"][:, 0], torch.tensor([e10, e10, math.exp(-10), e10], dtype=F64))
    aggregate(loss, mask, "seq-mean-token-mean").backward()
    assert logp.grad is not None and torch.equal(logp.grad, torch.zeros_like(logp))
    # the summed per-token loss gives the same: every token's gradient is exactly 0
    logp2 = logp.detach().clone().requires_grad_(True)
    gspo_loss(logp2, old, adv, response_mask=mask)[0].sum().backward()
    assert torch.equal(logp2.grad, torch.zeros_like(logp2))


def test_gspo_inside_clamp_value_and_gradient_unchanged():
    # rows with |m| <= 10, some far from 1, with the clip range [0.8, 1.2]; old_logp random
    gen = torch.Generator().manual_seed(11)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    lengths = mask.sum(1)
    target = torch.tensor([9.5, -9.5, 2.0, -0.5, 0.1, 9.9], dtype=F64)  # all inside [-10, 10]
    seq_adv = torch.tensor([-1.0, 1.0, -2.0, 0.5, 1.0, -1.0], dtype=F64)
    old = torch.randn(6, 4, generator=gen, dtype=F64) - 3
    noise = torch.randn(6, 4, generator=gen, dtype=F64) * 0.1
    noise = torch.where(mask.bool(), noise - (noise * mask).sum(1, keepdim=True) / lengths.unsqueeze(1), 0.0)
    logp0 = old + torch.where(mask.bool(), noise + target.unsqueeze(1), torch.zeros(()))
    adv = torch.where(mask.bool(), seq_adv.unsqueeze(1), torch.zeros(()))

    logp = logp0.clone().requires_grad_(True)
    loss, _ = gspo_loss(logp, old, adv, 0.2, 0.2, response_mask=mask)
    loss.sum().backward()

    # the formula: s_i = exp(m_i); loss = -min(s A, clip(s) A); d loss[i, t] / d logp[i, t] = -A s_i where
    # the unclipped term is the minimum, else 0 (m_i is detached: each token's own path only)
    m = ((logp0 - old) * mask).sum(1) / lengths
    s = torch.exp(m)
    torch.testing.assert_close(m, target, rtol=0, atol=1e-12)
    unclipped, clipped = s * seq_adv, s.clamp(0.8, 1.2) * seq_adv
    row_loss = -torch.minimum(unclipped, clipped)
    row_grad = torch.where(unclipped <= clipped, -seq_adv * s, torch.zeros(()))
    assert (unclipped < clipped).tolist() == [True, True, True, True, False, True]  # both branches exercised
    torch.testing.assert_close(loss, row_loss.unsqueeze(1) * mask, rtol=1e-14, atol=0)  # A = 0 on padding
    torch.testing.assert_close(logp.grad, row_grad.unsqueeze(1) * mask, rtol=1e-14, atol=0)
    # e.g. row 0: m = 9.5, A = -1 -> loss e^9.5 = 13359.73 per token, gradient e^9.5 per token
    assert loss[0, 0].item() == pytest.approx(math.exp(9.5), rel=1e-14)
    assert logp.grad[0, 0].item() == pytest.approx(math.exp(9.5), rel=1e-14)

    # the pre-fix form (clamp [-20, 20] on the detached m, then exp(m + logp - sg(logp))) gives the same
    logp_old = logp0.clone().requires_grad_(True)
    lp = torch.where(mask.bool(), logp_old, 0.0)
    m_old = (((lp - old * mask).sum(1, keepdim=True)) / lengths.unsqueeze(1)).detach().clamp(-20, 20)
    ratio_old = torch.exp(m_old + (lp - lp.detach()))
    loss_old = -torch.minimum(ratio_old * adv, ratio_old.clamp(0.8, 1.2) * adv)
    loss_old.sum().backward()
    torch.testing.assert_close(loss, loss_old, rtol=1e-15, atol=0)
    torch.testing.assert_close(logp.grad, logp_old.grad, rtol=1e-15, atol=0)


# --- CISPO ----------------------------------------------------------------------------------------------------


def test_cispo_hand_computed_with_gradient():
    # ratios [1.5, 0.5, 1.1], A = [1, -1, 2], weight bounds [0.8, 1.2] -> w = [1.2, 0.8, 1.1] (detached)
    # loss = -w * A * logp with logp = ln(ratio):  [-1.2 ln 1.5, 0.8 ln 0.5, -2.2 ln 1.1]
    # grad = -w * A = [-1.2, 0.8, -2.2]: clipped tokens keep a gradient (PPO would give 0 for the first two)
    logp, old = _logp_from_ratios([[1.5, 0.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=F64)
    loss, stats = cispo_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    expected = [[-1.2 * math.log(1.5), 0.8 * math.log(0.5), -2.2 * math.log(1.1)]]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-15)
    assert stats["clipped"].tolist() == [[1.0, 1.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2, 0.8, -2.2]], dtype=F64), rtol=0, atol=1e-15)
    # default clip_low = 1: no lower bound, so the 0.5 ratio is its own weight (grad -0.5 * -1 = 0.5)
    logp.grad = None
    loss, stats = cispo_loss(logp, old, adv)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2, 0.5, -2.2]], dtype=F64), rtol=0, atol=1e-15)
    assert stats["clipped"].tolist() == [[1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\]"):
        cispo_loss(logp, old, adv, clip_low=1.5)


def test_cispo_gradient_equals_ppo_on_policy():
    # at logp == old_logp every ratio is 1 (unclipped): both gradients are -A
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3, 4, generator=gen, dtype=F64) - 1
    adv = torch.randn(3, 4, generator=gen, dtype=F64)
    grads = []
    for fn in (ppo_clip_loss, cispo_loss):
        logp = base.clone().requires_grad_(True)
        fn(logp, base, adv)[0].sum().backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], -adv, rtol=0, atol=1e-15)
    torch.testing.assert_close(grads[1], -adv, rtol=0, atol=1e-15)


# --- truncated importance sampling ------------------------------------------------------------------------------


def test_tis_weights_hand_computed():
    # old - rollout = [0, ln 1.5, ln 3, 100 (clamped to 20), -100 (clamped to -20)], cap 2
    #   -> [1, 1.5, min(3, 2) = 2, min(e^20, 2) = 2, e^-20]
    rollout = torch.zeros(1, 5, dtype=F64)
    old = torch.tensor([[0.0, math.log(1.5), math.log(3.0), 100.0, -100.0]], dtype=F64, requires_grad=True)
    w = tis_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(
        w, torch.tensor([[1.0, 1.5, 2.0, 2.0, math.exp(-20)]], dtype=F64), rtol=1e-15, atol=0
    )
    assert not w.requires_grad
    assert tis_weights(old.float(), rollout.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(old, rollout, cap=0.0)


def test_mismatch_stats_hand_computed():
    # masked tokens: diffs |-1 - -1.5| = 0.5 and 0; the third token is masked (its 5.0 must not count)
    # k3 of KL(rollout || old) with logp = rollout, ref = old: d = old - rollout = 0.5, 0 -> e^0.5 - 1.5, 0
    old = torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-1.5, -2.0, 5.0]], dtype=F64)
    stats = mismatch_stats(old, rollout, torch.tensor([[1, 1, 0]]))
    assert float(stats["logp_abs_diff_mean"]) == pytest.approx(0.25, abs=1e-15)
    assert float(stats["logp_abs_diff_max"]) == pytest.approx(0.5, abs=1e-15)
    assert float(stats["kl_k3_mean"]) == pytest.approx((math.exp(0.5) - 1.5) / 2, abs=1e-15)
    assert float(stats["tokens"]) == 2.0
    empty = mismatch_stats(old, rollout, torch.zeros(1, 3))
    assert all(float(v) == 0.0 for v in empty.values())


# --- value loss -------------------------------------------------------------------------------------------------


def test_clipped_value_loss_hand_computed_with_gradient():
    # old values 0, value_clip 0.2 -> V_clip = clamp(V, -0.2, 0.2)
    #   V=0.5,  R=1:  (V-R)^2 = 0.25, (0.2-1)^2 = 0.64   -> max 0.64 (clipped): loss 0.32,  grad 0
    #   V=0.1,  R=1:  inside the clip: 0.81                              -> loss 0.405, grad V-R = -0.9
    #   V=-0.5, R=-2: (1.5)^2 = 2.25, (-0.2+2)^2 = 3.24 -> max 3.24 (clipped): loss 1.62, grad 0
    #   V=0.5,  R=0:  0.25 vs (0.2)^2 = 0.04            -> max 0.25 (unclipped): loss 0.125, grad 0.5
    values = torch.tensor([[0.5, 0.1, -0.5, 0.5]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 4, dtype=F64)
    returns = torch.tensor([[1.0, 1.0, -2.0, 0.0]], dtype=F64)
    loss, stats = clipped_value_loss(values, old, returns, value_clip=0.2)
    torch.testing.assert_close(
        loss, torch.tensor([[0.32, 0.405, 1.62, 0.125]], dtype=F64), rtol=0, atol=1e-15
    )
    assert stats["clipped"].tolist() == [[1.0, 0.0, 1.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(
        values.grad, torch.tensor([[0.0, -0.9, 0.0, 0.5]], dtype=F64), rtol=0, atol=1e-15
    )
    # without clipping: 0.5 * (V - R)^2 = [0.125, 0.405, 1.125, 0.125]
    plain, stats = clipped_value_loss(values.detach(), old, returns)
    torch.testing.assert_close(
        plain, torch.tensor([[0.125, 0.405, 1.125, 0.125]], dtype=F64), rtol=0, atol=1e-15
    )
    assert not stats["clipped"].any()
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        clipped_value_loss(values, old, returns, value_clip=0.0)
