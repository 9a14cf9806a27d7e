"""Where `model.path` points: a local directory, an fsspec URL (`s3://bucket/models/qwen`, `gs://...`) or a
Hugging Face hub id (`Qwen/Qwen2.5-7B-Instruct`). A remote model is fetched into a cache on the driver (its
checks read config.json and the tokenizer) and then once on every node, before any trainer or engine starts;
from there on `model.path` is the cached directory, the same path on every node.

- URL: copied with fsspec into `<cache>/<name>-<hash of the URL>/` (the cache: `$YATT_RAY_MODEL_CACHE`, else
  `~/.cache/yatt_ray/models`); a marker file written last says the copy is whole, so a node that has it copies
  nothing and a copy cut short is made again. Credentials are the environment's (for S3 the `AWS_*`
  variables, `AWS_ENDPOINT_URL` included, or the instance profile).
- hub id: `huggingface_hub.snapshot_download` into the Hugging Face cache (`$HF_HOME`); the driver resolves the
  revision and every node fetches that one, so all of them read the same files (a pre-filled cache is used
  as it is: `HF_HUB_OFFLINE=1` on a cluster without internet).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from yatt_ray.errors import ConfigError

CACHE_ENV = "YATT_RAY_MODEL_CACHE"
COMPLETE = ".yatt-complete"  # written last into a fetched copy
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the hub names repositories


@dataclass(frozen=True)
class ModelSource:
    """`given`: what model.path said; `kind`: local, url or hub; `revision`: the hub commit the driver got."""

    given: str
    kind: Literal["local", "url", "hub"]
    revision: str | None = None

    @property
    def remote(self) -> bool:
        return self.kind != "local"

    def describe(self, local: str) -> str:
        if not self.remote:
            return f"model: {local}"
        at = f" (revision {self.revision[:12]})" if self.revision else ""
        return f"model: {self.given}{at} -> {local} on every node"


def model_source(path: str) -> ModelSource:
    """The kind of `path`, without fetching: a URL has a scheme; an existing local path is local; "org/name"
    that is no local path is a hub id; anything else is local (the model checks report it missing)."""
    if "://" in path:
        return ModelSource(path, "url")
    if not Path(path).expanduser().exists() and HUB_ID.match(path):
        return ModelSource(path, "hub")
    return ModelSource(path, "local")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "yatt_ray" / "models").expanduser()


def url_cache_dir(url: str, root: Path) -> Path:
    """The cached copy of `url` under `root`: its last path part (readable) and a hash of the URL (unique)."""
    name = url.rstrip("/").rsplit("/", 1)[-1] or "model"
    return root / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def fetch(source: ModelSource, cache: str | None = None) -> tuple[str, str | None]:
    """This node's local directory of `source` (fetched now when missing; a URL into `cache`, default
    `cache_root()`) and, for a hub id, the revision it holds. Raises ConfigError naming model.path when the
    model cannot be fetched."""
    if source.kind == "local":
        return str(Path(source.given).expanduser().resolve()), None
    try:
        if source.kind == "url":
            return _fetch_url(source.given, Path(cache) if cache else cache_root()), None
        return _fetch_hub(source.given, source.revision)
    except ConfigError:
        raise
    except Exception as exc:  # the storage's own error, with the key and the fix around it
        raise ConfigError(
            f"model.path={source.given!r}: the model could not be fetched ({type(exc).__name__}: {exc}). Check "
            "the URL or hub id and this machine's credentials (for S3 the AWS_* variables or an instance "
            "profile; for the hub HF_TOKEN, or a pre-filled cache with HF_HUB_OFFLINE=1)"
        ) from exc


def _fetch_url(url: str, root: Path) -> str:
    import fsspec

    target = url_cache_dir(url, root)
    if (target / COMPLETE).exists():
        return str(target)
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(f"{path.rstrip('/')}/config.json"):
        raise ConfigError(
            f"model.path={url!r} holds no config.json: point it at a Hugging Face model folder (config.json, "
            "weights, tokenizer)"
        )
    partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        fs.get(f"{path.rstrip('/')}/", str(partial), recursive=True)
        (partial / COMPLETE).write_text(url)
        shutil.rmtree(target, ignore_errors=True)  # a copy cut short by an earlier run
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def _fetch_hub(repo_id: str, revision: str | None) -> tuple[str, str]:
    from huggingface_hub import snapshot_download

    local = snapshot_download(repo_id=repo_id, revision=revision)
    return str(local), Path(local).name  # the snapshot folder is named after its commit


def fetch_on_every_node(source: ModelSource, local: str, timeout_s: float) -> int:
    """Fetch `source` on every alive node of the cluster (once per node: a node that has it copies nothing) into
    the driver's cache folder, and check each node's copy is at `local`, the path the config gives the workers.
    Returns the number of nodes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from yatt_ray.shared_storage import cloud_env

    nodes = [n for n in ray.nodes() if n["Alive"]]
    task: Any = ray.remote(num_cpus=0, max_retries=1)(fetch)  # (mypy reads the default argument as none)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            runtime_env={"env_vars": cloud_env()},
        ).remote(source, str(cache_root()))
        for n in nodes
    ]
    fetched = ray.get(refs, timeout=timeout_s)
    elsewhere = [
        f"{n['NodeManagerAddress']}: {path}"
        for n, (path, _) in zip(nodes, fetched, strict=True)
        if path != local
    ]
    if elsewhere:
        raise ConfigError(
            f"model.path={source.given!r} was cached at {local} here but elsewhere on other nodes "
            f"({'; '.join(elsewhere)}); give every node the same HF_HOME"
        )
    return len(nodes)
