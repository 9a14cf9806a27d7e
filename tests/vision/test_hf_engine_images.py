"""The Hugging Face rollout engine on vision-language models (LLaVA; Qwen2-VL / Qwen2.5-VL): images reach
generation, greedy output equals transformers' own `generate`, log-probs are the raw teacher-forced ones, and
weight sync covers the vision weights (checkpoint names) and the language model (checkpoint or Llama names)."""

import math

import pytest
import torch

from yatt_ray.batch import Pixels
from yatt_ray.errors import ConfigError, DataError
from yatt_ray.model_dir import expand_image_tokens
from yatt_ray.models.tiny import EOS_ID, TinyModelSpec, build_tiny_model
from yatt_ray.models.tiny_qwen_vl import IMAGE_TOKEN_ID as QWEN_IMAGE_ID
from yatt_ray.models.tiny_qwen_vl import (
    VISION_END_ID,
    VISION_START_ID,
    TinyQwenVLSpec,
    build_image_processor,
    build_tiny_qwen_vl,
)
from yatt_ray.models.tiny_vlm import IMAGE_TOKEN_ID
from yatt_ray.rollout import GenerateRequest, SamplingSpec
from yatt_ray.rollout.hf_engine import HFEngine
from yatt_ray.train.model import read_hf_state_dict
from yatt_ray.train.qwen_vl import join_qwen_vl_state_dict, qwen_vl_layout, split_qwen_vl_state_dict
from yatt_ray.train.vision import split_llava_state_dict

P = 16
LOGPROB_ATOL = 1e-4  # fp32 on CPU
GREEDY = SamplingSpec(n=1, max_new_tokens=8, temperature=0.0)
# prompts with one placeholder per image, expanded as the data side does; prompt 2 is text-only
RAW = [
    [1, 20, IMAGE_TOKEN_ID, 30, 31],
    [1, IMAGE_TOKEN_ID, 40, IMAGE_TOKEN_ID, 41, 42, 43],
    [1, 50, 51, 52],
    [1, 60, 61, 62, 63, 64, IMAGE_TOKEN_ID, 65],
]
PROMPTS = [expand_image_tokens(p, IMAGE_TOKEN_ID, P) for p in RAW]


def _images(pixels, seed):
    return [Pixels(pixels(1, seed)), Pixels(pixels(2, seed + 1)), None, Pixels(pixels(1, seed + 2))]


@pytest.fixture(scope="module")
def engine(vlm_dir):
    engine = HFEngine(vlm_dir, seed=0)
    yield engine
    engine.close()


def _hf_greedy(model, prompt, pixel_values, max_new_tokens):
    """transformers' own greedy `generate` on one unpadded prompt, cut after the first EOS."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS_ID, pad_token_id=0
    )
    extra = {} if pixel_values is None else {"pixel_values": pixel_values.values}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config, **extra)
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def _hf_logprobs(model, prompt, tokens, pixel_values):
    """log_softmax of the model's logits at each generated token, teacher-forced, with the images."""
    extra = {} if pixel_values is None else {"pixel_values": pixel_values.values}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens]), **extra).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _check_against(engine, model, images, spec=GREEDY):
    """Engine greedy == HF generate per prompt, token for token; log-probs == teacher-forced HF."""
    outs = engine.generate(GenerateRequest(PROMPTS, spec, images=images))
    for prompt, pix, (completion,) in zip(PROMPTS, images, outs):
        assert completion.token_ids == _hf_greedy(model, prompt, pix, spec.max_new_tokens)
        want = _hf_logprobs(model, prompt, completion.token_ids, pix)
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=LOGPROB_ATOL, rtol=0)
    return [c.token_ids for (c,) in outs], [c.logprobs for (c,) in outs]


def test_greedy_with_images_matches_hf_generate(engine, hf_vlm, pixels):
    assert (engine.image_token_id, engine.tokens_per_image) == (IMAGE_TOKEN_ID, P)
    _check_against(engine, hf_vlm, _images(pixels, 0))


