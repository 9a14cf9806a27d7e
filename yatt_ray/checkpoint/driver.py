"""The driver's part in checkpoints: where they go, SIGTERM -> "save and stop", and one metrics curve."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from yatt_ray.checkpoint.history import rewind_history
from yatt_ray.checkpoint.schedule import PreemptionFlag

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


class StopOnSignal:
    """While the run goes: SIGTERM to the driver asks the workers (through `RunControl`) to save and stop."""

    def __init__(self, control, enabled: bool) -> None:
        self.control, self.flag, self.sent = control, None, False
        if enabled and threading.current_thread() is threading.main_thread():
            self.flag = PreemptionFlag()

    def poll(self) -> None:
        if self.flag is not None and self.flag.requested and not self.sent:
            self.sent = True
            self.control.request_stop.remote("SIGTERM")

    @property
    def reason(self) -> str | None:
        return "SIGTERM" if self.sent else None

    def close(self) -> None:
        if self.flag is not None:
            self.flag.close()


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
