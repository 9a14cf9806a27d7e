"""Checks of release/placement_sim.py: analytic cases, brute-force loops, accounting, and the expected winners
of its three modes (full, partial: the seed's, disaggregated: what it called partial before)."""

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
    dis = ps.simulate_disaggregated(ps.simulate_generation(lengths, n - k, costs), k, 0.0, costs)
    part = ps.simulate_partial(ps.simulate_generation(lengths, n, costs), 0.0, 0.0, costs)
    assert full.rollout_s == pytest.approx(gen_time_analytic(costs, n, costs.response_mean) + 5.0)
    assert dis.rollout_s == pytest.approx(gen_time_analytic(costs, n - k, costs.response_mean))
    assert part.rollout_s == pytest.approx(
        gen_time_analytic(costs, n, costs.response_mean)
    )  # no switch in it
    tokens = lengths.size * (costs.prompt_len + costs.response_mean)
    per_token = costs.logprob_s_per_token + costs.train_s_per_token
    tail = costs.trainer_switch_s + costs.weight_sync_s
    assert full.step_s == pytest.approx(full.rollout_s + 5.0 + tail + tokens * per_token / n)
    assert dis.step_s == pytest.approx(dis.rollout_s + tail + tokens * per_token / (n - k))
    assert part.step_s == pytest.approx(part.rollout_s + 5.0 + tail + tokens * per_token / n)  # the release
    # no spread, even shares: nobody waits on anybody
    assert np.allclose(full.idle, 0.0)
    assert np.allclose(dis.idle[: n - k], 0.0)


def test_zero_spread_judging_matches_the_analytic_queue():
    """All samples finish together at T_gen: full judges M c / N after a switch; disaggregated's k replicas
    M c / k; partial's engines run at 1 - s, so everything arrives at T_gen / (1 - s), when every device is free
    to judge: M c / N more, with no switch in series (the wake overlapped generation)."""
    costs = dataclasses.replace(SMALL, genrm_latency_s=0.0)
    lengths = uniform(costs)
    c, n, k = 0.3, 8, 4
    m = lengths.size
    full = ps.simulate_full(ps.simulate_generation(lengths, n, costs), c, costs)
    dis = ps.simulate_disaggregated(ps.simulate_generation(lengths, n - k, costs), k, c, costs)
    g_n, g_p = (gen_time_analytic(costs, d, costs.response_mean) for d in (n, n - k))
    assert full.rollout_s == pytest.approx(g_n + costs.genrm_switch_s + m * c / n)
    assert dis.rollout_s == pytest.approx(g_p + m * c / k)
    for share in (0.0, 0.25):
        part = ps.simulate_partial(ps.simulate_generation(lengths, n, costs), share, c, costs)
        assert part.rollout_s == pytest.approx(g_n / (1 - share) + m * c / n)
        assert part.step_s == pytest.approx(part.rollout_s + full.step_s - full.rollout_s)


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


@pytest.mark.parametrize("share, wake", [(0.3, 1.5), (0.0, 6.0), (0.6, 12.0)])
def test_capacity_of_shared_devices_matches_a_time_stepped_loop(share, wake):
    """Partial's judges: 0 before the wake, s of a device while its engine runs, all of it after; a fluid queue
    drained at that rate, stepped in small time steps, empties when queue_end says."""
    rng = np.random.default_rng(11)
    ends = rng.uniform(2.0, 10.0, size=5)
    arrivals = np.sort(rng.uniform(0.5, 10.0, size=30))
    c, dt = 0.4, 2e-4
    capacity = ps.shared_capacity(ends, share, wake)
    t, queue, arrived, offered = 0.0, 0.0, 0, 0.0
    while arrived < arrivals.size or queue > 0:
        while arrived < arrivals.size and arrivals[arrived] <= t:
            queue, arrived = queue + c, arrived + 1
        rate = 0.0 if t < wake else sum(share if t < e else 1.0 for e in ends)
        queue, t, offered = max(queue - rate * dt, 0.0), t + dt, offered + rate * dt
        if abs(t - 7.0) < dt / 2:
            assert capacity.at(7.0) == pytest.approx(offered, abs=5 * dt * ends.size)
    assert ps.queue_end(arrivals, c, capacity, latency=0.0) == pytest.approx(t, abs=5 * dt)
    assert ps.queue_end(arrivals, c, capacity, latency=100.0) == pytest.approx(arrivals[-1] + 100.0)
    for y in (
        0.1,
        3.0,
        max(capacity.cum[-1], 0.2),
        capacity.cum[-1] + 7.0,
    ):  # A^-1 inverts A, past the end too
        assert capacity.at(capacity.inverse(y)) == pytest.approx(y)


