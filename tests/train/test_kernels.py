"""CPU kernels chosen by measurement: cached per machine and shape, applied to the linear layers and attention."""

import dataclasses
import json

import pytest
import torch

from yatt_ray import machine_cache
from yatt_ray.model_shape import LlamaShape, linear_shapes
from yatt_ray.train import kernel_timing as KT
from yatt_ray.train import kernels as K
from yatt_ray.train.cpu_shims import onednn_linear_available

SHAPE = LlamaShape(
    vocab_size=64, hidden_size=96, ffn_hidden_size=160, num_layers=1, num_heads=6, num_kv_heads=2, head_dim=16,
    rms_norm_eps=1e-6, rope_theta=1e4, max_positions=128, tie_word_embeddings=False,
)  # fmt: skip


def test_choice_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    threads = torch.get_num_threads()
    choice = KT.choose_kernels(SHAPE, max_threads=2)
    assert torch.get_num_threads() == threads  # the caller's threads are restored
    assert choice.linear in K.LINEAR and choice.gqa in K.GQA and 1 <= choice.threads <= 2
    rates = choice.rates
    assert rates[f"linear_{choice.linear}"] == max(
        rates[f"linear_{k}"] for k in K.LINEAR if f"linear_{k}" in rates
    )
    assert ("linear_onednn" in rates) == onednn_linear_available()
    assert rates[f"gqa_{choice.gqa}"] == min(rates["gqa_native"], rates["gqa_expand"])
    assert "linear " + choice.linear in choice.describe() and "GQA " + choice.gqa in choice.describe()
    assert choice.dense_rows in (0, *KT.ROW_LENGTHS)
    # each row count takes its fastest weight-gradient form where that beats "direct" by WGRAD_WIN
    if choice.linear == "onednn":
        assert [rows for rows, _ in choice.wgrad] == list(K.WGRAD_ROWS)
        for rows, form in choice.wgrad:
            times = {k: rates[f"wgrad_{k}_{rows}"] for k in K.WGRAD}
            best = min(times, key=times.__getitem__)
            assert form == (best if times[best] < K.WGRAD_WIN * times["direct"] else "direct"), (rows, times)
            assert f"{form} at {rows} rows" in choice.describe()
    else:
        assert choice.wgrad == () and not any(k.startswith("wgrad_") for k in rates)
    for length in KT.ROW_LENGTHS:  # masked rows up to the first length where they stop being faster
        if length <= choice.dense_rows:
            assert rates[f"rows_{length}"] < rates[f"sequences_{length}"]
        elif f"rows_{length}" in rates:
            assert rates[f"rows_{length}"] >= rates[f"sequences_{length}"]
            break

    def no_measuring(*args):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(KT, "_measure", no_measuring)
    assert KT.choose_kernels(SHAPE, max_threads=2) == choice
    with pytest.raises(AssertionError, match="measured again"):  # another shape is another key
        KT.choose_kernels(dataclasses.replace(SHAPE, hidden_size=128), max_threads=2)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the same CPU capped to AVX2 measures differently
    with pytest.raises(AssertionError, match="measured again"):
        KT.choose_kernels(SHAPE, max_threads=2)


def test_a_damaged_cache_is_measured_again_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = machine_cache.cache_path()
    path.parent.mkdir(parents=True)
    measured = []
    real = KT._measure
    monkeypatch.setattr(KT, "_measure", lambda *a: measured.append(1) or real(*a))
    for damage in ("{not json", "[1, 2]"):
        path.write_text(damage)
        choice = KT.choose_kernels(SHAPE, max_threads=1)
        assert len(measured) == 1 and choice.threads == 1
        measured.clear()
    key = next(iter(json.loads(path.read_text())))
    path.write_text(json.dumps({key: {"linear": "mkl"}}))  # an entry of another version's fields
    assert KT.choose_kernels(SHAPE, max_threads=1) and len(measured) == 1
    assert (
        KT.choose_kernels(SHAPE, max_threads=1) and len(measured) == 1
    )  # rewritten: read from the cache now


def test_gqa_forms_agree():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 10, 16, generator=g)
    k, v = torch.randn(2, 2, 10, 16, generator=g), torch.randn(2, 2, 10, 16, generator=g)
    native = K.grouped_attention(q, k, v, 0.25, "native")
    torch.testing.assert_close(native, K.grouped_attention(q, k, v, 0.25, "expand"), atol=1e-6, rtol=0)


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear op")
def test_the_chosen_linear_kernel_is_the_one_that_runs(monkeypatch, single_process_world):
    """With linear=mkl the Megatron layers never call oneDNN; with onednn they do; the outputs agree."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from yatt_ray.train import cpu_shims, seed_everything
    from yatt_ray.train.model import transformer_config

    seed_everything(0)
    layer = ColumnParallelLinear(96, 160, config=transformer_config(SHAPE, 1), init_method=torch.nn.init.normal_,
                                 bias=False, gather_output=True)  # fmt: skip
    calls = []
    real = cpu_shims.onednn_mm_t
    monkeypatch.setattr(cpu_shims, "onednn_mm_t", lambda a, b: calls.append(1) or real(a, b))
    x = torch.randn(4, 3, 96)
    outputs = {}
    try:
        for linear in K.LINEAR:
            K.apply_kernels(K.KernelChoice(linear, torch.get_num_threads(), "native", 0, {}))
            calls.clear()
            outputs[linear] = layer(x)[0]
            assert bool(calls) == (linear == "onednn"), linear
    finally:
        K.apply_kernels(None)
    torch.testing.assert_close(outputs["mkl"], outputs["onednn"], atol=1e-4, rtol=1e-4)


def test_linear_rates_rank_a_kernel_that_does_twice_the_work_below_the_real_one():
    """`linear_rates` times the model's own layers (q/k/v, output, MLP in and out), kernels taking turns."""
    assert linear_shapes(SHAPE) == [(96, 96 + 2 * 32), (96, 96), (96, 320), (160, 96)]

    def real(a, b):
        return torch.matmul(a, b.t())

    def twice(a, b):
        real(a, b)
        return real(a, b)

    rates = KT.linear_rates(SHAPE, torch.float32, {"real": real, "twice": twice}, tokens=256, rounds=3)
    assert rates["twice"] < 0.8 * rates["real"]


def test_a_row_count_takes_the_weight_gradient_form_measured_nearest_to_it():
    choice = K.KernelChoice("onednn", 2, "native", 0, {}, ((1024, "mkl"), (4096, "transposed")))
    forms = {rows: choice.wgrad_form(rows) for rows in (1, 672, 1024, 2040, 2060, 4096, 20000)}
    assert forms == {1: "mkl", 672: "mkl", 1024: "mkl", 2040: "mkl", 2060: "transposed", 4096: "transposed",
                     20000: "transposed"}  # fmt: skip
    assert K.KernelChoice("onednn", 2, "native", 0, {}).wgrad_form(4096) == "direct"  # none measured
    cached = json.loads(json.dumps(dataclasses.asdict(choice)))  # the cache's round trip: pairs become lists
    assert K.KernelChoice(**cached) == choice and K.KernelChoice(**cached).wgrad_form(5000) == "transposed"
    with pytest.raises(ValueError, match="not among"):  # a damaged cache entry is measured again, not run
        K.KernelChoice(**{**cached, "wgrad": [[1024, "fast"]]})
