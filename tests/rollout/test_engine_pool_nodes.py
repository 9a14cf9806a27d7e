"""Engine actors on two Ray nodes (a second raylet on this machine joins the shared cluster for this module):
the engine on the other node gets its weights through the broadcast group (`rollout.weight_transport=auto`),
the one on this node through the object store, as on a real cluster. An engine killed between two pushes
rejoins the group whoever met it first; an engine killed in the middle of a push is replaced and the push
completes; no prompt is lost or answered twice, and every answer is the pushed model's."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import ray

from tests.conftest import BIN, _free_port
from tests.rollout.conftest import PROMPTS, reference_greedy
from tests.rollout.test_engine_pool import GREEDY, _buckets, _pool
from yatt_ray.rollout.base import GenerateRequest, complete
from yatt_ray.rollout.pool import EngineHandles, start_engine_pool, stop_engine_pool

NODE = "yatt_second_node"  # the second raylet's custom resource: engine 1 runs there


@pytest.fixture(scope="module")
def second_node(ray_cluster):
    """A second raylet (its own node id, object store and processes) joined to the shared cluster; stopped,
    with everything it ran, when the module ends."""
    ports = [
        f"--{name}={_free_port()}"
        for name in (
            "node-manager-port",
            "object-manager-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
        )
    ]  # the head's defaults are taken on this machine
    node = subprocess.Popen(
        [str(BIN / "ray"), "start", f"--address={ray_cluster['address']}", "--num-cpus=1", "--num-gpus=0",
         f"--resources={{\"{NODE}\": 2}}", *ports, "--block", "--disable-usage-stats"],
        env=ray_cluster["env"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(n["Alive"] and NODE in n["Resources"] for n in ray.nodes()):
        assert node.poll() is None and time.monotonic() < deadline, "the second raylet did not join"
        time.sleep(0.5)
    yield
    os.killpg(node.pid, signal.SIGTERM)
    node.wait(timeout=60)


@pytest.fixture(scope="module")
def two_node_engines(second_node, model_dirs):
    """Engine 0 on this node, engine 1 on the second one."""
    kwargs = {"seed": 0, "max_model_len": 128}
    # the second node's one CPU first, so the other engine can only go to this node
    there = start_engine_pool("hf", str(model_dirs[0]), 1, {"CPU": 1, NODE: 1}, kwargs)
    here = start_engine_pool("hf", str(model_dirs[0]), 1, {"CPU": 1}, kwargs)
    yield EngineHandles([*here.engines, *there.engines], _router(2), "auto")
    stop_engine_pool(here)
    stop_engine_pool(there)


def _router(engines: int):
    from yatt_ray.rollout.pool import EngineRouter

    return ray.remote(EngineRouter).options(num_cpus=0).remote(engines)


def _infos(handles) -> list[dict]:
    return ray.get([e.info.remote() for e in handles.engines])


def _kill(handles, engine: int) -> int:
    pid = _infos(handles)[engine]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def _answers_are(pool, model) -> None:
    """Every prompt (each engine takes some) answered once, by `model`'s weights."""
    prompts = PROMPTS * 3
    finished: list[int] = []
    out = complete(pool.generate(GenerateRequest(prompts, GREEDY), lambda i, c: finished.append(i)))
    assert sorted(finished) == list(range(len(prompts)))
    assert [o[0].token_ids for o in out] == [
        reference_greedy(model, p, GREEDY.max_new_tokens) for p in prompts
    ]


def test_a_restarted_engine_rejoins_the_broadcast_group(two_node_engines, hf_models):
    """The pusher's own request meets the restarted engine first (it pushes it the weights through the object
    store and learns its new process id); the next push still forms the group again with it."""
    old, new = hf_models
    handles = two_node_engines
    pool = _pool(handles, old, weights=lambda: _buckets(old))
    assert pool._group_members == [1], "engine 1 is on the other node: it takes the broadcast"
    _kill(handles, 1)
    _answers_are(pool, old)  # engine 1's prompts bounced, it was given the weights, they were sent again
    assert pool.take_stats()["rollout/resent_prompts"] > 0
    pool.weights = lambda: _buckets(new)
    for bucket in _buckets(new):
        pool.load_weights(bucket)
    pool.finish_weight_sync()
    pool.wait_applied()
    assert [i["version"] for i in _infos(handles)] == [pool.tag] * 2
    _answers_are(pool, new)
    stats = pool.take_stats()
    assert stats["rollout/resent_prompts"] == 0 and stats["rollout/failed_broadcasts"] == 0, stats


@pytest.mark.parametrize("gather", [True, False], ids=["tp1", "tp2"])
def test_an_engine_killed_during_a_push_is_replaced_and_the_push_completes(
    two_node_engines, hf_models, gather
):
    """Engine 1 dies after the push's first bucket reached it: the push still completes (the other engine
    has the new weights at once), the restarted engine gets them from the controller that meets it (tp1: it
    gathers the weights itself) or from the next push (tp2: its prompts go to engine 0 meanwhile), and the
    next push forms the group again with it."""
    old, new = hf_models
    handles = two_node_engines
    pool = _pool(handles, old, weights=(lambda: _buckets(new)) if gather else None)
    buckets = _buckets(new)
    pool.load_weights(buckets[0])
    killed = _kill(handles, 1)
    start = time.monotonic()
    for bucket in buckets[1:]:
        pool.load_weights(bucket)
    pool.finish_weight_sync()
    pool.wait_applied()
    assert time.monotonic() - start < 60, "the push waited on the dead engine"
    assert pool.take_stats()["rollout/failed_broadcasts"] == 1
    assert ray.get(handles.engines[0].info.remote())["version"] == pool.tag  # engine 1 may still restart
    _answers_are(pool, new)
    for bucket in _buckets(new):  # the next push: a new group, with the restarted engine in it
        pool.load_weights(bucket)
    pool.finish_weight_sync()
    pool.wait_applied()
    infos = _infos(handles)
    assert infos[1]["pid"] != killed and [i["version"] for i in infos] == [pool.tag] * 2
    _answers_are(pool, new)
