"""Fault drills for checkpoints: kill a training worker, damage a checkpoint, audit the prompts consumed.

Used by tests/integration/test_checkpoint_faults.py and release/fault_injection.py. The prompt audit reads
the per-step prompt-id files that `checkpoint.log_prompt_ids=true` writes, keeps for each step the record of
the attempt that survived (a start that resumed from step b replaces every earlier record after b), and
compares them with the consumed-prompt set of the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import fsspec

from yatt_ray.checkpoint.store import CheckpointStore
from yatt_ray.checkpoint.training import _NO_RETENTION, RUN_ENTRY, rank_url, run_position
from yatt_ray.checkpoint.writer import load


@dataclass
class PromptAudit:
    """Both directions of exactly-once, from the prompt-id log and the newest checkpoint."""

    steps: int  # steps whose prompts survive (one record per step and data-parallel group)
    prompts: int  # prompts trained on by surviving steps
    duplicated: int  # prompts trained on more than once in one epoch
    lost: int  # prompts the newest checkpoint counts as consumed that no surviving step trained on (skipped)
    forgotten: int  # prompts trained before the newest checkpoint (same epoch) that it does not count as
    # consumed: a run continued from it would train them a second time in the epoch
    discarded_steps: int  # step records of attempts that were rolled back (steps redone)


def prompt_records(checkpoint_dir: str, storage_options: dict | None = None) -> list[dict]:
    fs, root = fsspec.core.url_to_fs(checkpoint_dir, **(storage_options or {}))
    try:
        names = fs.ls(f"{root}/prompt_ids", detail=False)
    except FileNotFoundError:
        return []
    return sorted((json.loads(fs.cat_file(n)) for n in names), key=lambda r: r["t"])


def surviving_records(records: list[dict]) -> tuple[list[dict], int]:
    """The records of the attempts that survived (a start that resumed from step b replaces every earlier
    record after b), and how many step records were rolled back."""
    kept: list[dict] = []
    sessions: set[str] = set()
    discarded = 0
    for record in records:
        if record["session"] not in sessions:
            sessions.add(record["session"])
            stale = [r for r in kept if r["step"] > record["base"]]
            discarded += len({r["step"] for r in stale})
            kept = [r for r in kept if r["step"] <= record["base"]]
        kept.append(record)
    return kept, discarded


def prompt_audit(
    checkpoint_dir: str, storage_options: dict | None = None, earlier: tuple[str, ...] = ()
) -> PromptAudit:
    """Which prompts the surviving steps trained on, per epoch, against the newest checkpoint's data position.
    `earlier`: checkpoint folders of the runs this one continued (checkpoint.resume=<folder>), whose steps
    count too."""
    records = [r for d in (*earlier, checkpoint_dir) for r in prompt_records(d, storage_options)]
    kept, discarded = surviving_records(sorted(records, key=lambda r: r["t"]))
    per_epoch: dict[int, list] = {}
    for r in kept:
        for i, epoch in _with_epochs(r):
            per_epoch.setdefault(epoch, []).append(i)
    duplicated = sum(len(ids) - len(set(ids)) for ids in per_epoch.values())
    lost = forgotten = 0
    newest = newest_position(checkpoint_dir, storage_options)
    if newest is not None:
        step, floor, position = newest
        for epoch in range(floor, max([floor, *position]) + 1):
            consumed = set(position.get(epoch, []))
            before = {i for r in kept if r["step"] <= step for i, e in _with_epochs(r) if e == epoch}
            lost, forgotten = lost + len(consumed - before), forgotten + len(before - consumed)
    return PromptAudit(
        steps=len({r["step"] for r in kept}),
        prompts=sum(len(r["ids"]) for r in kept),
        duplicated=duplicated,
        lost=lost,
        forgotten=forgotten,
        discarded_steps=discarded,
    )


def _with_epochs(record: dict) -> list[tuple]:
    """(prompt id, epoch) pairs of one prompt-log record."""
    epochs = record.get("epochs") or [int(record.get("epoch", 0))] * len(record["ids"])
    return list(zip(record["ids"], epochs))


def newest_run_state(checkpoint_dir: str, storage_options: dict | None = None) -> dict | None:
    """The run state (run.json: step, epoch, position, history, KL, keep rate) of the newest valid checkpoint,
    or None."""
    ref = CheckpointStore(checkpoint_dir, storage_options=storage_options).latest_valid()
    if ref is None:
        return None
    rank0 = CheckpointStore(rank_url(checkpoint_dir, 0), _NO_RETENTION, None, storage_options)
    return load(rank0, rank0.ref(ref.step), [RUN_ENTRY])[RUN_ENTRY]


def newest_position(checkpoint_dir: str, storage_options: dict | None = None) -> tuple[int, int, dict] | None:
    """(step, oldest open epoch, consumed ids by epoch) of the newest valid checkpoint, or None."""
    run = newest_run_state(checkpoint_dir, storage_options)
    return None if run is None else (int(run["step"]), int(run["epoch"]), run_position(run))


def committed_steps(checkpoint_dir: str) -> list[int]:
    return CheckpointStore(checkpoint_dir).list_committed()


def when(
    condition: Callable[[], bool], action: Callable[[], None], timeout_s: float = 600
) -> threading.Thread:
    """Run `action` in a daemon thread as soon as `condition()` holds (polled every 0.2 s)."""

    def watch() -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if condition():
                    action()
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def kill_training_worker(rank_hint: int = 1) -> int:
    """SIGKILL one live Ray Train worker process (the `rank_hint`-th by pid order); returns its pid."""
    return _kill_actor("RayTrainWorker", rank_hint)


def kill_engine_actor(rank_hint: int = 0) -> int:
    """SIGKILL one live rollout engine actor process (`placement.rollout_engines`); Ray restarts it."""
    return _kill_actor("EngineActor", rank_hint)


def engine_actors() -> list:
    """Handles of the live rollout engine actors (`placement.rollout_engines`, named `yatt-engine-<run>-<i>`)."""
    import ray
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", "EngineActor"), ("state", "=", "ALIVE")], detail=True)
    return [ray.get_actor(a.name, namespace=a.ray_namespace) for a in actors if a.name]


def kill_engine_in_push(timeout_s: float = 600) -> int:
    """SIGKILL a rollout engine actor while it receives a bucket of a broadcast weight push (polled through its
    `info()`); returns its pid. RuntimeError when no push is seen within `timeout_s`."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for actor in engine_actors():
            try:
                info = ray.get(actor.info.remote(), timeout=10)
            except ray.exceptions.RayError:
                continue  # restarting
            if info["receiving"]:
                os.kill(info["pid"], signal.SIGKILL)
                return int(info["pid"])
    raise RuntimeError(f"no rollout engine received a broadcast push within {timeout_s:.0f} s")


