"""Model FLOPs from a decoder's shape, the peak table, and the CPU's measured matmul rate."""

from __future__ import annotations

import pytest
import torch

from yatt_ray.metrics.flops import (
    ModelFlops,
    PerfModel,
    causal_pairs,
    shared_prompt_work,
    table_peak,
)
from yatt_ray.model_shape import LlamaShape
from yatt_ray.train.cpu_shims import onednn_linear_available
from yatt_ray.train.kernel_timing import measure_matmul_flops, worker_perf_model

# hidden 8, 2 layers, 2 heads of 4 (q = 8), 1 kv head (kv = 4), MLP 16, vocabulary 10
SHAPE = LlamaShape(
    vocab_size=10, hidden_size=8, ffn_hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
    rms_norm_eps=1e-6, rope_theta=1e4, max_positions=64, tie_word_embeddings=True,
)  # fmt: skip


def test_matmul_params_of_a_small_shape():
    flops = ModelFlops.from_shape(SHAPE)
    # per layer: q 8x8 + o 8x8 = 128, k + v 2 x 8x4 = 64, gate/up/down 3 x 8x16 = 384 -> 576; x 2 layers = 1152;
    # the LM head 8 x 10 = 80 (tied embeddings: the lookup is no matmul, the head is)
    assert flops.matmul_params == 1152 + 80
    assert (flops.layers, flops.attn_width) == (2, 8)


def test_forward_flops_by_hand():
    flops = ModelFlops.from_shape(SHAPE)
    # two sequences of 3 and 1 tokens: T = 4, P = 3*4/2 + 1*2/2 = 7 causal pairs
    pairs = causal_pairs(torch.tensor([3, 1]))
    assert pairs == 7.0
    # 2 N T + 4 L q P = 2 * 1232 * 4 + 4 * 2 * 8 * 7
    assert flops.forward(4, pairs) == 9856 + 448


def test_peak_table_by_device_name_and_dtype():
    assert table_peak("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert table_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak("NVIDIA H200", "bf16") == 989e12
    assert table_peak("NVIDIA L40S", "bf16") is None  # not an L4
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on a V100


def test_cpu_peak_is_measured_and_an_override_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: measured here
    rate = measure_matmul_flops(threads=1, size=128, seconds=0.02)
    assert 1e6 < rate < 1e13
    threads = torch.get_num_threads()
    model = worker_perf_model(SHAPE, threads=1, override=5e9)
    assert model == PerfModel(ModelFlops.from_shape(SHAPE), 5e9, "cluster.peak_flops")
    assert torch.get_num_threads() == threads
    if not torch.cuda.is_available():
        measured = worker_perf_model(SHAPE, threads=1, override=None)
        assert measured.peak_flops is not None and measured.peak_flops > 0
        assert measured.peak_source.startswith("measured: fp32 matmul (best of MKL, oneDNN), 1 thread")
        bf16 = worker_perf_model(SHAPE, threads=1, override=None, dtype=torch.bfloat16)
        if onednn_linear_available(torch.bfloat16):  # bf16 units: their own measured peak
            assert bf16.peak_source.startswith("measured: bf16 matmul") and bf16.peak_flops > 0
        else:  # none (AVX2 only): bf16 is computed in fp32, whose peak is the ceiling
            assert (
                bf16.peak_source.endswith("no bf16 matmul units") and bf16.peak_flops == measured.peak_flops
            )
        import yatt_ray.train.kernel_timing as flops_module

        def no_measuring(*args, **kwargs):
            raise AssertionError("measured again although cached")

        monkeypatch.setattr(flops_module, "measure_matmul_flops", no_measuring)
        again = worker_perf_model(SHAPE, threads=1, override=None)  # the next start reads the cache
        assert again.peak_flops == measured.peak_flops
        with pytest.raises(AssertionError, match="measured again"):  # another thread count is another key
            worker_perf_model(SHAPE, threads=2, override=None)


@pytest.mark.parametrize("lengths", [[1], [5, 2, 9]])
def test_causal_pairs_count_what_attention_scores(lengths):
    by_loop = sum(sum(i + 1 for i in range(t)) for t in lengths)
    assert causal_pairs(torch.tensor(lengths)) == by_loop


def test_a_shared_prompt_counts_once_a_group():
    """Two groups of 3 samples: each prompt's positions and the pairs among them once, every response token
    attending to its prompt and to its own earlier tokens (counted by enumerating the attended keys)."""
    prompts, responses = [4, 2], [[1, 3, 0], [5, 2, 2]]
    tokens, pairs = 0, 0
    for p, group in zip(prompts, responses):
        tokens += p + sum(group)
        pairs += sum(q + 1 for q in range(p))  # prompt position q attends to positions 0..q
        pairs += sum(p + j + 1 for r in group for j in range(r))  # response token j: the prompt and 0..j
    prompt_lengths = torch.tensor([p for p in prompts for _ in range(3)])
    lengths = prompt_lengths + torch.tensor([r for group in responses for r in group])
    assert shared_prompt_work(prompt_lengths, lengths, group_size=3) == (tokens, pairs)
    # one sample a group: the same as the unshared count
    assert shared_prompt_work(prompt_lengths, lengths, group_size=1) == (
        float(lengths.sum()),
        causal_pairs(lengths),
    )
    with pytest.raises(ValueError, match="not whole groups of group_size=4"):
        shared_prompt_work(prompt_lengths, lengths, group_size=4)
