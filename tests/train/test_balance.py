"""Data-parallel balancing: Karmarkar-Karp, group costs, the exchange plan, and a 2-rank gloo exchange."""

import itertools
import random

import pytest
import torch
from dist_harness import run_ranks

from yatt_ray.batch import concat, pack, pad_to
from yatt_ray.metrics.flops import ModelFlops, PerfModel
from yatt_ray.train.balance import (
    choose_plan,
    exchange,
    imbalance,
    karmarkar_karp,
    plan_exchange,
    unit_costs,
    unit_sizes,
)
from yatt_ray.train.packing import pack_shared_prefix


def sums(costs, parts):
    return [sum(costs[i] for i in p) for p in parts]


# ---- Karmarkar-Karp -------------------------------------------------------------------------------------
def test_kk_by_hand():
    # sorted 8 7 6 5 4 (+ a zero dummy) -> partial solutions (8|7) (6|5) (4|0), spreads 1 1 4. Merge the
    # widest, (4|0), with the first-made spread-1 one, largest with smallest: (4+7 | 0+8) = (11|8), spread 3.
    # Then with (6|5): (11+5 | 8+6) = (16|14): parts {4,7,5} and {8,6} (the dummy dropped).
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[0, 2], [1, 3, 4]]  # 14 / 16 (optimum 15: {8,7} {6,5,4})
    # (4,3,3) and (2,1,0): {2}+{3}, {1}+{3}, {0}+{4} -> 5 4 4 (optimal: 13 / 3 > 4)
    assert karmarkar_karp([2, 4, 3, 1, 3], 3) == [[0, 2], [1], [3, 4]]
    # two items a part: largest with smallest, the optimal pairing
    assert karmarkar_karp([1, 2, 3, 4, 5, 6], 3) == [[0, 5], [1, 4], [2, 3]]
    assert karmarkar_karp([1, 1, 1, 1], 2) == [[0, 2], [1, 3]]  # ties broken by index
    assert karmarkar_karp([3, 1, 2], 1) == [[0, 1, 2]]


def test_kk_edge_cases():
    assert karmarkar_karp([], 2) == [[], []]
    assert karmarkar_karp([5.0], 3) == [[0], [], []]
    assert karmarkar_karp([0, 0, 0], 2) == [[0, 2], [1]]
    assert karmarkar_karp([-1.0, 2.0, -3.0], 3) == [[0], [1], [2]]  # any finite cost; one item a part
    with pytest.raises(ValueError, match="parts=0"):
        karmarkar_karp([1.0], 0)


def _optimum(costs, parts):
    """Smallest largest-part sum over every partition into parts of counts floor / ceil(n / parts)."""
    n = len(costs)
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    best = float("inf")

    def walk(rest, k, worst):
        nonlocal best
        if k == parts - 1:
            best = min(best, max(worst, sum(costs[i] for i in rest)))
            return
        for pick in itertools.combinations(rest, sizes[k]):
            left = [i for i in rest if i not in pick]
            walk(left, k + 1, max(worst, sum(costs[i] for i in pick)))

    walk(list(range(n)), 0, float("-inf"))
    return best


def test_kk_against_brute_force():
    rng = random.Random(0)
    exact = 0
    trials = 300
    for _ in range(trials):
        parts = rng.choice([2, 3])
        n = rng.randint(1, 9)
        costs = [rng.choice([rng.randint(0, 9), rng.random() * 100]) for _ in range(n)]
        split = karmarkar_karp(costs, parts)
        assert len(split) == parts
        assert sorted(i for p in split for i in p) == list(range(n))  # every index exactly once
        assert max(map(len, split)) - min(map(len, split)) <= 1  # equal counts
        assert all(p == sorted(p) for p in split)
        got, best = max(sums(costs, split)), _optimum(costs, parts)
        if n <= 2 * parts:  # at most two items a part: KK pairs largest with smallest, which is optimal
            assert got == pytest.approx(best, abs=1e-9)
        assert got <= 4 / 3 * best + 1e-9  # empirical worst over thousands of such cases: exactly 4/3
        exact += abs(got - best) < 1e-9
    assert exact >= 0.6 * trials  # KK is optimal on most small inputs (209 of these 300)