def test_images_are_used(engine, pixels):
    """Other images change the greedy tokens of at least one image prompt and the log-probs of every one;
    the text-only prompt is unaffected by the other prompts' images."""
    tokens_a, logp_a = _check_images_run(engine, _images(pixels, 0))
    tokens_b, logp_b = _check_images_run(engine, _images(pixels, 100))
    assert any(tokens_a[i] != tokens_b[i] for i in (0, 1, 3))
    for i in (0, 1, 3):
        if tokens_a[i][:1] == tokens_b[i][:1]:
            assert abs(logp_a[i][0] - logp_b[i][0]) > 1e-3
    assert tokens_a[2] == tokens_b[2]
    torch.testing.assert_close(torch.tensor(logp_a[2]), torch.tensor(logp_b[2]), atol=1e-5, rtol=0)


def _check_images_run(engine, images):
    outs = engine.generate(GenerateRequest(PROMPTS, GREEDY, images=images))
    return [c.token_ids for (c,) in outs], [c.logprobs for (c,) in outs]


def test_sampled_rows_see_their_prompt_images(vlm_dir, hf_vlm, pixels):
    """n > 1 samples and batches that cut across prompts: every row's log-probs are those of its own images."""
    small = HFEngine(vlm_dir, seed=0, max_batch_size=3)
    images = _images(pixels, 0)
    try:
        outs = small.generate(
            GenerateRequest(PROMPTS, SamplingSpec(n=2, max_new_tokens=6, seed=3), images=images)
        )
    finally:
        small.close()
    for prompt, pix, group in zip(PROMPTS, images, outs):
        assert len(group) == 2
        for c in group:
            want = _hf_logprobs(hf_vlm, prompt, c.token_ids, pix)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=LOGPROB_ATOL, rtol=0)


def test_weight_sync_covers_projector_tower_and_language_model(engine, vlm_dir, vlm_dir_seed7, pixels):
    from transformers import LlavaForConditionalGeneration

    images = _images(pixels, 0)
    old = read_hf_state_dict(vlm_dir)
    new = read_hf_state_dict(vlm_dir_seed7)
    before = _check_images_run(engine, images)
    try:
        # the projector alone, checkpoint names: outputs change, and equal HF with that projector
        projector = [(k, v) for k, v in new.items() if k.startswith("multi_modal_projector.")]
        engine.load_weights(projector)
        engine.finish_weight_sync()
        mixed = LlavaForConditionalGeneration.from_pretrained(vlm_dir).eval()
        result = mixed.load_state_dict(
            {k.replace("multi_modal_projector.", "model.multi_modal_projector."): v for k, v in projector},
            strict=False,
        )
        assert not result.unexpected_keys
        after = _check_against(engine, mixed, images)
        assert after != before
        # everything of seed 7: the language model under Llama names (as the Megatron trainer exports it),
        # the tower and projector under checkpoint names, in small buckets
        lm, vision = split_llava_state_dict(new)
        items = list(lm.items()) + list(vision.items())
        for start in range(0, len(items), 7):
            engine.load_weights(items[start : start + 7])
        engine.finish_weight_sync()
        _check_against(engine, LlavaForConditionalGeneration.from_pretrained(vlm_dir_seed7).eval(), images)
        with pytest.raises(ConfigError, match="not parameters of the model"):
            engine.load_weights([("vision_tower.no_such.weight", torch.zeros(1))])
    finally:
        engine.load_weights(old.items())  # checkpoint names, every weight: back to seed 0
        engine.finish_weight_sync()
    assert _check_images_run(engine, images) == before


