"""Engine-actor drills (issue: trust at real lengths and through failures), each audited both ways with the
prompt log and with the number of training attempts: an engine's trouble must never cost a training attempt.

- Requests that queue on the engines longer than `rollout.weight_timeout_s` (fixed-length generations, two
  controllers, two steps ahead) while the weights go through the broadcast group; one engine actor killed by
  its process id between two pushes and another during a push. One attempt, every step, prompts sent again
  and counted, nothing lost, nothing repeated.
- The same at `rollout.ordered=true` (two runs of one seed without kills repeat each other:
  tests/integration/test_engine_pool_fit.py, on the broadcast transport).
"""

from __future__ import annotations

import pytest

from tests.integration.runs import ENGINES, assert_each_prompt_once, short_run, train_steps
from yatt_ray.testing.drills import (
    committed_steps,
    kill_engine_between_pushes,
    kill_engine_in_push,
    prompt_records,
    when,
)

pytestmark = pytest.mark.cluster
TIMEOUT_S = 0.5
# generations of 96 tokens each (no stop at EOS), 4 a prompt, two steps ahead, weights by broadcast a tensor
# a bucket (a push long enough to be caught in the middle)
DRILL = ("rollout.max_staleness=2", "rollout.weight_transport=broadcast", f"rollout.weight_timeout_s={TIMEOUT_S}",
         "rollout.ignore_eos=true", "rollout.max_new_tokens=96", "rollout.n=4", "rollout.weight_sync_bucket_mb=0.01")  # fmt: skip


def _drill(tmp_path, name: str, steps: int, *overrides: str):
    ckpt, killed = str(tmp_path / f"ckpt_{name}"), []
    between = lambda: killed.append(("between", kill_engine_between_pushes()))  # noqa: E731
    when(lambda: bool(committed_steps(ckpt)), between)  # after step 2
    when(lambda: len(killed) == 1, lambda: killed.append(("in_push", kill_engine_in_push())))  # the next push
    result = short_run(ckpt, tmp_path / name, steps, *ENGINES, *DRILL, *overrides)
    assert [k for k, _ in killed] == ["between", "in_push"], killed
    assert train_steps(result) == list(range(1, steps + 1))
    # one training attempt: no restart, no step redone, every prompt record of attempt 1
    assert not result.metric("checkpoint/resumed_from") and result.steps_redone == 0
    assert {r["attempt"] for r in prompt_records(ckpt)} == {1}
    assert_each_prompt_once(ckpt, steps)
    assert sum(result.metric("rollout/failed_broadcasts")) >= 1  # the kill landed in a push ...
    assert sum(result.metric("rollout/resent_prompts")) > 0  # ... and the killed engines' prompts went again
    return result


def test_engine_failures_and_long_queues_cost_no_training_attempt(ray_cluster, demo_cache, tmp_path):
    result = _drill(tmp_path, "loads", 6)
    queued = max(result.metric("rollout/engine_queue_s_max"))
    assert queued > TIMEOUT_S, (
        f"no request queued longer than the weight timeout ({queued:.2f} s): shows nothing"
    )
    assert sum(result.metric("rollout/weight_timeouts")) == 0  # queueing is not missing weights


def test_engine_failures_cost_no_training_attempt_in_ordered_runs(ray_cluster, demo_cache, tmp_path):
    _drill(tmp_path, "ordered", 6, "rollout.ordered=true")
