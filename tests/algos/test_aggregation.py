import pytest
import torch

from yatt_ray.algos import LOSS_AGGREGATIONS, aggregate, token_mean
from yatt_ray.errors import UnknownNameError

F64 = torch.float64


def test_hand_computed_2x3():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # masked sum = 1 + 2 + 4 = 7 over 3 tokens -> 7/3; with a global count of 6 tokens -> 7/6
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx(7 / 3, abs=1e-15)
    assert aggregate(per_token, mask.bool(), "token-mean", global_tokens=6).item() == pytest.approx(
        7 / 6, abs=1e-15
    )
    assert LOSS_AGGREGATIONS.get("token-mean") is token_mean


def test_padding_values_cannot_leak():
    per_token = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    mask = torch.tensor([[True, False], [False, True]])
    assert aggregate(per_token, mask, "token-mean").item() == 1.5


def test_all_masked_and_bad_counts():
    z = torch.ones(2, 3)
    assert aggregate(z, torch.zeros(2, 3), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="global_tokens must be > 0"):
        aggregate(z, torch.ones(2, 3), "token-mean", global_tokens=0)
    with pytest.raises(ValueError, match=r"same shape|share one shape"):
        aggregate(z, torch.ones(3, 2), "token-mean")
    with pytest.raises(UnknownNameError, match="valid: token-mean"):
        aggregate(z, z, "token-sum")


def test_loop_matches_vectorised():
    gen = torch.Generator().manual_seed(1)
    per_token = torch.randn(4, 7, generator=gen, dtype=F64)
    mask = torch.rand(4, 7, generator=gen) < 0.6
    total, count = 0.0, 0
    for b in range(4):
        for t in range(7):
            if mask[b, t]:
                total += per_token[b, t].item()
                count += 1
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx(total / count, abs=1e-14)


def _batch():
    """6 responses of different lengths (1..6 tokens of 6) and a small differentiable per-token loss."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 6, 3, generator=gen, dtype=F64)
    lengths = torch.tensor([6, 1, 4, 2, 5, 3])
    mask = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)
    return x, mask


def _per_token(w, x):
    return torch.tanh(x @ w) ** 2  # [B, T]


def test_micro_batches_and_ranks_sum_to_the_full_batch_value_and_gradient():
    x, mask = _batch()
    w_full = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    full = aggregate(_per_token(w_full, x), mask, "token-mean")
    full.backward()

    # 2 data-parallel ranks x 2 micro-batches each, of unequal sizes and token counts; gradients accumulate
    # over micro-batches and are summed over ranks (an all-reduce with SUM).
    global_tokens = float(mask.sum())  # what the trainer all-reduces once per step
    w = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    ranks = [[[0], [1, 2]], [[3, 4], [5]]]
    total_value = 0.0
    for micro_batches in ranks:
        for rows in micro_batches:
            part = aggregate(_per_token(w, x[rows]), mask[rows], "token-mean", global_tokens=global_tokens)
            part.backward()
            total_value += part.item()

    assert total_value == pytest.approx(full.item(), abs=1e-14)
    torch.testing.assert_close(w.grad, w_full.grad, rtol=0, atol=1e-14)

    # Averaging per-micro-batch means instead (each with its own local count) gives a different value: the
    # convention above is what makes splitting invisible.
    local_means = [
        aggregate(_per_token(w, x[rows]), mask[rows], "token-mean").item() for mb in ranks for rows in mb
    ]
    assert abs(sum(local_means) / len(local_means) - full.item()) > 1e-4  # ~9e-4 with this seed
