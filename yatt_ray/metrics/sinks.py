"""Where per-step scalar metrics go: a JSONL file, TensorBoard, MLflow, Weights & Biases, or several at once.

Every sink has ``write(step, metrics)`` and ``close()`` and is a context manager. Values must be real scalars
(Python or NumPy ``int`` / ``float`` / ``bool``): the driver receives only scalars, so a tensor or a list
reaching a sink is a bug upstream, and it is reported with the offending key. Convert with ``.item()``.

`build_sinks` makes the sinks that a run's ``output.*`` keys ask for (the driver's `DriverProgress` feeds
them). The MLflow and W&B packages are imported only when their sink is made; a missing one is a
`ConfigError` naming the key and the ``pip install`` command.

Steps may come again: after a worker failure Ray Train restarts from the latest checkpoint and the steps
since then are pushed a second time, and the idle-time rows of a step arrive after later training rows.
Every sink records each row as it comes (JSONL and TensorBoard keep both copies of a redone step; so does
MLflow's metric history; for W&B see `WandbSink`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import numbers
import os
import re
import time
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from yatt_ray.config import WandbMode
from yatt_ray.errors import ConfigError

if TYPE_CHECKING:
    from yatt_ray.config import Config

__all__ = [
    "JsonlSink",
    "MlflowSink",
    "MultiSink",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "flatten_params",
    "read_jsonl",
    "validate_metrics",
]


def validate_metrics(step: Any, metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """Check ``step`` and ``metrics``; return the metrics as plain Python ``int`` / ``float`` values.

    Raises `TypeError` naming the key of any value that is not a real scalar (a tensor, array, list, string,
    None, ...), or a key that is not a non-empty string; `ValueError` for a negative step or a metric named
    ``"step"`` (reserved). Integers (and bools) stay ``int``; everything else becomes ``float`` (NaN and inf
    are allowed: a diverging loss should be recorded, not crash the run).
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> scalar, got {type(metrics).__name__}")
    out: dict[str, int | float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric names must be non-empty strings, got {key!r}")
        if key == "step":
            raise ValueError("'step' is reserved for the step number; rename the metric")
        if isinstance(value, numbers.Integral):
            out[key] = int(value)
        elif isinstance(value, numbers.Real):
            out[key] = float(value)
        else:
            shape = getattr(value, "shape", None)
            hint = f" of shape {tuple(shape)}" if shape is not None else ""
            raise TypeError(
                f"metric {key!r} must be a real scalar (int or float), got {type(value).__name__}{hint}; "
                f"reduce it and convert with .item() (e.g. tensor.mean().item()) before logging"
            )
    return out


class Sink:
    """Base class: ``write(step, metrics)``, ``rewind(rows)`` and ``close()``; usable as a context manager."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def rewind(self, rows: list[dict[str, float]]) -> None:
        """The curve went back (a restart redoes steps): `rows` is what it holds now, before the next write.
        Append-only stores (TensorBoard, MLflow, W&B) keep both versions of a redone step; the default
        does nothing."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class JsonlSink(Sink):
    """Appends one JSON object per step, ``{"step": 3, "reward_mean": 0.5, ...}``, one per line, to ``path``.

    The file is opened in append mode (a resumed run continues the same file; parent folders are created)
    and flushed after every line, so a crash loses nothing already written. Non-finite floats are written as
    ``NaN`` / ``Infinity``, which Python's `json` (and `read_jsonl`) read back.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": int(step), **validate_metrics(step, metrics)}
        if self._file.closed:
            raise RuntimeError(f"JsonlSink({str(self.path)!r}) is closed; create a new sink to write more")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def rewind(self, rows: list[dict[str, float]]) -> None:
        """Rewrite the file as `rows` (this sink is the file's one writer, so it holds one curve)."""
        self._file.close()
        lines = [json.dumps({"step": int(r.get("step", 0)), **{k: v for k, v in r.items() if k != "step"}})
                 for r in rows]  # fmt: skip
        self.path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink(Sink):
    """Writes each metric as a TensorBoard scalar (``add_scalar(key, value, step)``) under ``logdir``.

    Flushes after every step so that a running TensorBoard shows it at once (a step takes seconds or more,
    so the cost does not matter). ``torch.utils.tensorboard`` is imported only when a sink is created.
    """

    def __init__(self, logdir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir))
        self._closed = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = validate_metrics(step, metrics)
        if self._closed:
            raise RuntimeError(
                f"TensorBoardSink({str(self.logdir)!r}) is closed; create a new sink to write more"
            )
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True


def _require(module: str, key: str, package: str) -> ModuleType:
    """Import ``module`` for the sink that ``key`` turns on; a missing one is a `ConfigError` saying how to
    install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{key}=true needs the {package!r} package, which cannot be imported here ({exc}); "
            f"install it with `pip install {package}` (or `pip install -e .[dev]`), or set {key}=false"
        ) from exc


_SECRET_LEAF = re.compile(r"(secret|password|passwd|token|credentials?|api_key|access_key)$", re.IGNORECASE)


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings to dotted keys: ``{"algo": {"lr": 1e-6}}`` -> ``{"algo.lr": 1e-6}``.

    Leaves stay as they are (lists included); an empty mapping is kept as ``{}`` so its key still shows.
    Secrets are redacted to ``"<redacted>"``: every leaf under a ``storage_options`` key (fsspec keys and
    secrets) and every leaf whose name ends in secret / password / token / credentials / api_key /
    access_key (``max_tokens`` and ``prompt_key`` are not secrets and stay).
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            inner = flatten_params(value, prefix=f"{name}.")
            if str(key) == "storage_options":
                inner = dict.fromkeys(inner, "<redacted>")
            out.update(inner)
        elif _SECRET_LEAF.search(str(key)) and value not in (None, ""):
            out[name] = "<redacted>"
        else:
            out[name] = value
    return out


class MlflowSink(Sink):
    """Logs each step's metrics to one MLflow run, with the config as the run's params.

    ``tracking_uri`` is any MLflow tracking URI: a file store (``file:/path/mlruns``), ``sqlite:///x.db``
    (needs SQLAlchemy and Alembic, which ``mlflow-skinny`` lacks), or a server (``http://host:5000``).
    MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true ("maintenance mode"); for a
    ``file:`` URI this sink sets it for this process when it is unset (an explicit ``false`` is kept, and
    MLflow's refusal comes back as a `ConfigError`). The run goes into ``experiment`` (created if missing),
    named ``run_name``.

    Params: ``params`` flattened (`flatten_params`), values as text cut to 500 characters (the limit of
    older MLflow servers; newer take 6000) ending in ``...``; keys over 250 characters are skipped.
    Metrics: each ``write`` is one ``log_batch`` of ``(key, value, step)`` with the wall-clock time; a step
    written again (a redone step after a restart) is added to the metric's history, and MLflow's latest
    value becomes the newest write. ``close`` marks the run FINISHED (once). NaN / inf are logged as such.
    Uses ``MlflowClient`` only (no fluent ``mlflow.start_run``), so a user's own active run is untouched.
    """

    PARAM_VALUE_LIMIT = 500
    PARAM_KEY_LIMIT = 250
    _BATCH_PARAMS = 100  # MLflow's limit per log_batch
    _BATCH_METRICS = 1000

    def __init__(
        self,
        tracking_uri: str,
        experiment: str = "yatt_ray",
        *,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        key: str = "output.mlflow",
    ) -> None:
        _require("mlflow", key, "mlflow-skinny")
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.tracking_uri, self.experiment = tracking_uri, experiment
        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self._client = MlflowClient(tracking_uri=tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                try:
                    experiment_id = self._client.create_experiment(experiment)
                except MlflowException:  # another run created it meanwhile
                    again = self._client.get_experiment_by_name(experiment)
                    if again is None:
                        raise
                    experiment_id = again.experiment_id
            self.run_id: str = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        except MlflowException as exc:
            raise ConfigError(
                f"MLflow could not start a run at {key}_tracking_uri={tracking_uri!r}, experiment "
                f"{experiment!r}: {exc}. Check the URI (a file:/path store, sqlite:///path.db or "
                f"http://host:port) and that the server is up, or set {key}=false"
            ) from exc
        self._closed = False
        items = [(k, self._param_text(v)) for k, v in flatten_params(params or {}).items()]
        items = [(k, v) for k, v in items if len(k) <= self.PARAM_KEY_LIMIT]
        for i in range(0, len(items), self._BATCH_PARAMS):
            chunk = [Param(k, v) for k, v in items[i : i + self._BATCH_PARAMS]]
            self._client.log_batch(self.run_id, params=chunk)

    @classmethod
    def _param_text(cls, value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value) if value is None else str(value)
        limit = cls.PARAM_VALUE_LIMIT
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        values = validate_metrics(step, metrics)
        if self._closed:
            raise RuntimeError(f"MlflowSink(run {self.run_id}) is closed; create a new sink to write more")
        now_ms = int(time.time() * 1000)
        batch = [Metric(k, float(v), now_ms, int(step)) for k, v in values.items()]
        for i in range(0, len(batch), self._BATCH_METRICS):
            self._client.log_batch(self.run_id, metrics=batch[i : i + self._BATCH_METRICS])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id, status="FINISHED")


_WANDB_MODES = typing.get_args(WandbMode)  # one source: the config type


class WandbSink(Sink):
    """Logs each step's metrics to one Weights & Biases run, with the config as the run's config.

    ``mode``: "" leaves it to W&B (``$WANDB_MODE``, else "online", which needs ``wandb login`` or
    ``$WANDB_API_KEY``), or "online" / "offline" (files under ``<directory>/wandb/offline-run-*``, uploaded
    later with ``wandb sync``) / "disabled". ``directory`` is W&B's ``dir`` (None: ``$WANDB_DIR`` or the
    working directory). The run is made with ``reinit="create_new"``, so a user's own run is untouched.

    Steps: W&B's own step (``_step``) must only grow, and W&B drops a row logged at an earlier step. Rows
    here can go back (a redone step after a restart; idle rows arrive after later training rows), so this
    sink never passes W&B a step: it logs ``{"step": step, **metrics}`` as a new row (W&B's ``_step`` counts
    rows) and declares ``step`` the x-axis of every metric (``define_metric("*", step_metric="step")``).
    Nothing is dropped: a redone step is a second row with the same ``step`` (charts show both points; the
    summary holds the newest write). ``close`` finishes the run (once); W&B's background process may
    finish writing the run's files a moment after (at the latest when this process exits).
    """

    def __init__(
        self,
        project: str = "yatt_ray",
        *,
        mode: str = "",
        directory: str | Path | None = None,
        entity: str = "",
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        key: str = "output.wandb",
    ) -> None:
        if mode not in _WANDB_MODES:
            raise ConfigError(
                f"{key}_mode={mode!r} is not a W&B mode; use one of {list(_WANDB_MODES)} "
                '("" = the W&B default: $WANDB_MODE, else online)'
            )
        wandb = _require("wandb", key, "wandb")
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=project,
                entity=entity or None,
                name=run_name,
                dir=str(directory) if directory is not None else None,
                mode=mode or None,
                config=flatten_params(params or {}),
                reinit="create_new",
            )
        except wandb.errors.Error as exc:
            raise ConfigError(
                f"W&B could not start a run (project {project!r}, {key}_mode={mode!r}): {exc}. Log in with "
                f"`wandb login` or set WANDB_API_KEY, or set {key}_mode=offline (then `wandb sync` later), "
                f"or set {key}=false"
            ) from exc
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self._closed = False

    @property
    def run_dir(self) -> Path:
        """The run's local folder (offline: ``wandb/offline-run-<time>-<id>``, with ``run-<id>.wandb``)."""
        return Path(self._run.dir).parent

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = validate_metrics(step, metrics)
        if self._closed:
            raise RuntimeError(f"WandbSink(run {self._run.id}) is closed; create a new sink to write more")
        self._run.log({"step": int(step), **values})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._run.finish()


class MultiSink(Sink):
    """Forwards every write to each of ``sinks`` (validating once, so a bad value reaches none of them).

    ``close()`` closes every sink even if one fails, then re-raises the first failure.
    """

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = validate_metrics(step, metrics)
        for sink in self.sinks:
            sink.write(step, values)

    def rewind(self, rows: list[dict[str, float]]) -> None:
        for sink in self.sinks:
            sink.rewind(rows)

    def close(self) -> None:
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # keep closing the others
                first = first or exc
        if first is not None:
            raise first


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a `JsonlSink` file back as a list of records (for `plot_history` or analysis); blank lines skipped."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_sinks(config: Config, output_dir: Path) -> list[Sink]:
    """The sinks a run's ``output.*`` keys ask for: always ``<output_dir>/metrics.jsonl``, then TensorBoard
    (``<output_dir>/tensorboard``), MLflow and W&B when turned on. If one fails to start, those already made
    are closed and the error is raised.

    MLflow: ``output.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else the file store
    ``file:<output.dir>/mlruns``, shared by the runs under ``output.dir`` (each run gets a fresh folder, and
    MLflow is for comparing runs: ``mlflow ui --backend-store-uri <that URI>``). W&B's files go under
    ``<output_dir>/wandb`` unless ``$WANDB_DIR`` is set. Both runs are named after the run's folder and get
    the config as params, plus ``output.run_dir``.
    """
    sinks: list[Sink] = []
    try:
        sinks.append(JsonlSink(output_dir / "metrics.jsonl"))
        out = config.output
        if out.tensorboard:
            sinks.append(TensorBoardSink(output_dir / "tensorboard"))
        if out.mlflow or out.wandb:
            params = {**flatten_params(config.to_dict()), "output.run_dir": str(output_dir)}
        if out.mlflow:
            root = Path(out.dir).expanduser().resolve()
            uri = (
                out.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"file:{root / 'mlruns'}"
            )
            sinks.append(MlflowSink(uri, out.mlflow_experiment, run_name=output_dir.name, params=params))
        if out.wandb:
            directory = None if os.environ.get("WANDB_DIR") else output_dir
            sinks.append(
                WandbSink(
                    out.wandb_project,
                    mode=out.wandb_mode,
                    directory=directory,
                    entity=out.wandb_entity,
                    run_name=output_dir.name,
                    params=params,
                )
            )
    except BaseException:
        with contextlib.suppress(Exception):
            MultiSink(sinks).close()
        raise
    return sinks
