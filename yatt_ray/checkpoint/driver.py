"""The driver's part in checkpoints: where they go, and checking the store and the resume point before any
cluster work."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

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


def check_checkpoints(
    config, timeout_s: float = 60.0, check_position: Callable[[Mapping[int, list], str], None] | None = None
) -> str:
    """On the driver, before any cluster work: the checkpoint store takes a write (a probe file, then deleted),
    and the checkpoint to resume from (if any) is found, verified (sha256 of every file) and readable, with a
    tensor-parallel size this run can load. `check_position(position, where)` checks its data position against
    this run's data (the driver passes `data.sources.check_position`: checkpoints know nothing of the data).
    Returns a one-line summary; raises `CheckpointError` otherwise."""
    from yatt_ray.checkpoint.training import check_train_vision, choose_resume, read_run_state

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
    check_train_vision(meta, config.model.train_vision, root, step)
    if meta["tp_size"] != config.train.tp_size:
        raise CheckpointError(
            f"checkpoint step {step} in {root} was saved with train.tp_size={meta['tp_size']}, this run has "
            f"train.tp_size={config.train.tp_size}: tensor-parallel shards cannot be re-split; resume with "
            f"train.tp_size={meta['tp_size']} (train.dp_size may differ)"
        )
    run = read_run_state(c, root, step)
    if check_position is not None:  # its data position keys prompts as this run's files do
        from yatt_ray.checkpoint.training import run_position

        check_position(run_position(run), f"checkpoint step {step} in {root}")
    return f"checkpoints: {c.dir} (resuming from step {step} of {root}, epoch {run['epoch']})"
