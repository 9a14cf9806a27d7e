"""Hugging Face Llama-family <-> Megatron-core GPTModel weight conversion, as pure functions over state dicts.

The families and the decoder's sizes are read from config.json by `yatt_ray.model_shape` (`LlamaShape`,
`SUPPORTED_ARCHITECTURES`); the layouts here cover each of them (Qwen2's q/k/v biases, Qwen3's q/k norms).

Key names on the Megatron side are those of `GPTModel` built with `get_gpt_layer_local_spec()`. Layouts:
- `linear_qkv.weight` [G * (q_per_group + 2) * head_dim, hidden], fused per query group g (G = kv heads):
  [q heads of group g ..., k_g, v_g], groups in order. A TP rank holds G/tp consecutive groups. Qwen2's
  `linear_qkv.bias` [G * (q_per_group + 2) * head_dim] is fused and split the same way.
- Qwen3's `q_norm` / `k_norm` [head_dim] -> `self_attention.q_layernorm` / `k_layernorm` (replicated).
- `linear_fc1.weight` [2 * ffn, hidden] = [gate; up]; a TP rank holds [gate shard; up shard].
- Column-parallel weights (qkv, fc1, embedding, output layer) split along dim 0 (vocab split for the last
  two); row-parallel weights (attention out `linear_proj`, `linear_fc2`) along dim 1; norms are replicated.
`hf_to_megatron` then `megatron_to_hf` over all TP ranks is bit-exact (only slicing and concatenation).
"""

from __future__ import annotations

import math

import torch

from yatt_ray.errors import ConfigError
from yatt_ray.model_shape import LlamaShape

StateDict = dict[str, torch.Tensor]


def rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] (float32), computed as transformers does (default RoPE, or
    `_compute_llama3_parameters` for Llama 3.x scaling): inv_freq_i = theta^(-2i / d), then for llama3 with
    wavelength w = 2 pi / inv_freq, L = original_max_positions: w > L / low_freq_factor -> inv_freq / factor;
    w < L / high_freq_factor -> unchanged; between: (1 - s) inv_freq / factor + s inv_freq with
    s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = shape.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_positions
    low_wavelen, high_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def check_tp_size(shape: LlamaShape, tp_size: int) -> None:
    """Raise ConfigError unless tp_size divides the vocab, the heads, the kv heads and the FFN width."""
    sizes = {
        "vocab_size": shape.vocab_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.ffn_hidden_size,
    }
    bad = {k: v for k, v in sizes.items() if tp_size < 1 or v % tp_size}
    if bad:
        listed = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ConfigError(
            f"tensor_parallel_size={tp_size} does not divide {listed}; choose a tensor_parallel_size that "
            f"divides every one of {sizes}."
        )


