"""The copy-free RoPE and SwiGLU (`yatt_ray.train.fused`) against Megatron's own unfused code: values and gradients."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from yatt_ray.train import fused

CONFIG = SimpleNamespace(rotary_interleaved=False, multi_latent_attention=False, apply_rope_fusion=False)


def _inputs(equal_halves: bool, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 4, 16, generator=g, dtype=dtype)
    half = torch.rand(7, 3, 1, 8, generator=g, dtype=dtype) * 6
    other = half if equal_halves else torch.rand(7, 3, 1, 8, generator=g, dtype=dtype) * 6
    return x, torch.cat([half, other], dim=-1)


@pytest.mark.parametrize("equal_halves", [True, False])
def test_values_and_gradients_match_megatron(equal_halves):
    x, freqs = _inputs(equal_halves)
    grad = torch.randn_like(x)
    ours_x = x.clone().requires_grad_()
    theirs_x = x.clone().requires_grad_()
    ours = fused.apply_rotary_pos_emb(ours_x, freqs, CONFIG)
    theirs = rope_utils._apply_rotary_pos_emb_bshd(theirs_x, freqs)
    ours.backward(grad)
    theirs.backward(grad)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=0, atol=1e-12)
    assert not torch.allclose(ours, x)  # a rotation happened


def test_rotation_preserves_norm_and_inverts():
    """RoPE is a rotation of each (x1_i, x2_i) pair: norms kept, and the backward map is its inverse."""
    x, freqs = _inputs(True)
    y = fused.rotary(x, freqs)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    back = fused._rotate_grad(y, torch.cos(freqs), torch.sin(freqs))
    torch.testing.assert_close(back, x)


def test_other_layouts_fall_back_to_megatron():
    x, freqs = _inputs(True, torch.float32)
    interleaved = SimpleNamespace(**{**vars(CONFIG), "rotary_interleaved": True})
    got = fused.apply_rotary_pos_emb(x, freqs, interleaved, cp_group=object())
    want = rope_utils._apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=True)
    torch.testing.assert_close(got, want)
    partial = freqs[..., :8]  # rotary over half of the head: Megatron passes the rest through
    got = fused.apply_rotary_pos_emb(x, partial, CONFIG, cp_group=object())
    torch.testing.assert_close(got, rope_utils._apply_rotary_pos_emb_bshd(x, partial))
    torch.testing.assert_close(got[..., 8:], x[..., 8:])


def test_swiglu_values_and_gradients_match_megatron_glu():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 12, generator=g, dtype=torch.float64) * 3
    grad = torch.randn(5, 3, 6, generator=g, dtype=torch.float64)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = fused.bias_swiglu_impl(ours_x, None)
    a, b = torch.chunk(theirs_x, 2, dim=-1)  # Megatron's unfused glu (mlp.py), offset 0
    theirs = torch.nn.functional.silu(a) * (b + 0.0)
    ours.backward(grad)
    theirs.backward(grad)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(fused.swiglu, (x[:2, :1].clone().requires_grad_(),))


def test_swiglu_with_a_bias_is_megatrons():
    x, bias = torch.randn(4, 8), torch.randn(8)
    a, b = torch.chunk(x + bias, 2, dim=-1)
    torch.testing.assert_close(fused.bias_swiglu_impl(x, bias), torch.nn.functional.silu(a) * b)


def test_install_points_megatron_layers_here():
    from megatron.core.transformer import attention, mlp

    fused.install()
    assert attention.apply_rotary_pos_emb is fused.apply_rotary_pos_emb
    assert mlp.bias_swiglu_impl is fused.bias_swiglu_impl
    assert attention.apply_fused_qkv_rotary_pos_emb is fused.apply_fused_qkv_rotary_pos_emb


def test_single_qkv_rope_equals_megatrons_split_then_rotate():
    """fc_qkv's output [sq, b, g, (r + 2) d] -> rotated query [sq, b, g r, d], key, value: as Megatron's split
    path (split, reshape the query, rotate each), values and gradients; its backward writes one fc_qkv-shaped
    gradient (no concatenation)."""
    g = torch.Generator().manual_seed(2)
    groups, per_group, dim = 2, 3, 16
    mixed = torch.randn(7, 2, groups, (per_group + 2) * dim, generator=g, dtype=torch.float64)
    freqs = torch.rand(7, 2, 1, dim, generator=g, dtype=torch.float64) * 6
    split = [per_group * dim, dim, dim]
    ours_in, theirs_in = mixed.clone().requires_grad_(), mixed.clone().requires_grad_()
    ours = fused.apply_fused_qkv_rotary_pos_emb(ours_in, freqs, freqs, split)
    q, k, v = torch.split(theirs_in, split, dim=3)
    q = q.reshape(7, 2, groups * per_group, dim)
    theirs = (
        rope_utils._apply_rotary_pos_emb_bshd(q, freqs),
        rope_utils._apply_rotary_pos_emb_bshd(k, freqs),
        v,
    )
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in theirs]
    for got, want in zip(ours, theirs):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    sum((t * w).sum() for t, w in zip(ours, weights)).backward()
    sum((t * w).sum() for t, w in zip(theirs, weights)).backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="not \\[r \\* 16, 16, 16\\]"):
        fused.apply_fused_qkv_rotary_pos_emb(mixed, freqs, freqs, [per_group * dim, dim, 2 * dim])


CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu_check.sh)"),
]


@pytest.mark.parametrize(
    "device,dtype,tol",
    [
        ("cpu", torch.float64, 1e-12),
        ("cpu", torch.float32, 1e-5),
        ("cpu", torch.bfloat16, 0.0),
        pytest.param("cuda", torch.float32, 1e-5, marks=CUDA),
        pytest.param("cuda", torch.bfloat16, 0.0, marks=CUDA),
    ],
)
def test_rms_norm_operator_equals_torchs_rmsnorm(device, dtype, tol):
    """One operator each way (`yatt_ray::rms_norm` / `_backward`: torch's fused kernels on CUDA), the values
    and gradients of torch.nn.RMSNorm (bf16: bit for bit in the forward; the gradients as close to float64 as
    torch's own)."""
    from yatt_ray.testing.gpu_proxies import OpCounter

    g = torch.Generator().manual_seed(4)
    ref = torch.nn.RMSNorm(16, eps=1e-6, dtype=dtype, device=device)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, generator=g))
    x = torch.randn(9, 2, 16, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(9, 2, 16, generator=g).to(device, dtype)
    ours = torch.nn.RMSNorm(16, eps=1e-6, dtype=dtype, device=device)
    ours.load_state_dict(ref.state_dict())
    fused.use_fused_norms(torch.nn.Sequential(ours))
    assert isinstance(ours, fused.RMSNorm) and list(ours.state_dict()) == ["weight"]
    with OpCounter() as counter:
        y = ours(x)
        dx, dw = torch.autograd.grad(y, (x, ours.weight), grad)
    assert counter.ops == {"rms_norm": 1, "rms_norm_backward": 1}, counter.ops
    want = ref(x)
    want_dx, want_dw = torch.autograd.grad(want, (x, ref.weight), grad)
    torch.testing.assert_close(y, want, rtol=0, atol=tol)
    x64, w64 = x.detach().double().requires_grad_(), ref.weight.detach().double().requires_grad_()
    exact = torch.autograd.grad(
        torch.nn.functional.rms_norm(x64, (16,), w64, 1e-6), (x64, w64), grad.double()
    )
    for got, theirs, truth in zip((dx, dw), (want_dx, want_dw), exact):
        assert (got.double() - truth).abs().max() <= max((theirs.double() - truth).abs().max(), 1e-12) * 1.01
