"""The trainer side of a Qwen2-VL / Qwen2.5-VL policy: the tiny models, the shape and M-RoPE positions,
conversion both ways, and Megatron's decoder with the vision transformer against transformers' logits."""

import sys
from pathlib import Path

import pytest
import torch

from yatt_ray.errors import ConfigError, DataError
from yatt_ray.model_shape import LlamaShape
from yatt_ray.models.tiny import TinyModelSpec
from yatt_ray.models.tiny_qwen_vl import (
    IMAGE_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    TinyQwenVLSpec,
    build_image_processor,
    build_tiny_qwen_vl,
)
from yatt_ray.train import (
    build_gpt_model,
    hf_to_megatron,
    megatron_to_hf,
    pack_shared_prefix,
    seed_everything,
)
from yatt_ray.train.model import attention_input, load_megatron_shard, read_hf_state_dict
from yatt_ray.train.policy import packed_logprobs_and_entropy
from yatt_ray.train.qwen_vl import (
    QwenVisionEncoder,
    join_qwen_vl_state_dict,
    mrope_positions,
    packed_positions,
    set_trainable,
    split_qwen_vl_state_dict,
)
from yatt_ray.train.vision import decoder_input, forward_with_decoder_input, packed_image_index

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # the gloo harness of tests/train
from dist_harness import run_ranks  # noqa: E402

IMG = IMAGE_TOKEN_ID
LOGITS_ATOL = 1e-4
VARIANTS = [("qwen2_5_vl", True), ("qwen2_vl", False)]  # (variant, tied embeddings)


@pytest.fixture(scope="module", params=VARIANTS, ids=[v for v, _ in VARIANTS])
def qwen(request, tmp_path_factory, single_process_world):
    """(model dir, transformers model, Megatron GPTModel, QwenVisionEncoder) for one variant, eval mode."""
    import transformers

    variant, tied = request.param
    spec = TinyQwenVLSpec(variant=variant, tie_word_embeddings=tied)
    path = build_tiny_qwen_vl(tmp_path_factory.mktemp(variant), spec)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    seed_everything(0)
    shape = LlamaShape.from_hf_dir(path)
    model = build_gpt_model(shape)
    lm, _ = split_qwen_vl_state_dict(read_hf_state_dict(path))
    load_megatron_shard(model, hf_to_megatron(lm, shape), path)
    return path, hf.requires_grad_(False), model.eval(), QwenVisionEncoder.from_hf_dir(path).eval()


def images(sizes, seed=0):
    """PIL images of the given (width, height), smooth patterns plus noise, through Qwen's image processor:
    (pixel_values [patches, 1176], image_grid_thw [I, 3])."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pics = []
    for w, h in sizes:
        ramp = torch.linspace(0, 255, w)[None, :, None] * torch.rand(1, 1, 3, generator=g)
        noise = 60 * torch.rand(h, w, 3, generator=g)
        pics.append(Image.fromarray((ramp + noise).clamp(0, 255).to(torch.uint8).numpy()))
    out = build_image_processor()(images=pics, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def with_images(text_ids, grids, merge=2):
    """Prompt ids: each None in `text_ids` becomes <|vision_start|> + the image's pad tokens + <|vision_end|>."""
    out, k = [], 0
    for t in text_ids:
        if t is None:
            n = int(grids[k].prod()) // merge**2
            out += [VISION_START_ID] + [IMG] * n + [VISION_END_ID]
            k += 1
        else:
            out.append(t)
    return out


def hf_logits(hf, ids, pix, grid):
    ids = torch.tensor([ids])
    kwargs = {} if pix is None else dict(pixel_values=pix, image_grid_thw=grid)
    return hf(input_ids=ids, mm_token_type_ids=(ids == IMG).int(), **kwargs).logits[0]


