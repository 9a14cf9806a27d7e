"""Asynchronous rollout with a GenRM, without a cluster: the collector over a stand-in engine pool whose
prompts come back through a stand-in `ray.wait` / `ray.get` (so the judging thread runs as on a cluster), and
the real `GenRMClient` over a stand-in Serve handle. What a step leaves held at the GenRM, and a send to it
that fails from the judging thread."""

from __future__ import annotations

import logging

import pytest

from tests.unit.test_controller import N_SAMPLES, FakePool, Shard, _async_collector
from yatt_ray.data.feed import PromptFeed
from yatt_ray.reward import client as client_module
from yatt_ray.reward.genrm import Verdict


class FakeResponse:
    def __init__(self, key: str) -> None:
        self.key, self.cancelled = key, False

    def result(self, timeout_s: float) -> Verdict:
        return Verdict(self.key, 1.0, "yes")

    def cancel(self) -> None:
        self.cancelled = True


class FakeJudge:
    """`handle.judge`: `remote(request)` answers every sample "yes"; the sends numbered in `fail_at` raise (the
    Serve handle refusing a request)."""

    def __init__(self) -> None:
        self.sent, self.fail_at = 0, set()

    def remote(self, request) -> FakeResponse:
        self.sent += 1
        if self.sent in self.fail_at:
            raise ConnectionError("serve controller unreachable")
        return FakeResponse(request.key)


class FakeHandle:
    def __init__(self) -> None:
        self.judge = FakeJudge()


class Ref:
    """An engine actor's answer to one sub-request, as `ray.get` returns it."""

    def __init__(self, value) -> None:
        self.value = value


class AheadPool(FakePool):
    """A FakePool whose requests come back as one sub-request each (`Generation.pending`), answered the way
    `EngineActor.generate` answers, so the collector's judging thread streams them ahead."""

    def submit(self, request):
        generation = super().submit(request)
        answer = (generation.results, 0, generation.versions[0], 0.0)
        generation.pending = {Ref(answer): (0, list(range(len(request.prompts))))}
        return generation


@pytest.fixture
def genrm(monkeypatch):
    """The GenRM's stand-in handle, and `ray.wait` / `ray.get` over `Ref`s."""
    import ray

    handle = FakeHandle()
    monkeypatch.setattr(client_module, "_app_handle", lambda timeout_s: handle)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1: (refs[:num_returns], refs[num_returns:]))
    monkeypatch.setattr(ray, "get", lambda ref: ref.value)
    return handle


def genrm_collector(*overrides: str):
    collector, _ = _async_collector("reward.mode=genrm", *overrides)
    pool = collector.engine = AheadPool(collector.engine.engine)
    assert collector.streams_to_genrm
    rows = {
        "id": list(range(32)),
        "prompt": ["1+2="] * 32,
        "ground_truth": ["3"] * 32,
        "data_source": ["t"] * 32,
    }
    collector.feed = PromptFeed(Shard(rows), None, batch_size=4)
    return collector, pool


def judged_ahead(collector) -> None:
    """Until every started step's judging thread has sent what its engines returned."""
    for job in collector.inflight.values():
        job.judging.join()


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_nothing_is_held_after_a_step_at_any_staleness(genrm, staleness):
    """`collect(s)` ends by starting s+1..s+K: at K >= 2 the steps after s+1 are being judged ahead when step
    s ends. Their samples are counted in `genrm/ahead`, not in `genrm/held`, which is 0
    after every step; every sample sent ahead is scored, none discarded."""
    steps, held, ahead, later = 6, [], [], []
    collector, _ = genrm_collector(f"rollout.max_staleness={staleness}", f"train.steps={steps}")
    for step in range(1, steps + 1):
        judged_ahead(collector)
        later.append(sum(s != step for s in collector.inflight) * 4 * N_SAMPLES)  # started before, judged
        batch = collector.collect(step)  # then starts step + 1 .. step + K
        held.append(batch.counters["genrm/held"])
        ahead.append(batch.counters.get("genrm/ahead"))
        assert collector.scorer.held() == 0, f"step {step}"
        assert batch.counters["genrm/discarded"] == 0 and batch.rewards.tolist() == [1.0] * 4 * N_SAMPLES
    assert held == [0] * steps and ahead == later, (held, ahead, later)
    assert max(later) == 4 * N_SAMPLES * (staleness - 1)  # K - 1 steps judged ahead at the end of a step
    assert not collector.inflight and not collector.scorer.client.pending  # nothing left after the run


def test_a_prompt_whose_send_failed_ahead_is_sent_when_its_step_is_collected(genrm, caplog):
    """The judging thread's send of a prompt fails half way (its second sample): the prompt is not marked sent
    and none of its samples stays pending, so the step's collection sends it again; the other prompts streamed
    ahead are sent once."""
    collector, _ = genrm_collector("train.steps=1")  # collect(1) starts nothing ahead
    genrm.judge.fail_at = {2}  # prompt 0's second sample
    with caplog.at_level(logging.WARNING, logger="yatt_ray.collector"):
        collector.start(1)
        judged_ahead(collector)
    job = collector.inflight[1]
    assert job.streamed == {1, 2, 3} and "prompt 0 of step 1 could not be sent ahead" in caplog.text
    assert len(collector.scorer.client.pending) == 3 * N_SAMPLES
    batch = collector.collect(1)
    assert batch.rewards.tolist() == [1.0] * 4 * N_SAMPLES and job.streamed == {0, 1, 2, 3}
    # prompt 0 half sent (its first sample cancelled), then every sample once
    assert genrm.judge.sent == 4 * N_SAMPLES + 2
    assert collector.scorer.held() == 0 and batch.counters["genrm/held"] == 0


def test_a_failed_submit_leaves_none_of_its_samples_pending(genrm):
    """`GenRMClient.submit` is all or none: the requests it sent before one failed are cancelled and forgotten,
    so the same samples can be submitted again."""
    from yatt_ray.reward.genrm import JudgeRequest

    client = client_module.GenRMClient(timeout_s=5, max_retries=0, connect_timeout_s=1)
    genrm.judge.fail_at = {3}
    requests = [JudgeRequest(f"k{i}", "1+2=", "3", "3") for i in range(4)]
    with pytest.raises(ConnectionError):
        client.submit(requests)
    assert not client.pending
    client.submit(requests)
    assert sorted(client.collect()) == ["k0", "k1", "k2", "k3"]