def test_kk_is_deterministic_and_beats_chunks_on_sorted_input():
    costs = [float(c) for c in range(40, 0, -1)]  # descending: consecutive chunks are the worst case
    split = karmarkar_karp(costs, 4)
    assert split == karmarkar_karp(list(costs), 4)
    chunks = [list(range(s, s + 10)) for s in range(0, 40, 10)]
    assert max(sums(costs, split)) - min(sums(costs, split)) <= 1
    assert max(sums(costs, chunks)) == 355


# ---- costs ----------------------------------------------------------------------------------------------
def _group_batch():
    """Two groups of two (P = 3, R = 3): group 0 prompt [5, 6] with responses of 3 and 1 tokens; group 1
    prompt [7, 8, 9] with responses of 2 and 0 tokens."""
    prompts = [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    responses = [[1, 2, 3], [4], [1, 2], []]
    logps = [[0.0] * len(r) for r in responses]
    return pack(prompts, responses, logps, pad_id=0, group_size=2)


def test_unit_costs_tokens_by_hand():
    b = _group_batch()
    # group 0: body c = 2 (both rows go past the prompt), own 3 and 1 -> 6; group 1: a row ends with the
    # prompt, so body c - 1 = 2, own 3 and 1 -> 6
    assert unit_costs(b.attention_mask, 2, "tokens", prompt_width=3).tolist() == [6.0, 6.0]
    assert unit_costs(b.attention_mask, 2, "tokens").tolist() == [8.0, 8.0]  # nothing shared: 5+3, 5+3
    assert unit_costs(b.attention_mask, 1, "tokens", prompt_width=3).tolist() == [5.0, 3.0, 5.0, 3.0]
    assert unit_costs(b.attention_mask[:3], 2, "tokens", prompt_width=3).tolist() == [
        6.0,
        5.0,
    ]  # partial group


def test_unit_costs_flops_by_hand():
    b = _group_batch()
    model = ModelFlops(matmul_params=10, layers=2, attn_width=4)
    # P = sum_j (b + o_j)(b + o_j + 1) / 2 (the body's queries computed with each sample)
    # group 0: b = 2, o = 3, 1: P = 5*6/2 + 3*4/2 = 21; F = 6*10*6 + 12*2*4*21 = 2376
    # group 1: b = 2, o = 3, 1 (its second row ends with the prompt): the same
    assert unit_costs(b.attention_mask, 2, "flops", model, prompt_width=3).tolist() == [2376.0, 2376.0]
    perf = PerfModel(model, None, "test")
    assert unit_costs(b.attention_mask, 2, "flops", perf, prompt_width=3).tolist() == [2376.0, 2376.0]
    # unshared: rows of 5 and 3 tokens: P = 15 + 6 = 21, T = 8 -> 480 + 2016
    assert unit_costs(b.attention_mask, 2, "flops", model).tolist() == [2496.0, 2496.0]
    with pytest.raises(ValueError, match="valid modes: tokens, flops"):
        unit_costs(b.attention_mask, 2, "bytes")
    with pytest.raises(ValueError, match="needs a ModelFlops"):
        unit_costs(b.attention_mask, 2, "flops")


def test_unit_costs_match_the_packed_rows():
    """Tokens and computed (query, key) pairs of each packed group, counted from `pack_shared_prefix`: the
    packed attention runs one causal attention over [body; segment j] for each sample j."""
    g = torch.Generator().manual_seed(3)
    group, prompts, responses = 3, [], []
    for _ in range(4):
        prompt = torch.randint(10, 50, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        for j in range(group):  # distinct first response tokens: the common prefix is the prompt
            length = int(torch.randint(1, 7, (1,), generator=g))
            responses.append([60 + j] + torch.randint(10, 50, (length - 1,), generator=g).tolist())
            prompts.append(prompt)
    b = pack(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0, group_size=group)
    model = ModelFlops(matmul_params=1, layers=1, attn_width=1)
    tokens = unit_costs(b.attention_mask, group, "tokens", prompt_width=b.prompt_width)
    flops = unit_costs(b.attention_mask, group, "flops", model, prompt_width=b.prompt_width)
    for k in range(4):
        rows = slice(k * group, (k + 1) * group)
        packed = pack_shared_prefix(b.input_ids[rows], b.attention_mask[rows], group)
        body = int((packed.segment == 0).sum())
        seqs = [body + int((packed.segment == j).sum()) for j in range(1, group + 1)]
        pairs = sum(n * (n + 1) // 2 for n in seqs)
        assert packed.attention_layout().kv_index.numel() == body + sum(
            seqs
        )  # the body's own, then [body; j]
        assert tokens[k] == packed.tokens
        assert flops[k] == 6 * packed.tokens + 12 * int(pairs)


def test_imbalance():
    assert imbalance([1.0, 3.0]) == 1.5
    assert imbalance([2.0, 2.0, 2.0]) == 1.0
    assert imbalance([0.0, 0.0]) == 1.0


# ---- the plan -------------------------------------------------------------------------------------------
def test_plan_by_hand():
    # flat units 9 8 1 | 2 1 1; KK: {9,1(r0u2),1(r1u1)} = 11 and {8,2,1(r1u2)} = 11. The first part holds 10
    # on rank 0, the second 8 on rank 0 and 3 on rank 1: first -> rank 0, second -> rank 1.
    plan = plan_exchange([[9.0, 8.0, 1.0], [2.0, 1.0, 1.0]], 2)
    assert plan.holds == (((0, 0), (0, 2), (1, 1)), ((0, 1), (1, 0), (1, 2)))
    assert plan.before == (18.0, 4.0) and plan.after == (11.0, 11.0)
    assert plan.moved == 2 and plan.units(0, 1) == [1] and plan.units(1, 0) == [1]


def test_plan_keeps_the_placement_when_equal_counts_would_not_help():
    plan = plan_exchange([[10.0, 10.0, 10.0], [30.0]], 2)  # any 2 + 2 split has a part of 40 > 30
    assert plan.holds == (((0, 0), (0, 1), (0, 2)), ((1, 0),)) and plan.moved == 0
    assert plan.after == plan.before == (30.0, 30.0)
    with pytest.raises(ValueError, match="one part each"):
        plan_exchange([[1.0], [2.0]], 3)


def test_plan_is_deterministic_and_complete():
    rng = random.Random(1)
    for _ in range(50):
        ranks = rng.randint(2, 4)
        costs = [[rng.random() * 10 for _ in range(rng.randint(0, 6))] for _ in range(ranks)]
        plan = plan_exchange(costs, ranks)
        assert plan == plan_exchange([list(c) for c in costs], ranks)
        held = sorted(k for h in plan.holds for k in h)
        assert held == [(r, u) for r, c in enumerate(costs) for u in range(len(c))]
        assert all(list(h) == sorted(h) for h in plan.holds)
        assert imbalance(list(plan.after)) <= imbalance(list(plan.before)) + 1e-12
        if plan.moved:
            assert max(map(len, plan.holds)) - min(map(len, plan.holds)) <= 1


# ---- batch helpers ----------------------------------------------------------------------------------------
def test_pad_to_and_concat():
    a = _group_batch()
    a.rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = pack([[3]], [[4, 5, 6, 7, 8]], [[0.5] * 5], pad_id=9, group_size=2)
    b.rewards, b.truncated, a.truncated = torch.tensor([5.0]), 1, 2
    wide = pad_to(a, 5, 6, pad_id=1)
    assert wide.input_ids.shape == (4, 11) and wide.prompt_width == 5
    assert torch.equal(wide.input_ids[:, 2:8], a.input_ids) and (wide.input_ids[:, :2] == 1).all()
    assert torch.equal(wide.response_mask[:, :3], a.response_mask) and (wide.response_mask[:, 3:] == 0).all()
    assert torch.equal(wide.rewards, a.rewards) and pad_to(a, 3, 3) is a
    with pytest.raises(ValueError, match="padding only widens"):
        pad_to(a, 2, 3)
    both = concat([a, b])
    assert both.size == 5 and both.prompt_width == 3 and both.input_ids.shape == (5, 8)
    assert torch.equal(both.input_ids[4, 2:], b.input_ids[0]) and both.truncated == 3
    assert torch.equal(both.rewards, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    b.old_logp = torch.zeros(1, 5)
    with pytest.raises(ValueError, match="different row fields"):
        concat([a, b])


def test_exchange_on_one_rank_is_a_no_op():
    b = _group_batch()
    out, restore, stats = exchange(b, "tokens", None)
    t = torch.ones(4, 3)
    assert out is b and restore.restore(t) is t
    assert stats == {
        "balance/imbalance_before": 1.0,
        "balance/imbalance_after": 1.0,
        "balance/moved_groups": 0.0,
        "balance/unit_size": 2.0,
    }


# ---- two ranks over gloo ----------------------------------------------------------------------------------
GROUP = 2
SHAPES = {0: (4, (2, 6), (6, 12)), 1: (2, (1, 3), (1, 4))}  # rank: (groups, prompt lengths, response lengths)


def _rank_batch(rank: int):
    """Rank 0: 4 groups of long responses; rank 1: 2 groups of short ones (other widths, another pad id).
    The first prompt token of group k is its id 100 + 10 rank + k."""
    groups, (p_lo, p_hi), (r_lo, r_hi) = SHAPES[rank]
    g = torch.Generator().manual_seed(rank)
    prompts, responses = [], []
    for k in range(groups):
        length = int(torch.randint(p_lo, p_hi + 1, (1,), generator=g))
        prompt = [100 + 10 * rank + k] + torch.randint(10, 50, (length - 1,), generator=g).tolist()
        for _ in range(GROUP):
            size = int(torch.randint(r_lo, r_hi + 1, (1,), generator=g))
            responses.append(torch.randint(10, 50, (size,), generator=g).tolist())
            prompts.append(prompt)
    logps = [torch.randn(len(r), generator=g).tolist() for r in responses]
    b = pack(prompts, responses, logps, pad_id=7 + rank, group_size=GROUP)
    b.rewards = torch.randn(b.size, generator=g)
    b.old_logp = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    b.greedy_rewards = torch.randn(groups, generator=g)
    b.truncated, b.prompts_clipped, b.counters = rank + 1, rank, {"genrm/calls": float(rank)}
    return b


def _exchange_rank(rank, world_size):
    batch = _rank_batch(rank)
    out, restore, stats = exchange(batch, "tokens", None, slice_groups=False)
    again, _, stats_again = exchange(out, "tokens", None, slice_groups=False)
    mine = unit_costs(out.attention_mask, GROUP, "tokens", prompt_width=out.prompt_width).sum()
    return {
        "tensors": out.tensors(),
        "prompt_width": out.prompt_width,
        "greedy": out.greedy_rewards,
        "scalars": (out.truncated, out.prompts_clipped, out.counters, out.group_size),
        "stats": stats,
        "cost": float(mine),
        "old_logp": restore.restore(out.old_logp.clone()),
        "rewards": restore.restore(out.rewards.clone()),
        "response_mask": restore.restore(out.response_mask.clone()),
        "again_is_same": again is out,
        "moved_again": stats_again["balance/moved_groups"],
    }


def test_exchange_two_ranks_gloo():
    results = run_ranks(_exchange_rank, 2, timeout_s=120.0)
    originals = [_rank_batch(r) for r in range(2)]
    stats = results[0]["stats"]
    assert results[1]["stats"] == stats
    assert stats["balance/moved_groups"] >= 1
    assert stats["balance/imbalance_after"] < stats["balance/imbalance_before"]
    assert imbalance([r["cost"] for r in results]) == pytest.approx(stats["balance/imbalance_after"])
    seen = []
    for rank, res in enumerate(results):
        t, width_p = res["tensors"], res["prompt_width"]
        fields = ["advantages", "attention_mask", "input_ids", "old_logp", "response_mask", "rewards"]
        assert sorted(t) == sorted([*fields, "rollout_logp"])
        assert res["greedy"] is None
        assert res["scalars"] == (rank + 1, rank, {"genrm/calls": float(rank)}, GROUP)
        for row in range(t["input_ids"].shape[0]):
            first = int(t["attention_mask"][row].nonzero()[0])
            gid = int(t["input_ids"][row, first])
            src, unit = (gid - 100) // 10, (gid - 100) % 10
            j = row % GROUP
            if j == 0:
                seen.append(gid)
            else:  # the group's rows stay adjacent
                assert gid == seen[-1]
            o = originals[src]
            orow = unit * GROUP + j
            width_r = o.input_ids.shape[1] - o.prompt_width
            start = width_p - o.prompt_width
            assert torch.equal(t["input_ids"][row, start : start + o.input_ids.shape[1]], o.input_ids[orow])
            ids_mask = t["attention_mask"][row]
            assert torch.equal(ids_mask[start : start + o.input_ids.shape[1]], o.attention_mask[orow])
            assert ids_mask.sum() == o.attention_mask[orow].sum()  # nothing real in the new padding
            for name in ("response_mask", "rollout_logp", "old_logp", "advantages"):
                assert torch.equal(t[name][row, :width_r], getattr(o, name)[orow])
                assert (t[name][row, width_r:] == 0).all()
            assert torch.equal(t["rewards"][row], o.rewards[orow])
    assert sorted(seen) == sorted(100 + 10 * r + k for r in range(2) for k in range(SHAPES[r][0]))
    for rank, res in enumerate(results):
        o = originals[rank]
        assert torch.equal(res["old_logp"], o.old_logp)
        assert torch.equal(res["rewards"], o.rewards)
        assert torch.equal(res["response_mask"], o.response_mask)
        assert res["again_is_same"] and res["moved_again"] == 0.0  # balanced already: nothing moves


# rank 0's first three (long) groups: zero advantages, the trainer skips them
SKIPPED_GROUPS = {100, 101, 102}
SKIPPED_ROWS = {0: 3 * GROUP, 1: 0}  # rank -> its leading rows that are skipped


def _trained_cost(batch) -> float:
    """The tokens cost of `batch`'s groups that are not in SKIPPED_GROUPS (first prompt token = group id)."""
    costs = unit_costs(batch.attention_mask, GROUP, "tokens", prompt_width=batch.prompt_width)
    first = batch.attention_mask.argmax(dim=1)
    gids = batch.input_ids[torch.arange(batch.size), first][::GROUP].tolist()
    return float(sum(c for c, gid in zip(costs.tolist(), gids) if gid not in SKIPPED_GROUPS))


def _skipping_rank(rank, world_size):
    batch = _rank_batch(rank)
    skipped = torch.arange(batch.size) < SKIPPED_ROWS[rank]
    batch.old_logp[skipped] = float("nan")  # on-policy: no log-probs where skipped
    priced, restore, stats = exchange(batch, "tokens", None, slice_groups=False, skipped=skipped)
    plain = exchange(_rank_batch(rank), "tokens", None, slice_groups=False)[0]
    back = restore.restore(priced.old_logp.clone())
    return {"stats": stats, "priced": _trained_cost(priced), "plain": _trained_cost(plain), "old_logp": back,
            "rows": priced.size}  # fmt: skip


def test_exchange_prices_skipped_groups_at_zero():
    results = run_ranks(_skipping_rank, 2, timeout_s=120.0)
    priced, plain = [r["priced"] for r in results], [r["plain"] for r in results]
    assert results[0]["stats"]["balance/imbalance_after"] == pytest.approx(imbalance(priced))
    assert imbalance(priced) < imbalance(plain)  # the groups that train are what gets balanced
    assert sum(r["rows"] for r in results) == sum(_rank_batch(r).size for r in range(2))  # nothing lost
    for rank, res in enumerate(results):  # every row's log-probs come back, the NaN of skipped rows too
        original = _rank_batch(rank).old_logp
        skipped_rows = torch.arange(original.shape[0]) < SKIPPED_ROWS[rank]
        assert torch.equal(res["old_logp"].isnan().all(dim=1), skipped_rows)
        assert torch.equal(res["old_logp"][~skipped_rows], original[~skipped_rows])


def test_unit_sizes_and_choose_plan():
    assert unit_sizes(8) == [8, 4, 2, 1] and unit_sizes(6) == [6, 3, 2, 1] and unit_sizes(1) == [1]
    whole = plan_exchange([[90.0, 10.0], [10.0, 10.0]], 2)  # any 2 + 2 split keeps the 90 with another unit
    assert max(whole.after) == 100.0
    sliced = plan_exchange([[46.0, 46.0, 6.0, 6.0], [6.0, 6.0, 6.0, 6.0]], 2)  # halves, the prompt twice
    assert max(sliced.after) == 64.0
    assert choose_plan({2: whole, 1: sliced}) == 1
    near = plan_exchange([[50.0, 10.0], [10.0, 49.6]], 2)  # a slicing gain under SLICE_GAIN is not taken
    slight = plan_exchange([[29.8, 29.8], [29.8, 29.8]], 2)  # max 59.6: 0.7% under 60
    assert max(near.after) == 60.0 and choose_plan({2: near, 1: slight}) == 2


# ---- slicing a heavy group over two ranks ------------------------------------------------------------------
SLICED = 4  # rows a group


def _heavy_batch(rank: int):
    """Rank 0: group 0 with four 40-token responses and group 1 with short ones; rank 1: two short groups.
    Prompt token 0 is 100 + 10 rank + k (the group), response token 0 is 60 + j (the row in the group)."""
    g = torch.Generator().manual_seed(rank)
    prompts, responses = [], []
    for k in range(2):
        prompt = [100 + 10 * rank + k, 11, 12]
        for j in range(SLICED):
            size = 40 if (rank, k) == (0, 0) else 2
            responses.append([60 + j] + torch.randint(10, 50, (size - 1,), generator=g).tolist())
            prompts.append(prompt)
    logps = [torch.randn(len(r), generator=g).tolist() for r in responses]
    b = pack(prompts, responses, logps, pad_id=0, group_size=SLICED)
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    return b


def _sliced_rank(rank, world_size):
    out, restore, stats = exchange(_heavy_batch(rank), "tokens", None)
    whole = exchange(_heavy_batch(rank), "tokens", None, slice_groups=False)[2]
    first = out.attention_mask.float().argmax(1)
    return {
        "ids": [
            (int(out.input_ids[i, first[i]]), int(out.input_ids[i, out.prompt_width]))
            for i in range(out.size)
        ],
        "group_size": out.group_size,
        "cost": float(
            unit_costs(out.attention_mask, out.group_size, "tokens", prompt_width=out.prompt_width).sum()
        ),
        "stats": stats,
        "whole": whole,
        "advantages": restore.restore(out.advantages.clone()),
    }


def test_exchange_slices_a_heavy_group_when_whole_groups_cannot_balance():
    results = run_ranks(_sliced_rank, 2, timeout_s=120.0)
    stats, whole = results[0]["stats"], results[0]["whole"]
    assert results[1]["stats"] == stats
    assert whole["balance/imbalance_after"] > 1.5  # the heavy group outweighs the other three together
    assert stats["balance/unit_size"] < SLICED and stats["balance/imbalance_after"] < 1.1
    assert stats["balance/imbalance_before"] == whole["balance/imbalance_before"]
    assert imbalance([r["cost"] for r in results]) == pytest.approx(stats["balance/imbalance_after"])
    rows = [row for r in results for row in r["ids"]]
    assert sorted(rows) == sorted(
        (100 + 10 * r + k, 60 + j) for r in range(2) for k in range(2) for j in range(SLICED)
    )
    heavy_ranks = {r for r, res in enumerate(results) for gid, _ in res["ids"] if gid == 100}
    assert heavy_ranks == {0, 1}  # the heavy group is split over both ranks
    for res in results:
        size = res["group_size"]
        assert size == stats["balance/unit_size"]
        for start in range(0, len(res["ids"]), size):  # a slice's rows are one prompt's
            assert len({gid for gid, _ in res["ids"][start : start + size]}) == 1
    for rank, res in enumerate(results):
        assert torch.equal(res["advantages"], _heavy_batch(rank).advantages)
