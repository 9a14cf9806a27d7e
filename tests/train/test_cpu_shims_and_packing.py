"""CPU shims (Megatron's RNG tracker on the CPU generator) and the padding-packing helpers."""

import pytest
import torch

from yatt_ray.train import apply_cpu_shims, pack_rows, unpack_next_token_values


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are a no-op with CUDA")
def test_shims_are_idempotent_and_seed_distinct_tracker_states(single_process_world):
    from megatron.core import tensor_parallel

    assert apply_cpu_shims() and apply_cpu_shims()
    assert torch.cuda.current_device() == "cpu"
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = list(tracker.get_states().values())
    assert len(states) == 3 and not torch.equal(states[0], states[1])

    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # fork restores the outer stream
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # ... and advances its own


def test_pack_moves_real_tokens_first_and_unpack_restores_columns():
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 0]])
    mask = (ids != 0).long()
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 0], [5, 6, 7, 8]]  # trimmed to the longest row
    assert packed.position_ids.tolist() == [[0, 1, 2, 3]] * 2
    m = packed.attention_mask()
    assert m.shape == (2, 1, 4, 4) and m[0, 0, 3].tolist() == [False, False, False, False]
    assert m[0, 0, 2].tolist() == [False, False, False, True]  # future (and padding) keys masked

    values = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])  # values[:, j] predicts packed token j+1
    out = unpack_next_token_values(packed, values, total_len=5)
    assert out.tolist() == [[0.0, 0.0, 1.0, 2.0], [1.0, 2.0, 3.0, 0.0]]  # [B, T-1]; pad targets -> 0
