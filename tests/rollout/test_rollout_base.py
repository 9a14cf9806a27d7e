"""The engine interface: SamplingSpec and GenerateRequest validation, prompt checks, seeds, the private RNG,
make_engine errors."""

from __future__ import annotations

import pytest
import torch

import yatt_ray.rollout as rollout
from yatt_ray.batch import Pixels
from yatt_ray.errors import ConfigError, UnknownNameError, YattError
from yatt_ray.rollout import Completion, GenerateRequest, SamplingSpec, complete, make_engine
from yatt_ray.rollout.base import PrivateRng, derive_seed, read_eos_token_ids, validate_prompts
from yatt_ray.rollout.hf_engine import HFEngine


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"n": 0}, "n=0"),
        ({"n": True}, "n=True"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"seed": -1}, "seed=-1"),
        ({"stop_token_ids": [2]}, "stop_token_ids=[2]"),
        ({"stop_token_ids": (2, -1)}, "stop_token_ids=(2, -1)"),
    ],
)
def test_sampling_spec_rejects_bad_values(kwargs, needle):
    args = {"n": 2, "max_new_tokens": 8, **kwargs}
    with pytest.raises(ConfigError, match="invalid SamplingSpec") as info:
        SamplingSpec(**args)
    assert needle in str(info.value)


def test_sampling_spec_defaults_and_greedy():
    spec = SamplingSpec(n=4, max_new_tokens=16)
    assert (spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.stop_token_ids) == (
        1.0,
        1.0,
        -1,
        None,
        (),
    )
    assert not spec.greedy and SamplingSpec(n=1, max_new_tokens=1, temperature=0).greedy
    with pytest.raises(AttributeError):
        spec.n = 3  # frozen


def test_validate_prompts_names_the_bad_prompt():
    spec = SamplingSpec(n=1, max_new_tokens=8)
    validate_prompts([[1, 5], [1]], spec, max_model_len=16, vocab_size=128)
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        validate_prompts([[1], []], spec, 16, 128)
    with pytest.raises(
        ConfigError, match=r"prompt 0 has 9 tokens \+ max_new_tokens=8 = 17, over .*max_model_len=16"
    ):
        validate_prompts([[1] * 9], spec, 16, 128)
    with pytest.raises(ConfigError, match=r"prompt 0 holds token ids outside \[0, 128\): \[128\]"):
        validate_prompts([[1, 128]], spec, 16, 128)
    with pytest.raises(ConfigError, match="stop_token_ids"):
        validate_prompts([[1]], SamplingSpec(n=1, max_new_tokens=1, stop_token_ids=(300,)), 16, 128)


PROMPTS = [[1, 5], [1, 6], [1, 7], [1, 8]]
SPEC = SamplingSpec(n=1, max_new_tokens=2)


@pytest.mark.parametrize("k", [0, 5, -1, True, 1.0, "1"])
def test_request_finish_after_out_of_range_is_a_config_error(k):
    with pytest.raises(ConfigError, match=rf"finish_after={k!r} must be None or an int in \[1, 4\]"):
        GenerateRequest(PROMPTS, SPEC, finish_after=k)


def test_request_checks_wait_for_images_and_types():
    GenerateRequest(PROMPTS, SPEC, finish_after=1, wait_for=frozenset({3}))
    with pytest.raises(ConfigError, match=r"wait_for=\[0\] .* come with finish_after"):
        GenerateRequest(PROMPTS, SPEC, wait_for=frozenset({0}))
    with pytest.raises(ConfigError, match=r"wait_for=\[4\] must hold prompt indices in \[0, 4\)"):
        GenerateRequest(PROMPTS, SPEC, finish_after=1, wait_for=frozenset({4}))
    with pytest.raises(ConfigError, match="one entry .* per prompt: 4 prompts, images 1"):
        GenerateRequest(PROMPTS, SPEC, images=[None])
    with pytest.raises(ConfigError, match="spec must be a SamplingSpec, got dict"):
        GenerateRequest(PROMPTS, {"n": 1})
    with pytest.raises(ConfigError, match="prompts must be a list of token-id lists, got str"):
        GenerateRequest("1 5", SPEC)


