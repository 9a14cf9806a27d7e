"""Resume safety without a cluster: the data position survives a chain of resumes, a checkpoint holding a
pickled object is refused unread, bad resume folders and unreachable stores are caught on the driver,
Ctrl-C asks for a save and a second one aborts, worker errors keep their type."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from yatt_ray.checkpoint import AsyncCheckpointWriter, CheckpointError, CheckpointStore, load
from yatt_ray.checkpoint.driver import check_checkpoints
from yatt_ray.checkpoint.schedule import PreemptionFlag
from yatt_ray.checkpoint.store import step_dir_name
from yatt_ray.checkpoint.training import RUN_ENTRY, RUN_FORMAT, choose_resume, merge_positions, rank_url
from yatt_ray.config import Config
from yatt_ray.data.feed import MarkConsumed, PromptFeed, resumed_epochs
from yatt_ray.errors import DataError, WorkerError


class FakeShard:
    """A Ray Data shard stand-in: numpy batches of ids, in order."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def iter_batches(self, batch_size: int, batch_format: str, drop_last: bool = False):
        import numpy as np

        for i in range(0, len(self.ids) - batch_size + 1, batch_size):
            yield {"id": np.asarray(self.ids[i : i + batch_size])}


def test_carried_ids_stay_in_the_position_until_the_epoch_ends():
    """A resumed feed keeps the checkpoint's consumed ids beside the new ones (the bug: it started empty, so
    the next checkpoint forgot every prompt trained before the first resume); a new epoch starts empty."""
    full = FakeShard(list(range(12)))
    rest = FakeShard([4, 5, 6, 7, 8, 9, 10, 11])  # ids 0-3 were consumed before the resume
    feed = PromptFeed(full, [(0, rest)], batch_size=4, epoch=0, carried={0: [0, 1, 2, 3]})
    next(feed)
    assert sorted(feed.consumed[0]) == list(range(8)) and feed.epoch == 0
    next(feed)
    assert sorted(feed.consumed[0]) == list(range(12))
    next(feed)  # epoch 1 begins with the full shard
    assert feed.epoch == 1 and feed.consumed[1] == [0, 1, 2, 3] and feed.open_epoch() == 1
    assert feed.position(since=1) == {1: [0, 1, 2, 3]}


