"""The integration tests' fixture layer: a session-wide cache of runs (`shared_runs`), so that a run several
tests read, in one module or in several, is started once a session. How a run is started: `runs.py`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


class RunCache:
    """name -> what a run returned (or the error it raised), each run started on its first `get`.

    A run that failed is not started again: every later `get` of it raises its error again, so one broken run
    fails each test that reads it (named by the run) instead of costing its time once per test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, tuple[bool, Any]] = {}

    def get(self, name: str, start: Callable[[Path], Any]) -> Any:
        """The run `name`: `start(folder)` the first time (a fresh folder of its own), its result after."""
        if name not in self._done:
            folder = self.root / name.replace("/", "_")
            folder.mkdir(parents=True)
            try:
                self._done[name] = (True, start(folder))
            except Exception as exc:  # kept and raised again: the run is not started twice
                self._done[name] = (False, exc)
        ok, value = self._done[name]
        if not ok:
            raise RuntimeError(f"the shared run {name!r} failed: {value!r}") from value
        return value


@pytest.fixture(scope="session")
def shared_runs(ray_cluster, demo_cache, tmp_path_factory) -> RunCache:
    """The session's runs by name (`RunCache`): `shared_runs.get("genrm/partial", start)`."""
    return RunCache(tmp_path_factory.mktemp("runs"))
