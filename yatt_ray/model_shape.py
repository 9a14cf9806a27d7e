"""The sizes of a Llama-family decoder, read from a Hugging Face config.json (`LlamaShape`), and the families
the trainer converts (`SUPPORTED_ARCHITECTURES`): facts about a model directory, like `model_dir`'s, that the
driver (placement, FLOPs), the trainer and its kernel measurement all read. No torch, no weights.

Families, all RMSNorm + SwiGLU + RoPE decoders with grouped-query attention:
- llama: `LlamaForCausalLM`, plain RoPE or Llama 3.x's "llama3" RoPE scaling (`Llama3RopeScaling`);
- mistral: `MistralForCausalLM` (Llama's layout; a sliding window only when it covers every position);
- qwen2: `Qwen2ForCausalLM` (Qwen2 / Qwen2.5): biases on q/k/v (`LlamaShape.qkv_bias`), none on o_proj;
- qwen3: `Qwen3ForCausalLM`: per-head RMSNorm on queries and keys before RoPE (`LlamaShape.qk_norm`), an
  explicit head_dim that may differ from hidden / heads;
each with tied or untied embeddings; and the language models of LLaVA (`LlavaForConditionalGeneration`, a
Llama) and Qwen2-VL / Qwen2.5-VL (a Qwen2 with multimodal RoPE, `LlamaShape.mrope_section`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from yatt_ray.errors import ConfigError
from yatt_ray.model_dir import is_qwen_vl, text_config_dict

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
        if is_qwen_vl(cfg):  # a Qwen VL policy: its Qwen2 language model with multimodal RoPE
            text, section = text_config_dict(cfg)
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


def linear_shapes(shape) -> list[tuple[int, int]]:
    """(in, out) features of a decoder layer's four linear layers: q/k/v, attention output, MLP gate + up and
    MLP down (what one token costs: 2 x sum(in x out) FLOPs forward, twice that backward)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)]
