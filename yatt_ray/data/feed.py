"""The data position: which prompts this epoch has consumed, and streams that skip them after a resume.

Ray Data's `streaming_split` iterators cannot seek, so the position is kept as a set of prompt ids.

Epoch semantics: an epoch is one pass over the (shuffled) dataset, split evenly over the data-parallel groups
(`equal=True`: up to dp-1 rows may be left out; each group also leaves out the rows short of a full step at the
end of its share). Every controller records the ids of the prompts it trains on in the current epoch; a
checkpoint stores the union over all groups and the epoch number. A resumed run first finishes that epoch on the
dataset *without* those ids (the same shuffle, so the rest keeps its order), then runs full epochs. So each prompt
is consumed once per epoch across any number of resumes, whatever the number of groups before and after.

Each feed fetches one batch ahead in a background thread (`_Prefetch`), so a step's prompts are on hand when
it starts, and the first fetch (Ray Data's cold start, seconds) overlaps the engine's and trainer's start-up.
A batch fetched ahead is not consumed: the position changes only when `next()` hands a batch out.

The splits are made inside the training workers (rank 0 builds them and sends each rank the list), not on the
driver: after a Ray Train restart, the workers build fresh ones that know the checkpoint's consumed ids.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist

from yatt_ray.errors import DataError

log = logging.getLogger(__name__)


class ExcludeIds:
    """A Ray Data batch function dropping the rows whose "id" is in `ids`."""

    def __init__(self, ids: list) -> None:
        self.ids = np.asarray(ids)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        keep = ~np.isin(batch["id"], self.ids)
        return {k: v[keep] for k, v in batch.items()}


def open_splits(dataset, dp_size: int, consumed: list) -> dict[str, Any]:
    """On rank 0: {"full": splits of the dataset, "rest": splits without `consumed` (None when empty)}; each a
    list with one iterator per data-parallel group."""
    splits: dict[str, Any] = {"full": dataset.streaming_split(dp_size, equal=True), "rest": None}
    if consumed:
        rest = dataset.map_batches(ExcludeIds(consumed), batch_format="numpy")
        splits["rest"] = rest.streaming_split(dp_size, equal=True)
    return splits


def share_splits(splits: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's `open_splits` result on every rank (collective over the default group)."""
    box = [splits]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None, "rank 0 always sends the splits"
    return box[0]


class PromptFeed:
    """Batches of one group's prompt rows, epoch after epoch, recording the ids consumed in this epoch.

    `rest` (an iterator over the current epoch's unconsumed rows) serves first when given; then `full` serves
    whole epochs. Each ``next()`` returns a numpy batch of `batch_size` rows and records its ids.

    `carried`: ids a resumed checkpoint had already consumed in `epoch` (give them to one group only). They stay
    part of this epoch's position, so the next checkpoint stores them again beside the new ones: without them a
    second resume would forget every prompt trained before the first one and train it again in the same epoch.
    """

    def __init__(self, full, rest, batch_size: int, epoch: int = 0, carried: list | None = None) -> None:
        self.full, self.rest, self.batch_size = full, rest, batch_size
        self.epoch = epoch
        self.consumed: list = list(carried or [])  # ids consumed in `epoch` (carried ones included)
        self.last_ids: list = []  # ids of the latest batch
        self._warned_ids = False
        self._batches = _Prefetch(self._epochs())

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        epoch, rows = next(self._batches)
        if epoch != self.epoch:  # the first batch of a new epoch
            self.epoch, self.consumed = epoch, []
        ids = rows["id"].tolist()
        if -1 in ids or len(set(ids)) < len(ids):
            if not self._warned_ids:
                self._warned_ids = True
                log.warning(
                    "prompt ids are missing (-1) or repeated: the data position is not recorded, and a resumed "
                    "run starts its epoch over; give every row a unique data.id_key column"
                )
        else:
            self.consumed.extend(ids)
        self.last_ids = ids
        return rows

    def _epochs(self) -> Iterator[tuple[int, dict]]:
        """(epoch, batch) pairs; runs in the prefetch thread, so it changes no state of the feed."""
        shard, first = (self.rest, True) if self.rest is not None else (self.full, False)
        epoch = self.epoch
        while True:
            empty = True
            for batch in shard.iter_batches(batch_size=self.batch_size, drop_last=True, batch_format="numpy"):
                empty = False
                yield epoch, batch
            if empty and not first:
                raise DataError(
                    f"this group's share of the prompt data holds fewer than {self.batch_size} rows (one step's "
                    "prompts); lower train.prompts_per_step or add data"
                )
            shard, first = self.full, False
            epoch += 1


class _Prefetch:
    """An iterator run one item ahead in a daemon thread; its exceptions are raised to the consumer."""

    def __init__(self, source: Iterator) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=1)
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