def test_shape_reads_the_qwen2_decoder_and_its_sections(qwen):
    path = qwen[0]
    shape = LlamaShape.from_hf_dir(path)
    assert (shape.family, shape.qkv_bias, shape.mrope_section, shape.head_dim) == (
        "qwen2",
        True,
        (4, 6, 6),
        32,
    )
    legacy = {  # the flat config.json layout of the hub's Qwen2.5-VL checkpoints
        **shape_dict(path)["text_config"],
        "model_type": "qwen2_5_vl",
        "vision_config": {},
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "rope_theta": 10000.0,
    }
    legacy.pop("rope_parameters")
    assert LlamaShape.from_hf_config(legacy) == shape
    bad = {**legacy, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 7]}}
    with pytest.raises(ConfigError, match="mrope_section .* sums to 17, not head_dim / 2 = 16"):
        LlamaShape.from_hf_config(bad)


def shape_dict(path):
    import json

    return json.loads((path / "config.json").read_text())


def test_mrope_positions_match_transformers_get_rope_index(qwen):
    hf = qwen[1]
    pix, grid = images([(56, 112), (84, 56)])  # two images of different grids
    ids = with_images([1, 20, None, 30, 31, None, 40, 41, 42], grid)
    got = mrope_positions(torch.tensor(ids), grid, IMG, merge=2)
    t = torch.tensor([ids])
    want, _ = hf.model.get_rope_index(t, mm_token_type_ids=(t == IMG).int(), image_grid_thw=grid)
    assert torch.equal(got, want[:, 0])
    assert not torch.equal(got[1], got[0]) and not torch.equal(got[1], got[2])  # three different rows
    assert torch.equal(mrope_positions(torch.tensor([5, 6, 7]), None, IMG, 2), torch.arange(3).expand(3, 3))
    with pytest.raises(DataError, match="1 image\\(s\\) but 2 image_grid_thw"):
        mrope_positions(torch.tensor(with_images([1, None, 2], grid[:1])), grid, IMG, 2)
    with pytest.raises(DataError, match="run of exactly 8 image tokens"):
        mrope_positions(torch.tensor([1, IMG, IMG, 2]), grid[:1], IMG, 2)


def test_logits_match_transformers(qwen):
    path, hf, model, encoder = qwen
    pix, grid = images([(112, 56), (56, 56)], seed=1)
    ids = with_images([1, 20, 21, None, 30, None, 40, 41], grid)
    t = torch.tensor([ids])
    with torch.no_grad():
        feats = encoder(pix, grid)
        assert feats.shape == (int(encoder.tokens(grid).sum()), 128)
        emb = decoder_input(model, t, feats, IMG)
        got = forward_with_decoder_input(model, t, mrope_positions(t[0], grid, IMG, 2)[:, None], None, emb)[0]
        want = hf_logits(hf, ids, pix, grid)
        other, _ = images([(112, 56), (56, 56)], seed=2)
        changed = hf_logits(hf, ids, other, grid)
    diff = (got - want).abs().max().item()
    assert diff < LOGITS_ATOL, diff
    assert (changed - want).abs().max() > 100 * LOGITS_ATOL  # the pixels reach the logits


def _tp_logits(rank, world_size, model_dir, ids, pix, grid):
    """One TP rank's vocabulary shard of the logits [T, V / tp] (rank r holds columns r*V/tp ...)."""
    from yatt_ray.train import init_parallel_state

    init_parallel_state(world_size)
    seed_everything(0)
    shape = LlamaShape.from_hf_dir(model_dir)
    model = build_gpt_model(shape).eval()
    lm, _ = split_qwen_vl_state_dict(read_hf_state_dict(model_dir))
    load_megatron_shard(model, hf_to_megatron(lm, shape, tp_rank=rank, tp_size=world_size), model_dir)
    encoder = QwenVisionEncoder.from_hf_dir(model_dir).eval()
    t = torch.tensor([ids])
    with torch.no_grad():
        emb = decoder_input(model, t, encoder(pix, grid), IMG)
        positions = mrope_positions(t[0], grid, IMG, 2)[:, None]
        return forward_with_decoder_input(model, t, positions, None, emb)[0]