def test_partial_with_no_judging_work_is_full_generation():
    costs = dataclasses.replace(SMALL, genrm_latency_s=0.0)
    z = np.random.default_rng(2).standard_normal(costs.samples(8, "strong"))
    gen = ps.simulate_generation(ps.response_lengths(z, costs, 1.0), 8, costs)
    best = ps.search_share(lambda s: ps.simulate_partial(gen, s, 0.0, costs), (0.0, 0.9))
    full = ps.simulate_full(gen, 0.0, costs)
    assert best.share == 0.0
    assert best.rollout_s == pytest.approx(gen.time)
    assert best.rollout_s == pytest.approx(full.rollout_s - costs.genrm_switch_s)
    # a share forced on the engines only slows them
    assert ps.simulate_partial(gen, 0.2, 0.0, costs).rollout_s == pytest.approx(gen.time / 0.8)


@pytest.mark.parametrize("switch_s", [0.0, 5.0])
@pytest.mark.parametrize("latency_s", [0.0, 3.0])
def test_partial_rollout_never_exceeds_full(switch_s, latency_s):
    """With the share 0 in bounds, partial's rollout phase is never longer than full's: the judges get every
    device full coexistence gives them, only sooner (devices whose engines are done), and the wake runs
    beside generation. Its step is never longer either: both pay one switch after the rollout phase."""
    costs = dataclasses.replace(SMALL, genrm_switch_s=switch_s, genrm_latency_s=latency_s)
    z = np.random.default_rng(4).standard_normal(costs.samples(8, "strong"))
    for sigma in (0.0, 0.6, 1.2):
        for n in (2, 8):
            gen = ps.simulate_generation(ps.response_lengths(z, costs, sigma), n, costs)
            for ratio in (0.05, 0.5, 2.0):
                c = ratio * costs.gen_cost_per_sample()
                full = ps.simulate_full(gen, c, costs)
                best = ps.search_share(lambda s, g=gen, c=c: ps.simulate_partial(g, s, c, costs), (0.0, 0.9))
                assert best.rollout_s <= full.rollout_s + 1e-9, (sigma, n, ratio)
                assert best.step_s <= full.step_s + 1e-9, (sigma, n, ratio)


def test_search_share_finds_the_shortest_rollout():
    def evaluate(share):
        rollout = 10.0 + (share - 0.3137) ** 2
        return ps.ModeResult("partial", 0, rollout + 1.0, rollout, np.zeros(1), np.zeros(1), share)

    assert ps.search_share(evaluate, (0.0, 0.9)).share == pytest.approx(0.3137, abs=1e-3)
    assert ps.search_share(evaluate, (0.5, 0.9)).share == 0.5  # the bound holds
    assert ps.search_share(evaluate, (0.2, 0.2)).share == 0.2


def test_load_balance_share():
    assert ps.balanced_share(30.0, 10.0, (0.0, 0.9)) == pytest.approx(0.25)
    assert ps.balanced_share(30.0, 10.0, (0.3, 0.9)) == 0.3
    assert ps.balanced_share(1.0, 99.0, (0.0, 0.9)) == 0.9
    assert ps.balanced_share(0.0, 0.0, (0.1, 0.9)) == 0.1
    z = np.random.default_rng(6).standard_normal(SMALL.samples(8, "strong"))
    gens = [ps.simulate_generation(ps.response_lengths(z, SMALL, 0.6), 8, SMALL)]
    c = 0.5 * SMALL.gen_cost_per_sample()
    best, rule = ps.partial_results(gens, c, SMALL, (0.0, 0.9))
    g = gens[0]
    assert rule.share == pytest.approx(g.finish.size * c / (g.device_end.sum() + g.finish.size * c))
    assert best.rollout_s <= rule.rollout_s


