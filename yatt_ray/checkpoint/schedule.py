"""When to checkpoint: every N steps and/or every M minutes, and on a preemption signal.

`CheckpointSchedule` is pure (no I/O; the clock is injectable), so a loop asks ``schedule.due(step)`` after
each step and calls ``schedule.mark_saved(step)`` after saving. `PreemptionFlag` turns SIGTERM (what
Kubernetes, Slurm and spot-instance reclaimers send before killing) into a flag the loop polls, so the run can
*save, then exit cleanly* instead of dying mid-step.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from yatt_ray.checkpoint.store import CheckpointError

logger = logging.getLogger("yatt_ray.checkpoint")


class CheckpointSchedule:
    """Decides whether a step should be checkpointed.

    Due when either rule fires (a rule set to None is off; both None: never due):

    * ``every_steps=N``: when the step crosses a multiple of N since the last save (steps 0 < N, 2N, ...;
      aligned to multiples so a resumed run checkpoints at the same steps as an uninterrupted one, which is
      what `CheckpointStore`'s ``keep_every`` expects);
    * ``every_minutes=M``: when M minutes of `clock` have passed since the last save (or since construction).

    A step already saved is never due again. After resuming from step S call ``mark_saved(S)``.
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_minutes: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if every_steps is not None and (
            isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1
        ):
            raise CheckpointError(
                f"every_steps={every_steps!r} is invalid: use a positive integer, or None to save by time only"
            )
        if every_minutes is not None and (
            isinstance(every_minutes, bool)
            or not isinstance(every_minutes, int | float)
            or not every_minutes > 0
        ):
            raise CheckpointError(
                f"every_minutes={every_minutes!r} is invalid: use a positive number, or None to save by steps only"
            )
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self._clock = clock
        self.last_saved_step: int | None = None
        self._last_time = clock()

    def due(self, step: int) -> bool:
        """True if `step` should be checkpointed now."""
        return self.reason(step) is not None

    def reason(self, step: int) -> str | None:
        """Why `step` is due ("every 100 steps", "every 30 minutes"), or None if it is not."""
        if self.last_saved_step is not None and step <= self.last_saved_step:
            return None
        if self.every_steps is not None:
            last = self.last_saved_step if self.last_saved_step is not None else 0
            if step // self.every_steps > last // self.every_steps:
                return f"every {self.every_steps} steps"
        if self.every_minutes is not None and self._clock() - self._last_time >= self.every_minutes * 60.0:
            return f"every {self.every_minutes:g} minutes"
        return None

    def mark_saved(self, step: int) -> None:
        """Record that `step` was saved now (restarts the minute timer)."""
        self.last_saved_step = step
        self._last_time = self._clock()


class PreemptionFlag:
    """Catch SIGTERM (and any other `signals`) and set ``requested`` instead of dying: save, then exit cleanly.

    ::

        flag = PreemptionFlag()                       # or PreemptionFlag((signal.SIGTERM, signal.SIGUSR1))
        for step in ...:
            train_step()
            if flag.requested or schedule.due(step):
                writer.save(step, state)
            if flag.requested:
                writer.close()                        # wait for the write, then leave before the grace period ends
                break
        flag.close()                                  # restores the previous handlers

    Python runs signal handlers only in the main thread, so the flag must be created there (a ValueError from
    `signal.signal` is turned into a `CheckpointError` saying so). A second signal while the flag is already
    set is logged and otherwise ignored: the platform's kill after its grace period still ends the process.
    A second signal listed in `abort_on_repeat` (Ctrl-C's SIGINT, say) raises `KeyboardInterrupt` instead:
    the user asked to stop now.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,), abort_on_repeat: Iterable[int] = ()):
        self.signals = tuple(signals)
        self.abort_on_repeat = frozenset(abort_on_repeat)
        if not self.signals:
            raise CheckpointError("PreemptionFlag needs at least one signal, e.g. (signal.SIGTERM,)")
        self._event = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                f"PreemptionFlag must be created in the main thread (this is {threading.current_thread().name!r}):"
                " Python delivers signals only there; create it where the process starts and pass it down"
            )
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except (ValueError, OSError) as exc:
            self.close()
            raise CheckpointError(f"cannot install a handler for signal {sig!r}: {exc}") from exc

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._event.is_set() and signum in self.abort_on_repeat:
            logger.warning("%s received again: aborting now, without waiting for the checkpoint", name)
            raise KeyboardInterrupt
        if self._event.is_set():
            logger.warning("%s received again; the checkpoint-and-exit already requested is under way", name)
            return
        self.received = signum
        self._event.set()
        again = " (again to abort at once)" if signum in self.abort_on_repeat else ""
        logger.warning("%s received: finishing this step, saving a checkpoint, then exiting%s", name, again)

    @property
    def requested(self) -> bool:
        """True once one of the signals has arrived."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a signal arrives or `timeout` passes (for a watcher thread); True if one arrived."""
        return self._event.wait(timeout)

    def close(self) -> None:
        """Restore the handlers that were installed before this flag (idempotent)."""
        while self._previous:
            sig, previous = self._previous.popitem()
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def __enter__(self) -> PreemptionFlag:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
