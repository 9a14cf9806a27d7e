"""Images held once per prompt (`batch.PromptImages`): rows without images beside rows with them, row
selection and `concat` renumbering `image_prompt`, and a 2-rank gloo balance exchange where one rank's whole
batch has no image. A prompt without images has pixels [0, C, H, W] (`PromptEncoder`)."""

import sys
from pathlib import Path

import pytest
import torch

from yatt_ray.batch import Pixels, PromptImages, concat, pack, prompt_images
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


def _images(batch, row: int) -> torch.Tensor:
    """Row `row`'s images, from its prompt's entry in the batch's PromptImages."""
    return batch.images.prompt(int(batch.image_prompt[row])).values


def test_prompt_images_hold_each_prompt_once():
    images, index = prompt_images([Pixels(_pixels(0, 1)), Pixels(_pixels(2, 2)), Pixels(_pixels(1, 3))], N)
    assert index.tolist() == [0, 0, 1, 1, 2, 2]
    assert images.values.shape == (3, *SHAPE)  # 3 images once, not N times
    assert images.rows.tolist() == [0, 2, 1] and images.counts.tolist() == [0, 2, 1]
    assert torch.equal(images.prompt(1).values, _pixels(2, 2)) and images.prompt(0).count == 0
    picked = images.select([2, 1])
    assert torch.equal(picked.prompt(0).values, _pixels(1, 3)) and torch.equal(
        picked.prompt(1).values, _pixels(2, 2)
    )
    with pytest.raises(ValueError, match=r"differ in shape .*\[0, \*S\]"):
        PromptImages.of(
            [Pixels(torch.zeros(0, 3, 0, 0)), Pixels(_pixels(1, 2))]
        )  # the data task's empty form


def test_qwen_style_images_keep_their_grids():
    """Patch rows with grids: selecting prompts keeps each prompt's rows and grid rows together."""
    a = Pixels(torch.arange(8.0).reshape(4, 2), torch.tensor([[1, 2, 2]]))
    b = Pixels(torch.arange(24.0).reshape(12, 2) + 100, torch.tensor([[1, 2, 4], [1, 2, 2]]))
    images = PromptImages.of([a, b, Pixels(torch.zeros(0, 2), torch.zeros(0, 3, dtype=torch.long))])
    assert images.grid is not None and images.grid.shape == (3, 3)
    back = images.select([1, 0]).prompt(0)
    assert torch.equal(back.values, b.values) and torch.equal(back.grid, b.grid)
    assert images.prompt(2).count == 0 and len(images.prompt(2).values) == 0


def test_rows_and_concat_renumber_prompts():
    text = pack([[1, 2]] * N, [[3]] * N, [[0.0]] * N, pad_id=0, group_size=N)
    text.images, text.image_prompt = prompt_images([Pixels(_pixels(0, 1))], N)
    image = pack([[1, 5, 6]] * 2 * N, [[3, 4]] * 2 * N, [[0.0, 0.0]] * 2 * N, pad_id=0, group_size=N)
    image.images, image.image_prompt = prompt_images([Pixels(_pixels(2, 2)), Pixels(_pixels(1, 3))], N)
    both = concat([text, image])
    assert both.image_prompt.tolist() == [0, 0, 1, 1, 2, 2] and len(both.images) == 3
    assert both.images.values.shape == (3, *SHAPE)
    assert torch.equal(_images(both, 2), _pixels(2, 2)) and torch.equal(_images(both, 5), _pixels(1, 3))
    some = both.rows(torch.tensor([4, 5, 0]))  # prompt 2's rows and one of prompt 0's
    assert len(some.images) == 2 and some.image_prompt.tolist() == [1, 1, 0]
    assert torch.equal(_images(some, 0), _pixels(1, 3)) and _images(some, 2).shape == (0, *SHAPE)
    with pytest.raises(ValueError, match="different row fields"):
        concat([pack([[1]] * N, [[3]] * N, [[0.0]] * N, pad_id=0, group_size=N), image])


# ---- two ranks over gloo: rank 1 holds no image -------------------------------------------------------------
IMAGES = {0: (1, 2, 0), 1: (0, 0)}  # rank -> images of each of its prompts (rank 1: none at all)
LONG = {0: 30, 1: 2}  # response length on each rank: rank 0 is heavy, so groups move to rank 1


def _rank_batch(rank: int):
    """Prompt k of rank r starts with token 100 + 10 r + k, its images `_pixels(count, 100 + 10 r + k)`."""
    counts = IMAGES[rank]
    prompts = [[100 + 10 * rank + k, 11, 12] for k in range(len(counts)) for _ in range(N)]
    responses = [[60 + j] + [20] * (LONG[rank] - 1) for _ in counts for j in range(N)]
    b = pack(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0, group_size=N)
    b.images, b.image_prompt = prompt_images(
        [Pixels(_pixels(c, 100 + 10 * rank + k)) for k, c in enumerate(counts)], N
    )
    b.rewards = torch.arange(b.size, dtype=torch.float32) + 10 * rank
    return b


def _exchange_rank(rank, world_size):
    out, restore, stats = exchange(_rank_batch(rank), "tokens", None)
    first = out.attention_mask.float().argmax(1)
    return {
        "ids": [int(out.input_ids[i, first[i]]) for i in range(out.size)],
        "images": [_images(out, i) for i in range(out.size)],
        "prompts": len(out.images),
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
            assert torch.equal(res["images"][i], _pixels(c, gid))  # a row's images travel with it
    assert sorted(set(seen)) == sorted(counts)  # every prompt somewhere
    assert all(res["prompts"] == len(set(res["ids"])) for res in results)  # each prompt's images once
    assert any(counts[g] for g in results[1]["ids"])  # rank 1, with no image before, now holds one
    for rank, res in enumerate(results):
        assert torch.equal(res["rewards"], _rank_batch(rank).rewards)
