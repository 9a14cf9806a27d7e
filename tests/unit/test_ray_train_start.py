"""What each run's Ray Train start relies on: `WorldConfig` is Ray's `TorchConfig` for Ray Train (same fields,
context and CUDA sharing) without torch in the process that unpickles it (Ray Train's controller), and the
autoscaling coordinator `fit()` starts early is the one Ray Train's controller waits for."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

from ray.train.torch import TorchConfig

from yatt_ray.rendezvous import WorldConfig


def test_world_config_is_torch_config_for_ray_train():
    ours, ray_s = WorldConfig(backend="gloo", timeout_s=60), TorchConfig(backend="gloo", timeout_s=60)
    assert ours.to_dict() == ray_s.to_dict() and ours.torch_config() == ray_s
    assert ours.framework == ray_s.framework
    assert ours.train_func_context is ray_s.train_func_context  # sets each worker's CUDA device
    assert ours.backend_cls.share_cuda_visible_devices is ray_s.backend_cls.share_cuda_visible_devices is True
    assert WorldConfig().to_dict() == TorchConfig().to_dict()  # Ray's defaults


def test_the_controller_side_imports_no_torch():
    """Unpickled and its backend built, as Ray Train's controller does, in a process without torch."""
    blob = pickle.dumps(WorldConfig(backend="gloo"))
    code = (
        "import pickle, sys\n"
        f"config = pickle.loads({blob!r})\n"
        "backend = config.backend_cls()\n"
        "print(type(backend).__name__, config.to_dict()['backend'], 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["_LoopbackWorldBackend", "gloo", "False"], out


def test_fit_starts_the_coordinator_ray_train_waits_for():
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as data_side
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as train_side

    # the controller's client creates the coordinator through this function (named, detached, get_if_exists)
    assert train_side.get_or_create_autoscaling_coordinator is data_side.get_or_create_autoscaling_coordinator
    source = inspect.getsource(data_side.get_or_create_autoscaling_coordinator)
    assert 'lifetime="detached"' in source and "get_if_exists=True" in source