def test_logits_match_transformers_at_tp2(qwen):
    path, hf = qwen[0], qwen[1]
    pix, grid = images([(84, 112), (56, 56)], seed=5)
    ids = with_images([1, 20, None, 30, 31, None, 40], grid)
    shards = run_ranks(_tp_logits, 2, str(path), ids, pix, grid, timeout_s=180.0)
    assert shards[0].shape[-1] == shards[1].shape[-1] == 64  # each rank holds half the vocabulary
    with torch.no_grad():
        want = hf_logits(hf, ids, pix, grid)
    diff = (torch.cat(shards, dim=-1) - want).abs().max().item()
    assert diff < LOGITS_ATOL, diff


def test_conversion_round_trip_and_export_loads_in_transformers(qwen):
    path, hf, model, encoder = qwen
    shape = LlamaShape.from_hf_dir(path)
    disk = read_hf_state_dict(path)
    lm, vision = split_qwen_vl_state_dict(disk)
    assert (
        lm and all(n.startswith(("model.", "lm_head.")) for n in lm) and "model.visual" not in str(lm.keys())
    )
    back = join_qwen_vl_state_dict(megatron_to_hf([model.state_dict()], shape), encoder.hf_state_dict())
    assert back.keys() == disk.keys()
    assert all(torch.equal(back[k], disk[k]) for k in disk)
    module = join_qwen_vl_state_dict(*split_qwen_vl_state_dict(hf.state_dict()), layout="module")
    fresh = type(hf)(hf.config)
    fresh.load_state_dict(module, strict=True)  # the in-memory layout round-trips too
    tied = {"lm_head.weight"}  # in memory a tied head is listed; on disk it is not
    assert split_qwen_vl_state_dict(module)[0].keys() - tied == lm.keys() - tied
    with pytest.raises(ConfigError, match="no `visual"):
        split_qwen_vl_state_dict(lm)


def test_packed_samples_match_transformers_per_row(qwen):
    """Two prompts (one image each, different grids) x samples, packed by prompt: each row's log-probs at its
    real tokens == transformers' on the row alone; the responses continue from the prompt's M-RoPE position."""
    path, hf, model, encoder = qwen
    pix_a, grid_a = images([(112, 56)], seed=3)
    pix_b, grid_b = images([(56, 56)], seed=4)
    prompt_a = with_images([1, 20, None, 30], grid_a)
    prompt_b = with_images([1, None, 22, 23], grid_b)
    rows = [prompt_a + [41, 42, 43], prompt_a + [44], prompt_b + [47, 48], prompt_b + [49, 50, 51, 52]]
    grids = [grid_a, grid_a, grid_b, grid_b]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    packed = pack_shared_prefix(ids, mask, group_size=2)
    positions = packed_positions(
        packed, [mrope_positions(torch.tensor(r), g, IMG, 2) for r, g in zip(rows, grids)]
    )
    index = packed_image_index(packed, ids, mask, IMG, share_images=True)
    with torch.no_grad():
        per_row = [encoder(p, g) for p, g in [(pix_a, grid_a)] * 2 + [(pix_b, grid_b)] * 2]
        feats = torch.cat(per_row)[index]
        emb = decoder_input(model, packed.input_ids, feats, IMG)
        logits = forward_with_decoder_input(
            model, packed.input_ids, positions, attention_input(model, packed), emb
        )
        logp, _ = packed_logprobs_and_entropy(logits, torch.eye(logits.shape[-1]), packed)
    for i, (r, p, g) in enumerate(zip(rows, [pix_a, pix_a, pix_b, pix_b], grids)):
        with torch.no_grad():
            ref = torch.log_softmax(hf_logits(hf, r, p, g), -1)
        want = ref[:-1].gather(-1, torch.tensor(r[1:])[:, None])[:, 0]
        torch.testing.assert_close(logp[i, width - len(r) :], want, atol=LOGITS_ATOL, rtol=0)


def test_train_vision_modes(qwen):
    encoder = QwenVisionEncoder.from_hf_dir(qwen[0])
    assert set_trainable(encoder, "none") == []
    merger = set_trainable(encoder, "projector")
    assert merger and all(n.startswith("visual.merger.") for n in merger)
    assert len(set_trainable(encoder, "all")) == len(list(encoder.parameters()))
    with pytest.raises(ConfigError, match="train_vision='tower'"):
        set_trainable(encoder, "tower")
    pix, grid = images([(56, 56)])
    set_trainable(encoder, "projector")
    encoder(pix, grid).square().sum().backward()
    grads = {n for n, p in encoder.named_parameters() if p.grad is not None}
    assert grads == set(merger)


