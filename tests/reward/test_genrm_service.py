"""The GenRM Serve deployment on the shared cluster: verdicts, batching, a replica killed mid-flight, HTTP.

The judge is the demo's tiny model (taught to answer Y when the response equals the reference). Two CPU
replicas serve it through a handle, as the controllers reach it during training.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request

import pytest

import yatt_ray
from yatt_ray.reward.client import GenRMClient, GenRMError
from yatt_ray.reward.genrm import APP_NAME, JudgeRequest

pytestmark = pytest.mark.cluster


def judge_config(*extra: str):
    from yatt_ray.tasks.demo import demo_cache_dir, prepare_demo_judge

    # one CPU per replica, as `fit()` resolves it on this 2-core machine; a plan made outside fit() would
    # share the test cluster's 8 logical CPUs (2 each), and 2 x 2 judge threads on 2 cores starve Serve's probes
    config = yatt_ray.load_config(
        None,
        ["reward.mode=genrm", "placement.mode=partial", "cluster.use_gpu=false", "cluster.cpus_per_worker=1",
         *extra],
    )  # fmt: skip
    prepare_demo_judge(config, demo_cache_dir(config.demo) / "judge")
    return config


def deploy(config):
    import ray

    from yatt_ray.placement import plan_placement
    from yatt_ray.reward.service import deploy_genrm

    deploy_genrm(config, plan_placement(config, ray.cluster_resources()), hub=None)


@pytest.fixture(scope="module")
def two_replicas(ray_cluster, demo_cache):
    from yatt_ray.reward.service import shutdown_genrm

    deploy(
        judge_config(
            "reward.genrm.replicas=2", "reward.genrm.batch_size=32", "reward.genrm.batch_wait_s=0.05"
        )
    )
    yield
    shutdown_genrm()


def requests(count: int, seed: int, prefix: str) -> list[JudgeRequest]:
    """Half right answers, half off by one; the key says which."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        right = i % 2 == 0
        response = str(a + b if right else a + b + 1)
        out.append(JudgeRequest(f"{prefix}{i}:{int(right)}", f"{a}+{b}=", response, str(a + b)))
    return out


def test_verdicts_follow_the_reference(two_replicas):
    client = GenRMClient(timeout_s=60, max_retries=2, connect_timeout_s=60)
    batch = requests(200, seed=0, prefix="v")
    client.submit(batch)
    verdicts = client.collect()
    assert set(verdicts) == {r.key for r in batch}
    agree = sum(v.score == float(k.endswith(":1")) for k, v in verdicts.items())
    assert agree >= 180, f"the judge agreed with the reference on {agree} of 200"


def test_requests_are_batched_on_the_replicas(two_replicas):
    """Each replica runs several requests per engine call (Serve's router may favour one replica on a busy
    machine, so the count is over the replicas that answer)."""
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)

    def stats() -> dict[str, dict]:
        return {s["worker"]: s for s in (handle.stats.remote().result() for _ in range(30))}

    before = stats()
    client = GenRMClient(timeout_s=60, max_retries=0, connect_timeout_s=60)
    client.submit(requests(256, seed=1, prefix="b"))
    assert len(client.collect()) == 256
    after = stats()
    seen = before.keys() & after.keys()
    judged = sum(after[w]["requests"] - before[w]["requests"] for w in seen)
    batches = sum(after[w]["batches"] - before[w]["batches"] for w in seen)
    assert 0 < judged <= 256 and batches <= judged / 4, f"{judged} requests in {batches} batches"
    if len(seen) == 2:
        assert judged == 256


def replica_names() -> set[str]:
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if a["name"].startswith("SERVE_REPLICA::yatt-genrm#")}


def test_a_replica_killed_mid_flight_costs_no_sample_and_scores_none_twice(two_replicas):
    """Requests on the dead replica are answered elsewhere (Serve reroutes them, the client retries what
    still fails); each sample gets exactly one verdict, and Serve replaces the replica."""
    import ray

    # per attempt: 3000 requests land on the one surviving replica while Serve replaces the other (2 cores)
    client = GenRMClient(timeout_s=90, max_retries=4, connect_timeout_s=60)
    batch = requests(3000, seed=2, prefix="k")
    before = replica_names()
    assert len(before) == 2
    victim = ray.get_actor(sorted(before)[0], namespace="serve")
    client.submit(batch)
    killed_at: list[float] = []
    killer = threading.Timer(1.0, lambda: (ray.kill(victim), killed_at.append(time.time())))
    killer.start()
    verdicts = client.collect()
    done_at = time.time()
    killer.join()
    assert killed_at and killed_at[0] < done_at, "the replica died while the batch was being judged"
    assert sorted(verdicts) == sorted(r.key for r in batch), "every sample scored exactly once"
    assert all(v.key == k for k, v in verdicts.items())
    agree = sum(v.score == float(k.endswith(":1")) for k, v in verdicts.items())
    assert agree >= 0.9 * len(batch)
    deadline = time.time() + 120
    while len(replica_names() - before) < 1 and time.time() < deadline:
        time.sleep(1)
    assert len(replica_names() - before) == 1, "Serve started a replacement replica"


def test_requests_that_keep_timing_out_fail_loudly(two_replicas):
    client = GenRMClient(timeout_s=0.001, max_retries=2, connect_timeout_s=60)
    client.submit(requests(8, seed=3, prefix="t"))
    with pytest.raises(GenRMError, match=r"GenRM failed for sample 't0:1' after 3 attempts .* 8 sample\(s\)"):
        client.collect()
    assert client.retries == 2 and not client.pending


def test_no_http_unless_asked_then_only_on_loopback(two_replicas):
    from ray import serve

    assert not serve.status().proxies, "no HTTP proxy when reward.genrm.http_port is unset"
    serve.shutdown()
    port = 18000 + random.randint(0, 999)
    deploy(judge_config(f"reward.genrm.http_port={port}"))
    try:
        body = json.dumps({"prompt": "2+3=", "response": "5", "ground_truth": "5"}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/judge", data=body, method="POST")
        deadline = time.time() + 30
        while True:
            try:
                answer = json.loads(urllib.request.urlopen(req, timeout=10).read())
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        assert answer["score"] == 1.0 and answer["text"].strip() == "Y"
        assert serve.status().proxies, "the proxy runs when asked"
        import ray

        outside = ray.util.get_node_ip_address()
        if outside != "127.0.0.1":  # the node's own address is not served
            with pytest.raises(OSError):
                urllib.request.urlopen(f"http://{outside}:{port}/judge", data=body, timeout=5)
    finally:
        serve.shutdown()
