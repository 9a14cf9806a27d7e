"""The library's error types.

Every message says what happened, the values involved, the likely cause and the fix. All types pickle
cleanly (they keep only their message), so they survive crossing Ray actor and task boundaries.
"""

from __future__ import annotations


class YattError(Exception):
    """Base class of every error yatt_ray raises on purpose."""

    def __reduce__(self):
        return (type(self), (str(self),))


class ConfigError(YattError, ValueError):
    """A configuration value is invalid: the message names the key, the value and the fix."""


class UnknownNameError(ConfigError, KeyError):
    """A name (algorithm, estimator, engine, ...) is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else ""


class DataError(YattError, ValueError):
    """Input data is missing or has the wrong schema."""


class PlacementError(YattError):
    """The requested workers or roles cannot be placed on the cluster's resources."""


class RewardError(YattError):
    """The reward function failed on a sample or returned something that is not a finite number: the message
    names `reward.function`, the sample (data source, ground truth, start of the response) and the error."""


class WorkerError(YattError):
    """A training or rollout worker failed; the message carries the worker's rank and the original error."""