def test_disaggregated_matches_the_old_partial_numbers():
    """Before the seed's partial came in, this simulator called disaggregated placement "partial"; these are
    that version's figures for the same grid, to the rounding."""
    old = {  # (N, ratio): (best k, step, rollout, idle fraction, k of the shortest rollout, step at k = 3)
        (8, 0.25): (1, 56.5118, 45.88133333333334, 0.3592943438014577, 1, 60.53548470588236),
        (8, 1.0): (1, 57.24338431372549, 46.61291764705882, 0.31381712711659865, 2, 60.53548470588236),
        (16, 0.25): (1, 66.3566462745098, 55.982086274509804, 0.4199211175253051, 1, 67.97818883861238),
        (16, 1.0): (2, 67.49882464985994, 56.81179607843138, 0.41105230117421204, 2, 67.97818883861238),
    }
    cells = ps.run_grid(SMALL, [8, 16], [0.25, 1.0], [0.6], seed=0, k_spec="3")
    assert len(cells) == len(old)
    for c in cells:
        k, step, rollout, idle, k_rollout, fixed_step = old[(c.devices, c.ratio)]
        d = c.disaggregated
        assert (d.k, c.best_rollout.k, c.fixed.k) == (k, k_rollout, 3)
        assert (d.step_s, d.rollout_s, d.idle_fraction) == pytest.approx((step, rollout, idle), rel=1e-12)
        assert c.fixed.step_s == pytest.approx(fixed_step, rel=1e-12)


@pytest.mark.parametrize("sigma", [0.3, 1.0])
def test_idle_accounting_adds_up(sigma):
    z = np.random.default_rng(1).standard_normal(SMALL.samples(8, "strong"))
    lengths = ps.response_lengths(z, SMALL, sigma)
    c, n, k = 0.2, 8, 3
    dis = ps.simulate_disaggregated(ps.simulate_generation(lengths, n - k, SMALL), k, c, SMALL)
    gen = ps.simulate_generation(lengths, n, SMALL)
    full = ps.simulate_full(gen, c, SMALL)
    parts = [ps.simulate_partial(gen, share, c, SMALL) for share in (0.0, 0.1, 0.5)]
    for r in (dis, full, *parts):
        assert r.busy.size == r.idle.size == n
        assert np.all(r.idle >= -1e-9)
        np.testing.assert_allclose(r.busy + r.idle, r.step_s)  # every device's step is busy or idle
        assert r.idle.sum() == pytest.approx(n * r.step_s - r.busy.sum())
        assert r.idle_fraction == pytest.approx(r.idle.sum() / (n * r.step_s))
    # the k GenRM devices judge M c device-seconds in all, and idle through the whole training phase
    assert dis.busy[n - k :].sum() == pytest.approx(lengths.size * c)
    assert np.all(dis.idle[n - k :] >= dis.step_s - dis.rollout_s - 1e-9)
    # partial: busy = generation + wake + M c of judging + release + training, device-seconds in all
    train = parts[0].step_s - parts[0].rollout_s - SMALL.genrm_switch_s
    for r in parts:
        ends, w = gen.device_end / (1 - r.share), SMALL.genrm_switch_s
        waking = (r.share * np.minimum(ends, w) + np.maximum(w - ends, 0)).sum()
        expected = gen.device_end.sum() + waking + lengths.size * c + n * (w + train)
        assert r.busy.sum() == pytest.approx(expected)


def test_without_genrm_cost_full_wins_or_ties():
    # The default workload (128 samples a device): with few samples a device, dealing them over N - 1 devices
    # instead of N can group the tail luckily, and disaggregated then wins a step by chance.
    costs = dataclasses.replace(ps.Costs(), genrm_latency_s=0.0, genrm_switch_s=0.0)
    cells = ps.run_grid(costs, [8, 16], [0.0], [0.0, 0.6, 1.0], scaling="weak", seed=0)
    for cell in cells:
        assert cell.cut(cell.disaggregated, "step") <= 0.5, (cell.devices, cell.sigma)
        assert cell.winner.startswith("full=part"), cell.winner
        # nothing to judge: partial keeps every device generating (s = 0) and is full, to the rounding
        assert cell.partial.share == 0.0 and cell.partial_rule.share == 0.0
        assert cell.partial.rollout_s == pytest.approx(cell.full.rollout_s)
        assert cell.partial.step_s == pytest.approx(cell.full.step_s)
        if cell.sigma == 0.0:  # no luck to be had: the k idle GenRM devices are pure loss
            assert cell.full.step_s < cell.disaggregated.step_s


def test_heavy_genrm_with_a_long_tail_both_beat_full():
    cells = ps.run_grid(ps.Costs(), [16, 64], [1.0], [1.0], scaling="weak", seed=0)
    for cell in cells:
        assert cell.winner == "part", (cell.devices, cell.winner)
        assert cell.disaggregated_rollout_cut > 5.0
        assert cell.partial_rollout_cut > 5.0
        # partial trains on every device, disaggregated on N - k
        assert cell.cut(cell.partial, "step") > cell.cut(cell.disaggregated, "step") + 1.0
        assert 0 < cell.disaggregated.k < cell.devices


