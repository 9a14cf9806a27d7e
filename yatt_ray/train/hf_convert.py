"""Hugging Face Llama-family <-> Megatron-core GPTModel weight conversion, as pure functions over state dicts.

Families (`SUPPORTED_ARCHITECTURES`), all RMSNorm + SwiGLU + RoPE decoders with grouped-query attention:
- llama: `LlamaForCausalLM`, plain RoPE or Llama 3.x's "llama3" RoPE scaling (`Llama3RopeScaling`);
- mistral: `MistralForCausalLM` (Llama's layout; a sliding window only when it covers every position);
- qwen2: `Qwen2ForCausalLM` (Qwen2 / Qwen2.5): biases on q/k/v (`LlamaShape.qkv_bias`), none on o_proj;
- qwen3: `Qwen3ForCausalLM`: per-head RMSNorm on queries and keys before RoPE (`LlamaShape.qk_norm`), an
  explicit head_dim that may differ from hidden / heads;
each with tied or untied embeddings; and LLaVA (`LlavaForConditionalGeneration`) with a Llama language model.

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

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from yatt_ray.errors import ConfigError

StateDict = dict[str, torch.Tensor]


SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""HF causal-LM architecture -> family name; LLaVA (a Llama language model) is supported beside them."""
FAMILIES = tuple(sorted(set(SUPPORTED_ARCHITECTURES.values())))


def supported_architectures() -> str:
    """The supported architectures, for error messages."""
    return ", ".join(
        [
            *SUPPORTED_ARCHITECTURES,
            "LlavaForConditionalGeneration (Llama language model)",
            "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
        ]
    )


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x RoPE scaling (`rope_type: "llama3"`): wavelengths above original_max_positions /
    low_freq_factor are stretched by `factor`, those below original_max_positions / high_freq_factor kept,
    and the ones between interpolated smoothly (`rope_inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a Llama-style decoder, read from a Hugging Face `config.json`.

    The fields after `tie_word_embeddings` (with defaults, so a plain Llama needs none of them) tell the
    families apart: `family` (a `FAMILIES` name), `qkv_bias` (biases on q/k/v only: Qwen2), `qk_norm`
    (per-head RMSNorm on queries and keys: Qwen3), `rope_scaling` (Llama 3.x; None = plain RoPE),
    `mrope_section` (Qwen2-VL / Qwen2.5-VL's multimodal RoPE: frequency pairs per (time, height, width),
    summing to head_dim / 2; None = 1-D RoPE).
    """

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
    family: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    mrope_section: tuple[int, int, int] | None = None

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config") -> LlamaShape:
        """Build from a parsed HF config dict; raise ConfigError for an unsupported architecture or option."""
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
        from yatt_ray.model_dir import is_qwen_vl
        from yatt_ray.train import qwen_vl

        if is_qwen_vl(cfg):  # a Qwen VL policy: its Qwen2 language model with multimodal RoPE
            text, section = qwen_vl.text_config_dict(cfg)
            shape = cls.from_hf_config(text, source=f"{source} (text_config)")
            if 2 * sum(section) != shape.head_dim:
                raise ConfigError(
                    f"{source}: mrope_section {list(section)} sums to {sum(section)}, not head_dim / 2 = "
                    f"{shape.head_dim // 2}"
                )
            return replace(shape, mrope_section=section)
        family = _family(cfg)
        if family is None:
            raise ConfigError(
                f"{source}: model_type={cfg.get('model_type')!r}, architectures={arch} is not a Llama model or "
                f"one of the supported relatives; the Megatron trainer converts {supported_architectures()} "
                "checkpoints only. Point model.path at a Hugging Face directory of one of these architectures."
            )
        if family != "llama":  # transformers' defaults for the keys a checkpoint leaves out (Qwen3's head_dim
            cfg = _with_defaults(cfg, family)  # 128, Mistral's sliding_window 4096, ...)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        allowed = ("default", "llama3") if family == "llama" else ("default",)
        if rope_type not in allowed:
            raise ConfigError(
                f"{source}: rope type {rope_type!r} is not supported for {family} (supported: {list(allowed)}); "
                "use a checkpoint without that rope scaling."
            )
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise ConfigError(
                f"{source}: partial_rotary_factor != 1 is not supported (RoPE on every channel)."
            )
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ConfigError(
                f"{source}: attention_bias/mlp_bias=True is not supported; Llama has no biases."
            )
        _check_full_attention(cfg, family, source)
        heads = int(cfg["num_attention_heads"])
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta") or 10000.0)),
            max_positions=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            family=family,
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            rope_scaling=_llama3_scaling(rope, max_positions, source) if rope_type == "llama3" else None,
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


def _family(cfg: dict) -> str | None:
    """The family of a HF config: by `model_type` first (a critic directory is `LlamaForTokenClassification`
    with model_type "llama"), then by a supported causal-LM architecture."""
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return model_type
    for name in cfg.get("architectures") or []:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    return None


def _with_defaults(cfg: dict, family: str) -> dict:
    """`cfg` through the family's transformers config class: its defaults filled in, legacy keys (e.g.
    `rope_scaling`, top-level `rope_theta`) brought to the current form, `layer_types` derived."""
    import transformers

    config_class = {
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    return {**config_class(**cfg).to_dict(), "model_type": family}


def _check_full_attention(cfg: dict, family: str, source: str) -> None:
    """Raise ConfigError for sliding-window attention that limits any position (the trainer attends to every
    earlier token). Qwen2/3 mark such layers in `layer_types`; Mistral uses `sliding_window` in every layer."""
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    window = cfg.get("sliding_window")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    limited = kinds != {"full_attention"} or (
        family == "mistral" and window is not None and int(window) < max_positions
    )
    if limited:
        raise ConfigError(
            f"{source}: sliding-window attention (sliding_window={window}"
            + (f", layer_types {sorted(kinds)}" if cfg.get("layer_types") else "")
            + ") is not supported: the Megatron trainer attends to every earlier position. Use a checkpoint with "
            f"sliding_window null (Mistral) or use_sliding_window false (Qwen), or a window >= "
            f"max_position_embeddings={max_positions}."
        )


def _llama3_scaling(rope: dict, max_positions: int, source: str) -> Llama3RopeScaling:
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if missing:
        raise ConfigError(f"{source}: rope_type 'llama3' without {missing}; the config is incomplete.")
    scaling = Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_positions=int(rope.get("original_max_position_embeddings") or max_positions),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(
            f"{source}: llama3 rope scaling needs high_freq_factor > low_freq_factor, got {scaling}."
        )
    return scaling


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
