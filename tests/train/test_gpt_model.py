"""The Megatron GPTModel built from a HF Llama directory computes the same logits as transformers."""

import pytest
import torch

from yatt_ray.model_shape import LlamaShape
from yatt_ray.models.tiny import TinyModelSpec, build_tiny_model
from yatt_ray.train import build_gpt_model, load_hf_weights, seed_everything
from yatt_ray.train.model import rope_positions


@pytest.mark.parametrize("tied", [False, True])
def test_megatron_logits_match_hf(tiny_model_dir, tmp_path, single_process_world, tied):
    from transformers import AutoModelForCausalLM

    if tied:
        tiny_model_dir = build_tiny_model(tmp_path, TinyModelSpec(tie_word_embeddings=True))
    seed_everything(0)
    shape = LlamaShape.from_hf_dir(tiny_model_dir)
    model = build_gpt_model(shape).eval()
    load_hf_weights(model, tiny_model_dir, shape)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    b, t = ids.shape
    with torch.no_grad():
        got = model(ids, rope_positions(torch.arange(t).expand(b, t)), None)
        want = hf(ids).logits
    assert got.shape == (b, t, shape.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