def test_step_time_falls_as_the_cluster_grows_for_fixed_work():
    cells = ps.run_grid(SMALL, [8, 16, 32, 64], [0.5], [0.6], scaling="strong", seed=0)
    for mode in ("full", "partial", "disaggregated"):
        steps = [getattr(c, mode).step_s for c in cells]
        assert all(a > b for a, b in zip(steps, steps[1:])), (mode, steps)


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
    assert cell.disaggregated.step_s <= cell.fixed.step_s  # the search covers every k at N = 8


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


def test_main_prints_a_table_a_verdict_and_a_summary_line(capsys, tmp_path):
    out_csv = tmp_path / "grid.csv"
    argv = ["--devices", "8", "--ratios", "0.1", "1", "--sigmas", "0.6", "--k", "2", "--csv", str(out_csv)]
    cells = ps.main(argv)
    text = capsys.readouterr().out
    assert "winner" in text and "Verdict" in text and "16.2-24.1%" in text
    assert len(cells) == 2 and out_csv.read_text().count("\n") == 3
    last = text.strip().splitlines()[-1]
    assert last.startswith("placement_sim: ")
    values = dict(item.split("=") for item in last.split()[1:])
    part = [c.partial_rollout_cut for c in cells]
    assert float(values["partial_rollout_cut_min_pct"]) == pytest.approx(min(part), abs=0.05)
    assert float(values["partial_rollout_cut_max_pct"]) == pytest.approx(max(part), abs=0.05)
    assert values["partial_points_cut_ge_16pct"] == f"{sum(x >= 16 for x in part)}/2"
    assert values["partial_rule_points_cut_ge_16pct"].endswith("/2")
    dis_step = max(c.cut(c.disaggregated, "step") for c in cells)
    assert float(values["disaggregated_step_gain_max_pct"]) == pytest.approx(dis_step, abs=0.05)
    assert {"partial_step_gain_max_pct", "disaggregated_rollout_cut_max_pct"} <= values.keys()


@pytest.mark.parametrize("bounds", [("0.5", "0.2"), ("0", "1"), ("-0.1", "0.5")])
def test_share_bounds_are_checked(bounds):
    with pytest.raises(SystemExit):
        ps.parse_args(["--share-min", bounds[0], "--share-max", bounds[1]])
    with pytest.raises(ValueError, match="share"):
        ps.run_grid(SMALL, [8], [0.5], [0.6], share_bounds=tuple(map(float, bounds)))


# ---------------------------------------------------------------------------------------------------- asynchronous

# A small asynchronous workload: 8 slots a device, lengths 1-40, so that batches queue, tails drain and gates bind.
TINY = dataclasses.replace(
    SMALL, max_batch=8, decode_tps=400.0, seq_decode_tps=100.0, prompt_len=64, prefill_tps=2000.0
)


def tiny_draws(steps: int, size: int, seed: int = 0, high: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, high, size=size).astype(float) for _ in range(steps)]


