"""Placement simulator: step time and idle fraction of full versus partial coexistence under GenRM workloads.

    python release/placement_sim.py                                  # defaults: N = 8, 64, 512, 1024
    python release/placement_sim.py --devices 8 16 32 --ratios 0.25 1 --sigmas 0.6
    python release/placement_sim.py --k 0.25                         # also report a fixed k (fraction of N, or
                                                                     # a device count such as --k 16)
    python release/placement_sim.py --costs costs.json               # measured cost constants (Costs fields)
    python release/placement_sim.py --from-metrics runs/x/metrics.jsonl --measured-devices 8
    python release/placement_sim.py --scaling strong --csv out.csv --seed 1

It tests the claim of the WeChat-YATT paper (arXiv 2508.07970) that partial coexistence cuts rollout time by
16-24% under GenRM workloads, and shows where each placement mode wins. No Ray, no accelerator: it is a model.

The two modes (as yatt_ray runs them; see DESIGN.md):
  full     all N devices host trainer + rollout engine + a GenRM replica; per step, in series:
           generation on N -> switch (engine sleeps, GenRM wakes) -> judging on N -> switch back (GenRM
           released) -> trainer onload -> log-probs + train on N -> weight sync.
  partial  k devices hold GenRM replicas only, N - k hold trainer + rollout. Each finished sample goes to the
           judge at once (a queue served by k replicas), so judging overlaps generation; after the last sample
           the judge queue drains; then trainer onload -> log-probs + train on N - k -> weight sync. The GenRM
           devices wait through training. No GenRM switches. k is searched for the best step time.

Model (all times in seconds, one "device" = one accelerator):
  Lengths   each response length is lognormal with mean `response_mean` and spread sigma (the log-std),
            L = clip(round(exp(ln(mean) - sigma^2/2 + sigma z)), 1, response_max), z ~ N(0, 1). The same z are
            used for every sigma, mode and k (common random numbers), so comparisons are not noise.
  Placement sample j goes to rollout device j mod D (round robin); a device admits up to `max_batch`
            sequences at once and starts the next queued one when a slot frees (continuous batching, FCFS).
  Decoding  one decode iteration of a device with b active sequences costs t0 + t1 * b (a fixed part for
            reading the weights, a per-sequence part for KV reads and compute). Summing over iterations gives,
            exactly under that linear cost, the time at which a sequence ending at iteration e finishes:
                finish = prefill + t0 * e + t1 * (tokens the device generated up to iteration e)
            and a device's generation time  t0 * (iterations until its last sequence ends) + t1 * sum(L)
            (+ prefill). With every sequence admitted at once that is t0 * max(L) + t1 * sum(L): it holds both
            limits of the usual max(sum(L) / throughput, max(L) / per-sequence speed) and the slow, half-empty
            batch between them, which is where a long tail costs. t0 and t1 come from two public-style figures:
            a lone sequence decodes at `seq_decode_tps` (t0 + t1 = 1 / seq_decode_tps) and a full batch of
            `max_batch` at `decode_tps` per device (t0 + max_batch t1 = max_batch / decode_tps).
            prefill = (samples on the device) * prompt_len / prefill_tps, paid up front.
  GenRM     judging costs c = ratio * (response_mean / decode_tps) device-seconds per sample at batch: ratio is
            the judge's cost as a fraction of the mean generation cost of a sample. A sample's score is never
            ready sooner than `genrm_latency_s` after it reaches the judge (one judge pass at small batch).
            full:    T_judge = max(M c / N, genrm_latency_s)               (M samples spread over N devices)
            partial: k replicas serve the sorted arrivals a_1 <= ... <= a_M as one fluid server of rate k / c:
                     the last score is in at  max( max_j (a_j + (M - j + 1) c / k),  a_M + genrm_latency_s ).
  Training  log-probs and train scale as tokens * (s per token) / D over the D training devices; tokens are
            prompt + response tokens of the step. trainer_switch_s (optimizer/weights offload + onload) and
            weight_sync_s (colocated, in memory) are paid in both modes; genrm_switch_s twice, in full only.
  Steps     full:    rollout = T_gen(N) + genrm_switch + T_judge
                     step    = rollout + genrm_switch + trainer_switch + T_logprobs(N) + T_train(N) + weight_sync
            partial: rollout = max(T_gen(N - k), last score in)
                     step    = rollout + trainer_switch + T_logprobs(N - k) + T_train(N - k) + weight_sync
            "rollout" is the rollout phase: from the start of the step until the last score is in.
  Idle      busy = a device is executing something (decoding, even a half-empty batch; judging, counted as its
            work content c per sample; log-probs, training, switches, weight sync); idle = waiting for other
            devices: a rollout device that finished before the slowest one, a full-mode device waiting out the
            judge latency floor, a partial rollout device waiting for the judge queue to drain, a GenRM device
            with an empty queue and through the whole training phase.
            idle fraction = idle device-seconds / (N * step time).
  Scaling   `weak` (default): the workload (prompts x samples_per_prompt) is given for `reference_devices`
            and grows in proportion to N, so each device carries the same share at every N. `strong`: fixed.
  Search    k runs over every value below 64 devices, else over a log + linear grid that is then refined
            around the best step time (and the best rollout time, for the "max cut" column).
  Noise     a grid point is the mean of --steps simulated steps (default 3), each with its own lengths, so
            one lucky grouping of the tail on the devices does not decide a winner.

Departures from the real system, on purpose: one device per GenRM replica and per rollout engine (no tensor
parallelism); response lengths independent within a prompt's group; decode cost independent of context length;
prefill not interleaved; no network time to ship a sample to the judge; the judge pool is a fluid server, so
it runs at full batch efficiency even when samples trickle in (optimistic for partial, bounded by the latency
floor). The default constants are assumptions (see Costs); measure yours and pass them with --costs or
--from-metrics.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_DEVICES = (8, 64, 512, 1024)
DEFAULT_RATIOS = (0.1, 0.25, 0.5, 1.0)
DEFAULT_SIGMAS = (0.3, 0.6, 1.0)
PAPER_BAND = (16.0, 24.0)  # % rollout-time reduction claimed for partial coexistence under GenRM workloads


@dataclass(frozen=True)
class Costs:
    """Per-phase cost model. Defaults: a 7B policy and a 7B GenRM judge on H100-class devices, bf16.

    Every default is an ASSUMPTION in the range of public vLLM / Megatron figures, not a measurement here.
    """

    decode_tps: float = 4000.0
    """Decode tokens/s of one device at a full batch of `max_batch` sequences (vLLM 7-8B on A100/H100 serves
    roughly 2,000-8,000 output tokens/s per device at large batch)."""
    seq_decode_tps: float = 100.0
    """Decode tokens/s of one lone sequence (about 10 ms per token for a 7B model in bf16 on an H100)."""
    max_batch: int = 256
    """Concurrent sequences per rollout device (KV-cache bound; vLLM's default max_num_seqs is 256)."""
    prefill_tps: float = 20000.0
    """Prompt tokens/s of one device in prefill (compute bound; a conservative figure for 7B)."""
    prompt_len: int = 256
    """Prompt tokens per sample."""
    response_mean: float = 1024.0
    """Mean response tokens (reasoning-style RL runs sit at 500-4,000)."""
    response_max: int = 8192
    """Responses are cut at this many tokens (truncation)."""
    prompts: int = 64
    """Prompts per step on `reference_devices` devices (the workload)."""
    samples_per_prompt: int = 16
    """GRPO group size n."""
    reference_devices: int = 8
    """Device count for which `prompts` is given; weak scaling grows the workload by N / reference_devices."""
    genrm_latency_s: float = 3.0
    """Least time from a sample reaching the judge to its score (one judge pass writing ~256 verdict tokens at
    a small batch)."""
    genrm_switch_s: float = 5.0
    """One GenRM switch in full coexistence: sleep the rollout engine and wake the judge (or the reverse):
    15 GB of weights over PCIe plus engine sleep/wake and KV re-allocation. Paid twice per step."""
    trainer_switch_s: float = 4.0
    """Trainer offload + onload per step (both modes: trainer and rollout share devices in both)."""
    logprob_s_per_token: float = 8e-5
    """Device-seconds per token for the log-prob pass (old + reference forward: 2 x 2 x 7e9 FLOPs at 35% of
    989 TFLOP/s)."""
    train_s_per_token: float = 1.2e-4
    """Device-seconds per token for the training pass (6 x 7e9 FLOPs at 35% of 989 TFLOP/s)."""
    weight_sync_s: float = 2.0
    """Trainer -> rollout weight sync per step (colocated, in memory, bucketed)."""

    def decode_constants(self) -> tuple[float, float]:
        """(t0, t1): decode iteration time = t0 + t1 * active sequences. Raises if the figures contradict."""
        b = self.max_batch
        t1 = (b / self.decode_tps - 1.0 / self.seq_decode_tps) / max(b - 1, 1)
        t0 = 1.0 / self.seq_decode_tps - t1
        if t1 <= 0 or t0 <= 0:
            raise ValueError(
                f"decode_tps={self.decode_tps} at max_batch={b} and seq_decode_tps={self.seq_decode_tps} give "
                f"t0={t0:.3g}, t1={t1:.3g}: both must be > 0, so decode_tps must lie between seq_decode_tps and "
                f"max_batch * seq_decode_tps; fix one of the three"
            )
        return t0, t1

    def gen_cost_per_sample(self) -> float:
        """Mean generation cost of one sample at full batch, in device-seconds: response_mean / decode_tps."""
        return self.response_mean / self.decode_tps

    def samples(self, devices: int, scaling: str) -> int:
        """Samples per step at `devices` devices (whole prompts)."""
        prompts = self.prompts
        if scaling == "weak":
            prompts = max(1, round(self.prompts * devices / self.reference_devices))
        return prompts * self.samples_per_prompt


def response_lengths(z: np.ndarray, costs: Costs, sigma: float) -> np.ndarray:
    """Lognormal lengths with mean `costs.response_mean` and log-std `sigma`, from standard normals `z`."""
    mu = math.log(costs.response_mean) - sigma**2 / 2
    return np.clip(np.rint(np.exp(mu + sigma * z)), 1, costs.response_max)


# ---------------------------------------------------------------------------------------------------- generation


@dataclass
class Generation:
    """Generation of one step's samples on `devices` rollout devices."""

    devices: int
    finish: np.ndarray  # (M,) the time each sample finishes, sorted ascending
    device_end: np.ndarray  # (devices,) when each device's last sequence finishes
    tokens: float  # prompt + response tokens of the step

    @property
    def time(self) -> float:
        return float(self.device_end.max())


def _slots(lens: np.ndarray, max_batch: int) -> np.ndarray:
    """Start iteration of every sequence of every device under continuous batching (FCFS, `max_batch` slots).

    lens: (D, m). Each queued sequence takes the slot that frees first (list scheduling, vectorised over D).
    """
    d, m = lens.shape
    if m <= max_batch:
        return np.zeros_like(lens)
    start = np.zeros_like(lens)
    free = lens[:, :max_batch].copy()  # the first max_batch sequences start at iteration 0
    rows = np.arange(d)
    for i in range(max_batch, m):
        slot = free.argmin(axis=1)
        start[:, i] = free[rows, slot]
        free[rows, slot] += lens[:, i]
    return start


def simulate_generation(lengths: np.ndarray, devices: int, costs: Costs) -> Generation:
    """Finish time of each sample when `lengths` are dealt round robin over `devices` rollout devices.

    finish_j = prefill_d + t0 * e_j + t1 * sum_i overlap([s_i, e_i), [0, e_j)) for the sequences i of j's device,
    s and e the start and end iteration of each sequence (see the module docstring).
    """
    t0, t1 = costs.decode_constants()
    total = lengths.size
    per_device = -(-total // devices)
    padded = np.zeros(per_device * devices)
    padded[:total] = lengths
    lens = padded.reshape(per_device, devices).T  # lens[d, i] = lengths[i * devices + d]
    index = np.arange(per_device * devices).reshape(per_device, devices).T  # index[d, i] = i * devices + d
    real = index < total
    if per_device <= costs.max_batch:
        end, tokens_at_end = _tokens_at_end_one_batch(lens)
        real = end > 0  # padding has length 0, every real response at least 1 token
    else:
        end, tokens_at_end = _tokens_at_end_queued(lens, costs.max_batch)
    prefill = real.sum(axis=1, keepdims=True) * costs.prompt_len / costs.prefill_tps
    finish = prefill + t0 * end + t1 * tokens_at_end
    device_end = np.where(real, finish, 0.0).max(axis=1)
    device_end = np.maximum(device_end, prefill[:, 0])
    return Generation(
        devices=devices,
        finish=np.sort(finish[real]),
        device_end=device_end,
        tokens=float(lengths.sum() + total * costs.prompt_len),
    )


def _tokens_at_end_one_batch(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence admitted at iteration 0: for lengths sorted L_1 <= ... <= L_m on a device, sequence j ends
    at iteration L_j having seen sum_i min(L_i, L_j) = sum_{i<j} L_i + (m - j + 1) L_j tokens generated.
    Returns (end iteration, tokens) per sequence, each row in ascending order of length."""
    ordered = np.sort(lens, axis=1)
    m = ordered.shape[1]
    before = np.cumsum(ordered, axis=1) - ordered
    return ordered, before + (m - np.arange(m))[None, :] * ordered


def _tokens_at_end_queued(lens: np.ndarray, max_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """More sequences than slots: start/end iterations from list scheduling, then the tokens generated up to
    each end = the integral of the active-sequence count over iterations (events sorted per device)."""
    devices, per_device = lens.shape
    start = _slots(lens, max_batch)
    end = start + lens
    pos = np.concatenate([start, end], axis=1)
    step = np.concatenate([np.ones_like(start), -np.ones_like(end)], axis=1)
    order = np.argsort(pos, axis=1, kind="stable")
    pos_sorted = np.take_along_axis(pos, order, axis=1)
    active = np.cumsum(np.take_along_axis(step, order, axis=1), axis=1)
    area = np.cumsum(active[:, :-1] * np.diff(pos_sorted, axis=1), axis=1)
    area = np.concatenate([np.zeros((devices, 1)), area], axis=1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(pos.shape[1])[None, :].repeat(devices, axis=0), axis=1)
    return end, np.take_along_axis(area, rank[:, per_device:], axis=1)


# ---------------------------------------------------------------------------------------------------- the modes


@dataclass
class ModeResult:
    """One mode at one grid point. `busy` and `idle` hold each device's seconds within the step."""

    mode: str
    k: int  # GenRM devices (0 in full coexistence: every device hosts a replica)
    step_s: float
    rollout_s: float
    busy: np.ndarray
    idle: np.ndarray

    @property
    def idle_fraction(self) -> float:
        return float(self.idle.sum() / (self.busy.size * self.step_s))


def _train_phase(tokens: float, devices: int, costs: Costs) -> float:
    """Trainer onload/offload + log-probs + train + weight sync on `devices` training devices."""
    per_token = costs.logprob_s_per_token + costs.train_s_per_token
    return costs.trainer_switch_s + tokens * per_token / devices + costs.weight_sync_s


def simulate_full(gen: Generation, judge_cost: float, costs: Costs) -> ModeResult:
    """Full coexistence on gen.devices = N devices (see the module docstring for the equations)."""
    n, m = gen.devices, gen.finish.size
    judge_work = m * judge_cost / n  # each device's share of the judging, device-seconds
    judge_time = max(judge_work, costs.genrm_latency_s if m else 0.0)
    rollout = gen.time + costs.genrm_switch_s + judge_time
    train = _train_phase(gen.tokens, n, costs)
    step = rollout + costs.genrm_switch_s + train
    busy = gen.device_end + 2 * costs.genrm_switch_s + judge_work + train
    idle = (gen.time - gen.device_end) + (judge_time - judge_work)
    return ModeResult("full", 0, step, rollout, busy, idle)


def judge_queue_end(arrivals: np.ndarray, judge_cost: float, k: int, latency: float) -> float:
    """When the last score is in: k replicas as one fluid server of rate k / judge_cost, plus a latency floor.

    arrivals: sorted finish times a_1..a_M. Last departure = max_j (a_j + (M - j + 1) * judge_cost / k).
    """
    m = arrivals.size
    if m == 0:
        return 0.0
    remaining = np.arange(m, 0, -1) * (judge_cost / k)
    return float(max((arrivals + remaining).max(), arrivals[-1] + latency))


def simulate_partial(gen: Generation, k: int, judge_cost: float, costs: Costs) -> ModeResult:
    """Partial coexistence: gen ran on N - k devices, k devices judge (see the module docstring)."""
    m = gen.finish.size
    scored = judge_queue_end(gen.finish, judge_cost, k, costs.genrm_latency_s)
    rollout = max(gen.time, scored)
    train = _train_phase(gen.tokens, gen.devices, costs)
    step = rollout + train
    judge_work = m * judge_cost / k
    busy = np.concatenate([gen.device_end + train, np.full(k, judge_work)])
    idle = np.concatenate([rollout - gen.device_end, np.full(k, (rollout - judge_work) + train)])
    return ModeResult("partial", k, step, rollout, busy, idle)


def k_candidates(n: int, dense_up_to: int = 64, coarse: int = 48) -> list[int]:
    """GenRM device counts to try first: every k below `dense_up_to` devices, else a log + linear grid."""
    if n <= dense_up_to:
        return list(range(1, n))
    grid = np.concatenate([np.geomspace(1, n - 1, coarse // 2), np.linspace(1, 0.75 * n, coarse // 2)])
    return sorted({int(min(max(round(x), 1), n - 1)) for x in grid})


def search_k(n: int, evaluate: Callable[[int], ModeResult]) -> dict[int, ModeResult]:
    """Evaluate partial coexistence over k: a coarse grid, then, around the best step time and around the best
    rollout time, nine evenly spaced k between the best's neighbours, until the neighbours are adjacent.
    Returns {k: result} for every k tried."""
    tried = {k: evaluate(k) for k in k_candidates(n)}
    for key in (lambda r: r.step_s, lambda r: r.rollout_s):
        while True:
            ks = sorted(tried)
            best = ks.index(min(ks, key=lambda k: key(tried[k])))
            lo, hi = ks[max(best - 1, 0)], ks[min(best + 1, len(ks) - 1)]
            new = {round(x) for x in np.linspace(lo, hi, 9)} - tried.keys()
            if not new:
                break
            tried.update({k: evaluate(k) for k in sorted(new)})
    return tried


# ---------------------------------------------------------------------------------------------------- the sweep


@dataclass
class Cell:
    """One grid point: full coexistence, partial at its best k, and partial at a fixed k when asked."""

    devices: int
    ratio: float
    sigma: float
    full: ModeResult
    partial: ModeResult
    best_rollout: ModeResult  # partial at the k with the shortest rollout phase
    fixed: ModeResult | None

    @property
    def rollout_cut(self) -> float:
        """% rollout-phase time saved by partial (at its step-optimal k) against full."""
        return 100 * (1 - self.partial.rollout_s / self.full.rollout_s)

    @property
    def step_cut(self) -> float:
        return 100 * (1 - self.partial.step_s / self.full.step_s)

    @property
    def winner(self) -> str:
        rel = self.step_cut
        return "tie" if abs(rel) < 0.5 else ("partial" if rel > 0 else "full")


def resolve_k(spec: str | None, n: int) -> int | None:
    """--k: a device count ("16") or a fraction of N ("0.25"), clamped to 1..N-1."""
    if spec is None:
        return None
    value = float(spec)
    k = round(value * n) if ("." in spec and value < 1) else round(value)
    return min(max(k, 1), n - 1)


def mean_result(results: list[ModeResult]) -> ModeResult:
    """The average of one mode over several simulated steps (per device for busy and idle)."""
    first = results[0]
    return ModeResult(
        mode=first.mode,
        k=first.k,
        step_s=float(np.mean([r.step_s for r in results])),
        rollout_s=float(np.mean([r.rollout_s for r in results])),
        busy=np.mean([r.busy for r in results], axis=0),
        idle=np.mean([r.idle for r in results], axis=0),
    )


def run_grid(
    costs: Costs,
    devices: list[int],
    ratios: list[float],
    sigmas: list[float],
    scaling: str = "weak",
    k_spec: str | None = None,
    seed: int = 0,
    steps: int = 3,
) -> list[Cell]:
    """Simulate every (N, ratio, sigma), each the mean of `steps` steps with their own response lengths.

    Step s draws its standard normals from the stream (seed, s), so strong scaling sees the same samples at
    every N, and weak scaling's smaller workloads are prefixes of the larger ones. Generation on D devices
    depends only on (N, sigma, D): it is cached across GenRM ratios and k.
    """
    cells = []
    for n in devices:
        if n < 2:
            raise ValueError(f"cluster size {n}: partial coexistence needs at least 2 devices")
        m = costs.samples(n, scaling)
        zs = [np.random.default_rng([seed, s]).standard_normal(m) for s in range(steps)]
        for sigma in sigmas:
            draws = [response_lengths(z, costs, sigma) for z in zs]
            cache: dict[int, list[Generation]] = {}

            def gens(d: int, draws=draws, cache=cache) -> list[Generation]:
                if d not in cache:
                    cache[d] = [simulate_generation(lengths, d, costs) for lengths in draws]
                return cache[d]

            def partial(k: int, c: float, gens=gens, n=n) -> ModeResult:
                return mean_result([simulate_partial(g, k, c, costs) for g in gens(n - k)])

            for ratio in ratios:
                judge_cost = ratio * costs.gen_cost_per_sample()
                full = mean_result([simulate_full(g, judge_cost, costs) for g in gens(n)])
                tried = search_k(n, lambda k, c=judge_cost: partial(k, c))
                k_fixed = resolve_k(k_spec, n)
                fixed = partial(k_fixed, judge_cost) if k_fixed else None
                best = min(tried.values(), key=lambda r: (r.step_s, r.k))
                best_rollout = min(tried.values(), key=lambda r: (r.rollout_s, r.k))
                cells.append(Cell(n, ratio, sigma, full, best, best_rollout, fixed))
    return cells


# ---------------------------------------------------------------------------------------------------- cost inputs


def load_costs(path: str | None) -> Costs:
    """Costs from a JSON object of Costs fields (unknown keys raise, naming the valid ones)."""
    if path is None:
        return Costs()
    data = json.loads(Path(path).read_text())
    names = {f.name for f in dataclasses.fields(Costs)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SystemExit(f"{path}: unknown cost keys {unknown}; valid keys: {sorted(names)}")
    return Costs(**data)


def costs_from_metrics(path: str, devices: int, base: Costs) -> tuple[Costs, float | None]:
    """Best-effort per-phase costs from a yatt_ray metrics.jsonl (means over the steps that report timings).

    With S samples per step (`samples`, else base.prompts x samples_per_prompt), R mean response tokens
    (`response_length`), T tokens per step (`total_tokens_per_s` x `time/step`, else S x (prompt_len + R)) and D the
    run's device count:
        decode_tps          = S R / (time/rollout D)   (effective, tail included: a lower bound on the peak)
        logprob_s_per_token = time/logprobs D / T,  train_s_per_token = time/train D / T
        weight_sync_s       = time/weight_sync,      trainer_switch_s = time/offload (when present)
        response_mean = R,  prompt_len = (T - S R) / S
        GenRM ratio         = (time/reward D / S) / (R / decode_tps)   (returned; only meaningful with a GenRM)
    seq_decode_tps (not measurable from these keys) is kept, but clamped into [2 decode_tps / max_batch,
    decode_tps / 2] so that t0 and t1 stay positive.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/rollout" in r and "time/step" in r]
    if not rows:
        raise SystemExit(f"{path}: no rows with time/rollout and time/step; is it a yatt_ray metrics.jsonl?")

    def mean(key: str, default: float | None = None) -> float | None:
        values = [float(r[key]) for r in rows if key in r]
        return sum(values) / len(values) if values else default

    samples = mean("samples", float(base.prompts * base.samples_per_prompt))
    resp = max(mean("response_length", base.response_mean), 1.0)
    tps = mean("total_tokens_per_s", mean("tokens_per_s"))  # the name before it said what it counts
    tokens = tps * mean("time/step") if tps else samples * (base.prompt_len + resp)
    tokens = max(tokens, samples * resp)
    decode_tps = samples * resp / max(mean("time/rollout") * devices, 1e-9)
    updates = {
        "decode_tps": decode_tps,
        "seq_decode_tps": min(max(base.seq_decode_tps, 2 * decode_tps / base.max_batch), decode_tps / 2),
        "response_mean": resp,
        "prompt_len": max(round((tokens - samples * resp) / samples), 0),
        "logprob_s_per_token": mean("time/logprobs", 0.0) * devices / tokens,
        "train_s_per_token": mean("time/train", 0.0) * devices / tokens,
        "weight_sync_s": mean("time/weight_sync", base.weight_sync_s),
        "trainer_switch_s": mean("time/offload", base.trainer_switch_s),
    }
    costs = dataclasses.replace(base, **updates)
    reward = mean("time/reward")
    ratio = (reward * devices / samples) / costs.gen_cost_per_sample() if reward else None
    return costs, ratio


# ---------------------------------------------------------------------------------------------------- reporting

COLUMNS = (
    ("N", 5, "d"),
    ("ratio", 5, ".2f"),
    ("sigma", 5, ".2f"),
    ("full step", 9, ".1f"),
    ("full roll", 9, ".1f"),
    ("full idle", 9, ".1%"),
    ("part step", 9, ".1f"),
    ("part roll", 9, ".1f"),
    ("part idle", 9, ".1%"),
    ("k", 4, "d"),
    ("k/N", 5, ".1%"),
    ("roll cut", 8, "+.1f"),
    ("step cut", 8, "+.1f"),
    ("max cut", 7, "+.1f"),
    ("@k", 4, "d"),
    ("winner", 7, "s"),
)
FIXED_COLUMNS = (("k fix", 5, "d"), ("fix step", 8, ".1f"), ("fix roll", 8, ".1f"), ("fix cut", 7, "+.1f"))


def cell_row(c: Cell) -> list:
    """The table's values for one cell, in COLUMNS (+ FIXED_COLUMNS) order."""
    n = c.devices
    row = [
        n, c.ratio, c.sigma,
        c.full.step_s, c.full.rollout_s, c.full.idle_fraction,
        c.partial.step_s, c.partial.rollout_s, c.partial.idle_fraction, c.partial.k, c.partial.k / n,
        c.rollout_cut, c.step_cut, 100 * (1 - c.best_rollout.rollout_s / c.full.rollout_s), c.best_rollout.k,
        c.winner,
    ]  # fmt: skip
    if c.fixed is not None:
        row += [
            c.fixed.k,
            c.fixed.step_s,
            c.fixed.rollout_s,
            100 * (1 - c.fixed.rollout_s / c.full.rollout_s),
        ]
    return row


def format_table(cells: list[Cell]) -> str:
    """Aligned text table: times in seconds, idle as % of N x step, cuts in % (positive: partial is faster)."""
    cols = COLUMNS + (FIXED_COLUMNS if cells and cells[0].fixed is not None else ())
    lines = ["  ".join(f"{name:>{width}}" for name, width, _ in cols)]
    for c in cells:
        values = cell_row(c)
        lines.append("  ".join(f"{format(v, fmt):>{w}}" for v, (_, w, fmt) in zip(values, cols)))
    return "\n".join(lines)


def write_csv(cells: list[Cell], path: str) -> None:
    cols = COLUMNS + (FIXED_COLUMNS if cells and cells[0].fixed is not None else ())
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [name.replace(" ", "_").replace("/", "_per_").replace("@", "at_") for name, _, _ in cols]
        )
        for c in cells:
            writer.writerow([round(v, 6) if isinstance(v, float) else v for v in cell_row(c)])


def _where(cells: list[Cell], all_n: list[int]) -> str:
    """Plain-words region of a set of cells: per (sigma, ratio), the cluster sizes (or 'all N')."""
    if not cells:
        return "nowhere in this grid"
    groups: dict[tuple[float, float], list[int]] = {}
    for c in cells:
        groups.setdefault((c.sigma, c.ratio), []).append(c.devices)
    parts = []
    for (sigma, ratio), ns in sorted(groups.items()):
        where = "all N" if sorted(ns) == all_n else "N=" + ",".join(map(str, sorted(ns)))
        parts.append(f"sigma {sigma:g} / ratio {ratio:g} ({where})")
    return "; ".join(parts)


def verdict(cells: list[Cell]) -> str:
    """A short verdict computed from the cells: where the paper's band is reproduced, where each mode wins."""
    all_n = sorted({c.devices for c in cells})
    lo, hi = PAPER_BAND
    total = len(cells)
    band = [c for c in cells if lo <= c.rollout_cut <= hi]
    above = [c for c in cells if c.rollout_cut > hi]
    below = [c for c in cells if c.rollout_cut < lo]
    partial = [c for c in cells if c.winner == "partial"]
    full = [c for c in cells if c.winner == "full"]
    ties = [c for c in cells if c.winner == "tie"]

    def mean_cut(key: str, value: float) -> float:
        sel = [c.rollout_cut for c in cells if getattr(c, key) == value]
        return sum(sel) / len(sel)

    ratios = sorted({c.ratio for c in cells})
    sigmas = sorted({c.sigma for c in cells})
    lines = [
        f"Verdict ({total} grid points; rollout cut = partial at its step-optimal k vs full):",
        f"- Paper's {lo:g}-{hi:g}% rollout-time cut reproduced at {len(band)}/{total}: {_where(band, all_n)}.",
        f"- Cut above {hi:g}% at {len(above)}/{total}: {_where(above, all_n)}.",
        f"- Cut below {lo:g}% (or partial slower) at {len(below)}/{total}: {_where(below, all_n)}.",
        "- Mean rollout cut by GenRM cost ratio: "
        + ", ".join(f"{r:g}: {mean_cut('ratio', r):+.1f}%" for r in ratios)
        + "; by length spread sigma: "
        + ", ".join(f"{s:g}: {mean_cut('sigma', s):+.1f}%" for s in sigmas)
        + ".",
        f"- Partial wins the step (>0.5% faster) at {len(partial)}/{total}: {_where(partial, all_n)}.",
        f"- Full wins the step at {len(full)}/{total}: {_where(full, all_n)}.",
    ]
    if ties:
        lines.append(f"- Within 0.5% (tie) at {len(ties)}/{total}: {_where(ties, all_n)}.")
    return "\n".join(lines)


def describe(costs: Costs, scaling: str) -> str:
    t0, t1 = costs.decode_constants()
    return (
        f"cost model: decode {costs.decode_tps:g} tok/s/device at batch {costs.max_batch}, "
        f"{costs.seq_decode_tps:g} tok/s alone (t0={1e3 * t0:.2f} ms, t1={1e3 * t1:.3f} ms/seq); "
        f"responses mean {costs.response_mean:g} (max {costs.response_max}) + prompt {costs.prompt_len} tokens; "
        f"{costs.prompts} prompts x {costs.samples_per_prompt} per {costs.reference_devices} devices ({scaling} "
        f"scaling); GenRM cost = ratio x {costs.gen_cost_per_sample():.3f} device-s/sample, latency "
        f"{costs.genrm_latency_s:g} s, switch {costs.genrm_switch_s:g} s (x2, full only); trainer switch "
        f"{costs.trainer_switch_s:g} s; log-probs + train {1e6 * costs.logprob_s_per_token:g} + "
        f"{1e6 * costs.train_s_per_token:g} us/token/device; weight sync {costs.weight_sync_s:g} s"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=list(DEFAULT_DEVICES), help="cluster sizes N")
    p.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS), help="GenRM cost ratios")
    p.add_argument("--sigmas", type=float, nargs="+", default=list(DEFAULT_SIGMAS), help="length spreads")
    p.add_argument("--k", default=None, help="also report a fixed GenRM device count (16) or fraction (0.25)")
    p.add_argument("--scaling", choices=("weak", "strong"), default="weak")
    p.add_argument("--costs", default=None, help="JSON object of Costs fields")
    p.add_argument("--from-metrics", default=None, help="derive costs from a yatt_ray metrics.jsonl")
    p.add_argument("--measured-devices", type=int, default=1, help="devices of the run behind --from-metrics")
    p.add_argument("--csv", default=None, help="also write the table as CSV here")
    p.add_argument("--steps", type=int, default=3, help="simulated steps averaged per grid point")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str]) -> list[Cell]:
    args = parse_args(argv)
    costs = load_costs(args.costs)
    ratios = list(args.ratios)
    if args.from_metrics:
        costs, measured = costs_from_metrics(args.from_metrics, args.measured_devices, costs)
        if measured is not None and round(measured, 3) > 0:
            print(
                f"measured GenRM/reward cost ratio from {args.from_metrics}: {measured:.3g} (added to --ratios)"
            )
            ratios = sorted({*ratios, round(measured, 3)})
        elif measured is not None:
            print(
                f"measured reward cost ratio {measured:.2g}: a rule reward, not a GenRM; not added to --ratios"
            )
    print(describe(costs, args.scaling))
    start = time.perf_counter()
    cells = run_grid(costs, args.devices, ratios, args.sigmas, args.scaling, args.k, args.seed, args.steps)
    print(
        "\ntimes in s; idle = idle device-s / (N x step); cuts in % of full (positive: partial faster); "
        "max cut = best rollout cut over k, @k its k\n"
    )
    print(format_table(cells))
    if args.csv:
        write_csv(cells, args.csv)
        print(f"\nwrote {args.csv}")
    print()
    print(verdict(cells))
    print(
        f"\n({time.perf_counter() - start:.1f} s; mean of {args.steps} simulated steps per point, seed {args.seed})"
    )
    return cells


if __name__ == "__main__":
    main(sys.argv[1:])
