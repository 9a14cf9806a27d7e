"""Fixtures for the Megatron training backend tests: a tiny HF Llama and a one-process gloo world."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from yatt_ray.models.tiny import TinyModelSpec, build_tiny_model


def pytest_configure(config):
    # Megatron without Apex / TransformerEngine warns at every model build; nothing to act on here.
    config.addinivalue_line("filterwarnings", "ignore:Apex is not installed:UserWarning")
    config.addinivalue_line("filterwarnings", "ignore:full scope is deprecated:UserWarning")
    config.addinivalue_line("filterwarnings", "ignore:TypedStorage is deprecated:UserWarning")
    config.addinivalue_line(
        "filterwarnings", "ignore:Transformer Engine and Apex are not installed:UserWarning"
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny LlamaForCausalLM dir (GQA 4 heads / 2 kv heads, untied embeddings, vocab 128, fp32)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), TinyModelSpec())


@pytest.fixture(scope="module")
def single_process_world():
    """A world of size 1 (gloo, in-memory store) in the pytest process, with Megatron TP=1 on top of it.

    Everything TP=1 runs here; TP=2 / DP=2 runs in spawned processes (see `dist_harness.py`). Torn down
    after each module so no process group outlives these tests in a shared pytest session.
    """
    from yatt_ray.train import init_parallel_state

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state(1)
    yield
    if owned:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