def wall_clock_async(draws, g: int, n: int, eta: int, costs) -> np.ndarray:
    """Trainer finish times from a wall-clock loop: the device furthest behind in time moves first, one decode
    iteration at a time; batch s is admitted once the trainer has trained batch s - eta - 1 (pausing push and
    prefill when a device takes it up); the trainer trains batch s once all its samples are done."""
    t0, t1 = costs.decode_constants()
    steps, push = len(draws), costs.weight_sync_s
    queue = [[(s, x) for s in range(steps) for x in draws[s][d::g]] for d in range(g)]
    left, last = [x.size for x in draws], [0.0] * steps
    trained, trainer_free = [], 0.0
    wall, active, taken = [0.0] * g, [[] for _ in range(g)], [set() for _ in range(g)]
    train = [ps.train_seconds(x, n - g, costs) for x in draws]
    while any(queue) or any(active):
        while len(trained) < steps and left[len(trained)] == 0:
            end = max(last[len(trained)], trainer_free) + train[len(trained)]
            trained.append(end)
            trainer_free = end + push
        gate = [0.0 if s <= eta else (trained[s - eta - 1] if s - eta - 1 < len(trained) else None)
                for s in range(steps)]  # fmt: skip
        for d in sorted(range(g), key=lambda d: wall[d]):
            paused = False
            while queue[d] and len(active[d]) < costs.max_batch and gate[queue[d][0][0]] is not None:
                s, length = queue[d][0]
                if gate[s] > wall[d]:
                    break
                if s not in taken[d]:
                    taken[d].add(s)
                    count = len(draws[s][d::g])
                    wall[d] += count * costs.prompt_len / costs.prefill_tps + (push if s > eta else 0.0)
                    paused = True
                active[d].append([s, length])
                queue[d].pop(0)
            if paused:  # the others catch up before this device admits more at the same iteration boundary
                break
            if active[d]:
                wall[d] += t0 + t1 * len(active[d])
                for seq in active[d]:
                    seq[1] -= 1
                    if seq[1] == 0:
                        last[seq[0]], left[seq[0]] = max(last[seq[0]], wall[d]), left[seq[0]] - 1
                active[d] = [seq for seq in active[d] if seq[1] > 0]
                break
            if queue[d] and gate[queue[d][0][0]] is not None:  # nothing to decode: idle until the gate
                wall[d] = max(wall[d], gate[queue[d][0][0]])
                break
    while len(trained) < steps:
        trained.append(max(last[len(trained)], trainer_free) + train[len(trained)])
        trainer_free = trained[-1] + push
    return np.array(trained)


@pytest.mark.parametrize(
    "g, eta, train_s, samples, slots",
    [
        (3, 0, 2e-4, 30, 8), (3, 1, 2e-4, 30, 8), (2, 2, 3e-3, 9, 8), (3, 3, 1e-5, 40, 8), (1, 1, 1e-3, 12, 8),
        (2, 1, 2e-2, 7, 1), (2, 2, 2e-2, 9, 2),
    ],
)  # fmt: skip
def test_async_matches_a_wall_clock_loop(g, eta, train_s, samples, slots):
    """Queued batches (more samples than slots), drained tails and binding gates, against a plain event loop."""
    costs = dataclasses.replace(
        TINY, max_batch=slots, decode_tps=90.0 * slots, train_s_per_token=train_s, logprob_s_per_token=0.0,
        weight_sync_s=0.15,
    )  # fmt: skip
    draws = tiny_draws(5, samples, seed=g + 10 * eta)
    got = ps.simulate_async(draws, g, g + 2, eta, costs)
    np.testing.assert_allclose(got.trained, wall_clock_async(draws, g, g + 2, eta, costs), rtol=1e-9)
    assert np.all(got.generated <= got.trained)


@pytest.mark.parametrize(
    "slots, eta, push, train_s, draws",
    [  # a sequence ends at the very iteration a batch is taken up (its finish is before that pause); found by fuzzing
        (3, 1, 0.0, 5e-3, [[4, 4, 4, 4, 4], [1, 2], [4, 4, 2, 3]]),
        (2, 1, 0.1, 1e-5, [[3, 4, 2, 4, 1], [2, 4, 2], [4, 3, 1, 2, 2, 1], [3, 1, 1]]),
    ],
)
def test_async_ties_at_a_take_up_match_the_wall_clock_loop(slots, eta, push, train_s, draws):
    costs = dataclasses.replace(
        TINY, max_batch=slots, decode_tps=90.0 * slots, weight_sync_s=push, train_s_per_token=train_s,
        logprob_s_per_token=0.0,
    )  # fmt: skip
    draws = [np.array(x, dtype=float) for x in draws]
    got = ps.simulate_async(draws, 2, 3, eta, costs).trained
    np.testing.assert_allclose(got, wall_clock_async(draws, 2, 3, eta, costs), rtol=1e-9)


@pytest.mark.parametrize("samples", [20, 64])  # one batch a device, then queued (more than 8 slots)
def test_async_eta0_is_the_synchronous_model(samples):
    draws = tiny_draws(6, samples, seed=samples)
    for g in (1, 2, 3):
        sync = ps.sync_disaggregated(draws, g, 5, TINY)
        got = ps.simulate_async(draws, g, 5, 0, TINY)
        np.testing.assert_allclose(got.trained, sync.trained, rtol=1e-12)
        np.testing.assert_allclose(got.generated, sync.generated, rtol=1e-12)
        steps = [ps.simulate_generation(x, g, TINY).time + ps.train_seconds(x, 5 - g, TINY) for x in draws]
        assert np.diff(sync.trained) == pytest.approx(np.array(steps[1:]) + TINY.weight_sync_s)


