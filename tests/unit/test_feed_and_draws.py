"""The prompt feed's queue and data position, and the pure pieces of the rollout phase's draws, without a cluster:
requeued prompts come first and are not consumed, a step may cross an epoch, positions of several groups merge
into the one a checkpoint stores, and a feed resumed from it reads each prompt of an epoch once."""

from __future__ import annotations

import numpy as np
import pytest

from yatt_ray.checkpoint.training import merge_positions, run_position
from yatt_ray.config import DataConfig
from yatt_ray.data.feed import FeedRow, MarkConsumed, PromptFeed, columns
from yatt_ray.data.sources import canonical_columns
from yatt_ray.draws import groups_to_finish, is_informative, prompts_to_start, split_finished, top_up
from yatt_ray.errors import DataError


class Shard:
    """A streaming-split stand-in: the same ids every epoch, in batches (the last one short); with `consumed`,
    those rows are marked as `open_splits` marks a resumed epoch's."""

    def __init__(self, ids: list[int], consumed: list[int] | None = None) -> None:
        self.ids, self.mark = ids, MarkConsumed(consumed) if consumed is not None else None

    def iter_batches(self, batch_size: int, batch_format: str, drop_last: bool = False):
        for i in range(0, len(self.ids), batch_size):
            chunk = self.ids[i : i + batch_size]
            batch = {"id": np.asarray(chunk), "prompt": np.asarray([f"p{j}" for j in chunk])}
            yield self.mark(batch) if self.mark else batch


def ids(rows: list[FeedRow]) -> list[int]:
    return [r.id for r in rows]


def test_requeued_rows_come_first_and_are_not_consumed():
    feed = PromptFeed(Shard(list(range(10))), [], batch_size=4)
    feed.pull(6)
    started = feed.pop(6)
    assert ids(started) == [0, 1, 2, 3, 4, 5]
    feed.consume(started[:4])
    feed.requeue(started[4:])  # aborted: back to the front, in order
    assert feed.consumed == {0: [0, 1, 2, 3]}
    assert ids(list(feed.queue)) == [4, 5]
    batch = next(feed)  # the queue first, then the stream
    assert batch["id"].tolist() == [4, 5, 6, 7] and batch["prompt"].tolist() == ["p4", "p5", "p6", "p7"]
    assert sorted(feed.consumed[0]) == list(range(8))


def test_priming_waits_for_the_first_batch_and_neither_consumes_nor_reorders():
    """Start-up waits for the stream's first batch before step 1 (`prime`); the rows then come in stream order,
    none consumed, and a second prime reads nothing more."""
    feed = PromptFeed(Shard(list(range(10))), [], batch_size=4)
    at = feed.prime()
    assert at == feed.first_batch_at and feed.consumed == {} and not feed.queue
    assert feed.prime() == at and len(feed._buffer) == 4  # one batch read, not two
    batch = next(feed)
    assert batch["id"].tolist() == [0, 1, 2, 3] and sorted(feed.consumed[0]) == [0, 1, 2, 3]


def test_a_step_crosses_the_epoch_end_and_each_row_keeps_its_epoch():
    feed = PromptFeed(Shard(list(range(6))), [], batch_size=4)
    next(feed)
    next(feed)  # ids 4, 5 of epoch 0, then 0, 1 of epoch 1
    assert feed.consumed == {0: [0, 1, 2, 3, 4, 5], 1: [0, 1]}
    assert feed.epoch == 1 and feed.open_epoch() == 1
    feed.pull(3)  # rows 2, 3 (epoch 1) queued; the stream is past them
    feed.requeue([FeedRow(0, {"id": 5})])  # a row of epoch 0 waiting in the queue keeps epoch 0 open
    assert feed.open_epoch() == 0


def test_positions_merge_from_the_oldest_open_epoch():
    group_a = (1, {0: [1, 2], 1: [7, 8]})  # finished epoch 0, in epoch 1
    group_b = (0, {0: [3, 4]})  # still in epoch 0
    assert merge_positions([group_a, group_b]) == (0, {0: [1, 2, 3, 4], 1: [7, 8]})
    assert merge_positions([group_a, (1, {1: [9]})]) == (1, {1: [7, 8, 9]})  # epoch 0 is done by both
    assert run_position({"epoch": 2, "consumed": [5]}) == {2: [5]}  # a run state written before "position"
    assert run_position({"epoch": 1, "consumed": [], "position": {"1": [3], "2": [4]}}) == {1: [3], 2: [4]}


def test_a_feed_resumed_from_the_merged_position_reads_each_prompt_once_per_epoch():
    """Two epochs open at the checkpoint: the resumed feed reads each without its consumed ids, then full ones."""
    data = list(range(8))
    floor, position = merge_positions([(0, {0: [0, 1, 2, 3, 4, 5], 1: [0, 1]}), (0, {0: [6]})])
    rest = [(e, Shard(data, consumed)) for e, consumed in position.items()]
    feed = PromptFeed(Shard(data), rest, batch_size=3, epoch=floor, carried=position)
    while feed.epoch < 2:
        next(feed)
    for epoch in (0, 1):
        assert sorted(feed.consumed[epoch]) == data, epoch  # every prompt once: none lost, none repeated
    assert feed.consumed[2] and len(set(feed.consumed[2])) == len(feed.consumed[2])


def test_a_share_smaller_than_a_step_is_refused():
    feed = PromptFeed(Shard([0, 1]), [], batch_size=4)
    with pytest.raises(DataError, match="fewer than 4"):
        next(feed)


