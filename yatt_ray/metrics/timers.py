"""Wall-clock time per phase of a training step (rollout, reward, log-probs, train, weight sync, ...)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from yatt_ray.metrics.timeline import SpanRecorder

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Accumulates wall seconds per named phase.

    Usage::

        timer = PhaseTimer()
        with timer.phase("rollout"):
            ...
        with timer.phase("train"):
            ...
        metrics.update({f"time/{k}": v for k, v in timer.totals().items()})
        timer.reset()

    A phase entered several times accumulates. Different phases may overlap (each counts its own wall time),
    but re-entering a phase that is still open raises `RuntimeError`: it would count the overlap twice. Time
    is recorded even when the body raises. ``clock`` (seconds, monotonic) defaults to `time.perf_counter`;
    tests inject a fake one.

    With a ``recorder`` (`yatt_ray.metrics.timeline.SpanRecorder`), every phase is also recorded as a span of
    the recorder's current step (``recorder.step``) for the idle-time timeline; ``phase(name, busy=False)``
    marks a phase in which the device waits (for rewards, for a collective).
    """

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, recorder: SpanRecorder | None = None
    ) -> None:
        self._clock = clock
        self.recorder = recorder
        self._totals: dict[str, float] = {}
        self._open: dict[str, float] = {}  # phase -> start time

    @contextmanager
    def phase(self, name: str, busy: bool = True) -> Iterator[None]:
        """Time the body of the ``with`` block under ``name`` (and record a span when there is a recorder;
        ``busy`` only matters for the span)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        if name in self._open:
            raise RuntimeError(
                f"phase {name!r} is already open; phases cannot be re-entered (close the outer "
                f"`with timer.phase({name!r})` first, or give the inner block another name)"
            )
        start = self._clock()
        self._open[name] = start
        try:
            if self.recorder is None:
                yield
            else:
                with self.recorder.span(name, busy=busy):
                    yield
        finally:
            del self._open[name]
            self._totals[name] = self._totals.get(name, 0.0) + (self._clock() - start)

    def totals(self) -> dict[str, float]:
        """Seconds per phase since the last `reset` (a copy; phases still open are not included)."""
        return dict(self._totals)

    def reset(self) -> None:
        """Forget all totals. Raises `RuntimeError` while a phase is open (its time would be split)."""
        if self._open:
            raise RuntimeError(f"cannot reset while phases are open: {sorted(self._open)}")
        self._totals.clear()
