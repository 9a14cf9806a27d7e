"""`GroupController.step()` with injected roles in a one-process gloo world: no Ray cluster, no Megatron model,
no vLLM. The fakes record what each phase hands them, so the test sees the phase order, the batch fields each
phase adds, and the metrics reduced at the end of the step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yatt_ray.config import load_config
from yatt_ray.controller import GroupController
from yatt_ray.data.feed import PromptFeed
from yatt_ray.metrics.history import MetricRow
from yatt_ray.metrics.timeline import from_wire
from yatt_ray.models.tiny import build_tokenizer
from yatt_ray.reward.rules import exact_match
from yatt_ray.reward.scorer import RewardScorer
from yatt_ray.roles import Layout, Roles
from yatt_ray.rollout.base import Completion, InProcessEngine

N_SAMPLES = 2  # rollout.n


class FakePolicy:
    """Log-probs of -1 per position; a train step runs the real loss closure on them and records the batch."""

    def __init__(self, log: list) -> None:
        self.log, self.batches = log, []
        self.recorder, self.compute_s = None, 0.0  # set and read by the controller
        self.device = "cpu"

    def log_probs(self, ids, mask, reference: bool = False, **batching):
        self.log.append("ref_logp" if reference else "old_logp")
        logp = torch.full((ids.shape[0], ids.shape[1] - 1), -1.0 if not reference else -1.1)
        return logp, torch.zeros_like(logp)

    def train_step(self, batch: dict, loss_fn, **batching):
        self.log.append("train")
        self.batches.append(dict(batch))
        logp = torch.full(
            (batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1), -1.0, requires_grad=True
        )
        loss, stats = loss_fn(logp, torch.zeros_like(logp), batch)
        loss.backward()
        return {"loss": float(loss.detach()), "grad_norm": float(logp.grad.norm()), **stats}

    def iter_hf_buckets(self, bucket_bytes: int):
        self.log.append("weight_sync")
        yield [("model.embed_tokens.weight", torch.zeros(2, 2))]


class FakeEngine(InProcessEngine):
    """Answers every prompt with "3" then EOS, and "4" on the second sample (the tokenizer's ids)."""

    takes_image_features = False

    def __init__(self, tokenizer, log: list) -> None:
        self.tokenizer, self.log, self.loaded = tokenizer, log, []
        self.last_aborted = 0

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    def generate(self, request, on_finished=None):
        """Without `finish_after`, every prompt in order; with it, the last prompts finish first (the long tail
        is at the front) and the engine stops after `finish_after` of them, the rest aborted (None)."""
        self.log.append("generate")
        prompts, spec = request.prompts, request.spec
        finish_after, wait_for = request.finish_after, request.wait_for
        groups: list = [
            [Completion(self._ids(str(3 + j)), [-0.5, -0.5], "stop") for j in range(spec.n)] for _ in prompts
        ]
        order = list(range(len(prompts)))
        if finish_after is not None:  # then those waited for, when the engine stops only after them
            order = order[::-1][:finish_after]
            order += [i for i in sorted(wait_for) if i not in order]
            groups = [g if i in order else None for i, g in enumerate(groups)]
        self.last_aborted = sum(g is None for g in groups)
        for i in order:
            if on_finished is not None:
                on_finished(i, groups[i])
        return groups

    def wake(self) -> None:
        pass

    def sleep(self) -> int:
        return 0

    def load_weights(self, bucket) -> None:
        self.loaded.extend(name for name, _ in bucket)

    def finish_weight_sync(self) -> None:
        self.log.append("finish_weight_sync")


class FakeLink:
    def __init__(self) -> None:
        self.rows, self.spans = [], []

    def push(self, kind, values) -> None:
        self.rows.append(MetricRow(kind, values))

    def push_spans(self, spans) -> None:
        self.spans.extend(from_wire(spans))

    def rows_since(self, index: int):
        return self.rows[index:]


class Shard:
    """A Ray Data shard stand-in: numpy batches in order."""

    def __init__(self, rows: dict) -> None:
        self.rows = rows

    def iter_batches(self, batch_size: int, batch_format: str, drop_last: bool = False):
        n = len(self.rows["id"])
        for i in range(0, n - batch_size + 1, batch_size):
            yield {k: np.asarray(v[i : i + batch_size]) for k, v in self.rows.items()}


def controller(answers=None, **overrides) -> tuple[GroupController, list, FakePolicy, FakeEngine, FakeLink]:
    """A controller over 16 prompts "1+2=" whose ground truths are `answers` (default "3", "4", ...); samples
    answer "3" and "4", so a group of ground truth "5" scores 0 on both (uniform: dynamic sampling drops it)."""
    over = [
        "train.prompts_per_step=4",
        f"rollout.n={N_SAMPLES}",
        "rollout.max_new_tokens=2",
        "train.dp_size=1",
    ]
    config = load_config(None, over + [f"{k}={v}" for k, v in overrides.items()])
    log: list = []
    tokenizer = build_tokenizer()
    policy, engine, link = FakePolicy(log), FakeEngine(tokenizer, log), FakeLink()
    scorer = RewardScorer(config.reward, connect_timeout_s=5)
    roles = Roles(
        policy, None, link, engine=engine, scorer=scorer, tokenizer=tokenizer, reward_fn=exact_match
    )
    ctrl = GroupController(config, Layout(rank=0, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1), roles)
    rows = {
        "id": list(range(16)),
        "prompt": ["1+2="] * 16,
        "ground_truth": answers or ["3", "4"] * 8,
        "data_source": ["t"] * 16,
    }
    ctrl.collector.feed = PromptFeed(Shard(rows), None, batch_size=4)
    return ctrl, log, policy, engine, link


def test_one_step_runs_the_phases_in_order_and_reduces_the_metrics(single_process_world):
    ctrl, log, policy, engine, link = controller(**{"algo.kl_coef": 0.1})
    metrics = ctrl.step(1)
    # on-policy (one epoch, one mini-batch): the old log-probs come from the training forward, no pass of
    # their own; the reference pass remains
    assert log == ["generate", "ref_logp", "train", "weight_sync", "finish_weight_sync"]
    phases = [s.phase for s in link.spans]
    assert phases == ["rollout", "reward", "logprobs", "train", "weight_sync"]
    assert engine.loaded == ["model.embed_tokens.weight"]
    # prompts 0, 2 want "3" (sample 0 right), prompts 1, 3 want "4" (sample 1 right): half the samples score 1
    assert metrics["samples"] == 8 and metrics["reward_mean"] == 0.5 and metrics["accuracy"] == 0.5
    assert metrics["response_length"] == 2.0 and metrics["truncated_fraction"] == 0.0
    # engine -0.5 per token against the trainer's -1: |diff| 0.5; k3 KL of old -1 vs ref -1.1 per token
    assert metrics["rollout_logp_diff"] == pytest.approx(0.5)  # the training forward's log-probs, recorded
    assert metrics["kl"] == pytest.approx(float(torch.exp(torch.tensor(-0.1)) - 1 + 0.1), rel=1e-5)
    assert ctrl.collector.feed.consumed == {0: [0, 1, 2, 3]}


def test_each_phase_adds_its_batch_fields(single_process_world):
    ctrl, log, policy, _, _ = controller(**{"algo.kl_coef": 0.1, "algo.ppo_epochs": 2})
    ctrl.step(1)
    assert log[:3] == ["generate", "old_logp", "ref_logp"]  # two epochs: the old log-probs are data
    trained = policy.batches[0]
    assert sorted(trained) == sorted(
        ["input_ids", "attention_mask", "response_mask", "rollout_logp", "rewards", "old_logp", "ref_logp",
         "tis_weights", "advantages"]
    )  # fmt: skip
    assert trained["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0] * 2
    # GRPO: each prompt's right sample +0.7071, the wrong one -0.7071, on both response tokens
    assert trained["advantages"][:, 0].tolist() == pytest.approx(
        [0.70710, -0.70710, -0.70710, 0.70710] * 2, abs=1e-4
    )
    # truncated IS weight exp(old - rollout) = exp(-1 - (-0.5)), below the cap of 2
    torch.testing.assert_close(trained["tis_weights"], torch.full((8, 2), float(np.exp(-0.5))))


def test_without_kl_there_is_no_reference_pass_and_no_kl_metric(single_process_world):
    ctrl, log, policy, _, _ = controller(**{"algo.kl_coef": 0.0, "algo.tis_cap": "null"})
    metrics = ctrl.step(1)
    assert "ref_logp" not in log and "old_logp" not in log and "kl" not in metrics
    assert policy.batches[0]["row"].tolist() == list(range(8))  # where the training forward's log-probs go
    assert "ref_logp" not in policy.batches[0] and "tis_weights" not in policy.batches[0]


def test_groups_with_zero_advantages_skip_the_train_step_and_leave_the_update_as_it_was(single_process_world):
    answers = ["3", "5", "5", "4"] + ["3", "4"] * 6  # prompts 1 and 2: both samples wrong, advantages 0
    plain = {"algo.kl_coef": 0.0, "algo.tis_cap": "null"}
    skipping, _, skip_policy, _, _ = controller(answers, **plain)
    full, _, full_policy, _, _ = controller(answers, **plain, **{"train.skip_zero_advantage": "false"})
    m_skip, m_full = skipping.step(1), full.step(1)
    assert skip_policy.batches[0]["row"].tolist() == [0, 1, 6, 7]  # groups 0 and 3 ran, 1 and 2 did not
    assert full_policy.batches[0]["row"].tolist() == list(range(8))
    assert m_skip["train/skipped_fraction"] == 0.5 and "train/skipped_fraction" not in m_full
    # the loss is normalised by the whole batch's tokens either way: the same value (and gradient)
    assert m_skip["loss"] == pytest.approx(m_full["loss"])
    assert m_skip["grad_norm"] == pytest.approx(m_full["grad_norm"]) and m_skip["grad_norm"] > 0
    # the log-prob mismatch is measured over the rows that ran: still 0.5, not diluted by the skipped ones
    assert m_skip["rollout_logp_diff"] == pytest.approx(0.5) == m_full["rollout_logp_diff"]


def test_when_every_group_has_zero_advantages_one_still_trains(single_process_world):
    ctrl, _, policy, _, _ = controller(["5"] * 16, **{"algo.kl_coef": 0.0})
    metrics = ctrl.step(1)
    # one group still runs, so the optimizer steps (its gradient is 0)
    assert len(policy.batches) == 1 and len(policy.batches[0]["row"]) == N_SAMPLES
    assert metrics["train/skipped_fraction"] == 0.75 and metrics["grad_norm"] == 0.0


def test_a_loss_that_acts_at_zero_advantage_trains_every_row(single_process_world):
    answers = ["5"] * 16
    for overrides in ({"algo.kl_coef": 0.1}, {"algo.kl_coef": 0.0, "algo.entropy_coef": 0.01}):
        ctrl, _, policy, _, _ = controller(answers, **overrides)
        metrics = ctrl.step(1)
        assert len(policy.batches[0]["input_ids"]) == 8 and "train/skipped_fraction" not in metrics


def test_dynamic_sampling_draws_again_for_the_groups_it_drops(single_process_world):
    answers = ["3", "5", "5", "4"] + ["3", "4"] * 6  # prompts 1 and 2: both samples wrong (uniform)
    ctrl, log, policy, _, link = controller(answers, **{"algo.dynamic_sampling": "reward"})
    metrics = ctrl.step(1)
    assert log.count("generate") == 2  # 4 prompts, then 2 more for the 2 dropped
    assert [r.id for r in ctrl.collector.step_rows] == [0, 1, 2, 3, 4, 5]  # dropped ones count as consumed
    assert ctrl.collector.feed.consumed == {0: [0, 1, 2, 3, 4, 5]}
    assert policy.batches[0]["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]  # 0, 3, 4, 5
    assert metrics["dynamic/draws"] == 2 and metrics["dynamic/dropped_groups"] == 2
    assert metrics["dynamic/drawn_groups"] == 6 and metrics["dynamic/batch_full"] == 1.0
    assert [s.phase for s in link.spans][:4] == ["rollout", "reward", "rollout", "reward"]


def test_dynamic_sampling_tops_up_when_the_draws_run_out(single_process_world, caplog):
    ctrl, log, policy, _, _ = controller(
        ["5"] * 16, **{"algo.dynamic_sampling": "accuracy", "algo.max_draws": 2}
    )
    metrics = ctrl.step(1)
    assert log.count("generate") == 2 and "topping the batch up" in caplog.text
    assert len(policy.batches[0]["rewards"]) == 8  # a full batch of (uniform) groups
    assert metrics["dynamic/batch_full"] == 0.0 and metrics["dynamic/dropped_groups"] == 8
    assert sorted(ctrl.collector.feed.consumed[0]) == list(range(8))


def test_over_sampling_aborts_the_slowest_and_serves_them_first_next_step(single_process_world):
    ctrl, log, policy, _, _ = controller(**{"rollout.over_sample": 1.5, "rollout.max_aborts": 2})
    metrics = ctrl.step(1)  # starts 6 prompts (ids 0-5); 5, 4, 3, 2 finish first; 0 and 1 are aborted
    assert sorted(r.id for r in ctrl.collector.step_rows) == [2, 3, 4, 5]
    assert ctrl.collector.feed.consumed == {0: [5, 4, 3, 2]} and [
        r.id for r in ctrl.collector.feed.queue
    ] == [0, 1]
    assert metrics["rollout/requeued_prompts"] == 2 and metrics["data/queued_prompts"] == 2
    assert metrics["rollout/aborted_prompts"] == 2
    assert len(policy.batches[0]["rewards"]) == 8  # exactly the share trained
    ctrl.step(2)  # starts 0, 1 (queued) and 6-9; keeps 9, 8, 7, 6; 0 and 1 go back again
    assert sorted(r.id for r in ctrl.collector.step_rows) == [6, 7, 8, 9] and [
        r.id for r in ctrl.collector.feed.queue
    ] == [0, 1]
    ctrl.step(3)  # aborted twice: 0 and 1 are waited for and kept, with the first two others to finish
    assert sorted(r.id for r in ctrl.collector.step_rows) == [0, 1, 12, 13]
    assert [r.id for r in ctrl.collector.feed.queue] == [11, 10] and log.count(
        "generate"
    ) == 3  # finish order


def test_the_collector_alone_draws_scores_packs_and_keeps_its_state():
    """`RolloutCollector` without a controller, a trainer or a process group: one step's scored batch, the
    prompts it consumed, dynamic sampling's keep rate, and that rate through state_dict / load_state_dict."""
    from yatt_ray.collector import RolloutCollector
    from yatt_ray.metrics.timeline import SpanRecorder
    from yatt_ray.metrics.timers import PhaseTimer

    answers = ["3", "5", "5", "4"] + ["3", "4"] * 6  # prompts 1 and 2 score 0 on both samples: dropped
    config = load_config(
        None, ["train.prompts_per_step=4", f"rollout.n={N_SAMPLES}", "algo.dynamic_sampling=reward"]
    )
    tokenizer, log = build_tokenizer(), []
    recorder = SpanRecorder("trainer", "rank0", "cpu")
    collector = RolloutCollector(
        config, 0, 1, scorer=RewardScorer(config.reward, connect_timeout_s=5), tokenizer=tokenizer,
        reward_fn=exact_match, timer=PhaseTimer(recorder=recorder), recorder=recorder,
    )  # fmt: skip
    collector.engine = FakeEngine(tokenizer, log)
    rows = {
        "id": list(range(16)),
        "prompt": ["1+2="] * 16,
        "ground_truth": answers,
        "data_source": ["t"] * 16,
    }
    collector.feed = PromptFeed(Shard(rows), None, batch_size=4)
    batch = collector.collect(1)
    assert batch.size == 4 * N_SAMPLES and batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] * 2
    assert [r.id for r in collector.step_rows] == [0, 1, 2, 3, 4, 5] and log.count("generate") == 2
    assert batch.counters["dynamic/dropped_groups"] == 2.0
    assert collector.keep_rate == pytest.approx(0.5 + 0.5 * 4 / 6)
    other = RolloutCollector(
        config, 0, 1, scorer=None, tokenizer=tokenizer, reward_fn=exact_match, timer=PhaseTimer(),
        recorder=recorder,
    )  # fmt: skip
    other.load_state_dict(collector.state_dict())
    assert other.keep_rate == collector.keep_rate


class FakePool:
    """An engine pool stand-in: `submit` records the weight version the engines hold when the request runs
    (here: at submit), `wait` answers through a FakeEngine."""

    asynchronous, takes_image_features = True, False

    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.version, self.submitted = engine, 0, []

    def submit(self, request):
        from yatt_ray.rollout.pool import Generation

        self.submitted.append(len(request.prompts))
        n = len(request.prompts)
        return Generation(request, [1] * n, self.engine.generate(request), [self.version] * n)

    def wait(self, generation, on_finished=None):
        for i, group in enumerate(generation.results):
            if on_finished is not None:
                on_finished(i, group)
        return generation.results

    def generate(self, request, on_finished=None):  # a draw inside a step: submitted and waited for at once
        return self.wait(self.submit(request), on_finished)

    def wake(self) -> None:
        pass

    def take_stats(self) -> dict[str, float]:
        return {}

    def age(self, version: int) -> int:
        return self.version - version


def _async_collector(*overrides: str):
    """A controller's collector for asynchronous rollout (max_staleness 1, 4 prompts a step) over a FakePool.
    `collect(s)` starts steps s+1 .. s+K up to `train.steps` (set it to the steps a test collects)."""
    from yatt_ray.collector import RolloutCollector
    from yatt_ray.metrics.timeline import SpanRecorder
    from yatt_ray.metrics.timers import PhaseTimer

    config = load_config(
        None,
        ["train.prompts_per_step=4", f"rollout.n={N_SAMPLES}", "rollout.max_staleness=1",
         "placement.mode=disaggregated", "placement.rollout_engines=1", *overrides],
    )  # fmt: skip
    tokenizer, recorder = build_tokenizer(), SpanRecorder("trainer", "rank0", "cpu")
    collector = RolloutCollector(
        config, 0, 1, scorer=RewardScorer(config.reward, connect_timeout_s=5), tokenizer=tokenizer,
        reward_fn=exact_match, timer=PhaseTimer(recorder=recorder), recorder=recorder,
    )  # fmt: skip
    pool = collector.engine = FakePool(FakeEngine(tokenizer, []))
    return collector, pool


def test_asynchronous_collection_starts_ahead_holds_rows_in_flight_and_bounds_staleness():
    """`collect(s)` ends by starting step s+1 (K = 1): its prompts are drawn and submitted and stay unconsumed
    (held in flight, so the data position keeps their epoch open) until `collect` takes them; each sample's
    staleness is reported. Nothing is generated twice: the bound holds by construction (`collect_started`)."""
    collector, pool = _async_collector("train.steps=3")
    rows = {
        "id": list(range(16)),
        "prompt": ["1+2="] * 16,
        "ground_truth": ["3"] * 16,
        "data_source": ["t"] * 16,
    }
    collector.feed = feed = PromptFeed(Shard(rows), None, batch_size=4)
    first = collector.collect(1)  # not started ahead: started now; then step 2 starts
    assert sorted(r.id for r in feed.lent.values()) == [4, 5, 6, 7] and feed.consumed == {0: [0, 1, 2, 3]}
    pool.version = 1  # the trainer's weights moved on while step 2 generated
    second = collector.collect(2)
    assert first.counters["async/staleness_max"] == 0 and second.counters["async/staleness_max"] == 1
    assert (
        second.counters["async/staleness_hist_1"] == 4 * N_SAMPLES == first.counters["async/staleness_hist_0"]
    )
    assert (
        second.counters["async/staleness_hist_0"] == 0
        and second.counters["async/versions_per_sample_mean"] == 1
    )
    # per-token versions (weights that arrived while a sample generated): a sample's staleness is its oldest
    # token's, and the number of versions it spans is counted
    mixed = [Completion([5, 6, 7], [0.0] * 3, "stop", [1, 1, 3]), Completion([5], [0.0], "stop", [3])]
    pool.version = 3
    counters = collector._version_counters([mixed, [Completion([5, 6], [0.0] * 2, "stop")]], [2, 1])
    assert [counters[f"async/staleness_hist_{s}"] for s in (0, 1)] == [1, 2]  # ages 2 (bin >= 1), 0; 1
    assert counters["async/versions_per_sample_mean"] == pytest.approx((2 + 1 + 1) / 3)
    pool.version = 1
    assert [r.id for r in collector.step_rows] == [4, 5, 6, 7]
    assert sorted(r.id for r in feed.lent.values()) == [8, 9, 10, 11]  # step 3's, started by collect(2)
    pool.version = 2  # the push of step 2's training
    third = collector.collect(3)
    assert third.counters["async/staleness_max"] == 1 and "async/aged_out" not in third.counters
    assert third.size == 4 * N_SAMPLES and [r.id for r in collector.step_rows] == [8, 9, 10, 11]
    assert pool.submitted == [4, 4, 4] and not feed.lent  # each step's prompts once; none past train.steps


def test_asynchronous_collection_with_dynamic_sampling_filters_what_was_generated_ahead():
    """DAPO's filter on asynchronous rollout: the groups generated ahead are a draw; uniform ones are dropped
    (consumed), what is missing is drawn at once with the current weights, and informative groups past the
    share go back to the queue unconsumed."""
    collector, pool = _async_collector("algo.dynamic_sampling=reward", "train.steps=2")
    answers = ["9", "3", "9", "3", "3", "3", "3", "3", "3", "3", "3", "3"]  # "9": no sample right (uniform)
    rows = {
        "id": list(range(12)),
        "prompt": ["1+2="] * 12,
        "ground_truth": answers,
        "data_source": ["t"] * 12,
    }
    collector.feed = feed = PromptFeed(Shard(rows), None, batch_size=4)
    collector.start(1)  # 4 prompts ahead (keep rate 1): 0..3, two of them uniform
    batch = collector.collect(1)  # then step 2 starts: ceil(4 / keep rate 0.83) = 5 prompts ahead, 6..10
    assert batch.counters["dynamic/dropped_groups"] == 2 and batch.counters["dynamic/draws"] == 2
    assert sorted(r.id for r in collector.step_rows) == [0, 1, 2, 3, 4, 5]  # 0, 2 dropped; 4, 5 drawn now
    assert batch.size == 4 * N_SAMPLES and batch.counters["dynamic/batch_full"] == 1
    assert pool.submitted == [4, 2, 5] and feed.consumed == {0: [0, 1, 2, 3, 4, 5]}
    assert sorted(r.id for r in feed.lent.values()) == [6, 7, 8, 9, 10]  # step 2's, all informative
    assert collector.keep_rate == pytest.approx(0.5 * 1 + 0.5 * 4 / 6)
    second = collector.collect(2)
    assert sorted(r.id for r in collector.step_rows) == [6, 7, 8, 9] and second.counters["dynamic/draws"] == 1
    assert [r.id for r in feed.queue] == [10] and pool.submitted[2:] == [
        5
    ]  # past the share: back, unconsumed