def kill_engine_between_pushes(rank_hint: int = 0) -> int:
    """SIGKILL a rollout engine actor that is not receiving a push; returns its pid."""
    import ray

    while True:
        infos = ray.get([a.info.remote() for a in engine_actors()], timeout=60)
        idle = sorted((i["pid"] for i in infos if not i["receiving"]), reverse=rank_hint > 0)
        if idle:
            os.kill(idle[0], signal.SIGKILL)
            return int(idle[0])
        time.sleep(0.05)


def live_actor_pids(class_name: str, settle_s: float = 0.0) -> list[int]:
    """pids of the live actors of `class_name`, after waiting up to `settle_s` for any being killed to end
    (`ray.kill` returns before the process is gone)."""
    from ray.util.state import list_actors

    deadline = time.monotonic() + settle_s
    while True:
        actors = list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")], detail=True)
        if not actors or time.monotonic() >= deadline:
            return sorted(a.pid for a in actors if a.pid)
        time.sleep(0.5)


def _kill_actor(class_name: str, rank_hint: int) -> int:
    pids = live_actor_pids(class_name)
    if not pids:
        raise RuntimeError(f"no live {class_name} actor to kill")
    pid = pids[min(rank_hint, len(pids) - 1)]
    os.kill(pid, signal.SIGKILL)
    return pid


def corrupt_checkpoint(checkpoint_dir: str, step: int, rank: int = 0, name: str = "policy.pt") -> str:
    """Flip bytes in the middle of one rank file of checkpoint `step` (its manifest is left as it was)."""
    path = f"{rank_url(checkpoint_dir, rank)}/step_{step:08d}/{name}"
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(64)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return path
