"""Hugging Face Llama <-> Megatron-core GPTModel weight conversion, as pure functions over state dicts.

Key names on the Megatron side are those of `GPTModel` built with `get_gpt_layer_local_spec()`. Layouts:
- `linear_qkv.weight` [G * (q_per_group + 2) * head_dim, hidden], fused per query group g (G = kv heads):
  [q heads of group g ..., k_g, v_g], groups in order. A TP rank holds G/tp consecutive groups.
- `linear_fc1.weight` [2 * ffn, hidden] = [gate; up]; a TP rank holds [gate shard; up shard].
- Column-parallel weights (qkv, fc1, embedding, output layer) split along dim 0 (vocab split for the last
  two); row-parallel weights (attention out `linear_proj`, `linear_fc2`) along dim 1; norms are replicated.
`hf_to_megatron` then `megatron_to_hf` over all TP ranks is bit-exact (only slicing and concatenation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from yatt_ray.errors import ConfigError

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a Llama-style decoder, read from a Hugging Face `config.json`."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tie_word_embeddings: bool

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config") -> LlamaShape:
        """Build from a parsed HF config dict; raise ConfigError for a non-Llama or unsupported config."""
        arch = cfg.get("architectures") or []
        if cfg.get("model_type") == "llava" or "LlavaForConditionalGeneration" in arch:
            text = dict(cfg.get("text_config") or {})  # a LLaVA policy: the Llama behind its vision encoder
            if text.get("model_type", "llama") == "llama":  # transformers' defaults for the keys left out
                from transformers import LlamaConfig

                text = {**LlamaConfig(**text).to_dict(), "model_type": "llama"}
                text["tie_word_embeddings"] = bool(
                    cfg.get("tie_word_embeddings") or text["tie_word_embeddings"]
                )
            else:
                raise ConfigError(
                    f"{source}: a LLaVA model whose language model is {text.get('model_type')!r}; the Megatron "
                    "trainer converts LLaVA with a Llama language model only"
                )
            return cls.from_hf_config({**text, "model_type": "llama"}, source=f"{source} (text_config)")
        if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in arch:
            raise ConfigError(
                f"{source}: model_type={cfg.get('model_type')!r}, architectures={arch} is not a Llama model; "
                "the Megatron trainer converts LlamaForCausalLM and LlavaForConditionalGeneration (Llama) checkpoints "
                "only. Point model.path at a Llama- or LLaVA-architecture Hugging Face directory."
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(
                f"{source}: rope type {rope_type!r} is not supported (only plain RoPE, rope_type='default'); "
                "use a checkpoint without rope scaling."
            )
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ConfigError(
                f"{source}: attention_bias/mlp_bias=True is not supported; Llama has no biases."
            )
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> LlamaShape:
        """Read `<path>/config.json`; raise ConfigError naming the path when it is missing."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            what = "does not exist" if not Path(path).exists() else "has no config.json"
            raise ConfigError(
                f"model directory {str(path)!r} {what}; expected a Hugging Face model directory "
                "(config.json + *.safetensors). Fix model.path, or build the tiny demo model with "
                "yatt_ray.models.tiny.build_tiny_model(path)."
            )
        return cls.from_hf_config(json.loads(config_file.read_text()), source=str(config_file))


def is_vision_model(path: str | Path) -> bool:
    """True when `<path>/config.json` is a vision-language model (LLaVA: a `vision_config` beside the Llama's
    `text_config`); the policy then reads images (`yatt_ray.train.vision`)."""
    config_file = Path(path) / "config.json"
    return config_file.is_file() and "vision_config" in json.loads(config_file.read_text())


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
    """q [H*d, h], k/v [G*d, h] -> fused [G*(H/G+2)*d, h], per group [q heads..., k, v]."""
    g, d, hidden = shape.num_kv_heads, shape.head_dim, q.shape[1]
    q = q.reshape(g, shape.q_per_group * d, hidden)
    k, v = k.reshape(g, d, hidden), v.reshape(g, d, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _split_qkv(qkv: torch.Tensor, shape: LlamaShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_fuse_qkv` on the full (all-group) fused weight."""
    g, d, hidden = shape.num_kv_heads, shape.head_dim, qkv.shape[1]
    grouped = qkv.reshape(g, (shape.q_per_group + 2) * d, hidden)
    q, k, v = grouped.split([shape.q_per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def hf_to_megatron(hf_sd: StateDict, shape: LlamaShape, tp_rank: int = 0, tp_size: int = 1) -> StateDict:
    """This TP rank's shard of a HF Llama state dict, under GPTModel (local spec) key names.

    Shapes for rank r of tp: embedding/output [V/tp, h]; linear_qkv [(G/tp)*(H/G+2)*d, h];
    linear_proj [h, H*d/tp]; linear_fc1 [2*F/tp, h]; linear_fc2 [h, F/tp]; norms [h]. Tensors are
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
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf(shards: list[StateDict], shape: LlamaShape) -> StateDict:
    """Full HF Llama state dict from every TP rank's GPTModel state dict (`shards[r]` = rank r's).

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
    return {k: v.contiguous() for k, v in out.items()}
