"""A check of a finished run's folder, for tests that ran `yatt_ray.fit()`: its config.yaml is the config the
run used (`Result.config`, resolved and frozen by the driver)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from yatt_ray.config import Config
from yatt_ray.fit import CONFIG_FILE, REDACTED, read_run_config


def check_run_folder(run_dir: str | Path, config: Config) -> None:
    """Assert that `run_dir` holds config.yaml and that it reads back as `config` (with the values under
    `checkpoint.storage_options` redacted, as the file writes them). Call it with a Result:
    `check_run_folder(result.output_dir, result.config)`."""
    path = Path(run_dir) / CONFIG_FILE
    assert path.is_file(), f"{run_dir} holds no {CONFIG_FILE} (fit() writes it at the start of the run)"
    options = config.checkpoint.storage_options
    expected = dataclasses.replace(
        config,
        checkpoint=dataclasses.replace(config.checkpoint, storage_options=dict.fromkeys(options, REDACTED)),
    )
    got = read_run_config(run_dir)
    assert got == expected, _difference(got, expected)


def _difference(got: Config, expected: Config) -> str:
    """The keys whose values differ, for the assertion message."""
    a, b = got.to_dict(), expected.to_dict()
    diff = [
        f"{section}.{key}: {a[section].get(key)!r} in {CONFIG_FILE}, {value!r} in the run's config"
        for section, keys in b.items()
        for key, value in keys.items()
        if a[section].get(key) != value
    ]
    return f"{CONFIG_FILE} differs from the run's config: " + "; ".join(diff)
