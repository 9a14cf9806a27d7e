"""The data position: which prompts each epoch has consumed, and streams that skip them after a resume.

Ray Data's `streaming_split` iterators cannot seek, so the position is kept as prompt ids, per epoch. An id
names one row: `check_sources` refuses an id repeated within a file, and a run over several files keys each
row on its file and id ("gsm8k/train.parquet:17", `sources.qualified_id`), so files that index from 0 alike
(verl's GSM8K and MATH) do not mark each other's rows. A row without an id (-1, or "") is trained but not
recorded: a resumed run trains it again in its epoch.

Epoch semantics: an epoch is one pass over the (shuffled) dataset, split evenly over the data-parallel groups
(`equal=True`: up to dp-1 rows may be left out). A step may take the last rows of one epoch and the first of the
next. Every controller records the ids of the prompts it consumes, by epoch: the prompts it trains on and the
ones dynamic sampling drew and dropped. Prompts started and then aborted (over-sampling) are not consumed: they
go back to the front of the group's queue. A checkpoint stores, for every epoch some group has not finished
(the oldest one a group still reads, holds in its queue, or its stream is in), the union of the ids consumed in
it. A resumed run first reads those epochs again with their ids marked consumed and read past (the same
shuffle, so the rest keeps its order), oldest first, then full epochs. So each prompt is consumed once per epoch across any number of resumes,
whatever the number of groups before and after; what sat in a queue (not consumed) is read again.

Lockstep: a `streaming_split` starts its next epoch only once every split has asked for it, so a group that
reads further than another would wait for it at the epoch's end while the other waits in a collective of the
step. The groups therefore read their streams in lockstep (`pull(k)` with the same k on every group, rounds
until every group holds what it needs; the controller agrees k with an all-reduce) and keep what they do not
start yet in their queue.

Each feed fetches two batches ahead in a background thread (`_Prefetch`), so a step's prompts are on hand when
it starts, and the first fetch (Ray Data's cold start, seconds) overlaps the engine's and trainer's start-up.
Rows fetched ahead are not consumed: the position changes only through `consume`.

The splits are made inside the training workers (rank 0 builds them and sends each rank the list), not on the
driver: after a Ray Train restart, the workers build fresh ones that know the checkpoint's consumed ids.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch.distributed as dist

from yatt_ray.data.images import ERROR as IMAGE_ERROR  # why a row's images did not load ('' when they did)
from yatt_ray.data.sources import has_id
from yatt_ray.errors import DataError

log = logging.getLogger(__name__)

Position = dict[int, list]  # epoch -> prompt ids consumed in it (the epochs not finished by every group)
# (ids as `build_dataset` gives them: plain over one file, "<file name>:<id>" over several; JSON, sortable)


@dataclass(frozen=True)
class FeedRow:
    """One prompt row (column -> value), the epoch it was read in, and how often it was aborted."""

    epoch: int
    row: dict[str, Any]
    aborts: int = 0

    @property
    def id(self) -> Any:
        """The key of the row in the data position (see the module docstring), as a Python value."""
        value = self.row["id"]
        return value.item() if isinstance(value, np.generic) else value


def columns(rows: list[FeedRow]) -> dict[str, np.ndarray]:
    """Rows as a numpy batch (column -> array), the form Ray Data hands out."""
    if not rows:
        return {}
    return {key: _stack([r.row[key] for r in rows]) for key in rows[0].row}


def _stack(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out if any(isinstance(v, np.ndarray) for v in values) else np.asarray(values)


SKIP = "_consumed"  # the column `MarkConsumed` adds: rows a resumed epoch had already consumed
RECENT_REJECTED = 5  # rejected rows a feed keeps for the error that stops a run whose rows are all rejected


@dataclass
class EpochTally:
    """The rows of one epoch a feed read: usable ones (queued, or consumed before a resume) and rejected ones
    (images that did not load)."""

    epoch: int
    usable: int = 0
    rejected: int = 0


def describe_rejected(rows: list[FeedRow] | list[tuple[Any, str]], limit: int = 3, width: int = 240) -> str:
    """'id 3: <why>; id 7: <why>' for the first `limit` of `rows` (FeedRows or (id, why) pairs), each reason
    cut at `width` characters."""
    pairs = [(r.id, str(r.row.get(IMAGE_ERROR, ""))) if isinstance(r, FeedRow) else r for r in rows]
    cut = [(i, why if len(why) <= width else why[: width - 3] + "...") for i, why in pairs[:limit]]
    return "; ".join(f"id {i!r}: {why}" for i, why in cut)


class MarkConsumed:
    """A Ray Data batch function marking (column `SKIP`) the rows whose "id" is in `ids`; the feed reads past
    them. Marked rather than dropped: every split of the epoch then holds as many rows as in a fresh epoch
    (`equal=True` leaves out no unconsumed row), and the splits still end together. Compared as Python values
    (a set), so an object column of strings or ints of any width matches the ids read back from JSON."""

    def __init__(self, ids: list) -> None:
        self.ids = set(ids)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        column = batch["id"]
        marks = np.fromiter((_plain(i) in self.ids for i in column), dtype=bool, count=len(column))
        return {**batch, SKIP: marks}


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def resumed_epochs(epoch: int, position: Position) -> list[tuple[int, list]]:
    """The epochs a resumed run reads again before full ones, oldest first, each with its consumed ids: every
    epoch from the oldest open one (`epoch`) to the newest with consumed ids, also one in between (or the oldest)
    where nothing was consumed yet (its rows were all in queues when the checkpoint was taken)."""
    if not position:
        return []
    return [(e, list(position.get(e, []))) for e in range(min(epoch, *position), max(position) + 1)]


def open_splits(dataset, dp_size: int, epoch: int, position: Position) -> dict[str, Any]:
    """On rank 0: {"full": splits of the dataset, "rest": [(epoch, splits with that epoch's consumed rows
    marked)] for `resumed_epochs(epoch, position)`}; each splits value a list with one iterator per
    data-parallel group."""
    rest = [
        (e, dataset.map_batches(MarkConsumed(ids), batch_format="numpy").streaming_split(dp_size, equal=True))
        for e, ids in resumed_epochs(epoch, position)
    ]
    return {"full": dataset.streaming_split(dp_size, equal=True), "rest": rest}


def share_splits(splits: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's `open_splits` result on every rank (collective over the default group)."""
    box = [splits]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None, "rank 0 always sends the splits"
    return box[0]


