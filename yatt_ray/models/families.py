"""Tiny, randomly initialised Hugging Face models of each decoder family the Megatron trainer converts.

`build_family_model(family, out_dir)` writes a normal HF directory (`config.json`, `model.safetensors`, the
character tokenizer of `yatt_ray.models.tiny`), sized like `TinyModelSpec`, for:

- "llama":   `LlamaForCausalLM`, plain RoPE (what `tiny.build_tiny_model` builds);
- "llama3":  `LlamaForCausalLM` with Llama 3.x RoPE scaling (rope_type "llama3"), its original context set
             to 32 positions so that a 128-position model sees all three regimes (kept, smoothed, stretched
             frequencies) with head size 32;
- "mistral": `MistralForCausalLM`, sliding_window null;
- "qwen2":   `Qwen2ForCausalLM` (Qwen2 / Qwen2.5): q/k/v biases, tied embeddings by default (as the small
             Qwen2.5 checkpoints);
- "qwen3":   `Qwen3ForCausalLM`: q_norm / k_norm, head_dim 64 with hidden 128 and 4 heads (not hidden / heads).

Head sizes are 32 or 64: vLLM's CPU attention supports 32, 64, 80, ... (not 16). The norms' weights and the
biases are random too (transformers initialises them to ones and zeros), so a conversion that drops or
misplaces one changes the logits; weights are drawn with std 0.1 so greedy completions vary (`family_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from yatt_ray.models.tiny import TinyModelSpec, build_tokenizer, decoder_config

FAMILY_NAMES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
TIED_BY_DEFAULT = {"qwen2"}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
QWEN3_HEAD_DIM = 64


def family_config(family: str, spec: TinyModelSpec | None = None, tie_word_embeddings: bool | None = None):
    """The transformers config of `family`'s tiny model (float32); `tie_word_embeddings` None = the family's
    default (tied for qwen2, untied otherwise, unless `spec` asks for tied)."""
    import transformers

    spec = spec or TinyModelSpec()
    if family not in FAMILY_NAMES:
        raise ValueError(f"unknown family {family!r}; choose one of {list(FAMILY_NAMES)}")
    if tie_word_embeddings is None:
        tie_word_embeddings = spec.tie_word_embeddings or family in TIED_BY_DEFAULT
    common: dict[str, Any] = dict(
        decoder_config(spec),
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
        # std 0.1, not transformers' 0.02: with tied embeddings and std 0.02 the residual stream is mostly
        # the input embedding and greedy decoding just repeats the last token, which tells no models apart
        initializer_range=0.1,
    )
    if family in ("llama", "llama3"):
        rope = dict(LLAMA3_ROPE) if family == "llama3" else common["rope_parameters"]
        return transformers.LlamaConfig(
            **{**common, "rope_parameters": rope}, attention_bias=False, mlp_bias=False
        )
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    return transformers.Qwen3Config(
        **common, head_dim=QWEN3_HEAD_DIM, attention_bias=False, use_sliding_window=False
    )


def randomize_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """Draw the weights transformers initialises to constants: norm scales (every 1-D `.weight`, ones at init)
    ~ 1 + 0.2 N(0, 1), biases (zeros at init) ~ 0.1 N(0, 1), so each channel differs and a conversion that
    drops or misplaces one changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build_family_model(
    family: str,
    out_dir: str | Path,
    spec: TinyModelSpec | None = None,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """Write a randomly initialised tiny model of `family` (see the module docstring) and its tokenizer to
    `out_dir`; return the path. Seeded by `spec.seed` and the family (families of the same sizes get different
    weights): the same arguments give the same weights."""
    from transformers import AutoModelForCausalLM

    spec = spec or TinyModelSpec()
    config = family_config(family, spec, tie_word_embeddings)
    seed = spec.seed + 1000 * FAMILY_NAMES.index(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms_and_biases(model, seed + 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out
