"""The trainer side of a LLaVA policy: image-token expansion, LLaVA <-> (Megatron + vision) conversion, the
vision encoder against transformers, and Megatron GPTModel fed with image features against HF LLaVA logits."""

import pytest
import torch

from yatt_ray.batch import Pixels, PromptImages
from yatt_ray.errors import ConfigError, DataError
from yatt_ray.model_dir import check_image_count, expand_image_tokens, llava_module_name
from yatt_ray.models.tiny_vlm import IMAGE_TOKEN_ID, TinyVLMSpec, build_tiny_vlm
from yatt_ray.train import (
    build_gpt_model,
    hf_to_megatron,
    megatron_to_hf,
    pack_shared_prefix,
    seed_everything,
)
from yatt_ray.train.model import read_hf_state_dict
from yatt_ray.train.policy import load_language_model_weights, packed_logprobs_and_entropy
from yatt_ray.train.vision import (
    TRAIN_VISION_MODES,
    VisionEncoder,
    decoder_input,
    forward_packed_with_images,
    forward_with_decoder_input,
    join_llava_state_dict,
    packed_image_index,
    set_trainable,
    split_llava_state_dict,
    text_shape,
)

P = 16  # tokens per image of the tiny VLM
IMG = IMAGE_TOKEN_ID
LOGITS_ATOL = 1e-4  # fp32 on CPU; measured max |diff| 4.2e-7 on logits of size ~1 (oneDNN vs MKL matmuls)


# ------------------------------------------------------------------------------------- image tokens
def test_expand_image_tokens_by_hand():
    assert expand_image_tokens([1, 9, 5, 9, 6], image_token_id=9, tokens_per_image=3) == [
        1, 9, 9, 9, 5, 9, 9, 9, 6,
    ]  # fmt: skip
    assert expand_image_tokens([1, 5, 6], 9, 3, num_images=0) == [1, 5, 6]
    assert expand_image_tokens([9], 9, 2, num_images=1) == [9, 9]
    with pytest.raises(DataError, match=r"1 placeholders .* 2 image\(s\)"):
        expand_image_tokens([1, 9, 5], 9, 3, num_images=2)
    with pytest.raises(DataError, match="3 placeholders"):  # expanded already: a second expansion is caught
        expand_image_tokens([1, 9, 9, 9, 5], 9, 3, num_images=1)
    with pytest.raises(ConfigError, match="tokens_per_image=0"):
        expand_image_tokens([1, 9], 9, 0)


def test_check_image_count():
    check_image_count([1, 9, 9, 9, 5, 9, 9, 9], num_images=2, image_token_id=9, tokens_per_image=3)
    check_image_count(torch.tensor([1, 9, 9, 9, 9, 9, 9, 5]), 2, 9, 3)  # two images back to back
    check_image_count([1, 5], 0, 9, 3)
    with pytest.raises(DataError, match=r"holds 3 image tokens \(3 per image\) .* 2 image\(s\) .* need 6"):
        check_image_count([1, 9, 9, 9, 5], 2, 9, 3)
    with pytest.raises(DataError, match=r"runs of lengths \[2, 4\]"):
        check_image_count([1, 9, 9, 5, 9, 9, 9, 9], 2, 9, 3)
    with pytest.raises(DataError, match="0 image"):
        check_image_count([1, 9, 9, 9], 0, 9, 3)