def test_image_errors(engine, tmp_path, pixels):
    one = Pixels(pixels(1, 0))
    with pytest.raises(DataError, match=r"prompt 0: the prompt holds 16 image tokens .* 0 image"):
        engine.generate(GenerateRequest(PROMPTS[:1], GREEDY))
    with pytest.raises(DataError, match=r"prompt 0: .* 2 image\(s\)"):
        engine.generate(GenerateRequest(PROMPTS[:1], GREEDY, images=[Pixels(pixels(2, 0))]))
    with pytest.raises(ConfigError, match="one entry .* per prompt: 2 prompts, images 1"):
        GenerateRequest(PROMPTS[:2], GREEDY, images=[one])  # checked by the request itself
    with pytest.raises(ConfigError, match=r"images\[0\] has shape \(1, 3, 48, 48\).*\[I, 3, 32, 32\]"):
        engine.generate(GenerateRequest(PROMPTS[:1], GREEDY, images=[Pixels(pixels(1, 0, size=48))]))
    with pytest.raises(
        ConfigError, match=r"images\[0\] is a Tensor; .*Pixels.*wrap bare pixel_values as Pixels\(values\)"
    ):
        engine.generate(GenerateRequest(PROMPTS[:1], GREEDY, images=[pixels(1, 0)]))
    with pytest.raises(ConfigError, match=r"images\[0\] has an image grid \(1, 3\).*LLaVA"):
        engine.generate(
            GenerateRequest(PROMPTS[:1], GREEDY, images=[Pixels(pixels(1, 0), torch.tensor([[1, 4, 4]]))])
        )
    # a text-only model
    text_dir = build_tiny_model(
        tmp_path, TinyModelSpec(hidden_size=64, intermediate_size=192, num_heads=2, num_kv_heads=1)
    )
    text_engine = HFEngine(text_dir)
    try:
        with pytest.raises(
            ValueError, match=r"prompt\(s\) \[0\] come with images.*text-only LlamaForCausalLM"
        ):
            text_engine.generate(GenerateRequest([[1, 5, 6]], GREEDY, images=[one]))
        (group,) = text_engine.generate(GenerateRequest([[1, 5, 6]], GREEDY, images=[None]))
        assert len(group[0].token_ids) >= 1
    finally:
        text_engine.close()


def test_the_image_token_is_never_sampled(engine, pixels):
    """The trainer puts image features at every image token, so a sampled one would break the step: at a
    temperature that makes the 128 ids nearly uniform (~1/128 each), 512 sampled tokens hold none."""
    spec = SamplingSpec(n=64, max_new_tokens=8, temperature=50.0, seed=3, ignore_eos=True)
    out = engine.generate(GenerateRequest(PROMPTS[:1], spec, images=_images(pixels, 0)[:1]))
    tokens = [t for c in out[0] for t in c.token_ids]
    assert len(tokens) == 512 and len(set(tokens)) > 64  # the sampling is spread out
    assert IMAGE_TOKEN_ID not in tokens


def test_a_bf16_engine_generates_with_images_close_to_fp32(engine, vlm_dir, pixels):
    """train.dtype=bf16 makes the engine bf16: pixels are cast to it, and its log-probs of the fp32 engine's
    greedy tokens are within bf16's precision of them."""
    bf16 = HFEngine(vlm_dir, seed=0, dtype="bfloat16")
    try:
        images = _images(pixels, 0)
        want = engine.generate(GenerateRequest(PROMPTS, GREEDY, images=images))
        got = bf16.generate(GenerateRequest(PROMPTS, GREEDY, images=images))
        for (a,), (b,) in zip(want, got):
            assert b.token_ids and all(math.isfinite(x) for x in b.logprobs)
            n = next(
                (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(b.token_ids)
            )
            diffs = [abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])]
            assert max(diffs, default=0.0) < 0.1  # the common prefix of the two greedy paths
    finally:
        bf16.close()


