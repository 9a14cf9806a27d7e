"""Build a tiny Llama-style model and a character-level tokenizer, saved as a normal Hugging Face directory.

No hub access exists in tests or the demo, so the library makes its own model. The directory it writes
(`config.json`, `model.safetensors`, `tokenizer.json`, ...) is exactly what a user would point
`model.path` at for a real checkpoint: the loading code is the same.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " "


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings)."""

    hidden_size: int = 128  # head size 32: vLLM's CPU attention supports 32, 64, 80, ... (not 16)
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 128
    vocab_size: int = (
        128  # >= len(SPECIAL_TOKENS) + len(CHARACTERS); a multiple of 8 so TP up to 8 divides it
    )
    tie_word_embeddings: bool = False
    seed: int = 0


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per printable ASCII character, BOS prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def decoder_config(spec: TinyModelSpec, extra_tokens: int = 0) -> dict[str, Any]:
    """The config keys every tiny decoder shares (the Llama here, the other families' in `families`, the
    LLaVA language model in `tiny_vlm`): sizes, RMSNorm eps, plain RoPE, tying, the special token ids.
    ValueError when `spec.vocab_size` is below the tokenizer's ids (+ `extra_tokens` added to it)."""
    needed = len(SPECIAL_TOKENS) + len(CHARACTERS) + extra_tokens
    if spec.vocab_size < needed:
        raise ValueError(
            f"TinyModelSpec.vocab_size={spec.vocab_size} is below the {needed} tokens of the tokenizer"
        )
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a randomly initialised tiny `LlamaForCausalLM` and its tokenizer to `out_dir`; return the path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyModelSpec()
    config = LlamaConfig(**decoder_config(spec), attention_bias=False, mlp_bias=False, dtype="float32")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


def sft_tensors(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] input ids and labels for (prompt, target) text pairs: prompt + target + EOS, with
    labels -100 on the prompt and the padding, so the loss is on the target and its EOS only."""
    prompts = [tokenizer(p)["input_ids"] for p, _ in pairs]
    targets = [tokenizer(t, add_special_tokens=False)["input_ids"] + [EOS_ID] for _, t in pairs]
    width = max(len(p) + len(t) for p, t in zip(prompts, targets))
    input_ids = torch.zeros(len(pairs), width, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        input_ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    return input_ids, labels