# ------------------------------------------------------------------------------------- conversion
def _round_trip(hf_sd, shape, tp_size):
    lm, vision = split_llava_state_dict(hf_sd)
    shards = [hf_to_megatron(lm, shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    return join_llava_state_dict(megatron_to_hf(shards, shape), vision)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_round_trip_checkpoint_layout_is_exact(vlm_dir, tp_size):
    hf_sd = read_hf_state_dict(vlm_dir)
    assert any(k.startswith("language_model.model.") for k in hf_sd)  # what save_pretrained writes in 5.19
    back = _round_trip(hf_sd, text_shape(vlm_dir), tp_size)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_round_trip_module_layout_is_exact(vlm_dir, hf_vlm):
    hf_sd = hf_vlm.state_dict()
    assert "model.language_model.embed_tokens.weight" in hf_sd and "lm_head.weight" in hf_sd
    back = _round_trip(hf_sd, text_shape(vlm_dir), 1)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_split_names_and_errors(vlm_dir, hf_vlm):
    lm, vision = split_llava_state_dict(read_hf_state_dict(vlm_dir))
    assert "model.layers.1.mlp.down_proj.weight" in lm and "lm_head.weight" in lm
    assert "multi_modal_projector.linear_2.bias" in vision and "vision_tower.pre_layrnorm.weight" in vision
    assert not set(lm) & set(vision)
    with pytest.raises(ConfigError, match="neither the language model nor the vision part"):
        split_llava_state_dict({**lm, "vision_tower.x": torch.zeros(1)})  # Llama names are no LLaVA names
    # every name a trainer or a checkpoint uses maps onto the in-memory model
    module = set(hf_vlm.state_dict())
    names = set(read_hf_state_dict(vlm_dir)) | set(lm) | {"vision_tower.vision_model.pre_layrnorm.weight"}
    assert {llava_module_name(n) for n in names} <= module
    assert llava_module_name("model.layers.0.self_attn.q_proj.weight") == (
        "model.language_model.layers.0.self_attn.q_proj.weight"
    )


def test_text_shape(vlm_dir):
    shape = text_shape(vlm_dir)
    assert (shape.vocab_size, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (128, 128, 4, 2)
    assert shape.max_positions == 256 and not shape.tie_word_embeddings
    with pytest.raises(ConfigError, match="model_type='llama' is not 'llava'"):
        text_shape({"model_type": "llama"})


# ------------------------------------------------------------------------------------- encoder
def _hf_features(model, pixel_values):
    with torch.no_grad():
        return torch.stack(list(model.get_image_features(pixel_values=pixel_values).pooler_output))


@pytest.mark.parametrize(
    "layer, strategy",
    [(-1, "default"), (-2, "full"), ((0, -2), "default")],
    ids=["last", "penult-full", "list"],
)
def test_encoder_matches_hf(vlm_dir, tmp_path, pixels, layer, strategy):
    from transformers import LlavaForConditionalGeneration

    path = vlm_dir
    if (layer, strategy) != (-1, "default"):
        spec = TinyVLMSpec(vision_feature_layer=layer, vision_feature_select_strategy=strategy)
        path = build_tiny_vlm(tmp_path, spec)
    hf = LlavaForConditionalGeneration.from_pretrained(path).eval()
    encoder = VisionEncoder.from_hf_dir(path)
    x = pixels(3, 0)
    with torch.no_grad():
        got = encoder(x)
    want = _hf_features(hf, x)
    tokens = 17 if strategy == "full" else 16
    assert got.shape == want.shape == (3, tokens, 128) == (3, encoder.tokens_per_image, 128)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_encoder_loads_hub_layout(vlm_dir, pixels):
    """llava-hf hub checkpoints name the tower `vision_tower.vision_model.*`; the encoder loads them too."""
    _, vision = split_llava_state_dict(read_hf_state_dict(vlm_dir))
    hub = {n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in vision.items()}
    a, b = VisionEncoder.from_hf(vlm_dir, vision), VisionEncoder.from_hf(vlm_dir, hub)
    with torch.no_grad():
        assert torch.equal(a(pixels(2, 0)), b(pixels(2, 0)))
    with pytest.raises(ConfigError, match="missing=.*linear_1.weight"):
        VisionEncoder.from_hf(vlm_dir, {n: t for n, t in vision.items() if "linear_1.weight" not in n})
    assert a.hf_state_dict().keys() == vision.keys()


def test_set_trainable_flags_and_gradients(vlm_dir, tmp_path, pixels):
    encoder = VisionEncoder.from_hf_dir(vlm_dir)
    projector = {n for n, _ in encoder.named_parameters() if n.startswith("multi_modal_projector.")}
    everything = {n for n, _ in encoder.named_parameters()}
    post_norm = {"vision_tower.post_layernorm.weight", "vision_tower.post_layernorm.bias"}
    assert set(set_trainable(encoder, "none")) == set()
    assert not any(p.requires_grad for p in encoder.parameters())
    assert not encoder(pixels(1, 0)).requires_grad
    assert set(set_trainable(encoder, "projector")) == projector
    assert set(set_trainable(encoder, "all")) == everything - post_norm
    with pytest.raises(ValueError, match="'tower'.*'none', 'projector', 'all'"):
        set_trainable(encoder, "tower")
    assert TRAIN_VISION_MODES == ("none", "projector", "all")

    def grads(mode):
        set_trainable(encoder, mode)
        encoder.zero_grad(set_to_none=True)
        encoder(pixels(2, 1)).square().mean().backward()
        return {n: p.grad for n, p in encoder.named_parameters()}

    got = grads("projector")
    assert all(got[n] is not None and got[n].abs().sum() > 0 for n in projector)
    assert all(got[n] is None for n in everything - projector)
    got = grads("all")
    assert all(got[n] is not None and got[n].abs().sum() > 0 for n in everything - post_norm)

    # feature layer -2 of a 2-layer tower: the last layer never reaches the features, so it stays frozen
    spec = TinyVLMSpec(vision_feature_layer=-2)
    deep = VisionEncoder.from_hf_dir(build_tiny_vlm(tmp_path, spec))
    frozen = {n for n, _ in deep.named_parameters()} - set(set_trainable(deep, "all"))
    assert frozen == post_norm | {n for n, _ in deep.named_parameters() if ".layers.1." in n}
    deep(pixels(1, 0)).sum().backward()
    assert all(p.grad is not None for p in deep.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------- Megatron decoder
@pytest.fixture(scope="module")
def megatron_vlm(vlm_dir, single_process_world):
    """(GPTModel with the tiny VLM's language model, VisionEncoder), eval mode."""
    seed_everything(0)
    shape = text_shape(vlm_dir)
    model = build_gpt_model(shape)
    load_language_model_weights(model, vlm_dir, shape)
    return model.eval(), VisionEncoder.from_hf_dir(vlm_dir).eval()


def test_megatron_logits_match_hf(megatron_vlm, hf_vlm, pixels):
    """Two rows, one image and two images, the same length: the row-major image order matters."""
    model, encoder = megatron_vlm
    ids = torch.tensor(
        [
            [1, 20, 21] + [IMG] * P + [30, 31, 32, 33] + [40] * (P + 1),
            [1] + [IMG] * P + [50, 51] + [IMG] * P + [60, 61, 62, 63, 64],
        ]
    )
    b, t = ids.shape
    pix = pixels(3, 2)  # image 0 -> row 0, images 1, 2 -> row 1
    with torch.no_grad():
        embeddings = decoder_input(model, ids, encoder(pix), IMG)
        got = forward_with_decoder_input(model, ids, torch.arange(t).expand(b, t), None, embeddings)
        want = hf_vlm(input_ids=ids, pixel_values=pix).logits
        swapped = hf_vlm(input_ids=ids, pixel_values=pix[[1, 0, 2]]).logits
    assert embeddings.shape == (t, b, 128)
    assert got.shape == want.shape == (b, t, 128)
    diff = (got - want).abs().max().item()
    assert diff < LOGITS_ATOL, diff
    assert (swapped - want).abs().max() > 100 * LOGITS_ATOL  # so the order of the images is really tested
    with pytest.raises(DataError, match="48 image tokens .* give 32 rows"):
        decoder_input(model, ids, encoder(pix[:2]), IMG)
    with pytest.raises(DataError, match="48 image tokens"):
        decoder_input(model, ids, None, IMG)


def test_packed_rows_with_images_match_hf(megatron_vlm, hf_vlm, pixels):
    """Shared-prefix packing of two prompts' samples: prompt A has text after its image, prompt B ends with
    its image (the packed body then ends inside the image). Log-probs at every real token == HF's per row."""
    model, encoder = megatron_vlm
    prompt_a = [1, 20] + [IMG] * P + [30, 31]
    prompt_b = [1, 22, 23] + [IMG] * P
    rows = [
        prompt_a + [41, 42, 43],
        prompt_a + [44],
        prompt_a + [45, 46],
        prompt_b + [47, 48],
        prompt_b + [49],
    ]
    images = [pixels(1, 10)] * 3 + [pixels(1, 11)] * 2
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding, as the rollout batch has it
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    packed = pack_shared_prefix(ids, mask, group_size=3)
    index = packed_image_index(packed, ids, mask, IMG)
    shared = packed_image_index(packed, ids, mask, IMG, share_images=True)
    assert len(index) == len(shared) < 5 * P  # a group's prompt images are in its packed row once
    # each row holds one image (P tokens from i * P on); every image token is in its group's body (B's body
    # ends with its image's last token, which also predicts each B row's first response token)
    assert set((index // P).tolist()) == {0, 3} and set((shared // P).tolist()) == {0, 3}
    assert len(packed.extra_at) == 3  # rows 2, 3 and 5 predict their first own token from their body's end
    with torch.no_grad():
        every = encoder(torch.cat(images)).reshape(-1, 128)
        leaders = torch.zeros_like(every)  # share_images: only the leading rows' images are encoded
        leaders[:P], leaders[3 * P : 4 * P] = every[:P], every[3 * P : 4 * P]
        runs = [every[index], leaders[shared]]
        logps = []
        for features in runs:
            logits = forward_packed_with_images(model, packed, features, IMG)
            logps.append(packed_logprobs_and_entropy(logits, torch.eye(logits.shape[-1]), packed)[0])
    for i, (r, image) in enumerate(zip(rows, images)):
        with torch.no_grad():
            ref = torch.log_softmax(hf_vlm(input_ids=torch.tensor([r]), pixel_values=image).logits[0], -1)
        want = ref[:-1].gather(-1, torch.tensor(r[1:])[:, None])[:, 0]
        for logp in logps:
            torch.testing.assert_close(logp[i, width - len(r) :], want, atol=LOGITS_ATOL, rtol=0)
    mixed = pack_shared_prefix(ids[2:4], mask[2:4], group_size=2)  # A and B in one packed row
    with pytest.raises(DataError, match="rows 0 and 1 are packed together"):
        two = ids[2:4].clone()
        two[1, -3:-1] = IMG  # row 1 now holds more image tokens than row 0
        packed_image_index(
            pack_shared_prefix(two, mask[2:4], group_size=2), two, mask[2:4], IMG, share_images=True
        )
    assert len(packed_image_index(mixed, ids[2:4], mask[2:4], IMG)) == 2 * P
    alone = torch.tensor([prompt_b])  # a row without a token after its image
    with pytest.raises(DataError, match="row 0 ends with an image token"):
        packed_image_index(
            pack_shared_prefix(alone, torch.ones_like(alone)), alone, torch.ones_like(alone), IMG
        )


def test_projector_mode_trains_projector_and_decoder(megatron_vlm, vlm_dir, pixels):
    """train_vision='projector': a loss on the Megatron logits sends gradients to the projector and the decoder,
    none to the tower."""
    model, _ = megatron_vlm
    encoder = VisionEncoder.from_hf_dir(vlm_dir)
    set_trainable(encoder, "projector")
    ids = torch.tensor([[1, 20] + [IMG] * P + [30, 31, 32]])
    t = ids.shape[1]
    model.zero_grad()
    for p in model.parameters():
        p.grad = None
    logits = forward_with_decoder_input(
        model,
        ids,
        torch.arange(t)[None],
        None,
        decoder_input(model, ids, encoder(pixels(1, 3)), IMG),
    )
    torch.log_softmax(logits, -1)[0, -4:, 5].sum().backward()
    assert encoder.multi_modal_projector.linear_1.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in encoder.vision_tower.parameters())
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() > 0
    for p in model.parameters():
        p.grad = None


def test_a_bf16_vision_policy_tracks_fp32(vlm_dir, pixels, single_process_world):
    """train.dtype=bf16 with a LLaVA policy: the fp32 encoder's features enter the bf16 decoder; log-probs and
    the first step stay within bf16's precision of fp32, and the projector trains."""
    from yatt_ray.train import MegatronPolicy

    ids = torch.tensor([[1, 20] + [IMG] * P + [30, 31, 32]] * 2)
    mask = torch.ones_like(ids)
    images = {
        "images": PromptImages.of([Pixels(pixels(1, 3)), Pixels(pixels(1, 4))]),
        "image_prompt": torch.tensor([0, 1]),
    }
    batch = {"input_ids": ids, "attention_mask": mask, **images}

    def loss_fn(logp, entropy, mb):
        loss = -logp[:, -3:].sum() / 6
        return loss, {"loss": loss.detach()}

    out = {}
    for dtype in ("fp32", "bf16"):
        policy = MegatronPolicy(vlm_dir, lr=1e-3, seed=0, dtype=dtype, train_vision="projector")
        logp = policy.log_probs(ids, mask, 2, images=images)[0]
        projector = policy.encoder.multi_modal_projector.linear_1.weight.detach().clone()
        metrics = policy.train_step(batch, loss_fn, micro_batch_size=2)
        moved = (policy.encoder.multi_modal_projector.linear_1.weight.detach() - projector).abs().max()
        out[dtype] = logp, metrics, float(moved)
    (l32, m32, moved32), (l16, m16, moved16) = out["fp32"], out["bf16"]
    assert (l16 - l32).abs().max() < 0.1
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.05)
    assert moved16 > 0 and moved32 > 0