def test_request_is_a_plain_picklable_value():
    """A request may be sent to an engine in another process."""
    import pickle

    pixels = Pixels(torch.zeros(1, 3, 2, 2))
    request = GenerateRequest(
        PROMPTS[:2], SPEC, images=[pixels, None], finish_after=1, wait_for=frozenset({0})
    )
    back = pickle.loads(pickle.dumps(request))
    assert (back.prompts, back.spec, back.finish_after, back.wait_for) == (
        PROMPTS[:2],
        SPEC,
        1,
        frozenset({0}),
    )
    assert back.images is not None and torch.equal(back.images[0].values, pixels.values)


def test_complete_takes_results_without_aborted_prompts():
    group = [Completion([3], [-0.5], "stop")]
    assert complete([group, group]) == [group, group]
    with pytest.raises(YattError, match=r"prompts \[1\] were aborted"):
        complete([group, None])


def test_derive_seed_spreads_indices():
    seeds = {derive_seed(0, i, j) for i in range(50) for j in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**31 for s in seeds)
    assert derive_seed(3, 1) == derive_seed(3, 1) != derive_seed(4, 1)
    assert derive_seed(3, 1) != derive_seed(3, 1, 0)


def test_private_rng_leaves_the_global_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    rng = PrivateRng(seed=5)
    with rng.active():
        first = torch.rand(2)
    with rng.active():
        second = torch.rand(2)
    with rng.active(seed=9):
        seeded = torch.rand(2)
    with rng.active(seed=9):
        seeded_again = torch.rand(2)
    assert torch.equal(torch.rand(3), expected)  # the global stream neither moved nor was reseeded
    assert not torch.equal(first, second)  # the private stream continues between calls
    assert torch.equal(seeded, seeded_again)
    again = PrivateRng(seed=5)
    with again.active():
        assert torch.equal(torch.rand(2), first)


def test_read_eos_token_ids(model_dirs, tmp_path):
    assert read_eos_token_ids(str(model_dirs[0])) == (2,)
    (tmp_path / "config.json").write_text('{"eos_token_id": [2, 7]}')
    assert read_eos_token_ids(str(tmp_path)) == (2, 7)
    assert read_eos_token_ids(str(tmp_path / "missing")) == ()


def test_make_engine_unknown_kind_lists_the_valid_ones(model_dirs):
    with pytest.raises(
        UnknownNameError, match="unknown rollout engine kind 'vlm'; valid kinds: auto, vllm, hf"
    ):
        make_engine("vlm", model_dirs[0])


def test_make_engine_vllm_missing_says_how_to_install(model_dirs, monkeypatch):
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        make_engine("vllm", model_dirs[0])
    message = str(info.value)
    assert "vLLM is not installed" in message
    assert "pip install 'yatt_ray[cpu]'" in message and "pip install 'yatt_ray[gpu]'" in message


def test_make_engine_auto_without_vllm_is_hf_and_drops_vllm_only_arguments(model_dirs, monkeypatch):
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    engine = make_engine("auto", model_dirs[0], seed=3, kv_cache_gb=1.0, gpu_memory_utilization=0.3)
    try:
        assert isinstance(engine, HFEngine)
        assert isinstance(engine, rollout.RolloutEngine)
    finally:
        engine.close()
    with pytest.raises(ConfigError, match=r"takes no argument\(s\) \['kv_cache_size'\]"):
        make_engine("auto", model_dirs[0], kv_cache_size=1)
    with pytest.raises(ConfigError, match=r"'hf' \(HFEngine\) takes no argument\(s\) \['bogus'\]"):
        make_engine("hf", model_dirs[0], bogus=1)
