"""Rollout engines as actors of their own (`yatt_ray.rollout.pool`): routing, weights from the trainer by the
object store and by a broadcast group, a killed engine replaced without losing prompts, long-tail abort over
several engines. Real engine actors (the HF engine) on the shared test cluster; this process plays a
controller."""

from __future__ import annotations

import itertools
import time

import pytest
import ray
import torch

from tests.rollout.conftest import PROMPTS, reference_greedy
from yatt_ray.errors import YattError
from yatt_ray.rollout.base import GenerateRequest, SamplingSpec, complete
from yatt_ray.rollout.pool import (
    EngineHandles,
    EnginePool,
    EngineRouter,
    group_backend,
    spread,
    start_engine_pool,
    stop_engine_pool,
)

GREEDY = SamplingSpec(n=1, max_new_tokens=6, temperature=0.0)


def _buckets(model, per_bucket: int = 5):
    """The model's weights in Hugging Face names, a few tensors a bucket (as the trainer's buckets come)."""
    items = list(model.state_dict().items())
    return [items[i : i + per_bucket] for i in range(0, len(items), per_bucket)]


def _push(pool: EnginePool, model) -> None:
    for bucket in _buckets(model):
        pool.load_weights(bucket)
    pool.finish_weight_sync()
    pool.wait_applied()  # the engines apply a push on their own time; the checks below read their versions


ATTEMPTS = itertools.count(1)


def _pool(handles, model, seed: int = 0, weights=None, attempt: int | None = None) -> EnginePool:
    """A controller's pool, synced once (with `model`'s weights) as a restarted controller syncs at start:
    each pool of these tests is a new attempt, whose weights win over every earlier push (and whose start
    drops the requests of earlier ones), unless given the `attempt` of pools used beside it."""
    attempt = next(ATTEMPTS) if attempt is None else attempt
    pool = EnginePool(handles, True, weights, seed=seed, attempt=attempt)
    _push(pool, model)
    return pool


@pytest.fixture(scope="module")
def engines(ray_cluster, model_dirs):
    handles = start_engine_pool("hf", str(model_dirs[0]), 2, {"CPU": 1}, {"seed": 0, "max_model_len": 128})
    yield handles
    stop_engine_pool(handles)


def test_router_assigns_least_loaded_and_releases():
    router = EngineRouter(3)
    assert router.assign([5, 5, 5], exclude=[]) == [0, 1, 2]
    assert router.assign([10, 1], exclude=[0]) == [1, 2]  # heaviest first, to the least-loaded usable engine
    router.release(1, 15)
    assert router.loads() == [5, 0, 6]


def test_the_broadcast_group_is_nccl_only_between_gpus():
    assert group_backend(True, [True, True]) == "nccl"  # trainer GPU -> engine GPUs: device to device
    assert group_backend(True, [True, False]) == "gloo"  # one CPU engine: the whole group over host copies
    assert group_backend(False, [True]) == "gloo" and group_backend(True, []) == "gloo"


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_weights_reach_every_engine_and_prompts_spread(engines, hf_models, transport):
    """After a push of the new weights every engine answers as the new model does, whichever took a prompt."""
    pool = _pool(EngineHandles(engines.engines, engines.router, transport), hf_models[1])
    prompts = PROMPTS * 2
    out = complete(pool.generate(GenerateRequest(prompts, GREEDY)))
    want = [reference_greedy(hf_models[1], p, GREEDY.max_new_tokens) for p in prompts]
    assert [o[0].token_ids for o in out] == want
    assert ray.get(engines.router.loads.remote()) == [0, 0]  # every sub-request released its load
    versions = ray.get([e.info.remote() for e in engines.engines])
    assert [v["version"] for v in versions] == [pool.tag, pool.tag]
    assert pool._backend == "gloo" and not any(v["cuda"] for v in versions)  # CPU engines: host copies
    _push(pool, hf_models[0])  # back to the old weights for the next test
    out = complete(pool.generate(GenerateRequest(PROMPTS, GREEDY)))
    assert [o[0].token_ids for o in out] == [reference_greedy(hf_models[0], p, 6) for p in PROMPTS]