def test_prompts_without_images_as_the_encoder_gives_them(engine, vlm_dir, pixels):
    """A row without images (the data task's [0, 3, 0, 0]) encoded by `PromptEncoder` generates beside image
    prompts and in a batch of its own, exactly as a text-only prompt (None) does."""
    import numpy as np

    from yatt_ray.data.images import PIXELS
    from yatt_ray.model_dir import ImageLayout
    from yatt_ray.models.tiny_vlm import build_vlm_tokenizer
    from yatt_ray.prompts import PromptEncoder

    encoder = PromptEncoder(build_vlm_tokenizer(), 32, ImageLayout.from_model_dir(vlm_dir))
    rows = [
        {"prompt": "<image>Sum:", PIXELS: pixels(1, 0).numpy()},
        {"prompt": "3+4 Sum:", PIXELS: np.zeros((0, 3, 0, 0), dtype=np.float32)},
        {"prompt": "12+5 Sum:", PIXELS: np.zeros((0, 3, 0, 0), dtype=np.float32)},
    ]
    image, *text = [encoder.encode(r) for r in rows]
    for batch in ([image, *text], text):  # mixed, and a batch without any image
        ids = [e.ids for e in batch]
        got = engine.generate(GenerateRequest(ids, GREEDY, images=[e.pixels for e in batch]))
        want = engine.generate(
            GenerateRequest(ids, GREEDY, images=[e.pixels if e.pixels.count else None for e in batch])
        )
        assert [(c.token_ids, c.logprobs) for (c,) in got] == [(c.token_ids, c.logprobs) for (c,) in want]


# ---------------------------------------------------------------------------------------------- Qwen VL
# Each image is <|vision_start|>, t*h*w / 4 <|image_pad|>, <|vision_end|> in the prompt (as the data side expands
# it), with Pixels(pixel_values [patches, 1176], image_grid_thw [I, 3]) from Qwen's image processor.
QWEN_GREEDY = SamplingSpec(n=1, max_new_tokens=6, temperature=0.0)
QWEN_RAW = [  # None: an image; prompt 2 is text-only (None), prompt 3 text with Pixels of 0 images
    [1, 20, None, 30, 31],
    [1, None, 40, None, 41, 42, 43],
    [1, 50, 51, 52],
    [1, 60, 61, 62, 63, 64],
]
QWEN_SIZES = [[(112, 56)], [(56, 56), (84, 112)], [], []]  # (width, height): grids 1x4x8, 1x4x4 and 1x8x6
QWEN_VARIANTS = [("qwen2_5_vl", True), ("qwen2_vl", False)]  # (variant, tied embeddings)


def qwen_pixels(sizes, seed):
    """`Pixels` of PIL images of the given (width, height), a smooth pattern plus noise, through the tiny Qwen
    VL's image processor (as tests/vision/test_qwen_vl.py makes them); no sizes: 0 images."""
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


