"""The GenRM Serve deployment on the shared cluster: verdicts, batching, a replica killed mid-flight, HTTP,
and samples streamed but not needed: discarded, so the scorer holds nothing past its step.

The judge is the demo's tiny model (taught to answer Y when the response equals the reference). Two CPU
replicas serve it through a handle, as the controllers reach it during training.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
import urllib.request

import pytest

import yatt_ray
from yatt_ray.errors import RewardError
from yatt_ray.reward.client import GenRMClient, GenRMError
from yatt_ray.reward.genrm import APP_NAME, JudgeRequest
from yatt_ray.reward.scorer import RewardScorer, Sample

pytestmark = pytest.mark.cluster


def judge_config(*extra: str):
    from yatt_ray.tasks.demo import demo_cache_dir, prepare_demo_judge

    # one CPU per replica, as `fit()` resolves it on this 2-core machine; a plan made outside fit() would
    # share the test cluster's 8 logical CPUs (2 each), and 2 x 2 judge threads on 2 cores starve Serve's probes
    config = yatt_ray.load_config(
        None,
        ["reward.mode=genrm", "placement.mode=disaggregated", "cluster.use_gpu=false", "cluster.cpus_per_worker=1",
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


def replica_stats() -> dict[str, dict]:
    """worker -> its counters, from the replicas Serve routes 30 calls to (usually both)."""
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)
    return {s["worker"]: s for s in (handle.stats.remote().result() for _ in range(30))}


def both_replicas(timeout_s: float = 180.0) -> dict[str, dict]:
    """The counters of both replicas (stats calls until Serve has routed one to each; a replica that an
    earlier test killed may still be restarting, hence the wait)."""
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)
    seen: dict[str, dict] = {}
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        stats = handle.stats.remote().result()
        seen[stats["worker"]] = stats
        if len(seen) == 2:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"stats calls for {timeout_s:.0f} s reached only {sorted(seen)}")


def test_verdicts_follow_the_reference(two_replicas):
    client = GenRMClient(timeout_s=60, max_retries=2, connect_timeout_s=60)
    batch = requests(200, seed=0, prefix="v")
    client.submit(batch)
    verdicts = client.collect()
    assert set(verdicts) == {r.key for r in batch}
    agree = sum(v.score == float(k.endswith(":1")) for k, v in verdicts.items())
    assert agree >= 180, f"the judge agreed with the reference on {agree} of 200"


def test_the_demo_judge_rejects_near_misses(two_replicas):
    """The policy's usual mistakes are answers off by 1-3: a judge that says yes to many of them pays for near
    misses and the GenRM learning run stalls (the 400-step judge said yes to 3-8% of them; the 800-step one to
    0-1% on Intel and AVX2 EPYC machines, 4.7% on an AVX-512 EPYC, whose float rounding trains a slightly
    different judge from the same seed; the learning run passes with it). At most 6%."""
    rng = random.Random(5)
    batch = []
    for i in range(400):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        off = 0 if i < 100 else rng.choice([-3, -2, -1, 1, 2, 3])
        if a + b + off < 0:
            off = -off
        batch.append(JudgeRequest(f"near{i}:{off}", f"{a}+{b}=", str(a + b + off), str(a + b)))
    client = GenRMClient(timeout_s=60, max_retries=2, connect_timeout_s=60)
    client.submit(batch)
    verdicts = client.collect()
    yes_right = sum(v.score == 1.0 for k, v in verdicts.items() if k.endswith(":0"))
    yes_near = sum(v.score == 1.0 for k, v in verdicts.items() if not k.endswith(":0"))
    assert yes_right >= 90, f"the judge accepted {yes_right} of 100 right answers"
    assert yes_near <= 18, f"the judge accepted {yes_near} of 300 answers off by 1-3"


def test_requests_are_batched_on_the_replicas(two_replicas):
    """Each replica runs several requests per engine call (Serve's router may favour one replica on a busy
    machine, so the count is over the replicas that answer)."""
    before = replica_stats()
    client = GenRMClient(timeout_s=60, max_retries=0, connect_timeout_s=60)
    client.submit(requests(256, seed=1, prefix="b"))
    assert len(client.collect()) == 256
    after = replica_stats()
    seen = before.keys() & after.keys()
    judged = sum(after[w]["requests"] - before[w]["requests"] for w in seen)
    batches = sum(after[w]["batches"] - before[w]["batches"] for w in seen)
    assert 0 < judged <= 256 and batches <= judged / 4, f"{judged} requests in {batches} batches"
    if len(seen) == 2:
        assert judged == 256


def test_collect_reads_only_the_keys_asked_and_discard_cancels_the_rest(two_replicas):
    client = GenRMClient(timeout_s=60, max_retries=0, connect_timeout_s=60)
    batch = requests(64, seed=4, prefix="c")
    client.submit(batch)
    wanted = [r.key for r in batch[::2]]
    verdicts = client.collect(wanted)
    assert list(verdicts) == wanted and all(v.key == k for k, v in verdicts.items())
    assert sorted(client.pending) == sorted(r.key for r in batch[1::2]), "the others are still judged"
    assert client.discard([r.key for r in batch]) == 32, "collected keys are not pending any more"
    assert not client.pending
    with pytest.raises(GenRMError, match=r"not pending \['c0:1'\] \(1 in all\)"):
        client.collect(["c0:1"])  # already read: a sample is scored once
    client.submit(batch[:2])  # a key that left the pending set may be sent again (a new attempt)
    with pytest.raises(GenRMError, match=r"more than once \['c0:1'\]"):
        client.collect(["c0:1", "c0:1"])
    assert len(client.collect()) == 2 and not client.pending


def test_discarded_requests_are_mostly_never_judged(two_replicas):
    """Cancelling frees the replicas: of a backlog of discarded requests (about 30 s of judging here), only
    those in batches already running are judged; the rest are dropped where they wait (Serve's router, the
    replica's batch queue). The replicas then go on serving."""
    before = both_replicas()
    client = GenRMClient(timeout_s=60, max_retries=0, connect_timeout_s=60)
    batch = requests(2000, seed=5, prefix="d")
    client.submit(batch)
    assert client.discard(r.key for r in batch) == 2000 and not client.pending
    time.sleep(2)  # the batches already running finish
    after = both_replicas()  # (behind whatever the replicas still judge)
    judged = sum(after[w]["requests"] - before[w]["requests"] for w in before)
    assert judged < 1000, f"{judged} of 2000 discarded requests were judged anyway"
    fresh = requests(32, seed=6, prefix="a")
    client.submit(fresh)
    assert sorted(client.collect()) == sorted(r.key for r in fresh)


def as_samples(batch: list[JudgeRequest]) -> list[Sample]:
    return [Sample(r.key, r.prompt, r.response, r.ground_truth, "arithmetic") for r in batch]


def test_the_scorer_holds_nothing_after_each_of_many_steps(two_replicas):
    """Partial coexistence's pattern, step after step: every group's samples stream to the judge as they
    finish, the step scores the groups it takes and discards the spare ones (they go back to the queue and
    are drawn again under new keys), then scores a greedy baseline. Whatever the run's length, nothing is
    held after a step, and each taken sample gets its verdict once. A failed scoring leaves nothing either."""
    config = judge_config()
    scorer = RewardScorer(config.reward, connect_timeout_s=60)
    groups, per_group, taken = 12, 4, 8
    agree = scored = 0
    for step in range(25):
        batch = requests(groups * per_group, seed=100 + step, prefix=f"{step}/0/1/")
        streamed = as_samples(batch)
        for g in range(groups):  # streamed as each group finishes
            scorer.submit(streamed[g * per_group : (g + 1) * per_group])
        keep, spare = streamed[: taken * per_group], streamed[taken * per_group :]
        rewards = scorer.scores(keep)
        scorer.discard(spare)  # finished past the need: back to the queue, never scored
        greedy = as_samples(requests(taken, seed=200 + step, prefix=f"{step}/0/g"))
        scorer.submit(greedy)
        scorer.scores(greedy)
        stats = scorer.take_stats()
        assert scorer.held() == 0 and stats["genrm/held"] == 0.0, f"step {step}: {scorer.held()} held"
        assert stats["genrm/discarded"] == len(spare) and stats["genrm/retries"] == 0.0
        agree += sum(r == float(s.key.endswith(":1")) for r, s in zip(rewards, keep))
        scored += len(keep)
    assert agree >= 0.9 * scored, f"the judge agreed with the reference on {agree} of {scored}"
    with pytest.raises(GenRMError, match="not pending"):
        scorer.scores(keep[:1])  # scored already
    with pytest.raises(GenRMError, match="not pending"):
        scorer.scores(spare[:1])  # discarded
    assert scorer.held() == 0

    # mix mode, and a rule function that raises on an empty response (reward.on_error=raise): the step fails,
    # and its samples' requests are not left behind
    mix = dataclasses.replace(
        config.reward, mode="mix", function="tests.reward.rule_fns:fails_on_empty", on_error="raise"
    )
    scorer = RewardScorer(mix, connect_timeout_s=60)
    bad = as_samples(requests(8, seed=7, prefix="e"))
    bad[3] = dataclasses.replace(bad[3], response="")
    scorer.submit(bad)
    with pytest.raises(RewardError, match="raised IndexError"):
        scorer.scores(bad)
    assert scorer.held() == 0


def test_the_controller_discards_the_streamed_groups_it_does_not_take(two_replicas, single_process_world):
    """`GroupController.step()` (the fakes of tests/unit/test_controller.py, this judge) in partial
    coexistence with over-sampling: step 2 waits for the two prompts aborted in step 1 (rollout.max_aborts=1),
    so six groups stream to the judge and four are taken; the two spare ones go back to the queue, and their
    four samples are discarded, not kept for the rest of the run."""
    from tests.unit.test_controller import controller

    ctrl, *_ = controller(
        **{"reward.mode": "genrm", "placement.mode": "partial", "rollout.over_sample": 1.5,
           "rollout.max_aborts": 1}
    )  # fmt: skip
    assert ctrl.collector.streams_to_genrm
    discarded = []
    for step in range(1, 5):
        metrics = ctrl.step(step)
        held = ctrl.collector.scorer.held()
        assert held == 0 and metrics["genrm/held"] == 0, f"step {step}: {held}"
        assert metrics["genrm/retries"] == 0
        discarded.append(metrics["genrm/discarded"])
    assert discarded[:2] == [0, 4], discarded


def replica_names() -> set[str]:
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if a["name"].startswith("SERVE_REPLICA::yatt-genrm#")}


