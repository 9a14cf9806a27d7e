"""`rollout.engine=auto` on CPUs by measurement (`yatt_ray.rollout.engine_choice`), with stand-in timings: which
engine is taken, when the machine's cache answers and when it measures, what the cache key holds, and where
nothing is measured (GPUs, explicit kinds, a model only one engine can serve, a failed measurement)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from yatt_ray import load_config, machine_cache
from yatt_ray.errors import YattError
from yatt_ray.rollout import auto_engine, resolve_engine_kind
from yatt_ray.rollout import engine_choice as EC
from yatt_ray.rollout.engine_choice import RolloutShape, choice_key, choose_engine, faster

SHAPE = RolloutShape(prompts=16, prompt_tokens=16, n=8, max_new_tokens=6, threads=1)
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "tie_word_embeddings": False, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
}  # fmt: skip


def model_dir(tmp_path, name="model", **changes):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return folder


class StandIn:
    """A measurement that returns fixed timings and counts its calls."""

    def __init__(self, hf: float, vllm: float) -> None:
        self.seconds = {"hf": hf, "vllm": vllm}
        self.calls: list[tuple] = []

    def __call__(self, model, shape, engine_kwargs):
        self.calls.append((model, shape, engine_kwargs))
        return dict(self.seconds)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # an empty machine cache
    return machine_cache.cache_path()


def test_the_faster_engine_is_taken_and_a_tie_goes_to_vllm():
    assert faster({"hf": 0.37, "vllm": 0.93}) == "hf"
    assert faster({"hf": 0.5, "vllm": 0.2}) == "vllm"
    assert faster({"hf": 0.3, "vllm": 0.3}) == "vllm"


def test_measured_once_then_read_from_the_machine_cache(tmp_path, cache):
    model = model_dir(tmp_path)
    measure = StandIn(hf=0.37, vllm=0.93)
    first = choose_engine(model, SHAPE, {"seed": 0}, measure=measure)
    assert (first.kind, first.cached, first.seconds) == ("hf", False, {"hf": 0.37, "vllm": 0.93})
    assert measure.calls == [(str(model), SHAPE, {"seed": 0})]
    stored = json.loads(cache.read_text())  # beside the kernels, in the same file and style
    assert stored[choice_key(model, SHAPE)] == {"hf": 0.37, "vllm": 0.93}
    second = choose_engine(model, SHAPE, {"seed": 0}, measure=StandIn(hf=9.0, vllm=0.1))
    assert (second.kind, second.cached, second.seconds) == ("hf", True, first.seconds)  # not measured again
    text = second.describe()
    assert text.startswith("hf (auto, cached measurement on this machine: hf 0.370 s, vllm 0.930 s")
    assert (
        "a call of 16 prompts x 8 samples x 6 tokens after 16-token prompts, float32, 1 thread(s) beside the trainer"
        in text
    )
    assert "hf (auto, measured on this machine: hf 0.370 s, vllm 0.930 s" in first.describe()


def test_another_shape_model_or_machine_is_measured_anew(tmp_path, cache, monkeypatch):
    model = model_dir(tmp_path)
    measure = StandIn(hf=0.4, vllm=0.2)
    choose_engine(model, SHAPE, measure=measure)
    for shape in (
        RolloutShape(prompts=32, prompt_tokens=16, n=8, max_new_tokens=6, threads=1),
        RolloutShape(prompts=16, prompt_tokens=16, n=8, max_new_tokens=6, threads=2),
        RolloutShape(prompts=16, prompt_tokens=16, n=4, max_new_tokens=6, threads=1),
        RolloutShape(prompts=16, prompt_tokens=16, n=8, max_new_tokens=64, threads=1),
        RolloutShape(prompts=16, prompt_tokens=512, n=8, max_new_tokens=6, threads=1),
        RolloutShape(prompts=16, prompt_tokens=16, n=8, max_new_tokens=6, threads=1, dtype="bfloat16"),
        RolloutShape(prompts=16, prompt_tokens=16, n=8, max_new_tokens=6, threads=1, beside_trainer=False),
    ):
        assert choose_engine(model, shape, measure=measure).cached is False
    wider = model_dir(tmp_path, "wider", hidden_size=512, intermediate_size=2048)
    assert choose_engine(wider, SHAPE, measure=measure).cached is False
    assert len(measure.calls) == 9
    same_shape_elsewhere = model_dir(tmp_path, "copy")  # the same architecture in another folder: a hit
    assert choose_engine(same_shape_elsewhere, SHAPE, measure=measure).cached is True
    monkeypatch.setattr(machine_cache, "_cpu_model", lambda: "another CPU")
    assert choose_engine(model, SHAPE, measure=measure).cached is False
    monkeypatch.setattr(EC, "_vllm_version", lambda: "0.0.1")
    assert choose_engine(model, SHAPE, measure=measure).cached is False
    assert len(measure.calls) == 11


def test_the_key_names_the_machine_versions_model_and_rollout_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(EC, "_vllm_version", lambda: "0.32.0")
    key = choice_key(model_dir(tmp_path), SHAPE)
    assert key.startswith(f"{EC.CACHE_VERSION}|{machine_cache._cpu_model()}|{torch.__version__}|")
    assert "|vllm=0.32.0|" in key and "|transformers=" in key
    for field in ('"hidden_size":128', '"num_hidden_layers":2', '"num_key_value_heads":2', '"vocab_size":128',
                  '"architectures":["LlamaForCausalLM"]'):  # fmt: skip
        assert field in key
    assert "max_position_embeddings" not in key and "rms_norm_eps" not in key  # no bearing on the speed
    assert key.endswith(
        "prompts=16,prompt_tokens=16,n=8,max_new_tokens=6,threads=1,dtype=float32,beside_trainer=True"
    )


def test_a_damaged_entry_is_measured_again(tmp_path, cache):
    model = model_dir(tmp_path)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({choice_key(model, SHAPE): {"hf": -1, "vllm": 0.2}}))
    measure = StandIn(hf=0.1, vllm=0.2)
    choice = choose_engine(model, SHAPE, measure=measure)
    assert (choice.kind, choice.cached, len(measure.calls)) == ("hf", False, 1)
    assert json.loads(cache.read_text())[choice_key(model, SHAPE)] == {"hf": 0.1, "vllm": 0.2}


@pytest.fixture
def vllm_here(monkeypatch):
    """vLLM counts as installed; the measurement is a stand-in that records its calls."""
    import yatt_ray.rollout as rollout

    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    measure = StandIn(hf=0.37, vllm=0.93)
    monkeypatch.setattr(EC, "measure_engines", measure)
    return measure


def test_auto_on_a_cpu_takes_the_measured_engine_and_explicit_kinds_are_kept(tmp_path, cache, vllm_here):
    model = model_dir(tmp_path)
    choice = auto_engine(model, on_gpu=False, shape=SHAPE, engine_kwargs={"seed": 3})
    assert (choice.kind, choice.measured, choice.cached) == ("hf", True, False)
    assert vllm_here.calls == [(str(model), SHAPE, {"seed": 3})]
    assert resolve_engine_kind("auto", model, on_gpu=False, shape=SHAPE) == "hf"  # the cache answers
    assert resolve_engine_kind("vllm", model, on_gpu=False, shape=SHAPE) == "vllm"  # never overridden
    assert resolve_engine_kind("hf", model, on_gpu=False, shape=SHAPE) == "hf"
    assert len(vllm_here.calls) == 1


def test_nothing_is_measured_where_the_rule_decides(tmp_path, cache, vllm_here, monkeypatch):
    model = model_dir(tmp_path)
    on_gpu = auto_engine(model, on_gpu=True, shape=SHAPE)
    assert (on_gpu.kind, on_gpu.measured) == ("vllm", False) and "GPU" in on_gpu.describe()
    assert auto_engine(model, on_gpu=False).kind == "vllm"  # no shape (make_engine, the judge): the rule
    head16 = model_dir(tmp_path, "head16", hidden_size=64)  # 4 heads of 16: vLLM's CPU attention lacks it
    assert auto_engine(head16, on_gpu=False, shape=SHAPE).kind == "hf"
    vision = model_dir(
        tmp_path, "llava", vision_config={"model_type": "clip_vision_model"}, model_type="llava"
    )
    assert auto_engine(vision, on_gpu=False, shape=SHAPE).kind == "hf"
    import yatt_ray.rollout as rollout

    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    missing = auto_engine(model, on_gpu=False, shape=SHAPE)
    assert (missing.kind, missing.describe()) == ("hf", "hf (auto: vLLM is not installed)")
    assert vllm_here.calls == []
    assert not cache.exists()


def test_a_failed_measurement_keeps_the_rule_and_is_not_cached(tmp_path, cache, monkeypatch, caplog):
    import yatt_ray.rollout as rollout

    def broken(model, shape, engine_kwargs):
        raise YattError("timing the rollout engines failed (exit 1): out of memory")

    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    monkeypatch.setattr(EC, "measure_engines", broken)
    model = model_dir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="yatt_ray.rollout"):
        choice = auto_engine(model, on_gpu=False, shape=SHAPE)
    assert (choice.kind, choice.measured) == ("vllm", False)
    assert "out of memory" in caplog.text
    assert not cache.exists() or choice_key(model, SHAPE) not in json.loads(cache.read_text())


def test_the_rollout_shape_of_a_run():
    config = load_config(None, ["train.prompts_per_step=32", "train.dp_size=2", "rollout.n=8"])
    colocated = SimpleNamespace(engines=None, dp_size=2)
    shape = RolloutShape.of_run(config, colocated, threads=1)
    assert shape == RolloutShape(prompts=16, prompt_tokens=config.data.max_prompt_tokens, n=8,
                                 max_new_tokens=config.rollout.max_new_tokens, threads=1)  # fmt: skip
    actors = SimpleNamespace(engines=SimpleNamespace(count=3, cpus=2), dp_size=2)
    over = load_config(None, ["train.prompts_per_step=32", "rollout.over_sample=1.5", "train.dtype=bf16"])
    shape = RolloutShape.of_run(over, actors, threads=2)
    assert (shape.prompts, shape.threads, shape.dtype, shape.beside_trainer) == (
        16,
        2,
        "bfloat16",
        False,
    )  # ceil(48 / 3 engines)


def test_the_driver_resolves_auto_once_for_the_workers_and_engine_actors(tmp_path, cache, vllm_here):
    """`fit._resolve_engine`: the kind goes into the config the workers get, the line into the plan's print; an
    engine actor's shape takes its CPUs as threads; an explicit kind or tensor parallelism measures nothing."""
    from yatt_ray.fit import _resolve_engine
    from yatt_ray.placement import EngineSlice

    model = model_dir(tmp_path)
    actors = SimpleNamespace(engines=EngineSlice(count=2, gpus=0.0, cpus=1), dp_size=2, cpus_per_worker=1)
    config = load_config(None, [f"model.path={model}", "train.prompts_per_step=32", "train.dp_size=2"])
    line = _resolve_engine(config, actors, on_gpu=False)
    assert config.rollout.engine == "hf" and line.startswith("hf (auto, measured on this machine: hf 0.370 s")
    (_, shape, kwargs), = vllm_here.calls  # fmt: skip
    assert (shape.prompts, shape.threads, shape.beside_trainer) == (16, 1, False)
    assert kwargs["max_model_len"] == config.data.max_prompt_tokens + config.rollout.max_new_tokens
    for overrides, expected in ((["rollout.engine=vllm"], "vllm (rollout.engine=vllm)"),
                                (["train.tp_size=2"], "hf (auto: the colocated vLLM engine needs train.tp_size=1)")):  # fmt: skip
        config = load_config(None, [f"model.path={model}", "train.dp_size=2", *overrides])
        assert _resolve_engine(config, actors, on_gpu=False) == expected
    config = load_config(None, [f"model.path={model}"])
    assert _resolve_engine(config, actors, on_gpu=True) == "vllm (auto: on GPUs)"
    assert len(vllm_here.calls) == 1
