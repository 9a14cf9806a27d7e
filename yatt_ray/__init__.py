"""yatt_ray: Ray-native RL post-training (GRPO today) of language models on Megatron-core and vLLM.

    import yatt_ray
    result = yatt_ray.fit(yatt_ray.load_config("examples/configs/grpo.yaml", ["train.steps=20"]))
    result.metric("accuracy")[-1], result.checkpoint_path

`yatt_ray.fit()` with no argument trains the embedded demo (a tiny model on an addition task, on the CPU).
"""

from yatt_ray.config import Config, load_config
from yatt_ray.errors import (
    ConfigError,
    DataError,
    PlacementError,
    RewardError,
    UnknownNameError,
    WorkerError,
    YattError,
)
from yatt_ray.fit import Result, fit

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "PlacementError",
    "Result",
    "RewardError",
    "UnknownNameError",
    "WorkerError",
    "YattError",
    "fit",
    "load_config",
]
__version__ = "0.1.0"
