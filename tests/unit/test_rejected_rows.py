"""Rows whose images did not load (data.on_bad_image=skip), without a cluster: a collector whose rows are all
rejected stops with a DataError naming the image column and a few rejected ids (after one epoch, or once
`data.max_rejected_in_a_row` rows were rejected one after another) instead of reading its stream for ever;
skips are warned about as they are read; a stop request ends a lockstep read that waits for usable rows; and
with two data-parallel controllers every one takes the same decision (none is left waiting in a collective).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from yatt_ray import run_control
from yatt_ray.config import load_config
from yatt_ray.data.feed import PromptFeed
from yatt_ray.errors import DataError
from yatt_ray.rollout.base import Completion, InProcessEngine

MISSING = "row {i} image 0 ({{'path': '/gone/{i}.png'}}) does not exist ('/gone/{i}.png'); fix the path"


class Shard:
    """A streaming-split stand-in over `rows` (id -> image error, '' for a good row), every epoch in order;
    it refuses a read past `max_epochs` epochs, so a collector that would read for ever fails instead."""

    def __init__(self, errors: list[str], max_epochs: int = 20) -> None:
        self.errors, self.max_epochs, self.epochs = errors, max_epochs, 0

    def iter_batches(self, batch_size: int, batch_format: str, drop_last: bool = False):
        self.epochs += 1
        if self.epochs > self.max_epochs:
            raise AssertionError(f"the stream was read into epoch {self.epochs}: the reads did not stop")
        n = len(self.errors)
        for i in range(0, n, batch_size):
            ids = list(range(i, min(i + batch_size, n)))
            yield {
                "id": np.asarray(ids),
                "prompt": np.asarray(["1+2="] * len(ids)),
                "ground_truth": np.asarray(["3"] * len(ids)),
                "data_source": np.asarray(["t"] * len(ids)),
                "image_error": np.asarray([self.errors[j] for j in ids], dtype=object),
            }


class Engine(InProcessEngine):
    """Answers every sample of every prompt with "3" and EOS."""

    takes_image_features = False

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer("3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, request, on_finished=None):
        groups = [
            [Completion(self.ids, [-0.5] * len(self.ids), "stop")] * request.spec.n for _ in request.prompts
        ]
        for i, group in enumerate(groups):
            if on_finished is not None:
                on_finished(i, group)
        return groups

    def wake(self) -> None:
        pass


def bad(i: int) -> str:
    return MISSING.format(i=i)


def make_collector(errors: list[str], *overrides: str, dp_size: int = 1, dp_rank: int = 0):
    """A controller's collector (4 prompts a step over all groups, n = 2) reading `errors`' rows."""
    from yatt_ray.collector import RolloutCollector
    from yatt_ray.metrics.timeline import SpanRecorder
    from yatt_ray.metrics.timers import PhaseTimer
    from yatt_ray.models.tiny import build_tokenizer
    from yatt_ray.reward.rules import exact_match
    from yatt_ray.reward.scorer import RewardScorer

    config = load_config(
        None, ["train.prompts_per_step=4", "rollout.n=2", f"train.dp_size={dp_size}", *overrides]
    )
    tokenizer, recorder = build_tokenizer(), SpanRecorder("trainer", f"rank{dp_rank}", "cpu")
    collector = RolloutCollector(
        config, dp_rank, dp_size, scorer=RewardScorer(config.reward, connect_timeout_s=5), tokenizer=tokenizer,
        reward_fn=exact_match, timer=PhaseTimer(recorder=recorder), recorder=recorder,
    )  # fmt: skip
    collector.engine = Engine(tokenizer)
    shard = Shard(errors)
    collector.feed = PromptFeed(shard, None, batch_size=4 // dp_size)
    return collector, shard


def test_a_run_whose_rows_are_all_rejected_stops_after_one_epoch_naming_the_column_and_ids():
    collector, shard = make_collector([bad(i) for i in range(12)])
    with pytest.raises(DataError) as info:
        collector.collect(1)
    message = str(info.value)
    assert "all 12 rows of epoch 0 were rejected" in message
    assert "column data.image_key='images'" in message and "absolute paths" in message
    assert re.search(
        r"For example id (\d+): row \1 image 0 .* does not exist", message
    )  # a few ids, with why
    assert message.count("does not exist") == 3
    assert shard.epochs <= 3  # epoch 0 read to its end (the next fetched ahead), not again and again


def test_rows_rejected_in_a_row_past_the_bound_stop_before_the_epoch_ends():
    collector, shard = make_collector([bad(i) for i in range(400)], "data.max_rejected_in_a_row=10")
    with pytest.raises(
        DataError, match=r"rejected 12 rows one after another, more than data.max_rejected_in_a_row=10"
    ):
        collector.collect(1)
    assert 10 < len(collector.feed.consumed[0]) <= 10 + 4 and shard.epochs == 1


def test_no_bound_still_stops_on_a_whole_epoch_and_zero_stops_at_the_first_rejected_row():
    collector, _ = make_collector([bad(i) for i in range(40)], "data.max_rejected_in_a_row=null")
    with pytest.raises(DataError, match="all 40 rows of epoch 0 were rejected"):
        collector.collect(1)
    errors = [""] * 16
    errors[5] = bad(5)
    collector, _ = make_collector(errors, "data.max_rejected_in_a_row=0")
    collector.collect(1)  # rows 0-3: none rejected yet
    with pytest.raises(
        DataError, match=r"rejected 1 rows one after another.* For example id 5: row 5 image 0"
    ):
        collector.collect(2)  # row 5 among 4-7: the run inside one read counts


def test_skips_are_warned_as_they_are_read_and_the_step_counts_them(caplog):
    errors = [bad(i) if i % 3 == 1 else "" for i in range(24)]  # rows 1, 4, 7, ... rejected
    collector, _ = make_collector(errors)
    with caplog.at_level(logging.WARNING, logger="yatt_ray.collector"):
        assert collector._lockstep(4, 4)  # the read alone: rows 0-5 (two rejected), nothing generated yet
    assert [r.getMessage() for r in caplog.records] == [
        f"prompt id 1 skipped: {bad(1)}",
        f"prompt id 4 skipped: {bad(4)}",
    ]
    assert [r.id for r in collector.feed.rejected] == [1, 4]  # warned, and still to count in the step
    batch = collector.collect(1)
    assert batch.size == 4 * 2 and {1, 4} <= {r.id for r in collector.step_rows}
    assert collector.feed.rejected == []


def test_a_read_that_rejects_many_rows_warns_once_with_a_few_ids(caplog):
    errors = [bad(i) if i < 10 else "" for i in range(24)]
    collector, _ = make_collector(errors, "rollout.over_sample=2")  # 8 rows a draw
    with caplog.at_level(logging.WARNING, logger="yatt_ray.collector"):
        collector._lockstep(8, 4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(
        "8 prompts skipped, their images (column data.image_key='images') did not load:"
    )
    assert "id 0: " in lines[0] and "id 2: " in lines[0] and "id 3: " not in lines[0]
    assert lines[0].endswith("(and 5 more)")


def test_a_stop_request_ends_a_read_that_waits_for_usable_rows(monkeypatch):
    """Rejected rows without end (no bound, a long epoch): the read polls the stop request once it waits (not
    on a draw's first read) and ends with StopRequested."""
    polls = []

    def stop_request():
        polls.append(1)
        return "SIGTERM"

    monkeypatch.setattr(run_control, "stop_request", stop_request)
    collector, shard = make_collector([bad(i) for i in range(4000)], "data.max_rejected_in_a_row=null")
    with pytest.raises(run_control.StopRequested, match=r"asked to stop \(SIGTERM\) while waiting"):
        collector.collect(1)
    assert len(polls) == 1 and len(collector.feed.consumed[0]) == 4  # one read, then the stop
    # with usable rows the read never waits: the step ends as usual (its own poll is the checkpoints')
    collector, _ = make_collector([""] * 16)
    assert collector.collect(1).size == 8 and len(polls) == 1


def test_stop_request_asks_the_run_actor_at_most_once_a_poll_interval(monkeypatch):
    import time

    import ray

    answers, calls = [None, None, "SIGTERM"], []

    class Call:
        def __init__(self, fn):
            self.fn = fn

        def remote(self):
            return self.fn()

    class Control:
        fatal = Call(lambda: None)
        stop_requested = Call(lambda: calls.append(1) or answers[len(calls) - 1])

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(run_control, "STOP_POLL_S", 0.2)
    assert run_control.stop_request() is None  # outside a worker: nothing to ask
    seen = []

    def train():
        seen.append(run_control.stop_request())  # asked
        seen.append(run_control.stop_request())  # within the interval: the answer kept
        for _ in range(3):  # asked again; asked: a stop; a stop stays one, not asked again
            time.sleep(0.25)
            seen.append(run_control.stop_request())

    run_control.run_guarded(Control(), train)
    assert seen == [None, None, None, "SIGTERM", "SIGTERM"] and len(calls) == 3
    assert run_control.stop_request() is None  # the worker's function ended


def test_a_stop_met_while_waiting_is_recorded_so_no_restarted_attempt_runs(monkeypatch):
    import pickle

    import ray

    recorded = []

    class Call:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return self.fn(*args)

    class Control:
        fatal = Call(lambda: recorded[0] if recorded else None)
        record_fatal = Call(recorded.append)

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    ran = []

    def train():
        ran.append(1)
        raise run_control.StopRequested("asked to stop (SIGTERM) while waiting")

    with pytest.raises(run_control.StopRequested):
        run_control.run_guarded(Control(), train)
    run_control.run_guarded(Control(), train)  # Ray Train's next attempt returns at once
    assert ran == [1] and isinstance(recorded[0], run_control.StopRequested)
    copy = pickle.loads(pickle.dumps(recorded[0]))  # crosses to the driver with its type
    assert type(copy) is run_control.StopRequested and "SIGTERM" in str(copy)


def two_controllers(rank: int, world_size: int) -> str:
    """dp 2: controller 0's rows are all rejected, controller 1's all load; both must stop, alike."""
    errors = [bad(i) for i in range(200)] if rank == 0 else [""] * 200
    collector, _ = make_collector(errors, "data.max_rejected_in_a_row=6", dp_size=world_size, dp_rank=rank)
    try:
        collector.collect(1)
    except DataError as exc:
        return str(exc)
    return "no error"


def test_two_controllers_take_the_same_decision_and_name_the_rejected_ids_of_both():
    from tests.train.dist_harness import run_ranks

    messages = run_ranks(two_controllers, 2, timeout_s=120, collective_timeout_s=30)
    assert messages[0] == messages[1], messages  # controller 1, whose rows load, stops too (and alike)
    assert "rejected 8 rows one after another, more than data.max_rejected_in_a_row=6" in messages[0]
    assert re.search(r"For example id (\d+): row \1 image 0", messages[1])  # controller 0's ids