class Exploit:
    """An object whose unpickling would create a file: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_holding_a_pickled_object_is_refused_unread(tmp_path):
    marker = tmp_path / "code-ran"
    store = CheckpointStore(str(tmp_path / "ckpt"))
    ref = AsyncCheckpointWriter(store).save_sync(
        1, {"policy": {"w": torch.ones(2)}, "evil": [Exploit(marker)]}
    )
    assert not marker.exists()  # writing it ran nothing
    assert torch.equal(load(store, ref, ["policy"])["policy"]["w"], torch.ones(2))  # tensors load
    with pytest.raises(CheckpointError, match="evil.pt.*pickled object.*refused") as err:
        load(store, ref, ["evil"])
    assert "trust" in str(err.value)
    assert not marker.exists()  # ... and reading it ran nothing either


def test_run_state_is_json_on_disk(tmp_path):
    store = CheckpointStore(str(tmp_path))
    state = {"step": 3, "epoch": 0, "consumed": [5, 7], "history": [{"step": 1.0, "loss": 0.5}], "kl": 0.1}
    ref = AsyncCheckpointWriter(store).save_sync(3, {RUN_ENTRY: state})
    assert (Path(ref.path) / RUN_ENTRY).read_text().startswith("{")
    assert load(store, ref)[RUN_ENTRY] == state
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        AsyncCheckpointWriter(store).save_sync(4, {RUN_ENTRY: {"t": torch.ones(1)}})


def config_for(ckpt: str, resume: str = "auto", **storage) -> Config:
    config = Config()
    config.checkpoint.dir, config.checkpoint.resume = ckpt, resume
    config.checkpoint.storage_options = dict(storage)
    return config


def write_run_checkpoint(root: str, step: int, tp_size: int = 1, train_vision: str = "none") -> None:
    """A committed one-rank run checkpoint as the workers write it."""
    rank0 = CheckpointStore(rank_url(root, 0), keep_last=100)
    AsyncCheckpointWriter(rank0).save_sync(
        step, {"rng": {"torch": torch.get_rng_state()}, RUN_ENTRY: {"epoch": 0, "consumed": [1]}}
    )
    run = CheckpointStore(root, keep_last=100)
    meta = {
        "format": RUN_FORMAT,
        "world_size": 1,
        "dp_size": 1,
        "tp_size": tp_size,
        "train_vision": train_vision,
    }
    run.commit(run.begin(step), meta)


def damage(root: str, step: int) -> None:
    rng = Path(rank_url(root, 0), step_dir_name(step), "rng.pt")
    rng.write_bytes(rng.read_bytes()[:-8] + b"damaged!")


def test_the_runs_own_checkpoints_win_over_checkpoint_resume(tmp_path):
    """A continued run (checkpoint.resume=<another run's folder>) takes that folder only while its own
    checkpoint.dir holds no checkpoint; from its first commit on, every start (a restart after a killed worker,
    the same command again) continues from its own newest valid one: it never rolls back to the other folder."""
    earlier, own = str(tmp_path / "earlier"), str(tmp_path / "own")
    for step in (2, 4):
        write_run_checkpoint(earlier, step)
    cfg = config_for(own, earlier).checkpoint
    assert choose_resume(cfg)[:2] == (earlier, 4)
    assert choose_resume(cfg, restart=True)[:2] == (earlier, 4)  # died before its first commit
    for step in (6, 8):
        write_run_checkpoint(own, step)
    assert choose_resume(cfg)[:2] == (own, 8)
    assert choose_resume(cfg, restart=True)[:2] == (own, 8)
    assert choose_resume(config_for(own, f"{earlier}/step_00000002").checkpoint, restart=True)[:2] == (own, 8)
    damage(own, 8)
    assert choose_resume(cfg, restart=True)[:2] == (own, 6)  # the newest valid one of its own
    damage(own, 6)
    with pytest.raises(CheckpointError, match="every one of steps \\[6, 8\\] is damaged"):
        choose_resume(cfg, restart=True)  # never back to the other folder silently


def test_resume_never_refuses_a_used_folder_at_the_first_start_only(tmp_path):
    own = str(tmp_path / "own")
    cfg = config_for(own, "never").checkpoint
    assert choose_resume(cfg) is None and choose_resume(cfg, restart=True) is None
    write_run_checkpoint(own, 2)
    with pytest.raises(
        CheckpointError, match="already holds checkpoints \\[2\\] but checkpoint.resume=never"
    ):
        choose_resume(cfg)
    assert choose_resume(cfg, restart=True)[:2] == (own, 2)  # a restart continues the run


def test_a_checkpoint_resumes_only_under_its_train_vision(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    write_run_checkpoint(ckpt, 2, train_vision="projector")
    config = config_for(ckpt)
    with pytest.raises(
        CheckpointError, match="model.train_vision=projector, this run has model.train_vision=none"
    ):
        check_checkpoints(config)
    config.model.train_vision = "projector"
    assert "resuming from step 2" in check_checkpoints(config)


def test_resumed_epochs_include_open_epochs_that_consumed_nothing():
    assert resumed_epochs(3, {}) == []
    assert resumed_epochs(0, {0: [1, 2]}) == [(0, [1, 2])]
    # epoch 0 still open (its rows were all in queues: over-sampling requeued them), epoch 1 untouched,
    # epoch 2 consumed from: all three are read again, 0 and 1 whole
    assert resumed_epochs(0, {2: [5]}) == [(0, []), (1, []), (2, [5])]


def test_driver_check_finds_the_checkpoint_to_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert "fresh start" in check_checkpoints(config_for(ckpt))
    write_run_checkpoint(ckpt, 2)
    write_run_checkpoint(ckpt, 4)
    assert "resuming from step 4" in check_checkpoints(config_for(ckpt))
    assert "resuming from step 2" in check_checkpoints(
        config_for(str(tmp_path / "new"), f"{ckpt}/step_00000002")
    )
    assert not [p for p in Path(ckpt).iterdir() if p.name.startswith(".yatt-write-probe")]  # probe removed


def test_driver_check_rejects_missing_damaged_and_mismatched_folders(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="holds no committed checkpoint"):
        check_checkpoints(config_for(str(tmp_path / "new"), str(tmp_path / "nowhere")))
    write_run_checkpoint(ckpt, 2)
    rng = Path(rank_url(ckpt, 0), "step_00000002", "rng.pt")
    rng.write_bytes(rng.read_bytes()[:-8] + b"damaged!")
    with pytest.raises(CheckpointError, match="every one of steps \\[2\\] is damaged"):
        check_checkpoints(config_for(ckpt))
    write_run_checkpoint(str(tmp_path / "tp2"), 2, tp_size=2)
    with pytest.raises(CheckpointError, match="train.tp_size=2"):
        check_checkpoints(config_for(str(tmp_path / "tp2")))


def test_driver_check_names_an_unreachable_store_quickly():
    port = 1  # nothing listens there: connection refused
    config = config_for(
        "s3://bucket/run", endpoint_url=f"http://127.0.0.1:{port}", key="k", secret="s",
        client_kwargs={"region_name": "us-east-1"}, config_kwargs={"retries": {"max_attempts": 1}},
    )  # fmt: skip
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="checkpoint.dir='s3://bucket/run'.*endpoint_url"):
        check_checkpoints(config, timeout_s=20)
    assert time.monotonic() - start < 25


def test_first_ctrl_c_asks_for_a_save_and_the_second_aborts():
    before = signal.getsignal(signal.SIGINT)  # the default handler, or SIG_IGN in a background job
    flag = PreemptionFlag((signal.SIGTERM, signal.SIGINT), abort_on_repeat=(signal.SIGINT,))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert flag.requested and flag.received == signal.SIGINT  # no KeyboardInterrupt the first time
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    finally:
        flag.close()
    assert signal.getsignal(signal.SIGINT) == before  # the handler from before is back


def test_worker_errors_keep_their_type_through_ray_trains_wrappers():
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import WorkerGroupError

    from yatt_ray.fit import _worker_error

    wrapped = WorkerGroupError(
        "rank 1 failed", {1: UserExceptionWithTraceback(DataError("bad row 51"), "tb")}
    )
    err = _worker_error(wrapped)
    assert type(err) is DataError and "bad row 51" in str(err)
    assert type(_worker_error(WorkerGroupError("x", {0: RuntimeError("boom")}))) is WorkerError


class MarkedShard:
    """A streaming-split stand-in over a tiny epoch: the same ids every epoch, `consumed` ones marked as
    `open_splits` marks a resumed epoch's."""

    def __init__(self, ids: list[int], consumed: list | None = None) -> None:
        self.ids, self.mark = ids, MarkConsumed(consumed if consumed is not None else [])

    def iter_batches(self, batch_size: int, batch_format: str, drop_last: bool = False):
        import numpy as np

        for i in range(0, len(self.ids), batch_size):
            yield self.mark({"id": np.asarray(self.ids[i : i + batch_size])})


def test_an_epoch_that_consumed_nothing_before_the_save_is_read_after_the_resume():
    """A tiny epoch (3 prompts) and over-sampling: one draw starts 7 prompts over epochs 0-2, the last one
    finishes and the rest are aborted back to the queue. The checkpoint holds ids of epoch 2 only, with epoch 0
    still open; the resumed feed reads epochs 0 and 1 whole, then the rest of 2: every prompt once an epoch."""
    data = [0, 1, 2]
    feed = PromptFeed(MarkedShard(data), [], batch_size=2)
    feed.pull(7)
    started = feed.pop(7)
    feed.consume(started[-1:])  # finished first
    feed.requeue(started[:-1])  # aborted: not consumed
    floor, position = merge_positions([(feed.open_epoch(), feed.position(0))])
    assert (floor, position) == (0, {2: [0]})
    rest = [(e, MarkedShard(data, ids)) for e, ids in resumed_epochs(floor, position)]
    resumed = PromptFeed(MarkedShard(data), rest, batch_size=2, epoch=floor, carried=position)
    while resumed.epoch < 3:
        next(resumed)
    for epoch in (0, 1, 2):
        assert sorted(resumed.consumed[epoch]) == data, epoch
