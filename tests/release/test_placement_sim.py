"""Checks of release/placement_sim.py: analytic cases, brute-force loops, accounting, and the expected winners."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "release" / "placement_sim.py"
_spec = importlib.util.spec_from_file_location("placement_sim", _PATH)
ps = importlib.util.module_from_spec(_spec)
sys.modules["placement_sim"] = ps
_spec.loader.exec_module(ps)

# A small workload: 32 prompts x 4 samples = 128 samples, divisible by 8, 4, 2 and 1 devices.
SMALL = dataclasses.replace(ps.Costs(), prompts=32, samples_per_prompt=4, reference_devices=8)


def gen_time_analytic(costs, devices: int, length: float) -> float:
    """Every response `length` tokens, m = M / D per device, all in one batch: prefill + t0 L + t1 m L."""
    t0, t1 = costs.decode_constants()
    m = costs.samples(8, "strong") / devices
    return m * costs.prompt_len / costs.prefill_tps + t0 * length + t1 * m * length


def uniform(costs, length: float | None = None) -> np.ndarray:
    return np.full(costs.samples(8, "strong"), costs.response_mean if length is None else length)


def test_decode_constants_reproduce_both_throughputs():
    costs = ps.Costs()
    t0, t1 = costs.decode_constants()
    assert 1 / (t0 + t1) == pytest.approx(costs.seq_decode_tps)
    assert costs.max_batch / (t0 + costs.max_batch * t1) == pytest.approx(costs.decode_tps)
    with pytest.raises(ValueError, match="decode_tps"):
        dataclasses.replace(costs, decode_tps=50.0).decode_constants()


def test_zero_spread_lengths_equal_the_mean():
    z = np.random.default_rng(0).standard_normal(100)
    assert np.all(ps.response_lengths(z, SMALL, 0.0) == SMALL.response_mean)


def test_zero_genrm_cost_and_zero_spread_match_the_analytic_rollout():
    costs = dataclasses.replace(SMALL, genrm_latency_s=0.0, genrm_switch_s=5.0)
    lengths = uniform(costs)
    n, k = 8, 4
    full = ps.simulate_full(ps.simulate_generation(lengths, n, costs), 0.0, costs)
    partial = ps.simulate_partial(ps.simulate_generation(lengths, n - k, costs), k, 0.0, costs)
    assert full.rollout_s == pytest.approx(gen_time_analytic(costs, n, costs.response_mean) + 5.0)
    assert partial.rollout_s == pytest.approx(gen_time_analytic(costs, n - k, costs.response_mean))
    tokens = lengths.size * (costs.prompt_len + costs.response_mean)
    per_token = costs.logprob_s_per_token + costs.train_s_per_token
    tail = costs.trainer_switch_s + costs.weight_sync_s
    assert full.step_s == pytest.approx(full.rollout_s + 5.0 + tail + tokens * per_token / n)
    assert partial.step_s == pytest.approx(partial.rollout_s + tail + tokens * per_token / (n - k))
    # no spread, even shares: nobody waits on anybody
    assert np.allclose(full.idle, 0.0)
    assert np.allclose(partial.idle[: n - k], 0.0)


def test_zero_spread_judging_matches_the_analytic_queue():
    """All samples finish together at T_gen: full judges M c / N after a switch; partial's k replicas M c / k."""
    costs = dataclasses.replace(SMALL, genrm_latency_s=0.0)
    lengths = uniform(costs)
    c, n, k = 0.3, 8, 4
    m = lengths.size
    full = ps.simulate_full(ps.simulate_generation(lengths, n, costs), c, costs)
    partial = ps.simulate_partial(ps.simulate_generation(lengths, n - k, costs), k, c, costs)
    g_n, g_p = (gen_time_analytic(costs, d, costs.response_mean) for d in (n, n - k))
    assert full.rollout_s == pytest.approx(g_n + costs.genrm_switch_s + m * c / n)
    assert partial.rollout_s == pytest.approx(g_p + m * c / k)


def brute_force_finish(lens: list[list[float]], costs) -> list[float]:
    """Decode iteration by iteration: FCFS admission into max_batch slots, each iteration costs t0 + t1 * active."""
    t0, t1 = costs.decode_constants()
    out = []
    for queue in lens:
        now = len(queue) * costs.prompt_len / costs.prefill_tps
        waiting, active = list(queue), []
        while waiting or active:
            while waiting and len(active) < costs.max_batch:
                active.append(waiting.pop(0))
            now += t0 + t1 * len(active)
            active = [r - 1 for r in active]
            out += [now] * sum(r == 0 for r in active)
            active = [r for r in active if r > 0]
    return sorted(out)


@pytest.mark.parametrize("max_batch", [3, 64])
def test_generation_matches_an_iteration_loop(max_batch):
    costs = dataclasses.replace(SMALL, max_batch=max_batch, decode_tps=150.0, seq_decode_tps=100.0)
    lengths = np.random.default_rng(3).integers(1, 40, size=23).astype(float)
    devices = 4
    per_device = [
        list(lengths[d::devices]) for d in range(devices)
    ]  # round robin: sample j -> device j mod D
    gen = ps.simulate_generation(lengths, devices, costs)
    np.testing.assert_allclose(gen.finish, brute_force_finish(per_device, costs), rtol=1e-9)
    assert gen.time == pytest.approx(max(brute_force_finish(per_device, costs)))


