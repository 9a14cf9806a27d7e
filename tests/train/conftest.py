"""Fixtures for the Megatron training backend tests: a tiny HF Llama and a one-process gloo world."""

from __future__ import annotations

import pytest

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
