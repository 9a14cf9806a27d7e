"""A tiny Qwen2.5-VL policy through `fit()` on verl's geometry3k layout, on the shared cluster.

The file holds what verl's geo3k parquet holds (a chat prompt with `<image>`, an `images` column of
{bytes, path} structs, `reward_model.ground_truth`, `extra_info.index`, data_source hiyouga/geometry3k) with
images of five sizes (one above data.max_pixels, resized down), rows without an image and a corrupt one, and
is read through examples/configs/grpo_qwen_vl_geo3k.yaml cut to CPU size, generating on vLLM with the
policy's image features (the reward is the response's length: the random tiny policy answers no problem, and
the export check needs weights that move). A training worker is killed after the first checkpoint and the
run restarts from it; the run is then resumed, and resumed again: every prompt is trained once per epoch
(none lost, none repeated), the curve has each step once, and the HF export loads in transformers with the
merger trained (`train_vision=projector`) and the vision blocks as they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.runs import run, train_steps
from yatt_ray.tasks import visual
from yatt_ray.testing.drills import committed_steps, kill_training_worker, prompt_audit, when

pytestmark = pytest.mark.cluster
PROMPTS = 4
SIZES = [(56, 56), (84, 56), (112, 84), (40, 40), (168, 112)]  # (w, h); 168 x 112 is over max_pixels = 112^2
TEXT_ROWS, BAD_ROW = {5, 14}, 9


@pytest.fixture(scope="module")
def geo3k(ray_cluster, tmp_path_factory):
    """(tiny Qwen2.5-VL dir, geo3k-layout parquet of 20 rows, tmp dir)."""
    from yatt_ray.models.tiny_qwen_vl import build_tiny_qwen_vl

    tmp = tmp_path_factory.mktemp("geo3k")
    model = build_tiny_qwen_vl(tmp / "qwen2_5_vl")
    rows = [
        r
        for k, size in enumerate(SIZES)
        for r in visual.make_problems(4, seed=k, image_size=size, id_offset=4 * k)
    ]
    for i in TEXT_ROWS:
        rows[i]["images"], rows[i]["prompt"] = [], "3+4 Sum:"
    rows[BAD_ROW]["images"] = [{"bytes": b"\x89PNG not really"}]
    data = visual.write_rows(visual.as_geo3k(rows), tmp / "train.parquet")
    return str(model), data, tmp


def geo3k_run(model: str, data: str, out: Path, steps: int):
    return run(
        "grpo_qwen_vl_geo3k", out, f"model.path={model}", f"data.train_files=[{data}]", "data.eval_files=[]",
        "data.max_prompt_tokens=64", "data.max_pixels=12544", "rollout.engine=vllm", "rollout.n=2",
        "rollout.max_new_tokens=4", f"train.steps={steps}", f"train.prompts_per_step={PROMPTS}", "train.dp_size=2",
        "train.dtype=fp32", "train.micro_batch_size=4", "train.max_tokens_per_micro_batch=null", "train.lr=1e-3",
        "model.train_vision=projector", "train.balance=tokens", f"checkpoint.dir={out / 'ckpt'}",
        "checkpoint.every_steps=2", "checkpoint.log_prompt_ids=true", "checkpoint.export_hf_every=null",
        "reward.function=tests.reward.rule_fns:response_length",
    )  # fmt: skip


@pytest.fixture(scope="module")
def killed_run(geo3k):
    """4 steps; a worker killed once the first checkpoint is committed (the run restarts from it)."""
    model, data, tmp = geo3k
    out, killed = tmp / "run", []
    when(lambda: bool(committed_steps(str(out / "ckpt"))), lambda: killed.append(kill_training_worker()))
    return geo3k_run(model, data, out, 4), killed


def test_a_killed_worker_restarts_the_run_and_each_prompt_trains_once(killed_run, geo3k):
    result, killed = killed_run
    assert killed and result.metric("checkpoint/resumed_from"), "the drill did not restart the run"
    assert train_steps(result) == [1, 2, 3, 4]
    assert all(r["samples"] == PROMPTS * 2 for r in result.history if "reward_mean" in r)
    audit = prompt_audit(str(geo3k[2] / "run" / "ckpt"))
    assert audit.steps == 4 and audit.prompts >= 4 * PROMPTS, audit
    assert audit.duplicated == 0 and audit.lost == 0 and audit.forgotten == 0, audit


def test_a_resumed_run_resumed_again_trains_each_prompt_once(killed_run, geo3k):
    model, data, tmp = geo3k
    out = tmp / "run"
    for steps in (5, 6):
        resumed = geo3k_run(model, data, out, steps)
        assert train_steps(resumed) == list(range(1, steps + 1)) and resumed.steps_redone == 0
    bad = sum(r.get("data/bad_images", 0.0) for r in resumed.history)
    assert bad >= 1  # the corrupt row: counted and skipped
    audit = prompt_audit(str(out / "ckpt"))
    assert audit.steps == 6 and audit.duplicated == 0 and audit.lost == 0 and audit.forgotten == 0, audit
    # the 19 good rows (20 less the corrupt one) are read in order: 24 prompts crossed into epoch 1
    assert audit.prompts >= 6 * PROMPTS, audit
    from transformers import Qwen2_5_VLForConditionalGeneration

    before = Qwen2_5_VLForConditionalGeneration.from_pretrained(model).state_dict()
    after = Qwen2_5_VLForConditionalGeneration.from_pretrained(resumed.checkpoint_path).state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(".merger." in k for k in changed) and any("language_model" in k for k in changed)
    assert not any(".blocks." in k or "patch_embed" in k for k in changed)  # the vision blocks stay frozen
