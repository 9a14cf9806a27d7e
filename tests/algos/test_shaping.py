"""DAPO's overlong penalty against values worked out by hand."""

import pytest
import torch

from yatt_ray.algos import overlong_penalty


def test_overlong_penalty_ramps_over_the_buffer_by_hand():
    # L_max = 10, L_cache = 4: no penalty up to 10 - 4 = 6 tokens, then (6 - |y|) / 4 down to -1 at 10;
    # beyond the limit (not produced by a capped engine) -1
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 12])
    out = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=1.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    # the factor scales the ramp: 0.5 * [(6 - 7) / 4, ...]
    half = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=0.5)
    assert half.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]


def test_a_buffer_of_one_penalises_only_the_limit_and_zero_turns_it_off():
    lengths = torch.tensor([3, 4, 5])
    # L_max = 5, L_cache = 1: (4 - 5) / 1 = -1 at the limit only
    assert overlong_penalty(lengths, 5, 1, 2.0).tolist() == [0.0, 0.0, -2.0]
    assert overlong_penalty(lengths, 5, 0, 2.0).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.tensor([1]), 4, 4, 1.0), r"buffer=4 must be in \[0, max_new_tokens=4\)"),
        ((torch.tensor([1]), 4, -1, 1.0), r"buffer=-1 must be in \[0, max_new_tokens=4\)"),
        ((torch.tensor([1]), 4, 2, -1.0), "penalty=-1.0 must be >= 0"),
        ((torch.tensor([[1]]), 4, 2, 1.0), r"shape \[N\]"),
        ((torch.tensor([-1]), 4, 2, 1.0), "must be >= 0, got min -1"),
    ],
)
def test_overlong_penalty_errors(args, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(*args)
