import pytest
import torch

from yatt_ray.algos import (
    LOSS_AGGREGATIONS,
    aggregate,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
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
    with pytest.raises(UnknownNameError, match="valid: seq-mean-token-mean, .*, token-mean"):
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


MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def test_sequence_modes_hand_computed_2x3():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is an all-masked padding row: not counted
    # per-sequence sums [1 + 2, 4] = [3, 4]; lengths [2, 1]; 2 non-empty sequences; width T = 3
    # seq-mean-token-sum:       (3 + 4) / 2 = 3.5;          with global_seqs = 4: 7 / 4
    # seq-mean-token-mean:      (3/2 + 4/1) / 2 = 2.75;     with global_seqs = 4: 5.5 / 4
    # seq-mean-token-sum-norm:  7 / (2 * 3) = 7/6;          with norm_len = 7: 7 / 14 = 0.5
    cases = [
        ("seq-mean-token-sum", {}, 3.5),
        ("seq-mean-token-sum", {"global_seqs": 4}, 7 / 4),
        ("seq-mean-token-mean", {}, 2.75),
        ("seq-mean-token-mean", {"global_seqs": 4}, 5.5 / 4),
        ("seq-mean-token-sum-norm", {}, 7 / 6),
        ("seq-mean-token-sum-norm", {"norm_len": 7}, 0.5),
        ("seq-mean-token-sum-norm", {"global_seqs": 4, "norm_len": 7}, 7 / 28),
        ("token-mean", {"norm_len": 7}, 7 / 3),  # token-mean ignores norm_len
    ]
    for mode, kwargs, expected in cases:
        assert aggregate(per_token, mask, mode, **kwargs).item() == pytest.approx(expected, abs=1e-15), mode
    assert LOSS_AGGREGATIONS.get("seq-mean-token-sum") is seq_mean_token_sum
    assert LOSS_AGGREGATIONS.get("seq-mean-token-mean") is seq_mean_token_mean
    assert LOSS_AGGREGATIONS.get("seq-mean-token-sum-norm") is seq_mean_token_sum_norm


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_masks_padding_handles_empty_and_checks_counts(mode):
    per_token = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    mask = torch.tensor([[True, False], [False, True]])
    assert torch.isfinite(aggregate(per_token, mask, mode))
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0
    name = "global_tokens" if mode == "token-mean" else "global_seqs"
    with pytest.raises(ValueError, match=f"{name} must be > 0"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), mode, **{name: 0})
    if mode == "seq-mean-token-sum-norm":
        with pytest.raises(ValueError, match="norm_len must be > 0"):
            aggregate(torch.ones(2, 3), torch.ones(2, 3), mode, norm_len=0)


def test_sequence_modes_loop_matches_vectorised():
    gen = torch.Generator().manual_seed(3)
    per_token = torch.randn(5, 6, generator=gen, dtype=F64)
    mask = torch.rand(5, 6, generator=gen) < 0.6
    mask[2] = False
    seq_sums, seq_means = [], []
    for b in range(5):
        values = [per_token[b, t].item() for t in range(6) if mask[b, t]]
        if values:
            seq_sums.append(sum(values))
            seq_means.append(sum(values) / len(values))
    n = len(seq_sums)
    expected = {
        "seq-mean-token-sum": sum(seq_sums) / n,
        "seq-mean-token-mean": sum(seq_means) / n,
        "seq-mean-token-sum-norm": sum(seq_sums) / (n * 6),
    }
    for mode, value in expected.items():
        assert aggregate(per_token, mask, mode).item() == pytest.approx(value, abs=1e-14), mode


def _global_denominators(mask):
    return {
        "global_tokens": float(mask.sum()),
        "global_seqs": float((mask.sum(1) > 0).sum()),
        "norm_len": float(mask.shape[1]),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("trim", [False, True])
def test_every_mode_splits_into_micro_batches_and_ranks(mode, trim):
    # 2 simulated data-parallel ranks x 2 micro-batches each (unequal sizes); one micro-batch also carries an
    # all-masked padding row. trim=True cuts each micro-batch to its own longest response, as dynamic padding
    # does: then only the explicit norm_len keeps "seq-mean-token-sum-norm" consistent.
    x, mask = _batch()
    x = torch.cat([x, torch.randn(1, 6, 3, generator=torch.Generator().manual_seed(9), dtype=F64)])
    mask = torch.cat([mask, torch.zeros(1, 6, dtype=torch.bool)])  # row 6: padding
    w_full = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    full = aggregate(_per_token(w_full, x), mask, mode)
    full.backward()

    denominators = _global_denominators(mask)  # all-reduced once per step by the trainer
    w = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    ranks = [[[0, 6], [1, 2]], [[3, 4], [5]]]
    total_value = 0.0
    for micro_batches in ranks:
        for rows in micro_batches:
            width = int(mask[rows].sum(1).max()) if trim else mask.shape[1]
            part = aggregate(_per_token(w, x[rows, :width]), mask[rows, :width], mode, **denominators)
            part.backward()
            total_value += part.item()

    assert total_value == pytest.approx(full.item(), abs=1e-14)
    torch.testing.assert_close(w.grad, w_full.grad, rtol=0, atol=1e-14)