def test_spec_checks_the_sections(tmp_path):
    with pytest.raises(ValueError, match="must sum to head_dim / 2 = 16"):
        build_tiny_qwen_vl(tmp_path, TinyQwenVLSpec(mrope_section=(4, 4, 4), text=TinyModelSpec()))


def test_policy_log_probs_and_a_step_with_images_once_per_prompt(qwen, monkeypatch):
    """`MegatronPolicy` on a Qwen VL directory: rows of two prompts with images (different grids) and one text
    prompt, the images held once per prompt (`PromptImages`), micro-batches of one group: every row's
    log-probs equal transformers' on the row alone; a step with train_vision=projector moves the merger only.
    On CUDA (release/gpu_check.sh) the policy runs there against transformers on the CPU."""
    from yatt_ray.batch import Pixels, prompt_images
    from yatt_ray.train import MegatronPolicy

    # on CUDA: fp32 convolutions (the patch embedding), as on the CPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path, hf = qwen[0], qwen[1]
    pix_a, grid_a = images([(112, 56)], seed=5)
    pix_b, grid_b = images([(56, 56), (56, 84)], seed=6)
    prompts = [with_images([1, None, 20], grid_a), with_images([1, None, 21, None], grid_b), [1, 22, 23]]
    pixels = [Pixels(pix_a, grid_a), Pixels(pix_b, grid_b), Pixels(torch.zeros(0, 1176), grid_a[:0])]
    responses = [[41, 42], [43], [44, 45, 46], [47], [48, 49], [50]]
    rows = [prompts[i // 2] + r for i, r in enumerate(responses)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    images_, image_prompt = prompt_images(pixels, 2)
    assert images_.values.shape[0] == len(pix_a) + len(pix_b)  # once per prompt, not per sample
    inputs = {"images": images_, "image_prompt": image_prompt}
    policy = MegatronPolicy(path, lr=1e-2, seed=0, train_vision="projector")
    logp = policy.log_probs(ids, mask, micro_batch_size=2, group_size=2, images=inputs)[0]
    for i, r in enumerate(rows):
        p = pixels[i // 2]
        with torch.no_grad():
            ref = torch.log_softmax(hf_logits(hf, r, p.values if p.count else None, p.grid), -1)
        want = ref[:-1].gather(-1, torch.tensor(r[1:])[:, None])[:, 0]
        torch.testing.assert_close(logp[i, width - len(r) :], want, atol=LOGITS_ATOL, rtol=0)
    features = policy.image_features(pixels)  # what a features-taking engine (vLLM) gets: the trainer's own
    assert [len(f) for f in features] == [int(grid_a.prod()) // 4, int(grid_b.prod(-1).sum()) // 4, 0]
    device = next(policy.encoder.parameters()).device
    with torch.no_grad():
        direct = policy.encoder(pix_b.to(device), grid_b.to(device)).cpu()
    torch.testing.assert_close(features[1], direct, atol=1e-6, rtol=0)
    merger = {n: t.detach().clone() for n, t in policy.encoder.named_parameters()}

    def loss_fn(lp, entropy, mb):
        loss = -(lp * mb["attention_mask"][:, 1:]).sum() / 20
        return loss, {"loss": loss.detach()}

    policy.train_step({"input_ids": ids, "attention_mask": mask, **inputs}, loss_fn, 2, group_size=2)
    moved = {n for n, t in policy.encoder.named_parameters() if not torch.equal(t.detach(), merger[n])}
    assert moved and all(n.startswith("visual.merger.") for n in moved)
    exported = policy.hf_state_dict()
    assert exported is not None and any(n.startswith("visual.merger.") for n in exported)
    assert torch.equal(
        exported["visual.merger.mlp.0.weight"].cpu(),
        policy.encoder.visual.merger.mlp[0].weight.detach().cpu(),
    )