def test_one_prompt_of_two_epochs_in_one_step_is_recorded_in_both():
    feed = PromptFeed(Shard([0, 1, 2]), [], batch_size=2)
    feed.pull(3)
    held = feed.pop(1)  # id 0 of epoch 0 waits in the queue (requeued) while the stream moves on
    feed.requeue(held)
    feed.pull(1)  # id 0 again, of epoch 1
    rows = feed.pop(4)
    assert [(r.epoch, r.id) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    feed.consume(rows)
    assert feed.consumed == {0: [0, 1, 2], 1: [0]}


def test_missing_ids_leave_the_position_unrecorded(caplog):
    feed = PromptFeed(Shard([-1, -1, -1, -1]), [], batch_size=4)
    next(feed)
    assert feed.consumed == {} and "4 prompt(s) of this step have no id" in caplog.text


def test_rows_without_ids_are_left_out_and_the_rest_recorded(caplog):
    """A step mixing rows with and without ids records the ones with (it used to record none of the step)."""
    feed = PromptFeed(Shard([0, -1, 2, 3, 4, -1, 6, 7]), [], batch_size=4)
    next(feed)
    next(feed)
    assert feed.consumed == {0: [0, 2, 3, 4, 6, 7]}
    assert "1 prompt(s) of this step have no id" in caplog.text


class TwoFiles:
    """Rows of two files that both index from 0 (verl's GSM8K and MATH), as Ray Data hands them to
    `canonical_columns`: each batch carries the read's "path" column, the files' rows interleaved; with
    `consumed`, a resumed epoch's rows are marked as `open_splits` marks them."""

    files = ["/data/gsm8k/train.parquet", "/data/math/train.parquet"]

    def __init__(self, consumed: list | None = None) -> None:
        self.canonical = canonical_columns(DataConfig(), files=self.files)
        self.mark = MarkConsumed(consumed) if consumed is not None else None

    def iter_batches(self, batch_size: int, batch_format: str, drop_last: bool = False):
        rows = [(f, i) for i in range(6) for f in self.files]  # ids 0..5 of each file
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            raw = {
                "id": np.asarray([i for _, i in chunk]),
                "prompt": np.asarray([f"{f}#{i}" for f, i in chunk]),
                "ground_truth": np.asarray(["g"] * len(chunk)),
                "path": np.asarray([f for f, _ in chunk]),
            }
            batch = {k: np.asarray(v) for k, v in self.canonical(raw).items()}
            yield self.mark(batch) if self.mark else batch


def test_two_files_that_index_alike_resume_each_prompt_once():
    """Keyed by (file, id): a step holding id 3 of both files records both, and a resumed epoch skips exactly
    the consumed rows of each file (plain ids marked the other file's rows too, and a step with an id twice
    was not recorded at all)."""
    feed = PromptFeed(TwoFiles(), [], batch_size=4)
    first = [next(feed)["id"].tolist() for _ in range(2)]
    assert first[0] == [
        "gsm8k/train.parquet:0",
        "math/train.parquet:0",
        "gsm8k/train.parquet:1",
        "math/train.parquet:1",
    ]
    floor, position = merge_positions([(feed.open_epoch(), feed.position(0))])
    assert (floor, len(position[0])) == (0, 8)
    resumed = PromptFeed(
        TwoFiles(), [(0, TwoFiles(position[0]))], batch_size=4, epoch=floor, carried=position
    )
    later = [next(resumed)["id"].tolist() for _ in range(2)]  # the rest of epoch 0, then epoch 1 begins
    every = [f"{name}/train.parquet:{i}" for name in ("gsm8k", "math") for i in range(6)]
    assert sorted(resumed.consumed[0]) == sorted(every)  # each prompt once: none lost, none repeated
    assert sorted(sum(first, []) + later[0]) == sorted(every) and resumed.epoch == 1


def test_columns_keep_arrays_as_objects():
    rows = [FeedRow(0, {"id": 1, "image": np.zeros((2, 2))}), FeedRow(0, {"id": 2, "image": np.ones((3, 1))})]
    out = columns(rows)
    assert out["id"].tolist() == [1, 2] and out["image"][1].shape == (3, 1)


def test_draw_sizes_and_the_group_filter():
    assert [prompts_to_start(16, s) for s in (1.0, 1.25, 1.5)] == [16, 20, 24]
    assert prompts_to_start(3, 1.25) == 4 and prompts_to_start(0, 1.5) == 0
    assert groups_to_finish(16, keep_rate=0.5) == 32 and groups_to_finish(4, keep_rate=0.0) == 40
    assert groups_to_finish(5) == 5 and groups_to_finish(0, 0.5) == 0
    assert is_informative([0.0, 1.0], "reward") and not is_informative([0.5, 0.5], "reward")
    assert not is_informative([0.2, 0.5], "accuracy") and is_informative([0.2, 1.0], "accuracy")
    assert split_finished([3, 0, 4], count=5) == (
        [3, 0, 4],
        [1, 2],
    )  # finish order; the aborted in prompt order
    assert split_finished([3, 0, 4, 1], count=5, pinned=frozenset({1})) == ([1, 3, 0, 4], [2])
    assert top_up(["a"], ["x", "y", "z"], share=3) == ["a", "y", "z"] and top_up(["a", "b"], ["x"], 2) == [
        "a",
        "b",
    ]
