"""Disaggregated rollout engines end to end: engine actors on accelerators of their own (the shared cluster's
logical GPUs), reached by both controllers through the router, weights pushed every step. Asynchronous rollout
(rollout.max_staleness=2: the engines generate two steps ahead while the trainers train) with an engine actor
and a training worker killed in one run, then the run resumed, and resumed again in full placement: every
prompt trained once, none lost with the steps in flight at each stop. (The synchronous engine actor, its
weights every step and a killed worker: tests/integration/test_genrm_fit.py's disaggregated run.)"""

from __future__ import annotations

import pytest

from tests.integration.runs import ENGINES, PROMPTS, short_run, train_steps
from yatt_ray.testing.drills import (
    committed_steps,
    kill_engine_actor,
    kill_training_worker,
    prompt_audit,
    prompt_records,
    when,
)

pytestmark = pytest.mark.cluster


def pooled_run(ckpt_dir, out, steps: int, *overrides: str):
    return short_run(ckpt_dir, out, steps, *ENGINES, *overrides)


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
    # the samples' staleness histogram counts each step's samples once; a push applied while a request ran
    # makes its unfinished samples span two versions (counted; at least one version each)
    hist = [first.metric(f"async/staleness_hist_{s}") for s in range(3)]
    assert len({sum(step) for step in zip(*hist)}) == 1 and sum(hist[0]) + sum(hist[1]) + sum(hist[2]) > 0
    assert all(v >= 1 for v in first.metric("async/versions_per_sample_mean"))
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


# DAPO's filter and overlong shaping beside asynchronous rollout, every request on the version it asked for
# (weights through the broadcast group: the transport of engines on other nodes)
ORDERED = ("rollout.max_staleness=2", "rollout.ordered=true", "algo.dynamic_sampling=reward", "algo.max_draws=2",
           "algo.overlong_buffer=2", "rollout.weight_transport=broadcast")  # fmt: skip


def timed(key: str) -> bool:
    """What may differ between two runs of one seed: clocks, memory, and what is measured from them."""
    prefixes = ("time/", "memory/", "perf/", "idle/", "timeline/", "startup/", "checkpoint/")
    return key.startswith(prefixes) or key.endswith(("_s", "_s_max")) or "_per_s" in key


def test_ordered_asynchronous_runs_repeat_each_other(ray_cluster, demo_cache, tmp_path):
    """rollout.ordered, two steps ahead, with dynamic sampling and overlong shaping, balanced over two
    data-parallel ranks and two engine actors: two runs with one seed train the same prompts in the same
    order and report the same numbers, step by step."""
    runs = [pooled_run(str(tmp_path / f"ckpt{k}"), tmp_path / f"out{k}", 5, *ORDERED) for k in range(2)]
    first, second = runs
    assert train_steps(first) == train_steps(second) == list(range(1, 6))
    assert max(first.metric("async/staleness_max")) == 2  # generated two versions ahead ...
    assert all(v == 1.0 for v in first.metric("async/versions_per_sample_mean"))  # ... on one version each
    assert sum(first.metric("dynamic/dropped_groups")) > 0, "the filter never acted: the test shows nothing"
    prompts = [
        sorted((r["step"], r["dp_rank"], r["ids"]) for r in prompt_records(str(tmp_path / f"ckpt{k}")))
        for k in range(2)
    ]  # each controller's prompts of each step, in the order it read them
    assert prompts[0] == prompts[1] and len(prompts[0]) == 5 * 2
    rows = [[r for r in run.history if "reward_mean" in r] for run in runs]
    for a, b in zip(*rows):
        differ = {k: (a[k], b.get(k)) for k in a if not timed(k) and a[k] != b.get(k)}
        assert not differ, f"step {a['step']}: {differ}"