def overlap_case(ratio: float):
    """No spread, full batches (M / G = max_batch), no push: rollout R per batch, training T = ratio x R."""
    g, n, steps = 2, 4, 12
    base = dataclasses.replace(TINY, weight_sync_s=0.0, logprob_s_per_token=0.0)
    draws = [np.full(g * base.max_batch, 30.0) for _ in range(steps)]
    rollout = ps.simulate_generation(draws[0], g, base).time
    per_token = ratio * rollout * (n - g) / (draws[0].sum() + draws[0].size * base.prompt_len)
    return dataclasses.replace(base, train_s_per_token=per_token), draws, g, n, rollout


@pytest.mark.parametrize("ratio", [1.0, 0.5, 2.0])
def test_async_without_spread_gains_the_pure_overlap_and_no_more(ratio):
    costs, draws, g, n, rollout = overlap_case(ratio)
    train = ratio * rollout
    bound = (rollout + train) / max(rollout, train)
    sync = ps.steady_throughput(ps.sync_disaggregated(draws, g, n, costs), draws)
    for eta in (1, 2, 4):
        gain = ps.steady_throughput(ps.simulate_async(draws, g, n, eta, costs), draws) / sync
        assert gain == pytest.approx(bound, rel=1e-9), eta
    # a push between steps only takes from it
    pushed = dataclasses.replace(costs, weight_sync_s=0.2 * rollout)
    sync = ps.steady_throughput(ps.sync_disaggregated(draws, g, n, pushed), draws)
    assert ps.steady_throughput(ps.simulate_async(draws, g, n, 1, pushed), draws) / sync < bound


def test_async_throughput_does_not_fall_with_eta():
    points = ps.run_async(SMALL, [16], [0, 1, 2, 4, 8], sigma=0.6, steps=12)
    ratios = [p.ratio for p in points]
    assert all(b >= a * (1 - 1e-3) for a, b in zip(ratios, ratios[1:])), ratios
    assert ratios[-1] > ratios[0] * 1.2  # a long tail: asynchrony pays
    assert points[0].throughput == pytest.approx(
        points[0].disaggregated
    )  # eta 0 is synchronous disaggregated
    # and at a fixed split, common random numbers: a looser bound never slows the steady state
    draws = ps.step_lengths(SMALL, 16, 0.6, "weak", 0, 12 + 9)
    rates = [ps.steady_throughput(ps.simulate_async(draws[: 12 + e + 1], 9, 16, e, SMALL), draws, 12)
             for e in (1, 2, 4, 8)]  # fmt: skip
    assert all(b >= a * (1 - 1e-3) for a, b in zip(rates, rates[1:])), rates


def test_search_split_finds_the_peak():
    assert ps.search_split(64, lambda g: -abs(g - 41)) == (41, 0)
    assert ps.search_split(1024, lambda g: -abs(g - 700))[0] == pytest.approx(700, abs=16)
    assert ps.search_split(2, lambda g: 1.0) == (1, 1.0)


def test_main_async_prints_a_table_and_its_own_last_line(capsys, tmp_path):
    small = tmp_path / "costs.json"
    small.write_text(json.dumps({"prompts": 8, "samples_per_prompt": 4, "max_batch": 8, "decode_tps": 400.0}))
    argv = [
        "--async",
        "--costs",
        str(small),
        "--async-devices",
        "8",
        "16",
        "--async-etas",
        "0",
        "1",
        "2",
        "4",
    ]
    points = ps.main(argv + ["--async-steps", "8"])
    text = capsys.readouterr().out
    assert "x sync" in text and "AReaL" in text and "Verdict" not in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("placement_sim_async: ")
    values = dict(item.split("=") for item in last.split()[1:])
    assert list(values) == [
        "ratio_eta1", "ratio_eta2", "ratio_eta4", "saturates_at_eta", "areal_eta1", "areal_eta2",
    ]  # fmt: skip
    largest = {p.eta: p for p in points if p.devices == 16}
    for eta in (1, 2, 4):
        assert float(values[f"ratio_eta{eta}"]) == pytest.approx(largest[eta].ratio, abs=0.005)
    assert int(values["saturates_at_eta"]) == ps.saturation_eta(list(largest.values()))
    assert (values["areal_eta1"], values["areal_eta2"]) == ("2.09", "2.77")
    assert ps.parse_args([]).run_async is False
