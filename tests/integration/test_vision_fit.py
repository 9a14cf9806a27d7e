"""A vision-language policy end to end on the shared cluster: images in verl's layout (parquet bytes, a jsonl of
paths), decoded in Ray Data tasks, the tiny LLaVA trained with its projector (`model.train_vision=projector`),
a corrupt image and a missing file skipped and counted, a checkpoint resumed with every prompt once per
epoch, the HF export, and the driver never receiving an image or a sample. Most rows have no image (a null or
empty cell, a prompt without `<image>`): they generate, train, balance (dp 2) and evaluate beside the image
rows, and some rank trains a whole batch without any image.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import yatt_ray
from tests.integration.runs import run
from yatt_ray.tasks import visual
from yatt_ray.testing.drills import prompt_audit

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PROMPTS, ROWS = 8, 20
BAD = {3: "corrupt", 11: "missing"}  # row id -> what is wrong with its image
# the good rows with an image; the other 15 have none. Steps 1-2 train 4 batches of 4 prompts (4 a rank) of
# epoch 0's 18 good rows, so at most 3 of them hold an image: some rank's whole batch has none
IMAGE_ROWS = {0, 7, 15}
# the resume's placement: an engine actor of its own (a logical GPU of the shared cluster), a step ahead
ENGINE_AHEAD = ("placement.mode=disaggregated", "placement.rollout_engines=1", "cluster.use_gpu=true",
                "cluster.cpus_per_worker=1", "rollout.max_staleness=1")  # fmt: skip


def without_images(rows: list[dict], keep: set) -> list[dict]:
    """`rows` with the images of every row not in `keep` taken away (a null cell or an empty list, in turn)
    and its prompt's `<image>` with them."""
    for k, r in enumerate(r for r in rows if r["id"] not in keep):
        r["images"], r["prompt"] = (None if k % 2 else []), r["prompt"].replace("<image>", "")
    return rows


@pytest.fixture(scope="module")
def vision_data(ray_cluster, demo_cache, tmp_path_factory):
    """The demo's tiny LLaVA (a short warm-up), a parquet file of ROWS visual problems (two bad, only
    IMAGE_ROWS with a good image) and an eval file of 4 (two without images)."""
    from yatt_ray.tasks.demo import prepare_demo

    tmp = tmp_path_factory.mktemp("vision")
    cfg = yatt_ray.load_config(REPO / "examples/configs/grpo_vision.yaml", ["demo.sft_steps=300"])
    model = prepare_demo(cfg).model.path
    rows = without_images(visual.make_problems(ROWS, seed=3), IMAGE_ROWS | set(BAD))
    rows[3]["images"] = [{"bytes": b"\x89PNG not really"}]
    rows[11]["images"] = [{"path": str(tmp / "no_such.png")}]
    data = visual.write_rows(rows, tmp / "train.parquet")
    evals = without_images(visual.make_problems(4, seed=4, id_offset=100), {100, 101})
    visual.write_rows(evals, tmp / "eval.parquet")
    return model, data, rows, tmp


