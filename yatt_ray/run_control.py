"""Run control: the driver's line to the workers about the run itself ("save and stop" requests, fatal errors)
and the signals that ask for it (SIGTERM, Ctrl-C).

`RunControl` lives in a small Ray actor started by the driver (`RunActor`, with the `MetricsHub`). The driver
(on SIGTERM) or anyone holding the handle (a preemption watcher) calls ``request_stop``; the workers poll
``stop_requested`` once per step, save a checkpoint and leave cleanly; a loop that waits with no step under
way (the controllers reading past rejected prompt rows) polls it too (`stop_request`) and ends the attempt
(`StopRequested`, which `fit` reports as a stop, not an error). A worker that fails with the library's
own error (bad data, bad config) records it; such an error is deterministic (retrying cannot fix it), so the
attempt Ray Train starts after it ends at once without building anything, and the driver raises the recorded
error with its type and message.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from yatt_ray.checkpoint.schedule import PreemptionFlag
from yatt_ray.errors import YattError
from yatt_ray.metrics.hub import MetricsHub

log = logging.getLogger(__name__)


def start_run_actor():
    """The run's one driver-side actor, `RunActor`: the metrics hub and the run control (no CPU reserved)."""
    import ray

    return ray.remote(num_cpus=0)(RunActor).remote()


def run_guarded(control, train: Callable[[], None]) -> None:
    """Run `train`; a `YattError` is recorded on `control`, and an attempt that starts after one returns at
    once (no retry of a deterministic error; the driver raises it, or returns for a `StopRequested`). While
    `train` runs, `stop_request()` in this process asks `control`."""
    import ray

    global _worker_control
    fatal = ray.get(control.fatal.remote(), timeout=60) if control is not None else None
    if fatal is not None:
        return
    _worker_control, _polled[:] = control, [0.0, None]
    try:
        train()
    except YattError as exc:
        if control is not None:
            ray.get(control.record_fatal.remote(exc), timeout=60)
        raise
    finally:
        _worker_control = None


class StopRequested(YattError):
    """A stop request (SIGTERM, Ctrl-C) met a worker with no step under way (waiting for usable prompt rows):
    the attempt ends at once, without a further checkpoint, and `fit` returns (`Result.stopped`) rather than
    raising it."""


STOP_POLL_S = 1.0  # a worker's waiting loop asks the run actor about a stop request at most this often
_worker_control = None  # the run's RunActor, in a training worker while `run_guarded` runs its function
_polled: list = [0.0, None]  # [when the run actor was last asked, its answer]


def stop_request() -> str | None:
    """The run's stop request (its reason) as seen from a training worker, else None (also outside one):
    asked of the run actor at most every STOP_POLL_S seconds, the answer kept in between. For loops that
    wait with no step under way; a step polls through the checkpoints (`TrainingCheckpoints.after_step`)."""
    import time

    control = _worker_control
    if control is None:
        return None
    now = time.monotonic()
    if _polled[1] is None and now - _polled[0] >= STOP_POLL_S:
        import ray

        _polled[:] = [now, ray.get(control.stop_requested.remote(), timeout=60)]
    return _polled[1]


class RunControl:
    def __init__(self) -> None:
        self._stop: str | None = None
        self._fatal: BaseException | None = None
        self._attempts = 0

    def request_stop(self, reason: str) -> None:
        """Ask the workers to save a checkpoint after the current step and then stop."""
        self._stop = self._stop or reason

    def stop_requested(self) -> str | None:
        return self._stop

    def start_attempt(self) -> int:
        """Count a start of the training function (1 = first start, 2 = the first restart, ...)."""
        self._attempts += 1
        return self._attempts

    def record_fatal(self, error: BaseException) -> None:
        self._fatal = self._fatal or error

    def fatal(self) -> BaseException | None:
        return self._fatal


class RunActor(MetricsHub, RunControl):
    """`MetricsHub` and `RunControl` in one actor: one process, not two. An idle Ray actor is not free on a
    small machine: its core worker wakes about 150 times a second (a signal check every 10 ms), and on two
    cores every wake-up stalls the trainer's GEMM threads (docs/performance.md, "Against TRL")."""

    def __init__(self) -> None:
        MetricsHub.__init__(self)
        RunControl.__init__(self)


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
