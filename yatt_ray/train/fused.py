"""Copy-free RoPE and SwiGLU: the trainer's replacements for Megatron's unfused element-wise layer parts.

Both write each half of their output (or gradient) in place where Megatron's unfused code concatenates, and
`install()` routes Megatron's layers through them (idempotent; anything they do not cover goes to Megatron's own
function). Measured side by side on the 25M-parameter shape of `release/bench_vs_trl.py` (one process, fp32, a
32 x 8 group batch, alternating steps): RoPE 11% off the train step, SwiGLU a further 3% (docs/performance.md).

RoPE. Megatron's unfused path (`rope_utils._apply_rotary_pos_emb_bshd`) builds `rotate_half(x)` with a `torch.cat`,
multiplies twice, and concatenates the (empty) un-rotated tail back on: three full copies of q and k per
layer forward, a `cat` again in backward, and both x and rotate_half(x) saved for it. `rotate_half` here writes
each half of the output in place instead; for x = [x1, x2] (halves of the last dimension, d = 2h) and
cos = [c1, c2], sin = [s1, s2] of the same shape as x's last dimension (broadcast over heads):

    y1 = x1 c1 - x2 s1                 dx1 = g1 c1 + g2 s2
    y2 = x2 c2 + x1 s2                 dx2 = g2 c2 - g1 s1

so backward needs only cos and sin (saved, [S, B, 1, d], small against x [S, B, heads, d]). The halves of cos
and sin need not be equal (multimodal RoPE's sections select per frequency). `install()` points Megatron's
attention at `apply_rotary_pos_emb`, which takes this path for the layout the trainer uses (non-interleaved,
no multi-latent attention, mscale 1, rotary over the whole head, no packed `cu_seqlens`) and Megatron's own
function for anything else.

SwiGLU. For x = [a, b] (fc1's output, halves of the last dimension) y = silu(a) b; Megatron's unfused glu adds
a zero offset to b, and its backward concatenates the two half-gradients. `swiglu` saves x only (silu(a) is
recomputed in backward: less memory than the saved silu(a) and b of the unfused path) and writes

    db = g silu(a)                     da = silu'(a) g b

into the halves of one gradient tensor. Megatron reaches it through its `bias_activation_fusion` branch
(`transformer_config` sets it), with no bias.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """y1 = x1 c1 - sign x2 s1, y2 = x2 c2 + sign x1 s2 (sign -1 is the inverse rotation, the backward)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.empty_like(x)
    y1, y2 = out[..., :h], out[..., h:]
    torch.mul(x1, cos[..., :h], out=y1)
    y1.addcmul_(x2, sin[..., :h], value=-sign)
    torch.mul(x2, cos[..., h:], out=y2)
    y2.addcmul_(x1, sin[..., h:], value=sign)
    return out


def _rotate_grad(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1."""
    h = g.shape[-1] // 2
    g1, g2 = g[..., :h], g[..., h:]
    out = torch.empty_like(g)
    d1, d2 = out[..., :h], out[..., h:]
    torch.mul(g1, cos[..., :h], out=d1)
    d1.addcmul_(g2, sin[..., h:])
    torch.mul(g2, cos[..., h:], out=d2)
    d2.addcmul_(g1, sin[..., :h], value=-1.0)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_grad(grad, cos, sin), None, None


_tables: tuple[weakref.ref, torch.dtype, Tensor, Tensor] | None = None  # the last freqs' (cos, sin)


def rope_tables(freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin) of freqs in `dtype`, made once per freqs tensor: the model makes freqs once a forward and every
    layer's query and key read the same tables (4 kernels a layer less than computing them at each call)."""
    global _tables
    if _tables is not None:
        ref, kind, cos, sin = _tables
        if ref() is freqs and kind == dtype:
            return cos, sin
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    _tables = (weakref.ref(freqs), dtype, cos, sin)
    return cos, sin


def rotary(x: Tensor, freqs: Tensor) -> Tensor:
    """RoPE of x [S, B, heads, d] at angles freqs [S, B, 1, d] (non-interleaved halves); same dtype as x."""
    return _Rotary.apply(x, *rope_tables(freqs, x.dtype))


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """Megatron's `apply_rotary_pos_emb` signature: `rotary` where it applies, Megatron's function elsewhere."""
    from megatron.core.models.common.embeddings import rope_utils

    plain = (
        cu_seqlens is None
        and mscale == 1.0
        and not config.rotary_interleaved
        and not config.multi_latent_attention
        and not config.apply_rope_fusion
        and freqs.shape[-1] == t.shape[-1]
        and t.shape[-1] % 2 == 0
    )
    if plain:
        return rotary(t, freqs)
    return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens, mscale, cp_group)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        a, b = x.chunk(2, dim=-1)
        return F.silu(a).mul_(b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        out = torch.empty_like(x)
        da, db = out.chunk(2, dim=-1)
        torch.mul(grad, F.silu(a), out=db)
        torch.ops.aten.silu_backward.grad_input(grad * b, a, grad_input=da)
        return out


def swiglu(x: Tensor) -> Tensor:
    """silu(a) * b for x = [a, b] [..., 2F] -> [..., F]."""
    return _SwiGLU.apply(x)


def bias_swiglu_impl(input, bias, fp8_input_store: bool = False, cpu_offload_input: bool = False):
    """Megatron's `bias_swiglu_impl` signature: `swiglu` without a bias, Megatron's function with one."""
    from megatron.core.fusions import fused_bias_swiglu

    if bias is None and not fp8_input_store and not cpu_offload_input:
        return swiglu(input)
    return fused_bias_swiglu.bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)


def install() -> None:
    """Route Megatron's attention RoPE and MLP SwiGLU through this module (idempotent)."""
    from megatron.core.transformer import attention, mlp

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    mlp.bias_swiglu_impl = bias_swiglu_impl