def qwen_prompt(text_ids, grid, merge=2):
    """Prompt ids: each None in `text_ids` becomes <|vision_start|> + the image's pad tokens + <|vision_end|>."""
    out, k = [], 0
    for t in text_ids:
        if t is None:
            out += [VISION_START_ID] + [QWEN_IMAGE_ID] * (int(grid[k].prod()) // merge**2) + [VISION_END_ID]
            k += 1
        else:
            out.append(t)
    return out


def _qwen_images(seed):
    """Per QWEN_RAW prompt: its Pixels (None for prompt 2)."""
    images = [qwen_pixels(sizes, seed + k) for k, sizes in enumerate(QWEN_SIZES)]
    images[2] = None
    return images


QWEN_PROMPTS = [
    qwen_prompt(raw, None if pix is None else pix.grid) for raw, pix in zip(QWEN_RAW, _qwen_images(0))
]


@pytest.fixture(scope="module", params=QWEN_VARIANTS, ids=[v for v, _ in QWEN_VARIANTS])
def qwen(request, tmp_path_factory):
    """(model dir, transformers model, engine) of one tiny Qwen VL variant (seed 0), fp32."""
    from transformers import AutoModelForImageTextToText

    variant, tied = request.param
    path = build_tiny_qwen_vl(
        tmp_path_factory.mktemp(variant), TinyQwenVLSpec(variant=variant, tie_word_embeddings=tied)
    )
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    engine = HFEngine(path, seed=0)
    yield path, hf, engine
    engine.close()


def _qwen_inputs(ids, pixels):
    """transformers' image inputs for `ids` [1, L] (none without images)."""
    if pixels is None or not pixels.count:
        return {}
    return {
        "pixel_values": pixels.values,
        "image_grid_thw": pixels.grid,
        "mm_token_type_ids": (ids == QWEN_IMAGE_ID).int(),
    }


def _qwen_hf_greedy(model, prompt, pixels, max_new_tokens):
    """transformers' own greedy `generate` on one unpadded prompt, the image token suppressed as the engine does
    (the tiny model's argmax is often it), cut after the first EOS."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        suppress_tokens=[QWEN_IMAGE_ID],
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, generation_config=config, **_qwen_inputs(ids, pixels))
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def _qwen_hf_logprobs(model, prompt, tokens, pixels):
    """log_softmax of transformers' forward over prompt + tokens (with the images) at each of `tokens`."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, **_qwen_inputs(ids, pixels)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _qwen_run(engine, images, spec=QWEN_GREEDY):
    outs = engine.generate(GenerateRequest(QWEN_PROMPTS, spec, images=images))
    return [[(c.token_ids, c.logprobs) for c in group] for group in outs]


def _qwen_check_greedy(engine, model, images):
    """The engine's greedy tokens over the whole (left-padded) batch == transformers' per prompt alone."""
    outs = _qwen_run(engine, images)
    for prompt, pix, ((tokens, _),) in zip(QWEN_PROMPTS, images, outs):
        assert tokens == _qwen_hf_greedy(model, prompt, pix, QWEN_GREEDY.max_new_tokens)
    return outs


def test_qwen_greedy_with_images_matches_hf_generate(qwen):
    path, hf, engine = qwen
    assert (engine.image_token_id, engine.merge) == (QWEN_IMAGE_ID, 2)
    assert len({len(p) for p in QWEN_PROMPTS}) == 4  # every row of the batch is padded differently
    images = _qwen_images(0)
    outs = _qwen_check_greedy(engine, hf, images)
    assert sum(len(tokens) for ((tokens, _),) in outs) > 4  # not just EOS everywhere
    # other pixels change every image prompt's log-probs and leave the text prompts' alone
    other = _qwen_run(engine, _qwen_images(100))
    for i in (0, 1):
        (a, la), (b, lb) = outs[i][0], other[i][0]
        assert a != b or max(abs(x - y) for x, y in zip(la, lb)) > 1e-3
    assert [outs[i] for i in (2, 3)] == [other[i] for i in (2, 3)]


def test_qwen_logprobs_are_teacher_forced_transformers(qwen):
    """Sampled rows (n = 2, batches of 3 rows cutting across prompts): each row's log-probs == log_softmax of
    transformers' forward over prompt + completion with its prompt's pixels."""
    path, hf, _ = qwen
    small = HFEngine(path, seed=0, max_batch_size=3)
    images = _qwen_images(0)
    try:
        outs = small.generate(
            GenerateRequest(QWEN_PROMPTS, SamplingSpec(n=2, max_new_tokens=6, seed=3), images=images)
        )
    finally:
        small.close()
    for prompt, pix, group in zip(QWEN_PROMPTS, images, outs):
        assert len(group) == 2
        for c in group:
            want = _qwen_hf_logprobs(hf, prompt, c.token_ids, pix)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=LOGPROB_ATOL, rtol=0)


