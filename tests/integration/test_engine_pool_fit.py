"""Disaggregated rollout engines end to end: engine actors on accelerators of their own (the shared cluster's
logical GPUs), reached by both controllers through the router, weights pushed every step. Asynchronous rollout
(rollout.max_staleness=2: the engines generate two steps ahead while the trainers train) with an engine actor
and a training worker killed in one run, then the run resumed, and resumed again in full placement: every
prompt trained once, none lost with the steps in flight at each stop. (The synchronous engine actor, its weights every step and a killed worker:
tests/integration/test_genrm_fit.py's disaggregated run.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import yatt_ray
from yatt_ray.config import Config
from yatt_ray.testing.drills import (
    committed_steps,
    kill_engine_actor,
    kill_training_worker,
    prompt_audit,
    when,
)

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PROMPTS = 8


def pooled_run(ckpt_dir, out, steps: int, *overrides: str) -> yatt_ray.Result:
    from yatt_ray.tasks.demo import prepare_demo

    demo = prepare_demo(Config())
    config = yatt_ray.load_config(
        REPO / "examples/configs/grpo.yaml",
        [f"model.path={demo.model.path}", f"data.train_files=[{demo.data.train_files[0]}]", "data.eval_files=[]",
         f"output.dir={out}", "output.progress=false", "output.tensorboard=false", "output.plot=false",
         f"train.steps={steps}", f"train.prompts_per_step={PROMPTS}", "rollout.n=2", "train.dp_size=2",
         "rollout.engine=hf", "placement.mode=disaggregated", "placement.rollout_engines=2",
         "cluster.use_gpu=true", "cluster.cpus_per_worker=1",
         f"checkpoint.dir={ckpt_dir}", "checkpoint.every_steps=2", "checkpoint.log_prompt_ids=true", *overrides],
    )  # fmt: skip
    return yatt_ray.fit(config)


def train_steps(result) -> list[int]:
    return [int(r["step"]) for r in result.history if "reward_mean" in r]


def test_engine_actors_survive_kills_and_resumes_with_each_prompt_once(ray_cluster, demo_cache, tmp_path):
    ckpt, killed = str(tmp_path / "ckpt"), []
    when(lambda: bool(committed_steps(ckpt)), lambda: killed.append(("engine", kill_engine_actor())))
    when(
        lambda: any(s >= 4 for s in committed_steps(ckpt)),
        lambda: killed.append(("worker", kill_training_worker())),
    )
    first = pooled_run(ckpt, tmp_path / "a", 6, "rollout.max_staleness=2")
    assert [k for k, _ in killed] == ["engine", "worker"], killed
    assert first.metric("checkpoint/resumed_from"), "the killed worker did not restart the run"
    assert train_steps(first) == list(range(1, 7))
    # samples come from weights at most 2 versions older than the trainer's, and some were generated ahead
    staleness = first.metric("async/staleness_max")
    assert max(staleness) <= 2 and max(staleness) >= 1, staleness
    assert sum(first.metric("async/aged_out")) == 0
    assert all(t > 0 for t in first.metric("time/weight_sync"))
    # every step's prompts went out once, each controller's 4 over both engines (sent ahead, in earlier steps)
    assert sum(first.metric("rollout/engine_requests")) >= 4 * 6

    again = pooled_run(ckpt, tmp_path / "b", 8, "rollout.max_staleness=2")  # resumed (asynchronous)
    assert train_steps(again) == list(range(1, 9))
    # ... and resumed again with the engines back inside the trainers (full placement): a change of placement
    # between runs starts a fresh sampling stream (the saved one is the engine actors')
    last = pooled_run(ckpt, tmp_path / "c", 9, "placement.mode=full", "placement.rollout_engines=0")
    assert train_steps(last) == list(range(1, 10))
    audit = prompt_audit(ckpt)
    assert audit.steps == 9 and audit.prompts == 9 * PROMPTS, audit
    assert audit.duplicated == 0 and audit.lost == 0 and audit.forgotten == 0, audit
