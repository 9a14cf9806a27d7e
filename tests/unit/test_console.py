"""`output.verbose`: which settings a quiet console applies, and that verbose applies none (nothing runs)."""

from __future__ import annotations

import logging
import warnings

import pytest

from yatt_ray import console
from yatt_ray.cli import configure_logging


@pytest.fixture
def clean_env(monkeypatch):
    for key in (*console.QUIET_ENV, *console.LOCAL_QUIET_ENV):
        monkeypatch.delenv(key, raising=False)


def test_quiet_job_env_and_a_users_value_wins(clean_env, monkeypatch):
    assert console.job_env_vars(verbose=False) == console.QUIET_ENV
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    quiet = console.job_env_vars(verbose=False)
    assert "VLLM_LOGGING_LEVEL" not in quiet and quiet["RAY_DATA_LOG_LEVEL"] == "ERROR"
    assert console.job_env_vars(verbose=True) == {}
    assert console.job_env_vars(verbose=False, local=True)["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in quiet  # a running cluster's nodes may be reclaimed


def test_ray_init_options():
    local = console.ray_init_options(verbose=False, local=True)
    assert local["logging_level"] == logging.WARNING
    assert local["_system_config"]["worker_maximum_startup_concurrency"] >= console.STARTUP_CONCURRENCY
    assert "_system_config" not in console.ray_init_options(verbose=False, local=False)  # a running cluster
    assert console.ray_init_options(verbose=True, local=True) == {}
    assert console.train_log_level(False) == "WARNING" and console.train_log_level(True) == "INFO"


def test_quiet_worker_filters_the_named_notices_only():
    root, level = logging.getLogger(), logging.getLogger().level
    vllm, vllm_level = logging.getLogger("vllm"), logging.getLogger("vllm").level
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet_worker(verbose=False)
        warnings.warn(
            "Transformer Engine and Apex are not installed. Falling back to ...", UserWarning, stacklevel=1
        )
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
        warnings.warn("something the user should see", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["something the user should see"]
        assert root.level == logging.WARNING and vllm.level == logging.ERROR
    root.setLevel(level)
    vllm.setLevel(vllm_level)


def test_verbose_worker_changes_nothing():
    root, level = logging.getLogger(), logging.getLogger().level
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet_worker(verbose=True)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
        assert len(seen) == 1 and root.level == level


def test_the_command_line_keeps_the_librarys_info_lines(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # basicConfig configures an unconfigured root only
    level = root.level
    try:
        configure_logging(verbose=False)
        assert (
            root.level == logging.WARNING
            and logging.getLogger("yatt_ray").getEffectiveLevel() == logging.INFO
        )
        assert logging.getLogger("megatron").getEffectiveLevel() == logging.WARNING
    finally:
        root.setLevel(level)