def test_a_replica_killed_mid_flight_costs_no_sample_and_scores_none_twice(two_replicas):
    """A replica killed while it judges: the requests it held fail (ActorDiedError) and the client sends them
    all again at once, or Serve sends them elsewhere itself; the surviving replica answers them; each sample
    gets exactly one verdict, and Serve replaces the replica."""
    import ray

    both_replicas()  # both up and answering (a replica an earlier test killed has been replaced)
    before = replica_names()
    assert len(before) == 2
    victim = ray.get_actor(sorted(before)[0], namespace="serve")
    # 6 x max_ongoing_requests (4 x batch_size = 128): each replica holds 128 requests, 512 wait at the router
    client = GenRMClient(timeout_s=60, max_retries=3, connect_timeout_s=60)
    batch = requests(768, seed=2, prefix="k")
    client.submit(batch)
    killed_at: list[float] = []

    def kill_once_judging() -> None:
        """Once verdicts come back and the victim holds at least three batches of requests (the count Serve's
        router asks replicas for): some of them were accepted long before, and are still unanswered when it
        dies. (A request not yet accepted when its replica dies is sent elsewhere by Serve, unseen by the
        client; one accepted fails with ActorDiedError, and the client sends it again.)"""
        deadline = time.time() + 60
        while time.time() < deadline and len(client.pending) == len(batch):
            time.sleep(0.01)
        while time.time() < deadline and ray.get(victim.get_num_ongoing_requests.remote()) < 96:
            time.sleep(0.01)
        ray.kill(victim)
        killed_at.append(time.time())

    killer = threading.Thread(target=kill_once_judging, daemon=True)
    killer.start()
    verdicts = client.collect()
    done_at = time.time()
    killer.join()
    assert killed_at and killed_at[0] < done_at, "the replica died while the batch was being judged"
    # whether the victim's requests reach the client as failures (and are sent again: client.retries > 0) or
    # are sent elsewhere by Serve itself depends on where each was when the replica died, so it is not asserted
    # here; tests/unit/test_genrm_client_resend.py drives the client's resend path deterministically
    assert sorted(verdicts) == sorted(r.key for r in batch), "every sample scored exactly once"
    assert all(v.key == k for k, v in verdicts.items())
    agree = sum(v.score == float(k.endswith(":1")) for k, v in verdicts.items())
    assert agree >= 0.9 * len(batch)
    both_replicas()  # Serve replaced the replica, and the new one answers (the next tests find two)
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
