"""Copy-free RoPE and SwiGLU, one-operator RMSNorm: the trainer's replacements for Megatron's unfused element-wise
layer parts.

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

RMSNorm. y = x r w with r = (mean(x^2) + eps)^-1/2 over the last dimension (in fp32 for half inputs), and

    dx = r (g w - x r mean(g w x r)),   dw = sum over tokens of g x r.

`rms_norm` is one torch operator each way (`yatt_ray::rms_norm`, `yatt_ray::rms_norm_backward`): on CUDA torch's
fused kernels (`aten::_fused_rms_norm` and its backward, what `torch.nn.RMSNorm` itself reaches there), on the
CPU the formulas above in a few vector ops (torch's CPU path decomposes into ~20 autograd-recorded ops). `install`
has nothing to patch for it: `use_fused_norms(model)` turns a built model's `torch.nn.RMSNorm` modules (Megatron's
local spec) into `RMSNorm`, same parameters.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float, out: Tensor | None = None) -> Tensor:
    """y1 = x1 c1 - sign x2 s1, y2 = x2 c2 + sign x1 s2 (sign -1 is the inverse rotation, the backward), into
    `out` when given (x and out may be strided views)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.empty_like(x) if out is None else out
    y1, y2 = out[..., :h], out[..., h:]
    torch.mul(x1, cos[..., :h], out=y1)
    y1.addcmul_(x2, sin[..., :h], value=-sign)
    torch.mul(x2, cos[..., h:], out=y2)
    y2.addcmul_(x1, sin[..., h:], value=sign)
    return out


def _rotate_grad(g: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1 (into `out` when given)."""
    h = g.shape[-1] // 2
    g1, g2 = g[..., :h], g[..., h:]
    out = torch.empty_like(g) if out is None else out
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


class _QkvRotary(torch.autograd.Function):
    """RoPE of the query and key heads read straight from fc_qkv's output (see `apply_fused_qkv_rotary_pos_emb`)."""

    @staticmethod
    def forward(ctx, mixed: Tensor, cos: Tensor, sin: Tensor):
        sq, b, groups, width = mixed.shape
        dim = cos.shape[-1]
        per_group = width // dim - 2  # query heads a group
        heads = mixed.view(sq, b, groups, per_group + 2, dim)
        query = mixed.new_empty(sq, b, groups, per_group, dim)
        _rotate(heads[:, :, :, :per_group], cos[:, :, :, None], sin[:, :, :, None], 1.0, out=query)
        key = _rotate(heads[:, :, :, per_group], cos, sin, 1.0)
        ctx.save_for_backward(cos, sin)
        ctx.per_group = per_group
        return query.view(sq, b, groups * per_group, dim), key, heads[:, :, :, per_group + 1]

    @staticmethod
    def backward(ctx, grad_query: Tensor, grad_key: Tensor, grad_value: Tensor):
        cos, sin = ctx.saved_tensors
        r = ctx.per_group
        sq, b, groups, dim = grad_key.shape
        grad = grad_key.new_empty(sq, b, groups, r + 2, dim)
        _rotate_grad(
            grad_query.view(sq, b, groups, r, dim), cos[:, :, :, None], sin[:, :, :, None], grad[:, :, :, :r]
        )
        _rotate_grad(grad_key, cos, sin, grad[:, :, :, r])
        grad[:, :, :, r + 1].copy_(grad_value)
        return grad.view(sq, b, groups, (r + 2) * dim), None, None


def apply_fused_qkv_rotary_pos_emb(mixed_qkv: Tensor, q_freqs: Tensor, k_freqs: Tensor, split_arg_list):
    """Megatron's single-QKV RoPE hook (`fused_single_qkv_rope`, otherwise Transformer Engine's): fc_qkv's output
    [sq, b, g, (r + 2) d] (per group of g: r query heads, a key, a value) -> query [sq, b, g r, d] and key
    [sq, b, g, d] rotated, value [sq, b, g, d] (a view). RoPE reads the query heads where they lie: no copy of
    them into [sq, b, g r, d] before rotating (Megatron's split path makes one), and the backward writes the
    three gradients into one fc_qkv-shaped tensor (no concatenation)."""
    if q_freqs is not k_freqs and not torch.equal(q_freqs, k_freqs):
        raise ValueError("the single-QKV RoPE takes one set of angles for queries and keys (self-attention)")
    dim = q_freqs.shape[-1]
    if split_arg_list[1:] != [dim, dim] or mixed_qkv.shape[-1] != sum(split_arg_list) or dim % 2:
        raise ValueError(f"fc_qkv's split {split_arg_list} is not [r * {dim}, {dim}, {dim}] (r query heads)")
    return _QkvRotary.apply(mixed_qkv, *rope_tables(q_freqs, mixed_qkv.dtype))


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


HALF = (torch.float16, torch.bfloat16)


@torch.library.custom_op("yatt_ray::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, r): y [..., H] in x's dtype, r [..., 1] (fp32 for half x)."""
    if x.is_cuda:
        return torch._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    wide = x.float() if x.dtype in HALF else x
    rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True).add_(eps))
    return (wide * rstd).mul_(weight).to(x.dtype), rstd  # as torch's own: the weight applied before rounding


@_rms_norm.register_fake
def _(x, weight, eps):
    rstd_dtype = torch.float32 if x.dtype in HALF else x.dtype
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], 1), dtype=rstd_dtype)


@torch.library.custom_op("yatt_ray::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dw) of `_rms_norm`'s y given its gradient `grad`."""
    if x.is_cuda:
        return torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, [True, True])
    wide = lambda t: t.float() if t.dtype in HALF else t  # noqa: E731
    xhat = wide(x) * rstd
    dw = (wide(grad) * xhat).reshape(-1, x.shape[-1]).sum(0)
    gw = wide(grad) * wide(weight)
    dx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True)).mul_(rstd)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(grad, x, rstd, weight):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _norm_setup(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.set_materialize_grads(False)


def _norm_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(grad, x, rstd, weight)
    return dx, dw, None


_rms_norm.register_autograd(_norm_backward, setup_context=_norm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., H] with weight [H] (see the module docstring): one operator forward, one backward."""
    return _rms_norm(x, weight, eps)[0]


class RMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` (same parameters and state dict) through `rms_norm`."""

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return rms_norm(x, self.weight, eps)


def use_fused_norms(model: torch.nn.Module) -> None:
    """Every `torch.nn.RMSNorm` module of `model` becomes an `RMSNorm` (in place; its parameters unchanged)."""
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = RMSNorm


def install() -> None:
    """Route Megatron's attention RoPE (single-QKV where the config asks, `fused_single_qkv_rope`) and MLP SwiGLU
    through this module (idempotent)."""
    from megatron.core.transformer import attention, mlp

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    attention.apply_fused_qkv_rotary_pos_emb = apply_fused_qkv_rotary_pos_emb
    attention.HAVE_FUSED_QKV_ROPE = True
    mlp.bias_swiglu_impl = bias_swiglu_impl