def test_judge_queue_matches_a_single_server_loop():
    arrivals = np.sort(np.random.default_rng(5).uniform(0, 10, size=50))
    c, done = 0.4, 0.0
    for a in arrivals:  # one replica, service c per sample, first come first served
        done = max(done, a) + c
    assert ps.judge_queue_end(arrivals, c, 1, latency=0.0) == pytest.approx(done)
    assert ps.judge_queue_end(arrivals, c, 1, latency=100.0) == pytest.approx(arrivals[-1] + 100.0)


@pytest.mark.parametrize("sigma", [0.3, 1.0])
def test_idle_accounting_adds_up(sigma):
    z = np.random.default_rng(1).standard_normal(SMALL.samples(8, "strong"))
    lengths = ps.response_lengths(z, SMALL, sigma)
    c, n, k = 0.2, 8, 3
    partial = ps.simulate_partial(ps.simulate_generation(lengths, n - k, SMALL), k, c, SMALL)
    full = ps.simulate_full(ps.simulate_generation(lengths, n, SMALL), c, SMALL)
    for r in (partial, full):
        assert r.busy.size == r.idle.size == n
        assert np.all(r.idle >= -1e-9)
        np.testing.assert_allclose(r.busy + r.idle, r.step_s)  # every device's step is busy or idle
        assert r.idle.sum() == pytest.approx(n * r.step_s - r.busy.sum())
        assert r.idle_fraction == pytest.approx(r.idle.sum() / (n * r.step_s))
    # the k GenRM devices judge M c device-seconds in all, and idle through the whole training phase
    assert partial.busy[n - k :].sum() == pytest.approx(lengths.size * c)
    assert np.all(partial.idle[n - k :] >= partial.step_s - partial.rollout_s - 1e-9)


def test_without_genrm_cost_full_wins_or_ties():
    # The default workload (128 samples a device): with few samples a device, dealing them over N - 1 devices
    # instead of N can group the tail luckily, and partial then wins a step by chance.
    costs = dataclasses.replace(ps.Costs(), genrm_latency_s=0.0, genrm_switch_s=0.0)
    cells = ps.run_grid(costs, [8, 16], [0.0], [0.0, 0.6, 1.0], scaling="weak", seed=0)
    for cell in cells:
        assert cell.winner in ("full", "tie"), (cell.devices, cell.sigma, cell.step_cut)
        if cell.sigma == 0.0:  # no luck to be had: the k idle GenRM devices are pure loss
            assert cell.full.step_s < cell.partial.step_s


def test_heavy_genrm_with_a_long_tail_partial_wins():
    cells = ps.run_grid(ps.Costs(), [16, 64], [1.0], [1.0], scaling="weak", seed=0)
    for cell in cells:
        assert cell.winner == "partial", (cell.devices, cell.step_cut)
        assert cell.rollout_cut > 5.0
        assert 0 < cell.partial.k < cell.devices


def test_step_time_falls_as_the_cluster_grows_for_fixed_work():
    cells = ps.run_grid(SMALL, [8, 16, 32, 64], [0.5], [0.6], scaling="strong", seed=0)
    full = [c.full.step_s for c in cells]
    partial = [c.partial.step_s for c in cells]
    assert all(a > b for a, b in zip(full, full[1:])), full
    assert all(a > b for a, b in zip(partial, partial[1:])), partial


def test_deterministic_with_a_seed():
    def run(seed):
        return [
            ps.cell_row(c) for c in ps.run_grid(SMALL, [8, 32], [0.25, 1.0], [0.6], seed=seed, k_spec="0.25")
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_fixed_k_and_search_agree():
    assert ps.resolve_k("0.25", 64) == 16
    assert ps.resolve_k("16", 64) == 16
    assert ps.resolve_k("100", 8) == 7
    assert ps.resolve_k(None, 8) is None
    (cell,) = ps.run_grid(SMALL, [8], [0.5], [0.6], k_spec=str(0))  # clamped to k = 1
    assert cell.fixed.k == 1
    assert cell.partial.step_s <= cell.fixed.step_s  # the search covers every k at N = 8


def test_costs_from_metrics(tmp_path):
    rows = [
        {"step": 0, "eval/reward_mean": 0.1},
        *(
            {"step": s, "samples": 64, "response_length": 100.0, "total_tokens_per_s": 1000.0, "time/step": 16.0,
             "time/rollout": 4.0, "time/reward": 2.0, "time/logprobs": 1.0, "time/train": 3.0,
             "time/weight_sync": 0.5, "time/offload": 0.25}
            for s in (1, 2)
        ),
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    costs, ratio = ps.costs_from_metrics(str(path), devices=2, base=ps.Costs())
    tokens = 1000.0 * 16.0
    assert costs.decode_tps == pytest.approx(64 * 100 / (4.0 * 2))
    assert costs.prompt_len == round((tokens - 64 * 100) / 64)
    assert costs.train_s_per_token == pytest.approx(3.0 * 2 / tokens)
    assert costs.logprob_s_per_token == pytest.approx(1.0 * 2 / tokens)
    assert (costs.weight_sync_s, costs.trainer_switch_s) == (0.5, 0.25)
    assert ratio == pytest.approx((2.0 * 2 / 64) / (100 / costs.decode_tps))
    costs.decode_constants()  # still consistent


def test_main_prints_a_table_and_a_verdict(capsys, tmp_path):
    out_csv = tmp_path / "grid.csv"
    cells = ps.main(
        ["--devices", "8", "--ratios", "0.5", "--sigmas", "0.6", "--k", "2", "--csv", str(out_csv)]
    )
    text = capsys.readouterr().out
    assert "winner" in text and "Verdict" in text and "16-24%" in text
    assert len(cells) == 1 and out_csv.read_text().count("\n") == 2
