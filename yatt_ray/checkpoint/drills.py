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
from yatt_ray.checkpoint.training import _NO_RETENTION, rank_url
from yatt_ray.checkpoint.writer import load


@dataclass
class PromptAudit:
    steps: int  # steps whose prompts survive (one record per step and data-parallel group)
    prompts: int  # prompts trained on by surviving steps
    duplicated: int  # prompts trained on more than once (in one epoch)
    lost: int  # prompts the newest checkpoint counts as consumed that no surviving step trained on
    discarded_steps: int  # step records of attempts that were rolled back (steps redone)


def prompt_records(checkpoint_dir: str) -> list[dict]:
    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    try:
        names = fs.ls(f"{root}/prompt_ids", detail=False)
    except FileNotFoundError:
        return []
    return sorted((json.loads(fs.cat_file(n)) for n in names), key=lambda r: r["t"])


def prompt_audit(checkpoint_dir: str) -> PromptAudit:
    """Which prompts the surviving steps trained on, against the newest checkpoint's consumed set."""
    kept: list[dict] = []
    sessions: set[str] = set()
    discarded = 0
    for record in prompt_records(checkpoint_dir):
        if record["session"] not in sessions:  # a new start rolls back everything after its resume step
            sessions.add(record["session"])
            stale = [r for r in kept if r["step"] > record["base"]]
            discarded += len({r["step"] for r in stale})
            kept = [r for r in kept if r["step"] <= record["base"]]
        kept.append(record)
    ids = [i for r in kept for i in r["ids"]]
    store = CheckpointStore(checkpoint_dir)
    ref = store.latest_valid()
    consumed: set = set()
    if ref is not None:
        rank0 = CheckpointStore(rank_url(checkpoint_dir, 0), _NO_RETENTION, None)
        consumed = set(load(rank0, rank0.ref(ref.step), ["run"])["run"]["consumed"])
    return PromptAudit(
        steps=len({r["step"] for r in kept}),
        prompts=len(ids),
        duplicated=len(ids) - len(set(ids)),
        lost=len(consumed - set(ids)),
        discarded_steps=discarded,
    )


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
    from ray.util.state import list_actors

    actors = list_actors(
        filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")], detail=True
    )
    pids = sorted(a.pid for a in actors if a.pid)
    if not pids:
        raise RuntimeError("no live RayTrainWorker actor to kill")
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