def test_a_killed_engine_is_replaced_and_no_prompt_is_lost(engines, hf_models):
    """Kill an engine between pushes: it restarts with the model directory's weights (stale); the pool sends
    its prompts again after pushing it the current weights, and every prompt comes back exactly once."""
    weights = lambda: _buckets(hf_models[1])  # noqa: E731
    pool = _pool(engines, hf_models[1], weights=weights)
    ray.kill(engines.engines[0], no_restart=False)
    finished: list[int] = []
    prompts = PROMPTS * 3
    out = pool.generate(GenerateRequest(prompts, GREEDY), on_finished=lambda i, c: finished.append(i))
    assert sorted(finished) == list(range(len(prompts)))  # each prompt reported once
    want = [reference_greedy(hf_models[1], p, 6) for p in prompts]
    assert [o[0].token_ids for o in complete(out)] == want  # the restarted engine has the new weights too
    assert [i["version"] for i in ray.get([e.info.remote() for e in engines.engines])] == [pool.tag] * 2
    _push(pool, hf_models[0])


def test_without_weights_a_stale_engine_is_avoided(engines, hf_models):
    """A controller that cannot gather the weights alone (tp > 1) sends a stale engine's prompts elsewhere."""
    pool = _pool(engines, hf_models[1])
    ray.kill(engines.engines[1], no_restart=False)
    out = complete(pool.generate(GenerateRequest(PROMPTS * 2, GREEDY)))
    assert [o[0].token_ids for o in out] == [reference_greedy(hf_models[1], p, 6) for p in PROMPTS * 2]
    _push(pool, hf_models[0])  # the restarted engine is fresh again after the next push
    assert [i["version"] for i in ray.get([e.info.remote() for e in engines.engines])] == [pool.tag] * 2


def test_finish_after_over_several_engines(engines, hf_models):
    """Long-tail abort with the prompts split over engines: at least k prompts finish, every wait_for prompt
    finishes, and aborted prompts are None and counted."""
    spec = SamplingSpec(n=2, max_new_tokens=8, temperature=1.0)
    prompts = PROMPTS * 2
    pool = _pool(engines, hf_models[0], seed=3)
    out = pool.generate(GenerateRequest(prompts, spec, finish_after=3, wait_for=frozenset({7})))
    done = [i for i, o in enumerate(out) if o is not None]
    assert len(done) >= 3 and 7 in done
    assert pool.last_aborted == len(prompts) - len(done)
    assert all(len(o) == 2 for o in out if o is not None)


def test_sampling_follows_the_pools_saved_stream(engines, hf_models):
    """Two pools with one seed sample alike; a pool given another's saved state continues its stream; an
    in-process engine's state is refused with what to do."""
    spec = SamplingSpec(n=2, max_new_tokens=8, temperature=1.0)
    tokens = lambda out: [c.token_ids for group in complete(out) for c in group]  # noqa: E731
    attempt = next(ATTEMPTS)  # four controllers of one attempt
    a, b = (_pool(engines, hf_models[0], seed=3, attempt=attempt) for _ in range(2))
    assert tokens(a.generate(GenerateRequest(PROMPTS, spec))) == tokens(
        b.generate(GenerateRequest(PROMPTS, spec))
    )
    saved = a.rng_state()
    next_a = tokens(a.generate(GenerateRequest(PROMPTS, spec)))
    c = _pool(engines, hf_models[0], seed=3, attempt=attempt)
    c.set_rng_state(saved)
    assert tokens(c.generate(GenerateRequest(PROMPTS, spec))) == next_a
    fresh = _pool(engines, hf_models[0], seed=3, attempt=attempt)
    assert next_a != tokens(fresh.generate(GenerateRequest(PROMPTS, spec)))
    with pytest.raises(YattError, match="placement.rollout_engines"):
        c.set_rng_state({"cpu": torch.zeros(1, dtype=torch.uint8), "cuda": None})


def test_a_push_during_generation_continues_it_under_the_new_weights(engines, hf_models):
    """New weights pushed while the engines generate: each completion's first tokens are the old model's, the
    rest the new model's greedy continuation of prompt + those tokens, and every token says which weights
    sampled it (interrupted, continued with its prefix kept; the request reports the version it started on)."""
    old, new = hf_models
    pool = _pool(engines, old)
    start = pool.tag
    spec = SamplingSpec(n=1, max_new_tokens=60, temperature=0.0, ignore_eos=True)
    before = sum(i["in_flight_pushes"] for i in ray.get([e.info.remote() for e in engines.engines]))
    generation = pool.submit(GenerateRequest(PROMPTS, spec))
    deadline = time.monotonic() + 30
    while not all(i["running"] for i in ray.get([e.info.remote() for e in engines.engines])):
        assert time.monotonic() < deadline, "the engines never started the request"  # both hold a part
    _push(pool, new)
    out = complete(pool.wait(generation))
    after = sum(i["in_flight_pushes"] for i in ray.get([e.info.remote() for e in engines.engines]))
    assert after == before + 2 and generation.versions == [start] * len(PROMPTS)
    for prompt, (c,) in zip(PROMPTS, out):
        k = c.versions.index(pool.tag)  # the first token of the new weights
        assert 0 < k < 60 and c.versions == [start] * k + [pool.tag] * (60 - k)
        head = reference_greedy(old, prompt, k, stop_ids=())
        assert c.token_ids == head + reference_greedy(new, prompt + head, 60 - k, stop_ids=())
    _push(pool, old)


