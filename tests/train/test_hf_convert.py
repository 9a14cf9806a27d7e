"""HF Llama <-> Megatron GPTModel state-dict conversion: exact round trips, layouts, and config errors."""

import json

import pytest
import torch

from yatt_ray.errors import ConfigError
from yatt_ray.model_shape import LlamaShape
from yatt_ray.train import check_tp_size, hf_to_megatron, megatron_to_hf
from yatt_ray.train.model import read_hf_state_dict


def _round_trip(hf_sd, shape, tp_size):
    shards = [hf_to_megatron(hf_sd, shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    return shards, megatron_to_hf(shards, shape)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_round_trip_is_bit_exact(tiny_model_dir, tp_size):
    shape = LlamaShape.from_hf_dir(tiny_model_dir)
    hf_sd = read_hf_state_dict(tiny_model_dir)
    shards, back = _round_trip(hf_sd, shape, tp_size)
    assert back.keys() == hf_sd.keys()
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k
    # each rank holds 1/tp of every split weight
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape == ((4 + 2 * 2) * 32 // tp_size, 128)
    assert shards[0]["decoder.layers.0.mlp.linear_fc2.weight"].shape == (128, 384 // tp_size)
    assert shards[0]["output_layer.weight"].shape == (128 // tp_size, 128)


def test_round_trip_tied_embeddings():
    shape = LlamaShape(256, 32, 48, 1, 8, 4, 4, 1e-5, 5e5, 64, tie_word_embeddings=True)
    hf_sd = _random_hf_state_dict(shape)
    shards, back = _round_trip(hf_sd, shape, 4)
    assert "output_layer.weight" not in shards[0] and "lm_head.weight" not in back
    assert all(torch.equal(back[k], v) for k, v in hf_sd.items())


def test_fused_layouts_per_query_group():
    """qkv rows per group are [q heads of the group, k, v]; fc1 is [gate; up] per rank."""
    shape = LlamaShape(8, 4, 6, 1, 4, 2, 2, 1e-6, 1e4, 16, False)
    hf_sd = _random_hf_state_dict(shape)
    a = "model.layers.0.self_attn."
    q, k, v = (hf_sd[a + n + "_proj.weight"] for n in "qkv")  # q [4 heads*2, 4], k/v [2 heads*2, 4]
    rank1 = hf_to_megatron(hf_sd, shape, tp_rank=1, tp_size=2)  # holds query group 1: q heads 2, 3
    expected = torch.cat([q[4:6], q[6:8], k[2:4], v[2:4]])
    assert torch.equal(rank1["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
    gate, up = hf_sd["model.layers.0.mlp.gate_proj.weight"], hf_sd["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(rank1["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[3:], up[3:]]))
    o = hf_sd[a + "o_proj.weight"]
    assert torch.equal(rank1["decoder.layers.0.self_attention.linear_proj.weight"], o[:, 4:])


def test_shape_from_tiny_config(tiny_model_dir):
    shape = LlamaShape.from_hf_dir(tiny_model_dir)
    assert (shape.vocab_size, shape.hidden_size, shape.ffn_hidden_size, shape.num_layers) == (
        128,
        128,
        384,
        2,
    )
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 2, 32)
    assert shape.rope_theta == 10000.0 and shape.rms_norm_eps == 1e-6 and not shape.tie_word_embeddings


def test_missing_model_dir_names_path_and_fix(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="does not exist") as err:
        LlamaShape.from_hf_dir(missing)
    assert str(missing) in str(err.value) and "model.path" in str(err.value)


def test_non_llama_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ConfigError, match="'gpt2'.*not a Llama model"):
        LlamaShape.from_hf_dir(tmp_path)


def test_tp_not_dividing_heads_names_values_and_fix(tiny_model_dir):
    shape = LlamaShape.from_hf_dir(tiny_model_dir)
    with pytest.raises(ConfigError) as err:
        check_tp_size(shape, 4)  # 4 heads but only 2 kv heads
    msg = str(err.value)
    assert "tensor_parallel_size=4" in msg and "num_key_value_heads=2" in msg and "divides" in msg
    assert "num_attention_heads" not in msg.split("divide ")[1].split(";")[0]  # 4 heads are fine
    with pytest.raises(ConfigError, match="vocab_size=128"):
        hf_to_megatron(read_hf_state_dict(tiny_model_dir), shape, tp_rank=0, tp_size=3)


def _random_hf_state_dict(shape: LlamaShape) -> dict:
    g = torch.Generator().manual_seed(0)
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim

    def r(*size):
        return torch.randn(*size, generator=g)

    sd = {"model.embed_tokens.weight": r(shape.vocab_size, h), "model.norm.weight": r(h)}
    if not shape.tie_word_embeddings:
        sd["lm_head.weight"] = r(shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": r(h),
            p + "post_attention_layernorm.weight": r(h),
            p + "self_attn.q_proj.weight": r(shape.num_heads * d, h),
            p + "self_attn.k_proj.weight": r(shape.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": r(shape.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": r(h, shape.num_heads * d),
            p + "mlp.gate_proj.weight": r(f, h),
            p + "mlp.up_proj.weight": r(f, h),
            p + "mlp.down_proj.weight": r(h, f),
        }
    return sd