def vision_run(model: str, data: str, out: Path, steps: int, *overrides: str):
    evals = Path(data).with_name("eval.parquet")  # vision_data's
    return run(
        "grpo_vision", out, f"model.path={model}", f"data.train_files=[{data}]", f"data.eval_files=[{evals}]",
        f"train.steps={steps}", f"train.prompts_per_step={PROMPTS}", "rollout.n=4", "train.dp_size=2",
        "train.balance=tokens", "model.train_vision=projector", f"checkpoint.dir={out / 'ckpt'}",
        "checkpoint.every_steps=2", "checkpoint.log_prompt_ids=true", *overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def first_run(vision_data):
    """3 steps (24 prompts: past the 18 good rows of epoch 0), every object the driver fetched recorded."""
    import ray

    model, data, _, tmp = vision_data
    received = []
    real_get = ray.get

    def recording_get(refs, *args, **kwargs):
        value = real_get(refs, *args, **kwargs)
        received.append(value)
        return value

    mp = pytest.MonkeyPatch()
    mp.setattr(ray, "get", recording_get)
    try:
        result = vision_run(model, data, tmp / "run", 3)
    finally:
        mp.undo()
    return result, received


def test_bad_images_are_counted_and_skipped(first_run):
    result, _ = first_run
    bad = sum(r.get("data/bad_images", 0.0) for r in result.history)
    # 24 prompts trained: epoch 0 (18 good rows) is read whole, epoch 1 may be read into
    assert len(BAD) <= bad <= 2 * len(BAD)
    assert all(r["samples"] == PROMPTS * 4 for r in result.history if "reward_mean" in r)


def test_driver_never_receives_images_or_samples(first_run, vision_data):
    result, received = first_run
    _, _, rows, _ = vision_data
    blob = pickle.dumps(received)
    assert len(blob) < 200_000, f"the driver fetched {len(blob)} bytes"
    middle = {r["id"]: r["images"][0]["bytes"] for r in rows if r["id"] in IMAGE_ROWS}
    middle = {i: b[len(b) // 2 : len(b) // 2 + 32] for i, b in middle.items()}  # inside the compressed pixels
    leaked = [i for i, piece in middle.items() if piece in blob]
    assert not leaked, f"image bytes of rows {leaked} reached the driver"
    assert not any(isinstance(v, torch.Tensor) for v in received)


def test_rows_without_images_generate_train_balance_and_evaluate(first_run, vision_data):
    from yatt_ray.testing.drills import prompt_records

    result, _ = first_run
    out = vision_data[3] / "run"
    records = [r for r in prompt_records(str(out / "ckpt")) if r["step"] <= 2]  # one a rank and step
    batches = [set(r["ids"]) - set(BAD) for r in records]  # the bad rows a step read are logged with it
    assert len(batches) == 4 and all(len(ids) == PROMPTS // 2 for ids in batches)
    assert any(not IMAGE_ROWS & ids for ids in batches)  # a rank's whole batch without an image
    assert any(IMAGE_ROWS & ids for ids in batches)  # and a mixed one (at most 3 image rows in 4 prompts)
    steps = [r for r in result.history if "reward_mean" in r]
    assert len(steps) == 3 and all(r["samples"] == PROMPTS * 4 for r in steps)  # generated and trained
    assert all("balance/imbalance_after" in r for r in steps)  # the exchange ran every step
    assert len(result.metric("eval/accuracy")) == 2  # before and after, on 2 rows with images and 2 without


def test_export_is_a_llava_directory_with_a_trained_projector(first_run, vision_data):
    from transformers import LlavaForConditionalGeneration

    result, _ = first_run
    model_dir = vision_data[0]
    before = LlavaForConditionalGeneration.from_pretrained(model_dir).state_dict()
    after = LlavaForConditionalGeneration.from_pretrained(result.checkpoint_path).state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("multi_modal_projector" in k for k in changed)  # train_vision=projector
    assert any("language_model" in k for k in changed)
    assert not any("vision_tower" in k for k in changed)  # the tower stays frozen


def test_resume_with_images_consumes_each_prompt_once_per_epoch(first_run, vision_data):
    """Resumed on another placement: one engine actor on an accelerator of its own generating a step ahead
    (asynchronous rollout), so each image prompt travels to it beside the trainers' copy."""
    model, data, _, tmp = vision_data
    out = tmp / "run"
    # resumes from the first run's last checkpoint (step 3)
    resumed = vision_run(model, data, out, 5, *ENGINE_AHEAD)
    steps = [int(r["step"]) for r in resumed.history if "reward_mean" in r]
    assert steps == [1, 2, 3, 4, 5] and resumed.steps_redone == 0  # one curve, nothing trained twice
    assert resumed.metric("async/staleness_max")[-1] == 1  # step 5 was generated during step 4
    assert [r["samples"] for r in resumed.history if "reward_mean" in r][3:] == [PROMPTS * 4] * 2
    audit = prompt_audit(str(out / "ckpt"))
    assert audit.steps == 5 and audit.prompts >= 5 * PROMPTS, audit
    assert audit.duplicated == 0 and audit.lost == 0 and audit.forgotten == 0, audit