class PromptFeed:
    """One group's prompt rows, epoch after epoch: a queue in front of its stream, and the ids it consumed.

    - `rest`: [(epoch, iterator over that epoch's unconsumed rows)], read first, in order; then `full` serves
      whole epochs, numbered from one past the last `rest` epoch (from `epoch` without any).
    - `pull(k)` reads k rows from the stream to the back of the queue; `pop(k)` takes up to k from its front;
      `requeue(rows)` puts rows back at the front (aborted prompts: served first next time); `consume(rows)`
      records their ids in the position. `next(feed)` is all four for a step of `batch_size` rows.
    - `carried`: the position a resumed checkpoint had already consumed (give it to one group only). It stays
      part of this feed's position, so the next checkpoint stores it again beside the new ids: without it a
      second resume would forget every prompt trained before the first one and train it again in the epoch.
    """

    def __init__(self, full, rest, batch_size: int, epoch: int = 0, carried: Position | None = None) -> None:
        self.full, self.rest, self.batch_size = full, list(rest or []), batch_size
        self.first_full_epoch = self.rest[-1][0] + 1 if self.rest else epoch
        self.consumed: Position = {e: list(ids) for e, ids in (carried or {}).items()}
        self.queue: deque[FeedRow] = deque()
        self.lent: dict[int, FeedRow] = {}  # popped, not yet consumed or requeued (in flight), by object id
        self.last_ids: list = []  # ids of the latest `next()` batch
        # rows with images that did not load, consumed; the controller drains it
        self.rejected: list[FeedRow] = []
        # rows rejected since the last usable one, the most ever rejected one after another, and the latest
        # few rejected (data.max_rejected_in_a_row)
        self.rejected_in_a_row = self.longest_rejected_run = 0
        self.recent_rejected: deque[FeedRow] = deque(maxlen=RECENT_REJECTED)
        self.epoch = self.rest[0][0] if self.rest else epoch  # epoch of the latest row read from the stream
        self._tally = EpochTally(self.epoch)  # the rows of the epoch being read
        self.finished: EpochTally | None = None  # those of the last epoch read to its end
        self._warned_ids = False
        self._buffer: deque[FeedRow | None] = deque()  # rows of the fetched batch not pulled yet
        self._batches = _Prefetch(self._epochs())
        self.first_batch_at: float | None = None  # when the stream's first batch arrived (start-up table)

    # ---- reading ------------------------------------------------------------------------------------
    def pull(self, k: int) -> None:
        """Read `k` rows of the stream (blocks until they arrive); the unconsumed ones join the back of the
        queue (a resumed epoch's consumed rows are read past), except rows whose images did not load (a
        non-empty `image_error`): those are consumed at once and kept in `rejected` for the controller to
        count, so the queue may grow by fewer than `k`. It counts them as it goes (`rejected_in_a_row`,
        `longest_rejected_run`, and per epoch `finished`: the usable and rejected rows of the last epoch read
        to its end), so the controllers can stop a run whose rows are all rejected."""
        for _ in range(k):
            if not self._buffer:
                self._fetch()
            row = self._buffer.popleft()
            if row is None:  # consumed before a resume: counted as usable (its images loaded then)
                self._tally.usable += 1
                continue
            self.epoch = row.epoch
            if row.row.get(IMAGE_ERROR):  # images that did not load (data.on_bad_image=skip): set aside
                self.consume([row])
                self.rejected.append(row)
                self.recent_rejected.append(row)
                self.rejected_in_a_row += 1
                self.longest_rejected_run = max(self.longest_rejected_run, self.rejected_in_a_row)
                self._tally.rejected += 1
            else:
                self.queue.append(row)
                self.rejected_in_a_row = 0
                self._tally.usable += 1

    def _fetch(self) -> None:
        """The stream's next batch into the buffer (blocks until it arrives)."""
        epoch, batch = next(self._batches)
        self.first_batch_at = self.first_batch_at or time.time()
        if epoch != self._tally.epoch:  # every row of the epoch before was pulled (the buffer was empty)
            self.finished, self._tally = self._tally, EpochTally(epoch)
        skip = batch.pop(SKIP, np.zeros(len(batch["id"]), dtype=bool))
        rows = (FeedRow(epoch, {c: v[i] for c, v in batch.items()}) for i in np.flatnonzero(~skip))
        self._buffer.extend([None] * int(skip.sum()) + list(rows))  # None: a consumed row's place
        self.epoch = epoch

    def prime(self) -> float:
        """Wait for the stream's first batch (start-up: Ray Data's cold start, 9 s on 2 cores, is then not
        counted in step 1); returns when it arrived. Nothing is consumed or queued."""
        if not self._buffer and self.first_batch_at is None:
            self._fetch()
        assert self.first_batch_at is not None
        return self.first_batch_at

    def pop(self, k: int) -> list[FeedRow]:
        """Up to `k` rows from the front of the queue. They count as held (`open_epoch`) until consumed or
        requeued: an asynchronous rollout keeps them in flight across a checkpoint, and a resumed run reads
        them again."""
        rows = [self.queue.popleft() for _ in range(min(k, len(self.queue)))]
        self.lent.update((id(r), r) for r in rows)
        return rows

    def requeue(self, rows: list[FeedRow]) -> None:
        """Put `rows` back at the front of the queue, in their order (each one's abort count + 1): not consumed,
        served first next time."""
        for r in rows:
            self.lent.pop(id(r), None)
        self.queue.extendleft(replace(r, aborts=r.aborts + 1) for r in reversed(rows))

    def consume(self, rows: list[FeedRow]) -> None:
        """Record the rows' ids in their epochs' position (once trained on, or drawn and dropped). One prompt may
        come twice in `rows`, from the queue and from the next epoch: each is recorded in its own epoch. A row
        without an id is left out (warned once): a resumed run trains it again in its epoch."""
        unrecorded = 0
        for r in rows:
            self.lent.pop(id(r), None)
            if has_id(r.id):
                self.consumed.setdefault(r.epoch, []).append(r.id)
            else:
                unrecorded += 1
        if unrecorded and not self._warned_ids:
            self._warned_ids = True
            log.warning(
                "%d prompt(s) of this step have no id (data.id_key: no column, a null, or -1): the data position "
                "does not record them, so a resumed run trains them again in their epoch; give every row a "
                "unique id in data.id_key",
                unrecorded,
            )

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        """A step of `batch_size` rows (queue first), consumed, as a numpy batch."""
        while len(self.queue) < self.batch_size:
            self.pull(self.batch_size - len(self.queue))
        rows = self.pop(self.batch_size)
        self.consume(rows)
        self.last_ids = [r.id for r in rows]
        return columns(rows)

    # ---- the position -------------------------------------------------------------------------------
    def open_epoch(self) -> int:
        """The oldest epoch this group still reads, holds in its queue or in flight (popped, not yet consumed
        or requeued), or has its stream in."""
        held = [r.epoch for r in (*self.queue, *self._buffer, *self.lent.values()) if r is not None]
        return min([self.epoch, *held])

    def position(self, since: int) -> Position:
        """The consumed ids of each epoch >= `since` (older epochs are finished by every group)."""
        return {e: ids for e, ids in self.consumed.items() if e >= since}

    def _epochs(self) -> Iterator[tuple[int, dict]]:
        """(epoch, batch) pairs; runs in the prefetch thread, so it changes no state of the feed."""
        for epoch, shard in self.rest:
            for batch in shard.iter_batches(batch_size=self.batch_size, batch_format="numpy"):
                yield epoch, batch
        epoch = self.first_full_epoch
        while True:
            rows = 0
            for batch in self.full.iter_batches(batch_size=self.batch_size, batch_format="numpy"):
                rows += len(batch["id"])
                yield epoch, batch
            if rows < self.batch_size:
                raise DataError(
                    f"this group's share of the prompt data holds {rows} rows, fewer than {self.batch_size} (one "
                    "step's prompts); lower train.prompts_per_step or add data"
                )
            epoch += 1


class _Prefetch:
    """An iterator run `depth` items ahead in a daemon thread; its exceptions are raised to the consumer."""

    def __init__(self, source: Iterator, depth: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)  # batches held ahead (over-sampling pulls > 1)
        threading.Thread(target=self._run, args=(source,), name="prompt-prefetch", daemon=True).start()

    def _run(self, source: Iterator) -> None:
        try:
            for item in source:
                self._queue.put((item, None))
        except BaseException as exc:  # handed to the consumer's next()
            self._queue.put((None, exc))
        else:
            self._queue.put((None, StopIteration()))

    def __next__(self):
        item, error = self._queue.get()
        if error is not None:
            raise error
        return item
