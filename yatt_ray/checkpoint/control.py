"""The driver's line to the workers about the run itself: "save and stop" requests and fatal errors.

`RunControl` is a small Ray actor started by the driver. The driver (on SIGTERM) or anyone holding the handle
(a preemption watcher) calls ``request_stop``; the workers poll ``stop_requested`` once per step, save a
checkpoint and leave cleanly. A worker that fails with the library's own error (bad data, bad config) records
it; such an error is deterministic (retrying cannot fix it), so the attempt Ray Train starts after it ends at
once without building anything, and the driver raises the recorded error with its type and message.
"""

from __future__ import annotations

from collections.abc import Callable


def start_control():
    """The control actor (no CPU reserved)."""
    import ray

    return ray.remote(num_cpus=0)(RunControl).remote()


def run_guarded(control, train: Callable[[], None]) -> None:
    """Run `train`; a `YattError` is recorded on `control`, and an attempt that starts after one returns at
    once (no retry of a deterministic error; the driver raises it)."""
    import ray

    from yatt_ray.errors import YattError

    fatal = ray.get(control.fatal.remote(), timeout=60) if control is not None else None
    if fatal is not None:
        return
    try:
        train()
    except YattError as exc:
        if control is not None:
            ray.get(control.record_fatal.remote(exc), timeout=60)
        raise


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
