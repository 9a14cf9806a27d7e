"""The driver's part in checkpoints: where they go, SIGTERM -> "save and stop", and one metrics curve."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import uuid
from pathlib import Path

from yatt_ray.checkpoint.history import rewind_history
from yatt_ray.checkpoint.schedule import PreemptionFlag
from yatt_ray.checkpoint.store import CheckpointError, CheckpointStore

log = logging.getLogger("yatt_ray.checkpoint")


def resolve_checkpoint_dir(config, output_dir: Path) -> None:
    """`checkpoint.dir` "" -> `<output_dir>/checkpoints`; a local path made absolute (workers run elsewhere)."""
    c = config.checkpoint
    if not c.dir:
        c.dir = str(output_dir / "checkpoints")
    elif "://" not in c.dir:
        c.dir = str(Path(c.dir).expanduser().resolve())
    if c.resume not in ("auto", "never") and "://" not in c.resume:
        c.resume = str(Path(c.resume).expanduser().resolve())


def check_checkpoints(config, timeout_s: float = 60.0) -> str:
    """On the driver, before any cluster work: the checkpoint store takes a write (a probe file, then deleted),
    and the checkpoint to resume from (if any) is found, verified (sha256 of every file) and readable, with a
    tensor-parallel size this run can load. Returns a one-line summary; raises `CheckpointError` otherwise."""
    from yatt_ray.checkpoint.training import choose_resume, read_run_state

    c = config.checkpoint

    def probe() -> None:
        store = CheckpointStore(c.dir, storage_options=dict(c.storage_options))
        name = f"{store.root}/.yatt-write-probe-{uuid.uuid4().hex[:8]}"
        store.fs.makedirs(store.root, exist_ok=True)
        store.fs.pipe_file(name, b"probe")
        store.fs.rm(name)

    outcome: list[BaseException | None] = []

    def run_probe() -> None:
        try:
            probe()
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run_probe, daemon=True)  # a hung endpoint must not hold the exit
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise CheckpointError(
            f"checkpoint.dir={c.dir!r} did not answer a test write within {timeout_s:.0f}s; check the endpoint "
            "(checkpoint.storage_options.endpoint_url) and the network, or use a local checkpoint.dir"
        )
    if outcome[0] is not None:
        exc = outcome[0]
        raise CheckpointError(
            f"checkpoint.dir={c.dir!r} cannot be written ({type(exc).__name__}: {exc}); check the path, the "
            "credentials and checkpoint.storage_options (e.g. endpoint_url), or use a local checkpoint.dir"
        ) from exc
    chosen = choose_resume(c)
    if chosen is None:
        return f"checkpoints: {c.dir} (fresh start)"
    root, step, meta = chosen
    if meta["tp_size"] != config.train.tp_size:
        raise CheckpointError(
            f"checkpoint step {step} in {root} was saved with train.tp_size={meta['tp_size']}, this run has "
            f"train.tp_size={config.train.tp_size}: tensor-parallel shards cannot be re-split; resume with "
            f"train.tp_size={meta['tp_size']} (train.dp_size may differ)"
        )
    run = read_run_state(c, root, step)
    return f"checkpoints: {c.dir} (resuming from step {step} of {root}, epoch {run['epoch']})"


class StopOnSignal:
    """While the run goes: SIGTERM or Ctrl-C (SIGINT) to the driver asks the workers (through `RunControl`) to
    save a checkpoint after this step and stop; a second Ctrl-C aborts at once (`KeyboardInterrupt`, after
    `abort_training`). Signals are caught only in the main thread (a notebook's kernel runs `fit` there)."""

    def __init__(self, control, enabled: bool) -> None:
        self.control, self.flag, self.sent = control, None, False
        if enabled and threading.current_thread() is threading.main_thread():
            self.flag = PreemptionFlag((signal.SIGTERM, signal.SIGINT), abort_on_repeat=(signal.SIGINT,))

    def poll(self) -> None:
        if self.flag is not None and self.flag.requested and not self.sent:
            self.sent = True
            self.control.request_stop.remote(self.reason)

    @property
    def reason(self) -> str | None:
        if not self.sent or self.flag is None or self.flag.received is None:
            return None
        return signal.Signals(self.flag.received).name

    def close(self) -> None:
        if self.flag is not None:
            self.flag.close()


def abort_training() -> None:
    """Kill this job's Ray Train controllers, and with them their workers (they share the controller's fate):
    the second Ctrl-C. Ray Train places its controller on the driver's node, so a SIGKILL to its pid does it."""
    import ray
    from ray.util.state import list_actors

    job = ray.get_runtime_context().get_job_id()
    try:
        actors = list_actors(
            filters=[("class_name", "=", "TrainController"), ("state", "=", "ALIVE")], timeout=10
        )
        for actor in actors:
            if actor.job_id == job and actor.pid:
                os.kill(actor.pid, signal.SIGKILL)
    except Exception as exc:  # the state API is down, or the process is elsewhere: say so
        log.error("could not abort the training controllers (%r); `ray stop` ends them", exc)


def one_curve(progress, output_dir: Path) -> int:
    """Replace redone steps' rows in `progress.history` and metrics.jsonl by their last version; return how
    many training rows were dropped (steps redone after restarts)."""
    rows, dropped = rewind_history(progress.history)
    if dropped:
        progress.history[:] = rows
        path = output_dir / "metrics.jsonl"
        if path.exists():
            lines = [json.dumps({"step": int(r.get("step", 0)), **{k: v for k, v in r.items() if k != "step"}})
                     for r in rows]  # fmt: skip
            path.write_text("".join(line + "\n" for line in lines))
        log.warning("%d steps were redone after a restart; the metrics keep their last version", dropped)
    return dropped
