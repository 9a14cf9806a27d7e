"""Rows without images beside rows with them: `stack_images`, `concat` and a 2-rank gloo balance exchange
where one rank's whole batch has no image. A prompt without images has pixels [0, C, H, W] (`PromptEncoder`)."""

import sys
from pathlib import Path

import pytest
import torch

from yatt_ray.batch import concat, pack, stack_images
from yatt_ray.train.balance import exchange

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # the gloo harness of tests/train
from dist_harness import run_ranks  # noqa: E402

SHAPE = (3, 4, 4)  # (C, H, W) of the test images
N = 2  # samples a prompt


def _pixels(count: int, tag: int) -> torch.Tensor:
    """`count` images, every pixel of image k holding tag + k / 10: each row's images can be told apart."""
    return (
        torch.stack([torch.full(SHAPE, tag + k / 10) for k in range(count)])
        if count
        else torch.zeros(0, *SHAPE)
    )


def test_stack_images_with_prompts_without_images():
    values, count = stack_images([_pixels(0, 1), _pixels(2, 2), _pixels(1, 3)], N)
    assert values.shape == (3 * N, 2, *SHAPE) and count.tolist() == [0, 0, 2, 2, 1, 1]
    assert (values[:2] == 0).all() and torch.equal(values[2], _pixels(2, 2))
    assert torch.equal(values[4, :1], _pixels(1, 3)) and (values[4, 1:] == 0).all()
    none, zero = stack_images([_pixels(0, 1), _pixels(0, 2)], N)  # a batch without any image
    assert none.shape == (2 * N, 0, *SHAPE) and zero.tolist() == [0] * (2 * N)
    with pytest.raises(ValueError, match=r"differ in shape .*\[0, C, H, W\]"):
        stack_images(
            [torch.zeros(0, 3, 0, 0), _pixels(1, 2)], N
        )  # the data task's empty form, not the model's


def test_concat_joins_a_batch_without_images_to_one_with():
    text = pack([[1, 2]] * N, [[3]] * N, [[0.0]] * N, pad_id=0, group_size=N)
    text.pixel_values, text.image_count = stack_images([_pixels(0, 1)], N)
    image = pack([[1, 5, 6]] * N, [[3, 4]] * N, [[0.0, 0.0]] * N, pad_id=0, group_size=N)
    image.pixel_values, image.image_count = stack_images([_pixels(2, 2)], N)
    both = concat([text, image])
    assert both.pixel_values is not None and both.pixel_values.shape == (2 * N, 2, *SHAPE)
    assert both.image_count is not None and both.image_count.tolist() == [0, 0, 2, 2]
    assert (both.pixel_values[:N] == 0).all() and torch.equal(both.pixel_values[N], _pixels(2, 2))


# ---- two ranks over gloo: rank 1 holds no image -------------------------------------------------------------
IMAGES = {0: (1, 2, 0), 1: (0, 0)}  # rank -> images of each of its prompts (rank 1: none at all)
LONG = {0: 30, 1: 2}  # response length on each rank: rank 0 is heavy, so groups move to rank 1


def _rank_batch(rank: int):
    """Prompt k of rank r starts with token 100 + 10 r + k, its images `_pixels(count, 100 + 10 r + k)`."""
    counts = IMAGES[rank]
    prompts = [[100 + 10 * rank + k, 11, 12] for k in range(len(counts)) for _ in range(N)]
    responses = [[60 + j] + [20] * (LONG[rank] - 1) for _ in counts for j in range(N)]
    b = pack(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0, group_size=N)
    b.pixel_values, b.image_count = stack_images(
        [_pixels(c, 100 + 10 * rank + k) for k, c in enumerate(counts)], N
    )
    b.rewards = torch.arange(b.size, dtype=torch.float32) + 10 * rank
    return b


def _exchange_rank(rank, world_size):
    out, restore, stats = exchange(_rank_batch(rank), "tokens", None)
    first = out.attention_mask.float().argmax(1)
    return {
        "ids": [int(out.input_ids[i, first[i]]) for i in range(out.size)],
        "pixel_values": out.pixel_values,
        "image_count": out.image_count,
        "stats": stats,
        "rewards": restore.restore(out.rewards.clone()),
    }


def test_exchange_moves_rows_with_and_without_images():
    results = run_ranks(_exchange_rank, 2, timeout_s=120.0)
    assert results[0]["stats"]["balance/moved_groups"] >= 1
    counts = {100 + 10 * r + k: c for r, cs in IMAGES.items() for k, c in enumerate(cs)}
    seen = []
    for res in results:
        for i, gid in enumerate(res["ids"]):
            seen.append(gid)
            c = counts[gid]
            assert int(res["image_count"][i]) == c  # a row's images travel with it
            assert torch.equal(res["pixel_values"][i, :c], _pixels(c, gid))
            assert (res["pixel_values"][i, c:] == 0).all()
    assert sorted(set(seen)) == sorted(counts)  # every prompt somewhere
    assert any(counts[g] for g in results[1]["ids"])  # rank 1, with no image before, now holds one
    for rank, res in enumerate(results):
        assert torch.equal(res["rewards"], _rank_batch(rank).rewards)