def test_qwen_weight_sync_with_checkpoint_names(qwen, tmp_path):
    """Buckets named as on disk (`model.*` Qwen2 names, `visual.*`) land where a direct load_state_dict of the
    in-memory names puts them: the vision tower alone, then all of another model's weights."""
    from transformers import AutoModelForImageTextToText

    path, hf, engine = qwen
    spec = TinyQwenVLSpec(
        variant=hf.config.model_type, tie_word_embeddings=hf.config.tie_word_embeddings, seed=7
    )
    other = build_tiny_qwen_vl(tmp_path / "seed7", spec)
    old, new = read_hf_state_dict(path), read_hf_state_dict(other)
    assert qwen_vl_layout(new) == "checkpoint" and any(k.startswith("visual.") for k in new)
    images = _qwen_images(0)
    before = _qwen_run(engine, images)
    try:
        lm, vision = split_qwen_vl_state_dict(new)
        engine.load_weights(vision.items())
        engine.finish_weight_sync()
        mixed = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        result = mixed.load_state_dict(join_qwen_vl_state_dict({}, vision, layout="module"), strict=False)
        assert not result.unexpected_keys
        tower = _qwen_check_greedy(engine, mixed, images)
        assert tower[:2] != before[:2] and tower[2:] == before[2:]  # only the image prompts see the tower
        items = list(new.items())
        for start in range(0, len(items), 7):  # every weight of seed 7, in small buckets
            engine.load_weights(items[start : start + 7])
        engine.finish_weight_sync()
        _qwen_check_greedy(engine, AutoModelForImageTextToText.from_pretrained(other).eval(), images)
        with pytest.raises(ConfigError, match="not parameters of the model"):
            engine.load_weights([("visual.no_such.weight", torch.zeros(1))])
    finally:
        engine.load_weights(old.items())
        engine.finish_weight_sync()
    assert _qwen_run(engine, images) == before


def test_qwen_image_errors(qwen):
    engine = qwen[2]
    pix = qwen_pixels([(112, 56)], 0)  # grid 1x4x8: 32 patch rows, 8 tokens
    good = qwen_prompt([1, 20, None, 30], pix.grid)
    short = [t for i, t in enumerate(good) if i != 3]  # one image token fewer
    with pytest.raises(
        DataError, match=r"prompt 1: .* runs \(id 101\) of \[7\] tokens .* need runs of \[8\]"
    ):
        engine.generate(GenerateRequest([good, short], QWEN_GREEDY, images=[pix, pix]))
    with pytest.raises(DataError, match=r"prompt 0: .* runs \(id 101\) of \[8\] .* its 0 image\(s\)"):
        engine.generate(GenerateRequest([good], QWEN_GREEDY))
    two = qwen_pixels([(112, 56), (56, 56)], 0)
    with pytest.raises(
        DataError, match=r"prompt 0: .* of \[8\] .* its 2 image\(s\) .* need runs of \[8, 4\]"
    ):
        engine.generate(GenerateRequest([good], QWEN_GREEDY, images=[two]))
    with pytest.raises(DataError, match=r"images\[0\] has 28 pixel rows but .* makes 32 patches"):
        engine.generate(GenerateRequest([good], QWEN_GREEDY, images=[Pixels(pix.values[:28], pix.grid)]))
    with pytest.raises(ConfigError, match=r"images\[0\] has grid None; a Qwen VL model needs image_grid_thw"):
        engine.generate(GenerateRequest([good], QWEN_GREEDY, images=[Pixels(pix.values)]))
    with pytest.raises(ConfigError, match=r"images\[0\] has shape \(32, 588\).*\[patches, 1176\]"):
        engine.generate(GenerateRequest([good], QWEN_GREEDY, images=[Pixels(pix.values[:, :588], pix.grid)]))
    with pytest.raises(ConfigError, match=r"images\[0\] is a Tensor; .*grid=image_grid_thw"):
        engine.generate(GenerateRequest([good], QWEN_GREEDY, images=[pix.values]))


def test_qwen_image_token_is_never_sampled(qwen):
    """At a temperature that makes the 128 ids nearly uniform, 1024 sampled tokens (~8 image tokens
    expected unsuppressed) hold none."""
    engine = qwen[2]
    spec = SamplingSpec(n=64, max_new_tokens=16, temperature=50.0, seed=3, ignore_eos=True)
    out = engine.generate(GenerateRequest(QWEN_PROMPTS[:1], spec, images=_qwen_images(0)[:1]))
    tokens = [t for c in out[0] for t in c.token_ids]
    assert len(tokens) == 1024 and len(set(tokens)) > 64
    assert QWEN_IMAGE_ID not in tokens