def test_spread_is_a_fixed_rule_balanced_by_cost():
    """`rollout.ordered` routing: heaviest first to the engine with the least of this request's work; ties by
    position from the controller's start; the router's loads play no part."""
    assert spread([5, 5, 5, 5], [0, 1], first=0) == [0, 1, 0, 1]
    assert spread([5, 5, 5, 5], [0, 1], first=1) == [1, 0, 1, 0]  # another controller starts elsewhere
    assert spread([1, 9, 4, 4], [0, 2], first=0) == [2, 0, 2, 2]  # 9 | 4 + 4 + 1, engine 1 avoided
    assert spread([3, 3], [0, 1, 2], first=2) == [2, 0]


@pytest.fixture(scope="module")
def ordered_engine(ray_cluster, model_dirs):
    handles = start_engine_pool(
        "hf", str(model_dirs[0]), 1, {"CPU": 1}, {"seed": 0, "max_model_len": 128}, ordered=True
    )
    yield handles
    stop_engine_pool(handles)


def test_ordered_requests_run_on_exactly_the_weights_they_ask_for(ordered_engine, hf_models):
    """rollout.ordered: requests sent before a push run on the old weights even when the push arrives while
    they run or wait (held, not taken in flight); a request sent after it runs on the new ones. (Without
    `ordered` the push reaches the running request in flight and the waiting one starts on it: see the test
    above.)"""
    old, new = hf_models
    pool = _pool(ordered_engine, old)
    start = pool.tag
    (actor,) = ordered_engine.engines
    spec = SamplingSpec(n=1, max_new_tokens=60, temperature=0.0, ignore_eos=True)
    first = pool.submit(GenerateRequest(PROMPTS, spec))
    deadline = time.monotonic() + 30
    while not ray.get(actor.info.remote())["running"]:
        assert time.monotonic() < deadline, "the engine never started the request"
    second = pool.submit(GenerateRequest(PROMPTS[:2], spec))  # waits behind the first, asking for `start`
    for bucket in _buckets(new):
        pool.load_weights(bucket)
    pool.finish_weight_sync()  # not waited for: the engine keeps it behind the two older requests
    pool.wait_applied()
    third = pool.submit(GenerateRequest(PROMPTS[:2], spec))  # asks for the new weights
    for generation, model in ((first, old), (second, old), (third, new)):
        out = complete(pool.wait(generation))
        want = start if model is old else pool.tag
        assert generation.versions == [want] * len(out)
        prompts = generation.request.prompts
        assert [o[0].token_ids for o in out] == [reference_greedy(model, p, 60, stop_ids=()) for p in prompts]
    info = ray.get(actor.info.remote())
    assert info["in_flight_pushes"] == 0 and info["kept_pushes"] == 0 and info["version"] == pool.tag, info


def test_a_controller_that_cannot_push_learns_a_restarted_engine_once_it_holds_the_weights(
    engines, hf_models
):
    """tp_size > 1: a non-pushing controller meets a restarted engine (stale) and sends its prompts to the other
    engine; once the pusher's next push reached it, the controller's next request that meets it learns its
    new process and later requests go to it without bouncing."""
    attempt = next(ATTEMPTS)
    pusher = _pool(engines, hf_models[1], attempt=attempt)
    other = EnginePool(engines, False, None, seed=1, attempt=attempt, rank=1)
    other.finish_weight_sync()  # this controller's version follows the pusher's
    ray.kill(engines.engines[1], no_restart=False)
    prompts = PROMPTS * 2
    want = [reference_greedy(hf_models[1], p, 6) for p in prompts]
    assert [o[0].token_ids for o in complete(other.generate(GenerateRequest(prompts, GREEDY)))] == want
    assert other.take_stats()["rollout/resent_prompts"] > 0  # bounced off the restarted engine
    _push(pusher, hf_models[1])  # the next push reaches the restarted engine
    other.finish_weight_sync()
    for resent in (None, 0.0):  # the first request that meets it learns its id; the next ones go straight
        assert [o[0].token_ids for o in complete(other.generate(GenerateRequest(prompts, GREEDY)))] == want
        stats = other.take_stats()
        assert resent is None or stats["rollout/resent_prompts"] == resent, stats
    _push(pusher, hf_models[0])
