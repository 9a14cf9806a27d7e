"""plan_micro_batches (token-budget planning) and the fixed-size / budget index lists."""

import pytest
import torch

from yatt_ray.train import plan_micro_batches
from yatt_ray.train.micro_batches import micro_batch_indices, mini_batch_rows, select_rows


def cost(lengths, group):
    return len(group) * max(max(lengths[i] for i in group), 1)


def test_longest_first_greedy_by_hand():
    lengths = [3, 10, 5, 9, 2, 2]
    # sorted: 1(10) 3(9) 2(5) 0(3) 4(2) 5(2); budget 18: [1] (2*10>18), [3] (2*9=18 ok -> add 2) ...
    assert plan_micro_batches(lengths, 18) == [[1], [3, 2], [0, 4, 5]]
    assert plan_micro_batches(lengths, 100) == [[1, 3, 2, 0, 4, 5]]
    assert plan_micro_batches(lengths, 10) == [[1], [3], [2, 0], [4, 5]]


def test_ties_keep_row_order_and_every_row_appears_once():
    lengths = [4, 4, 4, 4, 4]
    assert plan_micro_batches(lengths, 8) == [[0, 1], [2, 3], [4]]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 50, (40,), generator=g).tolist()
    for budget in (1, 7, 49, 50, 120, 10_000):
        plan = plan_micro_batches(lengths, budget)
        assert sorted(i for group in plan for i in group) == list(range(40))
        for group in plan:
            assert len(group) == 1 or cost(lengths, group) <= budget


def test_edge_cases():
    assert plan_micro_batches([], 16) == []
    assert plan_micro_batches([30, 20], 8) == [[0], [1]]  # budget below one row: each row alone
    assert plan_micro_batches([0, 0, 0], 2) == [[0, 1], [2]]  # an empty row still costs one token
    assert plan_micro_batches([7], 7) == [[0]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0"):
        plan_micro_batches([1, 2], 0)
    with pytest.raises(ValueError, match=">= 0"):
        plan_micro_batches([1, -2], 8)


def test_micro_batch_indices_fixed_and_budget():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 0]])
    # real tokens 2 4 3 1 3: ceil(5 / 2) = 3 micro-batches of similar lengths, longest first: [1, 2] [4, 0] [3],
    # padded sizes 8 6 1 (Karmarkar-Karp's balanced sums [0, 2] [1] [3, 4] would pad to 6 4 6, consecutive
    # chunks [0, 1] [2, 3] [4] to 8 6 3)
    assert micro_batch_indices(mask, 2, None) == [[0, 4], [1, 2], [3]]
    assert micro_batch_indices(mask, 1, None) == [[0], [1], [2], [3], [4]]
    assert micro_batch_indices(mask, 8, None) == [[0, 1, 2, 3, 4]]
    assert micro_batch_indices(mask, 2, 9) == [[1, 2], [4, 0, 3]]  # the budget wins over micro_batch_size
    with pytest.raises(ValueError, match="micro_batch_size=None"):
        micro_batch_indices(mask, None, None)


def test_select_rows_indexes_row_tensors_only():
    batch = {"x": torch.arange(5), "y": torch.arange(10).view(5, 2), "scalar": torch.tensor(3.0), "n": 7}
    out = select_rows(batch, 5, [3, 1], "cpu")
    assert out["x"].tolist() == [3, 1] and out["y"].tolist() == [[6, 7], [2, 3]]
    assert out["scalar"] is batch["scalar"] and out["n"] == 7
    assert select_rows(batch, 5, [1, 2], "cpu")["x"].tolist() == [1, 2]


def test_fixed_size_keeps_groups_and_pads_least():
    g = torch.Generator().manual_seed(0)
    rows, group = (
        22,
        2,
    )  # 11 groups, the last one full; micro_batch_size 7 -> 3 groups each -> 4 micro-batches
    lengths = torch.randint(1, 30, (rows,), generator=g)
    mask = (torch.arange(30)[None, :] < lengths[:, None]).long()
    plan = micro_batch_indices(mask, 7, None, group_size=group)
    assert len(plan) == 4 and sorted(len(m) for m in plan) == [4, 6, 6, 6]  # equal group counts, <= 3 each
    assert sorted(i for m in plan for i in m) == list(range(rows))
    for m in plan:
        assert m == sorted(m)
        assert all(m[k] % group == 0 and m[k + 1] == m[k] + 1 for k in range(0, len(m), group))

    def padded(parts):  # what the packed forward computes: groups x the longest group's real tokens
        return sum(len(m) // group * max(int(mask[k : k + group].sum()) for k in m[::group]) for m in parts)

    chunks = [list(range(s, min(s + 6, rows))) for s in range(0, rows, 6)]
    assert padded(plan) < padded(chunks)
    from yatt_ray.train.balance import karmarkar_karp

    sums = [int(mask[k : k + group].sum()) for k in range(0, rows, group)]
    balanced = [
        [i for k in part for i in range(k * group, k * group + group)] for part in karmarkar_karp(sums, 4)
    ]
    assert padded(plan) < padded(balanced)  # the former balanced-sums split
    assert [m[0] for m in plan] == sorted(m[0] for m in plan)  # ordered by first row


@pytest.mark.parametrize("groups, size, count", [(6, 4, 4), (5, 2, 2), (3, 8, 1), (2, 3, 4)])
def test_mini_batches_are_whole_groups_covering_every_row_once(groups, size, count):
    chunks = mini_batch_rows(groups * size, size, count)
    rows = torch.cat(chunks)
    assert sorted(rows.tolist()) == list(range(groups * size))
    assert len(chunks) == min(count, groups)
    assert max(map(len, chunks)) - min(map(len, chunks)) <= size  # group counts differ by at most one
    for chunk in chunks:
        assert len(chunk) % size == 0
        assert all(set(g.tolist()) == set(range(g[0], g[0] + size)) for g in chunk.view(-1, size))
        assert chunk[0] % size == 0


def test_mini_batches_refuse_partial_groups():
    with pytest.raises(ValueError, match="whole groups"):
        mini_batch_rows(10, 4, 2)


def test_to_device_keeps_host_tensors_on_the_host_and_values_on_the_way():
    from yatt_ray.train.micro_batches import to_device

    host = torch.arange(6).view(2, 3)[:, 1:]  # a strided view, as a micro-batch slice can be
    assert (
        to_device(host, "cpu") is host
    )  # nothing to move (and no pinning: a CPU build has no pinned memory)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (release/gpu_check.sh runs it there)")
def test_to_device_copies_to_a_gpu_without_blocking_the_host():
    """Pinned and non-blocking: the values arrive (read after the stream's work), strided sources too."""
    from yatt_ray.train.micro_batches import to_device

    host = torch.arange(12).view(3, 4)[:, ::2]
    moved = to_device(host, "cuda")
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), host)
    assert to_device(moved, "cuda") is moved
