"""Storage that every node of a cluster reaches: where Ray Train keeps a run's final report, and the check that
a local path the workers write is the same folder on every node.

On a cluster of several nodes a local path names a folder on each node's own disk unless a filesystem every
node mounts (NFS, FSx, a shared volume) holds it. The training workers write checkpoints to `checkpoint.dir`
and Ray Train writes the final report under its storage path, so a path the nodes do not share would spread a
run over several disks, and the final report, sent after the last step, would fail after all the training
time is spent. `check_shared` finds that before any work: the driver writes a marker file into each local path
and a task on every node reads it back.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from yatt_ray.errors import ConfigError

MARK_PREFIX = ".yatt-shared-"
# what a process needs to reach remote storage and the hub the standard way (credentials, endpoints, caches),
# passed on from the driver to the run's tasks and workers
CLOUD_ENV_PREFIXES = ("AWS_", "HF_")


def cloud_env() -> dict[str, str]:
    """This process's standard cloud and hub variables (`AWS_*`, `HF_*`), for the run's other processes."""
    import os

    return {k: v for k, v in os.environ.items() if k.startswith(CLOUD_ENV_PREFIXES)}


def train_storage(checkpoint_dir: str, storage_options: dict[str, Any], run_dir: Path) -> tuple[str, Any]:
    """(storage path, filesystem or None) for Ray Train's RunConfig: beside the checkpoints, under
    `<checkpoint.dir>/ray`, when they go to an fsspec URL (every node reaches it, with the same
    `checkpoint.storage_options`); else `<run folder>/ray` on the local filesystem."""
    if "://" not in checkpoint_dir:
        return str(run_dir / "ray"), None
    import fsspec
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, path = fsspec.core.url_to_fs(checkpoint_dir, **storage_options)
    return f"{path.rstrip('/')}/ray", PyFileSystem(FSSpecHandler(fs))


def report_url(path: str, checkpoint_dir: str) -> str:
    """A path Ray Train returned for its storage (`train_storage`) as the user reaches it: a URL with the
    checkpoints' scheme when they are remote, else the local path."""
    if "://" not in checkpoint_dir:
        return path
    return f"{checkpoint_dir.split('://', 1)[0]}://{path.lstrip('/')}"


def check_shared(paths: dict[str, str], timeout_s: float) -> str | None:
    """On a cluster of several alive nodes, ConfigError unless every local path in `paths` (what it is -> path;
    URLs are skipped) is one folder on all of them: a marker written here must be readable by a task on each
    node. Returns the plan's line, or None on one node (nothing to check)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    local = {what: p for what, p in paths.items() if p and "://" not in p}
    if len(nodes) < 2 or not local:
        return None
    token = uuid.uuid4().hex
    marks = {what: str(Path(p) / f"{MARK_PREFIX}{token}") for what, p in local.items()}
    for mark in marks.values():
        Path(mark).parent.mkdir(parents=True, exist_ok=True)
        Path(mark).write_text(token)
    try:
        read = ray.remote(num_cpus=0, max_retries=0)(_read_marks)
        refs = [
            read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                marks, token
            )
            for n in nodes
        ]
        seen = ray.get(refs, timeout=timeout_s)
    finally:
        for mark in marks.values():
            Path(mark).unlink(missing_ok=True)
    blind = {
        what: [n["NodeManagerAddress"] for n, ok in zip(nodes, seen, strict=True) if not ok[what]]
        for what in local
    }
    problems = [
        f"{what}={local[what]} (not seen from {', '.join(ips)})" for what, ips in blind.items() if ips
    ]
    if problems:
        raise ConfigError(
            f"a local path is not shared by the cluster's {len(nodes)} nodes: {'; '.join(problems)}. Each node "
            "would write to its own disk and the final report would fail after the last step. Give "
            "checkpoint.dir as an fsspec URL every node reaches (checkpoint.dir=s3://bucket/checkpoints/run; "
            "Ray Train's report then goes beside it), or put the path on a filesystem every node mounts at the "
            "same place (NFS, FSx)"
        )
    return f"storage: {', '.join(local)} shared by the {len(nodes)} nodes (a marker read back on each)"


def _read_marks(marks: dict[str, str], token: str) -> dict[str, bool]:
    """On one node: which markers hold the token."""
    out = {}
    for what, mark in marks.items():
        try:
            out[what] = Path(mark).read_text() == token
        except OSError:
            out[what] = False
    return out


def fetch_tree(url: str, target: str | Path, storage_options: dict | None = None) -> str:
    """Copy the folder `url` (a local path or an fsspec URL) to the local folder `target`, replacing what was
    there (a continued run's newer final policy over the earlier one); a local file is hard-linked where the two
    folders share a filesystem (no second copy of a 7B policy's 15 GB). Returns `target`."""
    import shutil

    import fsspec

    out = Path(target)
    if out.exists():
        shutil.rmtree(out)
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    for path in fs.find(root):
        dest = out / path[len(root) + 1 :]
        dest.parent.mkdir(parents=True, exist_ok=True)
        if "://" in url:
            fs.get_file(path, str(dest))
            continue
        try:
            os.link(path, dest)
        except OSError:  # another filesystem
            shutil.copy2(path, dest)
    return str(out)


def run_mirror(url: str) -> Path:
    """The local folder the driver writes for the run folder `url` (output.dir an fsspec URL), uploaded there
    by `upload_tree`: `$YATT_RAY_RUN_CACHE` (default ~/.cache/yatt_ray/runs) / <scheme> / <the URL's path>."""
    scheme, rest = url.split("://", 1)
    root = Path(os.environ.get("YATT_RAY_RUN_CACHE") or Path.home() / ".cache/yatt_ray/runs")
    return root / scheme / rest.strip("/")


def upload_tree(local: str | Path, url: str, storage_options: dict | None = None) -> int:
    """Put every file under the local folder `local` at the same place under `url` (what is there already is
    overwritten; nothing is deleted). Returns the number of files."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    files = [p for p in Path(local).rglob("*") if p.is_file()]
    for path in files:
        fs.put_file(str(path), f"{root.rstrip('/')}/{path.relative_to(local).as_posix()}")
    return len(files)


def keep_earlier_metrics(url: str, stamp: str, storage_options: dict | None = None) -> None:
    """A named run folder at `url` continued: its metrics.jsonl moved aside as metrics-<stamp>.jsonl."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    earlier = f"{root.rstrip('/')}/metrics.jsonl"
    if fs.exists(earlier):
        fs.mv(earlier, f"{root.rstrip('/')}/metrics-{stamp}.jsonl")