def _layer_keys(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    """q [H*d, ...], k/v [G*d, ...] -> fused [G*(H/G+2)*d, ...], per group [q heads..., k, v] (a weight
    [., h] or a bias [.])."""
    g, d, rest = shape.num_kv_heads, shape.head_dim, q.shape[1:]
    q = q.reshape(g, shape.q_per_group * d, *rest)
    k, v = k.reshape(g, d, *rest), v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: LlamaShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_fuse_qkv` on the full (all-group) fused weight or bias."""
    g, d, rest = shape.num_kv_heads, shape.head_dim, qkv.shape[1:]
    grouped = qkv.reshape(g, (shape.q_per_group + 2) * d, *rest)
    q, k, v = grouped.split([shape.q_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf_sd: StateDict, shape: LlamaShape, tp_rank: int = 0, tp_size: int = 1) -> StateDict:
    """This TP rank's shard of a HF Llama-family state dict, under GPTModel (local spec) key names.

    Shapes for rank r of tp: embedding/output [V/tp, h]; linear_qkv [(G/tp)*(H/G+2)*d, h] (its bias
    [(G/tp)*(H/G+2)*d] with `qkv_bias`); linear_proj [h, H*d/tp]; linear_fc1 [2*F/tp, h]; linear_fc2
    [h, F/tp]; norms [h]; q/k_layernorm [d] with `qk_norm`. Tensors are
    contiguous clones (safe to load or mutate independently of `hf_sd`).
    """
    check_tp_size(shape, tp_size)

    def col(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=0)[tp_rank]

    def row(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=1)[tp_rank]

    out = {
        "embedding.word_embeddings.weight": col(hf_sd["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf_sd["model.norm.weight"],
    }
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = col(hf_sd["lm_head.weight"])
    for i in range(shape.num_layers):
        hf, mg = _layer_keys(i)
        attn, mlp = hf + "self_attn.", hf + "mlp."
        qkv = _fuse_qkv(
            hf_sd[attn + "q_proj.weight"], hf_sd[attn + "k_proj.weight"], hf_sd[attn + "v_proj.weight"], shape
        )
        gate, up = col(hf_sd[mlp + "gate_proj.weight"]), col(hf_sd[mlp + "up_proj.weight"])
        out |= {
            mg + "input_layernorm.weight": hf_sd[hf + "input_layernorm.weight"],
            mg + "self_attention.linear_qkv.weight": col(qkv),
            mg + "self_attention.linear_proj.weight": row(hf_sd[attn + "o_proj.weight"]),
            mg + "pre_mlp_layernorm.weight": hf_sd[hf + "post_attention_layernorm.weight"],
            mg + "mlp.linear_fc1.weight": torch.cat([gate, up], dim=0),
            mg + "mlp.linear_fc2.weight": row(hf_sd[mlp + "down_proj.weight"]),
        }
        if shape.qkv_bias:
            bias = _fuse_qkv(
                hf_sd[attn + "q_proj.bias"], hf_sd[attn + "k_proj.bias"], hf_sd[attn + "v_proj.bias"], shape
            )
            out[mg + "self_attention.linear_qkv.bias"] = col(bias)
        if shape.qk_norm:
            out[mg + "self_attention.q_layernorm.weight"] = hf_sd[attn + "q_norm.weight"]
            out[mg + "self_attention.k_layernorm.weight"] = hf_sd[attn + "k_norm.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf(shards: list[StateDict], shape: LlamaShape) -> StateDict:
    """Full HF Llama-family state dict from every TP rank's GPTModel state dict (`shards[r]` = rank r's).

    Extra keys in the shards (e.g. `*._extra_state`) are ignored. Output tensors are new, contiguous tensors.
    """
    tp_size = len(shards)
    check_tp_size(shape, tp_size)

    def col(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards], dim=0)

    def row(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards], dim=1)

    first = shards[0]
    out = {
        "model.embed_tokens.weight": col("embedding.word_embeddings.weight"),
        "model.norm.weight": first["decoder.final_layernorm.weight"].clone(),
    }
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = col("output_layer.weight")
    for i in range(shape.num_layers):
        hf, mg = _layer_keys(i)
        q, k, v = _split_qkv(col(mg + "self_attention.linear_qkv.weight"), shape)
        gate_up = [s[mg + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out |= {
            hf + "input_layernorm.weight": first[mg + "input_layernorm.weight"].clone(),
            hf + "self_attn.q_proj.weight": q,
            hf + "self_attn.k_proj.weight": k,
            hf + "self_attn.v_proj.weight": v,
            hf + "self_attn.o_proj.weight": row(mg + "self_attention.linear_proj.weight"),
            hf + "post_attention_layernorm.weight": first[mg + "pre_mlp_layernorm.weight"].clone(),
            hf + "mlp.gate_proj.weight": torch.cat([g for g, _ in gate_up], dim=0),
            hf + "mlp.up_proj.weight": torch.cat([u for _, u in gate_up], dim=0),
            hf + "mlp.down_proj.weight": row(mg + "mlp.linear_fc2.weight"),
        }
        if shape.qkv_bias:
            biases = _split_qkv(col(mg + "self_attention.linear_qkv.bias"), shape)
            out |= {hf + f"self_attn.{n}_proj.bias": b for n, b in zip("qkv", biases)}
        if shape.qk_norm:
            out[hf + "self_attn.q_norm.weight"] = first[mg + "self_attention.q_layernorm.weight"].clone()
            out[hf + "self_attn.k_norm.weight"] = first[mg + "self_attention.k_layernorm.weight"].clone()
    return {k: v.contiguous() for k, v in out.items()}
