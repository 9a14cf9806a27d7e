"""Checkpoints of a training run as the workers see them: resume, save on schedule, commit, export.

Layout under `checkpoint.dir` (any fsspec URL)::

    step_00000040/manifest.json           the run's commit marker for step 40 (no files; layout in metadata)
    ranks/rank_00000/step_00000040/...    rank 0's files: rng.pt, policy.pt, policy_optimizer.pt (+ critic's),
                                          run.json
    ranks/rank_00001/step_00000040/...    rank 1's files: rng.pt (+ its tensor-parallel shard when DP rank 0;
                                          + its optimizer shard with train.distributed_optimizer)
    hf/step_00000040/                     a Hugging Face export of the policy (at the chosen steps)
    prompt_ids/                           per-step prompt ids (only with checkpoint.log_prompt_ids)

Each rank writes its own files in the background (`AsyncCheckpointWriter` on its own store) and commits them
there. After every step the ranks exchange which saves they have finished; once every rank has committed step
s, rank 0 commits ``step_s/manifest.json``. A resume takes the newest step whose run marker and every needed
rank file verify (sha256); a damaged one is skipped with a warning (and moved aside when the run resumes
from an older one), while one in a newer format than this yatt_ray reads stops the start with an error
naming the versions (upgrade yatt_ray) and stays where it is. Rank 0 applies retention to the run's
markers and removes the rank files of steps no longer kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from yatt_ray.checkpoint.schedule import CheckpointSchedule
from yatt_ray.checkpoint.state import (
    load_trainer_state,
    owns_optimizer_state,
    rng_state,
    set_rng_state,
    trainer_state,
)
from yatt_ray.checkpoint.store import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointRef,
    CheckpointStore,
    step_dir_name,
)
from yatt_ray.checkpoint.writer import AsyncCheckpointWriter, SaveHandle, load
from yatt_ray.metrics.history import RESUME_KEY, MetricRow, rewind_history

log = logging.getLogger("yatt_ray.checkpoint")

RUN_FORMAT = "yatt_ray.run/2"  # /2: run state as JSON (run.json), tensors read with weights_only=True
RUN_ENTRY = "run.json"  # step, data position (epoch, consumed ids by epoch), history, KL, keep rate
_NO_RETENTION = 2**31 - 1  # rank stores keep everything; rank 0 prunes them after the run's retention
_STEP_RE = re.compile(r"step_(\d{8,})/?$")


def optimizer_ranks(meta: dict, layout, sharded: bool) -> list[int]:
    """The saved ranks whose optimizer files a rank at `layout` (its optimizer `sharded` or not) reads from a
    checkpoint whose run marker says `meta`: its own when the sharding is unchanged, else every saved shard of
    its tensor-parallel rank (it then cuts out its part); DP rank 0's when the saved state was not sharded.
    Rank = dp_rank * tp_size + tp_rank."""
    tp, tp_rank = layout.tp_size, layout.tp_rank
    if not meta.get("distributed_optimizer") or meta["dp_size"] == 1:
        return [tp_rank]  # data-parallel rank 0 holds the whole state
    if sharded and meta["dp_size"] == layout.dp_size:
        return [layout.rank]
    return [dp * tp + tp_rank for dp in range(meta["dp_size"])]


def merge_positions(groups: list[tuple[int, dict[int, list]]]) -> tuple[int, dict[int, list]]:
    """The run's data position from each group's (open epoch, consumed ids by epoch): the oldest open epoch and,
    for it and every later epoch, the sorted union of the ids consumed in it (older epochs are finished)."""
    floor = min(open_epoch for open_epoch, _ in groups)
    merged: dict[int, set] = {}
    for _, position in groups:
        for epoch, ids in position.items():
            if epoch >= floor:
                merged.setdefault(epoch, set()).update(ids)
    return floor, {e: sorted(merged[e]) for e in sorted(merged)}


def run_position(run: dict) -> dict[int, list]:
    """The position stored in a run state (run.json); one written before "position" existed holds one epoch."""
    if "position" in run:
        return {int(e): list(ids) for e, ids in run["position"].items()}
    return {int(run["epoch"]): list(run["consumed"])} if run["consumed"] else {}


def check_train_vision(meta: dict, train_vision: str, root: str, step: int) -> None:
    """A checkpoint resumes only under the `model.train_vision` it was saved with: with less, what trained of
    the vision encoder would be dropped; with more, its optimizer state is missing. (Checkpoints written before
    the run marker recorded it are checked when the encoder state loads.)"""
    saved = meta.get("train_vision")
    if saved is not None and saved != train_vision:
        raise CheckpointError(
            f"checkpoint step {step} in {root} was saved with model.train_vision={saved}, this run has "
            f"model.train_vision={train_vision}: resume with model.train_vision={saved} (to train another part "
            "of the vision encoder, start a new run from an export: checkpoint.export_hf_steps)"
        )


def rank_url(root: str, rank: int) -> str:
    return f"{root.rstrip('/')}/ranks/rank_{rank:05d}"


@dataclass
class TrainState:
    """What one worker's checkpoint holds of its training, and where a resume puts it back.

    `policy` / `critic`: `MegatronTrainerBase` (model and optimizer); `kl_coef`: the KL coefficient now (read
    at each save); `rollout`: the controller's `RolloutCollector` (None on other ranks), read at each save: its
    feed's consumed ids by epoch are the data position, its `state_dict()` holds dynamic sampling's keep rate
    (a run saves the mean over its controllers), and its engine's own sampling stream goes into this rank's
    RNG entry, so a resumed run samples what the uninterrupted one would have."""

    policy: Any
    critic: Any | None
    kl_coef: Callable[[], float]
    rollout: Any | None = None


@dataclass
class Resumed:
    """What a resumed run continues from. The trainers and RNGs are already restored; the caller sets the KL
    coefficient, the rollout engine's sampling stream (`engine_rng`) and syncs the engine's weights."""

    step: int
    epoch: int  # the oldest epoch some group had not finished
    position: dict[int, list]  # epoch -> consumed prompt ids, for `epoch` and later ones
    kl_coef: float
    history: list[MetricRow] = field(default_factory=list)
    source: str = ""
    keep_rate: float = 1.0  # dynamic sampling's estimate (1.0 from checkpoints written before it was saved)
    engine_rng: dict | None = None  # the rollout engine's sampling stream (`RolloutEngine.set_rng_state`)


class TrainingCheckpoints:
    """One worker's side of the run's checkpoints; every method that says "collective" is called by all ranks.

    `hub` is the worker's `HubLink` to the MetricsHub (the metrics history goes into each checkpoint); `control` its RunControl.
    With `checkpoint.enable=false` no store is opened: `resume` starts fresh, nothing is saved, and
    `after_step` only passes stop requests on (collective, so every rank stops after the same step).
    """

    def __init__(self, config, layout, control, hub) -> None:
        c = config.checkpoint
        self.config, self.cfg, self.layout, self.control, self.hub = config, c, layout, control, hub
        self.enabled = bool(c.enable)
        opts = dict(c.storage_options)
        if self.enabled:
            self.store = CheckpointStore(
                c.dir, keep_last=c.keep_last, keep_every=c.keep_every, storage_options=opts
            )
            self.rank_store = CheckpointStore(rank_url(c.dir, layout.rank), _NO_RETENTION, None, opts)
            self.writer = AsyncCheckpointWriter(self.rank_store)
        self.schedule = CheckpointSchedule(c.every_steps, c.every_minutes)
        self.handles: list[SaveHandle] = []
        self.ok_steps: set[int] = set()
        self.agreed = 0  # newest step every rank has written (committed by rank 0 unless that failed)
        self.failures = 0  # this rank's failed saves and commits
        self.failures_all = 0  # every rank's, as of the last exchange
        self.overhead_s = 0.0  # how long the last `after_step` held the loop
        self.stop_reason: str | None = None
        self.last_saved = -1
        self.preempt_saved = False
        self.session = ""  # one id per start of the training function (see `attempt_number`)
        self.agreed_at_start = 0  # the step this start resumed from (0: a fresh start)
        self.unlogged: list[tuple[str, dict]] = []  # prompt-id records not yet written (store down)

    # ---- resume (collective) --------------------------------------------------------------------------------
    def resume(self, state: TrainState, restart: bool = False) -> Resumed | None:
        """Restore the checkpoint `choose_resume` picks (`restart`: Ray Train's attempt > 1, which always
        continues from the run's own newest checkpoint) into `state`'s trainers and this rank's RNGs; None for a
        fresh start (always with checkpoints off)."""
        if not self.enabled:
            return None
        choice: Any = None
        if self.layout.rank == 0:
            try:
                choice = choose_resume(self.cfg, restart)
            except Exception as exc:  # every rank raises it, none waits forever
                choice = exc
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], BaseException):
            raise box[0]
        if box[0] is None:
            self._clear_after(0)  # rank files of an attempt that died before its first run marker
            return None
        root, step, meta = box[0]
        self._check_layout(meta, root, step)
        resumed = self._restore(state, root, step, meta)
        self._clear_after(step)
        self.schedule.mark_saved(step)
        self.agreed = self.last_saved = self.agreed_at_start = step
        log.warning("resumed from checkpoint step %d in %s", step, root)
        return resumed

    def _check_layout(self, meta: dict, root: str, step: int) -> None:
        check_train_vision(meta, self.config.model.train_vision, root, step)
        tp, dp = self.layout.tp_size, self.layout.dp_size
        if meta["tp_size"] != tp:
            raise CheckpointError(
                f"checkpoint step {step} in {root} was saved with train.tp_size={meta['tp_size']}, this run has "
                f"train.tp_size={tp}: tensor-parallel shards cannot be re-split; resume with "
                f"train.tp_size={meta['tp_size']} (train.dp_size may differ)"
            )
        if meta["dp_size"] != dp:
            log.warning(
                "resuming checkpoint step %d saved with train.dp_size=%d on train.dp_size=%d: the model comes "
                "from data-parallel rank 0, the optimizer state is cut to the new ranks, the consumed prompts "
                "are global; RNG streams of new ranks are fresh",
                step,
                meta["dp_size"],
                dp,
            )

    def _restore(self, state: TrainState, root: str, step: int, meta: dict) -> Resumed:
        opts = dict(self.cfg.storage_options)

        def entries(rank: int, names: list[str]) -> dict[str, Any]:
            store = CheckpointStore(rank_url(root, rank), _NO_RETENTION, None, opts)
            return load(store, store.ref(step), names=names)

        trainers = {"policy": state.policy, "critic": state.critic}
        trainers = {name: t for name, t in trainers.items() if t is not None}
        saved = entries(self.layout.tp_rank, list(trainers))  # data-parallel rank 0 holds this TP shard
        for name, trainer in trainers.items():
            if "optimizer" in saved[name]:  # written before optimizer pieces: AdamW state inside
                load_trainer_state(trainer, saved[name])
                continue
            key = f"{name}_optimizer"
            ranks = optimizer_ranks(meta, self.layout, trainer.optimizer.distributed)
            shards = [entries(rank, [key])[key] for rank in ranks]
            load_trainer_state(trainer, saved[name], shards)
        run = entries(0, [RUN_ENTRY])[RUN_ENTRY]
        rng: dict[str, Any] = {}
        if self.layout.rank < meta["world_size"]:
            rng = entries(self.layout.rank, ["rng"])["rng"]
            set_rng_state(rng)
        return Resumed(
            step,
            int(run["epoch"]),
            run_position(run),
            float(run["kl"]),
            _rows(run["history"]),
            root,
            float(run.get("keep_rate", 1.0)),
            rng.get("rollout"),  # saved by a controller rank
        )

    def _clear_after(self, step: int) -> None:
        """Before the steps after `step` are redone: this rank's files of later steps that no run marker
        commits (a dead attempt's writes, never a checkpoint) are removed. A later run marker exists only when
        it failed its checks (`choose_resume` takes the newest valid one); it is moved aside with its rank
        files to ``<dir>/set_aside/<session>/``, never deleted, since a check can fail on a read error too.
        Collective."""
        marked = {s for s in self.store.list_committed() if s > step}
        dist.barrier()  # every rank has read the markers before rank 0 moves any
        aside = f"{self.store.root}/set_aside/{self.session or 'start'}"
        committed, unfinished = self.rank_store._scan()
        for s in sorted(set(committed + unfinished)):
            if s in marked and s in committed:
                target = f"{aside}/{step_dir_name(s)}/ranks/rank_{self.layout.rank:05d}"
                self.rank_store.fs.mv(self.rank_store.step_path(s), target, recursive=True)
            elif s > step:
                self.rank_store.delete(s)
        if self.layout.rank == 0 and marked:
            for s in sorted(marked):
                self.store.fs.mv(self.store.step_path(s), f"{aside}/{step_dir_name(s)}/run", recursive=True)
            log.warning(
                "checkpoint steps %s in %s failed their checks; moved aside to %s (the steps are redone)",
                sorted(marked),
                self.store.root_url,
                aside,
            )
        dist.barrier()

    def attempt_number(self) -> int:
        """Collective: how many times the training function has started in this run (1 = the first)."""
        import ray

        box: list[Any] = [None]
        if self.layout.rank == 0:
            box = [(ray.get(self.control.start_attempt.remote(), timeout=60), uuid.uuid4().hex[:12])]
        dist.broadcast_object_list(box, src=0)
        attempt, self.session = box[0]
        return int(attempt)

    def announce(self, resumed: Resumed) -> None:
        """Rank 0: a resume marker row; a new driver (empty hub) also gets the checkpoint's metrics history, so
        the resumed run's curve starts at step 1."""
        if not self.hub.rows_since(0):
            for row in resumed.history:
                self.hub.push(row.kind, row.values)
        self.hub.push("checkpoint", {"step": resumed.step, RESUME_KEY: resumed.step})

    # ---- after each step (collective) ----------------------------------------------------------------------
    def after_step(self, step: int, state: TrainState) -> bool:
        """Commit finished saves, save when due, export when due; True when the run should stop now. The time
        it held the step is kept in `overhead_s` (the next step's row reports it)."""
        start = time.perf_counter()
        if not self.enabled:
            self.stop_reason = self._broadcast_stop_request()
            return self.stop_reason is not None
        head = self._exchange(step, poll=True)
        reason = head["stop"] or head["due"]
        if head["stop"]:
            self.stop_reason = head["stop"]
        if reason:
            self.save(step, state, reason, wait=bool(head["stop"]) or head["due"] == "preemption notice")
        if self._export_due(step):
            self.export_hf(step, state.policy)
        self.overhead_s = time.perf_counter() - start
        return self.stop_reason is not None

    def finish(self, step: int, state: TrainState) -> None:
        """At the end (or a stop): the final save when `checkpoint.at_end`, then wait for every write."""
        if not self.enabled:
            return
        if self.cfg.at_end and self.last_saved != step:
            self.save(step, state, "end of run", wait=True)
        if self.unlogged:
            self.flush_prompt_log()
        if not self.writer.close(timeout=self.config.cluster.timeout_s):
            log.error("the checkpoint of step %d is still being written after cluster.timeout_s", step)
        self._exchange(step, poll=False)
        if self.layout.rank == 0:  # the last saves' outcome, which no step row carries
            row = {
                "step": step,
                "checkpoint/failures": self.failures_all,
                "checkpoint/committed": self.agreed,
            }
            self.hub.push("checkpoint", row)

    def metrics(self) -> dict[str, float]:
        """For the step's row: failed saves so far (all ranks) and the previous step's checkpoint overhead."""
        if not self.enabled:
            return {}
        return {"checkpoint/failures": float(self.failures_all), "checkpoint/overhead_s": self.overhead_s}

    def _exchange(self, step: int, poll: bool) -> dict:
        """Tell every rank what the others finished; rank 0 commits the newest step all have written. Returns
        rank 0's view: {"stop": reason or None, "due": reason or None}."""
        self._collect_handles()
        mine: dict[str, Any] = {
            "ok": sorted(self.ok_steps),
            "stop": None,
            "due": None,
            "failed": self.failures,
        }
        if poll and self.layout.rank == 0:
            mine["stop"] = self._stop_requested()
            mine["due"] = self.schedule.reason(step)
        if poll and self.cfg.on_preemption and _preemption_notice() and not self.preempt_saved:
            self.preempt_saved = True  # one just-in-time save; Ray Train restarts from it after the reclaim
            mine["due"] = "preemption notice"
        views: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine)
        self.failures_all = sum(v["failed"] for v in views)
        common = set.intersection(*(set(v["ok"]) for v in views))
        if common and max(common) > self.agreed:
            self.agreed = max(common)
            if self.layout.rank == 0:
                self._commit(self.agreed)
        self.ok_steps = {s for s in self.ok_steps if s > self.agreed}
        due = views[0]["due"] or next((v["due"] for v in views if v["due"] == "preemption notice"), None)
        return {"stop": views[0]["stop"], "due": due}

    def _collect_handles(self) -> None:
        for handle in [h for h in self.handles if h.done()]:
            self.handles.remove(handle)
            if handle.ref is not None:
                self.ok_steps.add(handle.step)
            else:
                self.failures += 1  # the writer has logged it; the previous checkpoint stays the newest

    def _broadcast_stop_request(self) -> str | None:
        """Collective: rank 0's view of a stop request (the reason, or None), on every rank."""
        box = [self._stop_requested() if self.layout.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _stop_requested(self) -> str | None:
        import ray

        return ray.get(self.control.stop_requested.remote(), timeout=self.config.cluster.timeout_s)

    def _commit(self, step: int) -> None:
        """Rank 0: the run's marker for `step`, retention, and pruning of the rank files no longer kept."""
        meta = {
            "format": RUN_FORMAT,
            "world_size": dist.get_world_size(),
            "dp_size": self.layout.dp_size,
            "tp_size": self.layout.tp_size,
            "distributed_optimizer": bool(self.config.train.distributed_optimizer),
            "train_vision": self.config.model.train_vision,
        }
        try:
            self.store.commit(self.store.begin(step), meta)
            self.store.apply_retention(known_valid=step)
            self._prune_ranks(set(self.store.list_committed()), step)
        except Exception as exc:  # storage trouble must not stop training; the older markers stay valid
            self.failures += 1
            log.error(
                "checkpoint step %d: committing the run marker failed (%r); training goes on", step, exc
            )

    def _prune_ranks(self, kept: set[int], newest: int) -> None:
        """Rank 0: delete rank files of steps older than `newest` that the run no longer keeps (any rank count)."""
        try:
            rank_dirs = self.store.fs.ls(f"{self.store.root}/ranks", detail=False)
        except FileNotFoundError:
            return
        opts = dict(self.cfg.storage_options)
        for rank_dir in rank_dirs:
            m = re.search(r"rank_(\d+)$", str(rank_dir).rstrip("/"))
            if m is None:
                continue
            store = CheckpointStore(rank_url(self.cfg.dir, int(m.group(1))), _NO_RETENTION, None, opts)
            committed, unfinished = store._scan()
            for s in set(committed + unfinished):
                if s < newest and s not in kept:
                    store.delete(s)

    # ---- saving (collective) -------------------------------------------------------------------------------
    def save(self, step: int, state: TrainState, reason: str, wait: bool) -> None:
        """Snapshot this rank's state and write it in the background (`wait`: then wait and commit)."""
        payload = self._payload(step, state)
        try:
            handle = self.writer.save(step, payload, {"rank": self.layout.rank, "reason": reason})
            self.handles.append(handle)
            log.info("checkpoint step %d (%s): blocked %.3fs", step, reason, handle.blocking_s)
        except CheckpointError as exc:
            self.failures += 1
            log.error("checkpoint step %d could not start (%s); training goes on", step, exc)
        self.schedule.mark_saved(step)
        self.last_saved = step
        if wait:
            last = self.writer.last_handle
            if last is not None and not last.wait(self.config.cluster.timeout_s):
                log.error(
                    "checkpoint step %d still writing after cluster.timeout_s; not waiting longer", step
                )
            self._exchange(step, poll=False)

    def _payload(self, step: int, state: TrainState) -> dict[str, Any]:
        rollout = state.rollout
        feed = None if rollout is None else rollout.feed
        mine = None
        if rollout is not None and feed is not None:
            mine = (feed.open_epoch(), feed.position(0), rollout.state_dict()["keep_rate"])
        gathered: list[Any] | None = [None] * dist.get_world_size() if self.layout.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        payload: dict[str, Any] = {"rng": rng_state()}
        engine_rng = None if rollout is None else rollout.engine_rng_state()
        if engine_rng is not None:
            payload["rng"]["rollout"] = engine_rng
        for name, trainer in (("policy", state.policy), ("critic", state.critic)):
            if trainer is None:
                continue
            if self.layout.dp_rank == 0:
                payload[name] = trainer_state(trainer)
            if owns_optimizer_state(trainer, self.layout.dp_rank):
                payload[f"{name}_optimizer"] = trainer.optimizer.state_dict()
        if self.layout.rank == 0:
            assert gathered is not None
            groups = [g for g in gathered if g is not None]
            epoch, position = merge_positions([(open_epoch, ids) for open_epoch, ids, _ in groups])
            payload[RUN_ENTRY] = {
                "step": step,
                "epoch": epoch,
                "consumed": position.get(epoch, []),
                "position": {str(e): ids for e, ids in position.items()},
                "history": self._history(),
                "kl": float(state.kl_coef()),
                "keep_rate": sum(rate for _, _, rate in groups) / len(groups),
            }
        return payload

    def _history(self) -> list[dict[str, Any]]:
        """The run's curve so far (checkpoint events left out), as JSON for run.json."""
        rows = self.hub.rows_since(0)
        return [r.to_json() for r in rewind_history(rows)[0] if r.kind != "checkpoint"]

    # ---- Hugging Face export (collective over the TP group) ---------------------------------------------------
    def _export_due(self, step: int) -> bool:
        every = self.cfg.export_hf_every
        return step in self.cfg.export_hf_steps or bool(every and step % every == 0)

    def export_hf(self, step: int, policy) -> str | None:
        """Write the policy as a HF directory under ``<dir>/hf/step_XXXXXXXX``; errors are logged, not raised."""
        target = f"{self.store.root}/hf/{step_dir_name(step)}"
        try:
            with tempfile.TemporaryDirectory() as tmp:
                local = target if self.store.is_local else os.path.join(tmp, "hf")
                written = policy.save_hf(local)  # TP collective; the writer rank returns its path
                if written is not None and not self.store.is_local:
                    self.store.fs.put(local, target, recursive=True)
            return target if written is not None else None
        except Exception as exc:
            self.failures += 1
            log.error("Hugging Face export of step %d to %s failed (%r); training goes on", step, target, exc)
            return None

    # ---- prompt audit log ----------------------------------------------------------------------------------
    def log_prompts(self, step: int, attempt: int, ids: list, epochs: list[int]) -> None:
        """With `checkpoint.log_prompt_ids`: this controller's prompt ids of `step` (those it consumed: trained
        on, or drawn and dropped by dynamic sampling) and each one's epoch, as one small JSON file.

        A record that cannot be written (the store is down) is kept and written with the next one, so an
        outage of the store leaves no hole in the audit once it is back."""
        if not self.cfg.log_prompt_ids or not self.enabled:
            return
        name = f"step_{step:08d}.dp_{self.layout.dp_rank:03d}.{self.session}.json"
        record = {
            "step": step,
            "dp_rank": self.layout.dp_rank,
            "attempt": attempt,
            "session": self.session,
            "base": self.agreed_at_start,
            "epochs": epochs,
            "ids": ids,
            "t": time.time(),
        }
        self.unlogged.append((name, record))
        self.flush_prompt_log()

    def flush_prompt_log(self) -> None:
        folder = f"{self.store.root}/prompt_ids"
        try:
            self.store.fs.makedirs(folder, exist_ok=True)
            while self.unlogged:
                name, record = self.unlogged[0]
                self.store.fs.pipe_file(f"{folder}/{name}", json.dumps(record).encode())
                self.unlogged.pop(0)
        except Exception as exc:
            log.error(
                "could not write the prompt-id log (%d records kept for later): %r", len(self.unlogged), exc
            )


def _rows(history: list) -> list[MetricRow]:
    """run.json's history as rows; a row saved without its kind (before kinds were recorded) is refused."""
    try:
        return [MetricRow.from_json(r) for r in history]
    except (KeyError, TypeError) as exc:
        raise CheckpointError(
            f"run.json's metrics history is not in this version's format ({exc!r})"
        ) from exc


def choose_resume(cfg, restart: bool = False) -> tuple[str, int, dict] | None:
    """(root URL, step, run metadata) of the checkpoint that `cfg` (the `checkpoint` section) resumes from, or
    None for a fresh start. Runs on the driver before any cluster work, and on rank 0 at each (re)start.

    The run's own `checkpoint.dir` comes first: once it holds a valid checkpoint, every start resumes from its
    newest one, whatever `checkpoint.resume` says, so a restart (`restart`: Ray Train's attempt > 1) or a
    re-run of the same command continues the run instead of rolling it back. Otherwise `checkpoint.resume`
    decides: "auto" starts fresh; a folder (or one of its step_XXXXXXXX folders) of an earlier run resumes from
    there; "never" starts fresh, and refuses a first start whose `checkpoint.dir` already holds checkpoints.
    Every file of the chosen step passes its sha256 check; a damaged step is skipped with a warning. A step
    written in a newer format than this yatt_ray reads stops the choice (`CheckpointFormatError`: upgrade),
    and is neither skipped nor, later, moved aside."""
    mode = cfg.resume
    own = CheckpointStore(cfg.dir, storage_options=dict(cfg.storage_options)).list_committed()
    if mode == "never" and own and not restart:
        raise CheckpointError(
            f"checkpoint.dir={cfg.dir!r} already holds checkpoints {own} but checkpoint.resume=never: "
            "use a new checkpoint.dir, or checkpoint.resume=auto to continue"
        )
    chosen = _newest_valid(cfg, cfg.dir, own)
    if own and chosen is None:
        raise CheckpointError(
            f"no valid checkpoint in checkpoint.dir={cfg.dir!r}: every one of steps {own} is damaged (see the "
            "warnings above); move them aside to start from checkpoint.resume, or use a new checkpoint.dir"
        )
    if chosen is not None or mode in ("auto", "never"):
        if chosen is not None and mode not in ("auto", "never") and not restart:
            log.warning(
                "checkpoint.dir=%s already holds this run's checkpoints (newest valid: step %d): continuing from "
                "there, not from checkpoint.resume=%s; give a new checkpoint.dir to start again from that folder",
                cfg.dir,
                chosen[1],
                mode,
            )
        return chosen
    root, only = _split_step(mode)
    steps = CheckpointStore(root, storage_options=dict(cfg.storage_options)).list_committed()
    if only is not None:
        steps = [s for s in steps if s == only]
    if not steps:
        raise CheckpointError(
            f"checkpoint.resume={mode!r} holds no committed checkpoint; give a checkpoint.dir of an earlier "
            "run (or one of its step_XXXXXXXX folders), or use checkpoint.resume=auto"
        )
    chosen = _newest_valid(cfg, root, steps)
    if chosen is None:
        raise CheckpointError(
            f"no valid checkpoint in {root!r}: every one of steps {steps} is damaged (see the warnings above); "
            "resume from another folder, or start afresh with a new checkpoint.dir"
        )
    return chosen


def _newest_valid(cfg, root: str, steps: list[int]) -> tuple[str, int, dict] | None:
    """(root, step, run metadata) of the newest of `steps` under `root` whose files all verify, or None; each
    damaged one is skipped with a warning."""
    source = CheckpointStore(root, storage_options=dict(cfg.storage_options))
    for step in reversed(steps):
        problem, meta = _verify_run_step(source, root, step, cfg.storage_options)
        if problem is None:
            return root, step, meta
        log.warning(
            "checkpoint step %d in %s is damaged (%s); falling back to an older checkpoint",
            step,
            root,
            problem,
        )
    return None


def read_run_state(cfg, root: str, step: int) -> dict[str, Any]:
    """The run state (step, epoch, consumed ids, history, KL) of checkpoint `step` under `root`."""
    store = CheckpointStore(rank_url(root, 0), _NO_RETENTION, None, dict(cfg.storage_options))
    return load(store, store.ref(step), names=[RUN_ENTRY])[RUN_ENTRY]


def _split_step(url: str) -> tuple[str, int | None]:
    """A resume URL: a run's checkpoint folder, or one of its step_XXXXXXXX folders."""
    m = _STEP_RE.search(url)
    if m is None:
        return url, None
    return url[: m.start()].rstrip("/") or "/", int(m.group(1))


def _run_format_version(fmt: Any) -> int | None:
    """N of a run marker's format "yatt_ray.run/N"; None for anything else."""
    prefix = "yatt_ray.run/"
    text = str(fmt)
    tail = text[len(prefix) :]
    return int(tail) if text.startswith(prefix) and tail.isdigit() else None


def _verify_run_step(source: CheckpointStore, root: str, step: int, opts: dict) -> tuple[str | None, dict]:
    """(None, run metadata) when step's marker and every rank file it needs verify; else (the problem, {}).
    A checkpoint written in a newer format (its marker's or a rank's manifest, or its run format) is not damage:
    `CheckpointFormatError` is raised, naming the versions, and the checkpoint is left where it is (the
    store's rule; falling back to an older step would set it aside and lose its progress)."""
    try:
        ref: CheckpointRef = source.ref(step)
    except CheckpointFormatError:
        raise
    except CheckpointError as exc:
        return str(exc), {}
    meta = ref.manifest.metadata
    if meta.get("format") != RUN_FORMAT:
        found, reads = _run_format_version(meta.get("format")), _run_format_version(RUN_FORMAT)
        if found is not None and reads is not None and found > reads:
            raise CheckpointFormatError(
                f"checkpoint step {step} in {root} was written by a newer yatt_ray (run format "
                f"{meta['format']!r}); this yatt_ray reads up to {RUN_FORMAT!r}: upgrade yatt_ray to resume "
                "from it (the checkpoint is left as it is)"
            )
        if found is not None:
            return (
                f"written in format {meta['format']!r}, this yatt_ray reads {RUN_FORMAT!r} (older checkpoints "
                "held pickled run state); continue it with the yatt_ray that wrote it, or start afresh"
            ), {}
        return f"not a yatt_ray run checkpoint (metadata {meta})", {}
    for rank in range(int(meta["world_size"])):
        store = CheckpointStore(rank_url(root, rank), _NO_RETENTION, None, dict(opts))
        try:
            problem = store.verify(store.ref(step))
        except CheckpointFormatError:
            raise
        except CheckpointError as exc:
            problem = str(exc)
        if problem is not None:
            return f"rank {rank}: {problem}", {}
    return None, meta


def _preemption_notice() -> bool:
    """Ray Train's advance notice that a node of this run is about to be reclaimed (a barrier over workers)."""
    import ray.train

    return ray.train.get_preemption_info() is not None
