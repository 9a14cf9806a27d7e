"""An engine actor's request queue (`yatt_ray.rollout.pool.EngineActor`), without a cluster: the real actor
class in this process, its methods called from threads as Ray's threads call them, over a stand-in engine
that sleeps a fixed time per call (what is tested is the queue, not generation: the engines are tested in
test_engine_pool.py and test_rollout_*.py).

- time queued behind other requests never counts toward `rollout.weight_timeout_s`; only missing weights do,
  and a timeout leaves no request or held push behind;
- requests queued together run in one engine call (one batch), each answered with its own prompts;
- a request of a training attempt older than one seen since is dropped, not run.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import yatt_ray.rollout as rollout
from yatt_ray.rollout.base import Completion, GenerateRequest, SamplingSpec
from yatt_ray.rollout.pool import INITIAL, EngineActor, StaleAttempt, WeightsMissing, _joined

SPEC = SamplingSpec(n=2, max_new_tokens=4, seed=1)


class SleepyEngine:
    """Answers each prompt with n completions holding the prompt's last id, after `delay` seconds a call."""

    in_flight_updates = False

    def __init__(self, delay: float) -> None:
        self.delay, self.calls, self.loaded, self.last_aborted = delay, [], [], 0

    def generate(self, request: GenerateRequest) -> list[list[Completion]]:
        self.calls.append([p[-1] for p in request.prompts])
        time.sleep(self.delay)
        return [[Completion([p[-1]], [0.0]) for _ in range(request.spec.n)] for p in request.prompts]

    def load_weights(self, bucket) -> None:
        self.loaded.append(bucket)

    def finish_weight_sync(self) -> None:
        pass


@pytest.fixture
def make_actor(monkeypatch):
    def make(delay: float = 0.4, timeout_s: float = 0.3, ordered: bool = False) -> EngineActor:
        monkeypatch.setattr(rollout, "make_engine", lambda kind, path, **kw: SleepyEngine(delay))
        return EngineActor("hf", "unused", 0, {}, ordered=ordered, weight_timeout_s=timeout_s)

    return make


def _ask(actor: EngineActor, ids: list[int], version=INITIAL, attempt: int = 1, **kw):
    import os

    return actor.generate(GenerateRequest([[1, i] for i in ids], SPEC, **kw), version, os.getpid(), attempt)


def _when_running(actor: EngineActor) -> None:
    deadline = time.monotonic() + 5
    while not actor.running:
        assert time.monotonic() < deadline, "the first request never started"
        time.sleep(0.005)


def test_time_queued_behind_other_requests_is_not_a_weight_timeout(make_actor):
    """Requests for the version the engine holds queue behind a call that lasts longer than the timeout:
    none fails, and the queue wait they report is over the timeout (the old wait counted it and raised)."""
    actor = make_actor(delay=0.5, timeout_s=0.2)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(_ask, actor, [10])
        _when_running(actor)
        later = [pool.submit(_ask, actor, [20 + k], finish_after=1) for k in range(3)]  # run one by one
        outs = [first.result(), *[f.result() for f in later]]
    assert [o[0][0][0].token_ids for o in outs] == [[10], [20], [21], [22]]
    assert max(o[3] for o in outs) > 0.2 * 3  # the last one queued behind three calls
    assert actor.queue == [] and actor.asked == [] and not actor.running


def test_missing_weights_time_out_and_leave_nothing_behind(make_actor):
    """A request for a version no push brought fails after the timeout, naming the key; afterwards the engine
    holds no request, and a later push and request run normally."""
    actor = make_actor(delay=0.01, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(WeightsMissing, match="rollout.weight_timeout_s=0.2"):
        _ask(actor, [10], version=(1, 0))
    assert 0.2 <= time.monotonic() - start < 2
    assert actor.queue == [] and actor.asked == [] and not actor.running
    actor.apply((1, 0), [("w", None)])
    assert actor.version == (1, 0) and _ask(actor, [11], version=(1, 0))[2] == (1, 0)


def test_a_push_that_arrives_in_time_is_waited_for(make_actor):
    """Missing weights that come within the timeout: the request runs on them."""
    actor = make_actor(delay=0.01, timeout_s=2.0)
    threading.Timer(0.3, actor.apply, args=((1, 0), [("w", None)])).start()
    assert _ask(actor, [10], version=(1, 0))[2] == (1, 0)


def test_queued_requests_run_as_one_batch(make_actor):
    """While the engine runs a call, requests from several controllers queue; they then run in one engine
    call, and each gets exactly its own prompts' completions in order. A request with `finish_after` (its
    abort counts its own prompts) runs alone."""
    actor = make_actor(delay=0.4)
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(_ask, actor, [1, 2])
        _when_running(actor)
        joined = [pool.submit(_ask, actor, ids) for ids in ([3], [4, 5], [6])]
        alone = pool.submit(_ask, actor, [7, 8], finish_after=1)
        time.sleep(0.1)  # all queued before the first call ends
        outs = [f.result() for f in joined]
        alone.result()
        first.result()
    assert [[g[0].token_ids[0] for g in o[0]] for o in outs] == [[3], [4, 5], [6]]
    calls = actor.engine.calls
    assert calls[0] == [1, 2] and sorted(calls[1:], key=len) == [[7, 8], [3, 4, 5, 6]], calls
    assert actor.batches == 3 and actor.batched_requests == 5


def test_ordered_requests_run_alone_and_a_timeout_releases_a_held_push(make_actor):
    """rollout.ordered: queued requests run one call each; a request whose version never arrives times out
    and the newer push held back for it is applied."""
    actor = make_actor(delay=0.01, timeout_s=0.3, ordered=True)
    actor.apply((1, 0), [("w", None)])
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(_ask, actor, [10], version=(1, 1))  # push (1, 1) never comes
        time.sleep(0.05)
        actor.apply((1, 2), [("w", None)])  # held: a request asks for the older (1, 1)
        assert actor.version == (1, 0) and len(actor.pending) == 1
        with pytest.raises(WeightsMissing):
            waiting.result()
    assert actor.version == (1, 2) and actor.pending == [] and actor.asked == []


def test_a_request_of_an_earlier_attempt_is_dropped(make_actor):
    """A restarted training attempt's first push reaches the engine while the dead attempt's request still
    waits: the request is dropped (nobody reads it), not run once the push lands."""
    actor = make_actor(delay=0.01, timeout_s=30.0)
    actor.apply((1, 0), [("w", None)])
    with ThreadPoolExecutor(1) as pool:
        dead = pool.submit(_ask, actor, [10], version=(1, 3), attempt=1)
        time.sleep(0.05)
        start = time.monotonic()
        actor.apply((2, 0), [("w", None)])
        with pytest.raises(StaleAttempt, match="attempt 2"):
            dead.result()
    assert time.monotonic() - start < 2 and actor.engine.calls == []
    with pytest.raises(StaleAttempt):
        _ask(actor, [11], attempt=1)
    assert _ask(actor, [12], version=(2, 0), attempt=2)[2] == (2, 0)


def test_joined_requests_keep_their_prompts_images_and_a_mixed_seed():
    a = GenerateRequest([[1, 2]], SPEC)
    b = GenerateRequest([[1, 3], [1, 4]], SamplingSpec(n=2, max_new_tokens=4, seed=9), images=[None, None])
    joined = _joined([a, b])
    assert joined.prompts == [[1, 2], [1, 3], [1, 4]] and joined.images == [None, None, None]
    assert joined.spec.seed not in (None, 1, 9) and joined.spec.n == 2
    assert _joined([a, a]).spec.seed != _joined([a, b]).spec.seed
