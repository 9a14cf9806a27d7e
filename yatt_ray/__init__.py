"""yatt_ray: Ray-native RL post-training (GRPO, PPO) of language models on Megatron-core and vLLM.

import yatt_ray
result = yatt_ray.fit(yatt_ray.load_config("examples/configs/grpo.yaml", ["train.steps=20"]))
result.history[-1]["accuracy"], result.checkpoint_path
"""

from yatt_ray.config import Config, load_config
from yatt_ray.errors import ConfigError, DataError, PlacementError, UnknownNameError, WorkerError, YattError
from yatt_ray.fit import Result, fit

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "PlacementError",
    "Result",
    "UnknownNameError",
    "WorkerError",
    "YattError",
    "fit",
    "load_config",
]
__version__ = "0.1.0"
