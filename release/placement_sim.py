"""Placement simulator: step time, rollout time and idle fraction of full coexistence, partial coexistence
(the seed system's) and disaggregated placement under GenRM workloads.

    python release/placement_sim.py                                  # defaults: N = 8, 64, 512, 1024
    python release/placement_sim.py --devices 8 16 32 --ratios 0.25 1 --sigmas 0.6
    python release/placement_sim.py --share-min 0.1 --share-max 0.5  # bounds on partial's judging share s
    python release/placement_sim.py --k 0.25                         # also report disaggregated at a fixed k
                                                                     # (a fraction of N, or a count: --k 16)
    python release/placement_sim.py --costs costs.json               # measured cost constants (Costs fields)
    python release/placement_sim.py --from-metrics runs/x/metrics.jsonl --measured-devices 8
    python release/placement_sim.py --scaling strong --csv out.csv --seed 1
    python release/placement_sim.py --async                          # asynchronous rollout: throughput vs eta
    python release/placement_sim.py --async --async-devices 64 256 --async-etas 0 1 2 --async-sigma 1.0

It tests the claim of the WeChat-YATT paper (arXiv 2508.07970) that partial coexistence cuts rollout time by
16.2-24.1% under GenRM workloads, and shows where each placement mode wins. No Ray, no accelerator: it is a
model. The last line sums it up: `placement_sim: partial_rollout_cut_min_pct=... partial_rollout_cut_max_pct=...
partial_points_cut_ge_16pct=a/b partial_rule_points_cut_ge_16pct=c/b partial_step_gain_max_pct=...
disaggregated_rollout_cut_max_pct=... disaggregated_step_gain_max_pct=...` (cuts and gains in % of full's time;
a/b: grid points where partial's rollout phase is at least 16% shorter than full's). With --async it models
asynchronous rollout instead (see the end of this docstring) and ends on its own line.

The three modes (as yatt_ray runs them; see DESIGN.md):
  full           all N devices host trainer + rollout engine + a GenRM replica; per step, in series:
                 generation on N -> switch (engine sleeps, GenRM wakes) -> judging on N -> switch back (GenRM
                 released) -> trainer onload -> log-probs + train on N -> weight sync.
  partial        the seed's partial coexistence. All N devices train. In the rollout phase every device holds its
                 rollout engine and a GenRM replica side by side and both work at once: while a device's engine
                 generates, a share s of the device judges and 1 - s generates; once its engine is done, the
                 whole device judges. Each finished sample goes to the judge at once. The replicas wake at the
                 start of the step (genrm_switch_s, overlapping generation: no judging before it) and are released
                 after the last score (genrm_switch_s, in series: the trainer needs the memory); then trainer
                 onload -> log-probs + train on N -> weight sync. s is chosen in every simulated step, within
                 [--share-min, --share-max] (default 0-0.9), two ways: "part" columns take the s with the
                 shortest rollout phase (an oracle: the best any share held for the phase can do), "rule"
                 columns the load-balance rule s = J / (G + J), G the step's generation work (sum of E_d below)
                 and J its judging work (M c), both in device-seconds, as a balancer measures them.
  disaggregated  k devices hold GenRM replicas only and never train, N - k hold trainer + rollout. Each finished
                 sample goes to the judge at once (a queue served by k replicas), so judging overlaps generation;
                 after the last sample the judge queue drains; then trainer onload -> log-probs + train on N - k
                 -> weight sync. The GenRM devices wait through training. No GenRM switches. k is searched for the
                 best step time. (This simulator called it "partial" before; the numbers are the same.)

Model (all times in seconds, one "device" = one accelerator):
  Lengths   each response length is lognormal with mean `response_mean` and spread sigma (the log-std),
            L = clip(round(exp(ln(mean) - sigma^2/2 + sigma z)), 1, response_max), z ~ N(0, 1). The same z are
            used for every sigma, mode, k and s (common random numbers), so comparisons are not noise.
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
            a_1 <= ... <= a_M are the finish times of the M samples, E_d the time device d's last one finishes.
  GenRM     judging costs c = ratio * (response_mean / decode_tps) device-seconds per sample at batch: ratio is
            the judge's cost as a fraction of the mean generation cost of a sample. A sample's score is never
            ready sooner than `genrm_latency_s` after it reaches the judge (one judge pass at small batch).
            The judges of partial and disaggregated are one fluid server: with A(t) the device-seconds of
            judging offered by time t, the last score is in at
                max( A^-1( max_j (A(a_j) + (M - j + 1) c) ),  a_M + genrm_latency_s ).
            full:          T_judge = max(M c / N, genrm_latency_s)          (M samples spread over N devices)
            partial:       generation on N at 1 - s of each device: a_j and E_d of the unshared generation
                           on N stretch to a_j / (1 - s) and E_d / (1 - s); device d offers the judge 0 before
                           w = genrm_switch_s, then s until its engine ends, then 1:
                               A(t) = sum_d [ s * |[w, min(t, e_d)]| + |[e_d, t]| ],  e_d = max(E_d / (1 - s), w)
                           (|[x, y]| = max(y - x, 0)); with the stretched a_j in the formula above.
            disaggregated: k replicas, A(t) = k t:  max( max_j (a_j + (M - j + 1) c / k),  a_M + genrm_latency_s )
                           with a_j from generation on N - k.
  Training  log-probs and train scale as tokens * (s per token) / D over the D training devices; tokens are
            prompt + response tokens of the step. trainer_switch_s (optimizer/weights offload + onload) and
            weight_sync_s (colocated, in memory) are paid in every mode; genrm_switch_s twice in full (both in
            series), twice in partial (the wake overlapping generation, the release in series), never in
            disaggregated.
  Steps     full:          rollout = T_gen(N) + genrm_switch + T_judge
                           step    = rollout + genrm_switch + trainer_switch + T_logprobs(N) + T_train(N)
                                     + weight_sync
            partial:       rollout = last score in (never before T_gen(N) / (1 - s))
                           step    = rollout + genrm_switch + trainer_switch + T_logprobs(N) + T_train(N)
                                     + weight_sync
            disaggregated: rollout = max(T_gen(N - k), last score in)
                           step    = rollout + trainer_switch + T_logprobs(N - k) + T_train(N - k) + weight_sync
            "rollout" is the rollout phase: from the start of the step until the last score is in.
  Idle      busy = a device is executing something (decoding, even a half-empty batch; judging, counted as its
            work content c per sample; log-probs, training, switches, weight sync); idle = waiting for other
            devices: a rollout device that finished before the slowest one, a full-mode device waiting out the
            judge latency floor, a disaggregated rollout device waiting for the judge queue to drain, a GenRM
            device with an empty queue and through the whole training phase, a partial device's judging share
            while the queue is empty. Partial's judging work M c is shared among the devices in proportion to
            the judging capacity each offered after the wake; the capacity a device offers during the wake
            counts as busy (loading the replica).
            idle fraction = idle device-seconds / (N * step time).
  Scaling   `weak` (default): the workload (prompts x samples_per_prompt) is given for `reference_devices`
            and grows in proportion to N, so each device carries the same share at every N. `strong`: fixed.
  Search    disaggregated: k runs over every value below 64 devices, else over a log + linear grid that is
            then refined around the best step time (and the best rollout time, for the "max cut" column).
            partial: 21 evenly spaced s in the bounds, then 4 rounds of 9 between the best one's neighbours
            (step = rollout + terms that do not depend on s, so the s of the best rollout is the best step's).
  Noise     a grid point is the mean of --steps simulated steps (default 3), each with its own lengths (and
            partial with its own s; disaggregated's k is one for the point, the best for the mean), so one
            lucky grouping of the tail on the devices does not decide a winner.

Departures from the real system, on purpose: one device per GenRM replica and per rollout engine (no tensor
parallelism); response lengths independent within a prompt's group; decode cost independent of context length;
prefill not interleaved; no network time to ship a sample to the judge; the judge pool is a fluid server, so
it runs at full batch efficiency even when samples trickle in (optimistic for partial and disaggregated,
bounded by the latency floor). Partial: a device is time-shared, so an engine and a judge side by side run
no faster together than in turn (pessimistic where a half-empty decode batch leaves the device underused);
the share s is held for the whole rollout phase, so while an engine runs, its judging share is not lent back
to it when the judge queue is empty (pessimistic); the engine keeps the batch size it has alone, though the
replica's weights and KV cache beside it take memory (optimistic); the wake takes no generation time
(optimistic); s is chosen from the step's own loads (a balancer has only the previous steps'). The library
moves the share by the replicas' number (Serve autoscaling); the model's one s on every device is the fluid
form of that. The default constants are assumptions (see Costs); measure yours and pass them with --costs or
--from-metrics.

Asynchronous rollout (--async): training throughput against the staleness bound eta (`rollout.max_staleness`) for
N = 64, 256, 1,024 (--async-devices) and eta = 0, 1, 2, 4, 8 (--async-etas), set against AReaL (arXiv 2505.24298:
2.09x at eta = 1 and 2.77x at eta = 2 over synchronous, saturating beyond). No GenRM (a rule reward, no reward
time). Lengths from the model above with sigma = --async-sigma (default 0.6), step s's from the stream (seed, s)
as in the grid, the same for every mode, split and eta at one N (common random numbers); weak scaling as above.
The last line: `placement_sim_async: ratio_eta1=... ratio_eta2=... ratio_eta4=... saturates_at_eta=...
areal_eta1=2.09 areal_eta2=2.77`, ratios at the largest N over the better synchronous mode.
  Training  T_train(D) = tokens (logprob_s_per_token + train_s_per_token) / D on D trainer devices, tokens = the
            step's prompt + response tokens (the Costs figures above: 2 x 2 x 7e9 and 6 x 7e9 FLOPs a token at 35%
            of an H100's bf16 peak). push = weight_sync_s, also for a push from trainers to separate engines.
  Sync      colocated on N:    T_s - T_{s-1} = T_gen(N) + trainer_switch + T_train(N) + weight_sync
            disaggregated:     T_s - T_{s-1} = push + T_gen(G) + T_train(N - G)   (G engines, N - G trainers; no
                               offload; batch s >= 1 waits for the weights trained on s - 1)
            T_gen(D) as above: with all of a device's samples in one batch, t0 max(L) + t1 sum(L) + prefill.
  Async     G engines generate without stopping, N - G train. Batch s (its prompts) is released when the trainer
            has trained batch s - eta - 1 (at t = 0 for s <= eta): at most eta + 1 batches are started and not yet
            trained, and a sample is trained at most eta versions after the weights it started under. Engine d
            holds one FCFS queue over the batches in order (sample j of a batch goes to engine j mod G) and fills
            a slot of its max_batch from it whenever one frees, with the next batch's samples once the current
            batch's are all admitted: with eta > 0 the tail of batch s decodes in a batch kept full by batch s + 1
            (continuous batching across steps), beyond merely overlapping generation with training. Interruptible
            generation (weights taken between decode steps): an engine never waits for a weight sync; taking up
            a batch s > eta it pauses push (the push that released it) + the prefill of its share of the batch.
            The trainer trains batch s once its last sample is done (C_s) and the previous push is out:
                T_s = max(C_s, T_{s-1} + push) + T_train(N - G)
            The engines exactly, in decode iterations (cost t0 + t1 b as above): between two admissions e_a < e
            every slot is busy (an admission happens when the first slot frees), so the wall time is
                W(e) = W(e_a) + (t0 + t1 max_batch) (e - e_a);
            an engine whose next sample's batch is not yet released (gate g) decodes what it holds,
                W(c + x) = W(c) + t0 x + t1 sum_j min(d_j, x)   (d_j: the remaining lengths),
            up to the first iteration with W >= g, or idles until g once all have ended. A sample ending at
            iteration e is done at W(e), before the pauses charged at e. At eta = 0 this is the synchronous
            disaggregated model, step for step (tested, as is the whole against a plain wall-clock loop).
  Rate      trained response tokens per second in steady state: mean_{h <= s < S} sum(L_s) / P, P the least-
            squares slope of T_s over s = h..S-1, h = S / 2 (S = --async-steps, default 20; the first half fills
            the pipeline; eta + 1 more batches are simulated past S so that the engines stay loaded to the end).
  Split     G by pattern search at each eta (from the previous eta's G, steps N / 4 halved down to N / 64);
            synchronous disaggregated likewise at eta = 0.
  Ratios    "x sync" (the summary line's): over the better of synchronous colocated and synchronous
            disaggregated at its best split; "x coloc" and "x dis0" over each. saturates_at_eta: the least eta
            within 2% of the best ratio over the etas (the largest eta: not saturated within those tried).

What the asynchronous model leaves out, and why its curve's shape may differ from AReaL's:
  - The trainer here trains a fixed batch of prompts and waits for its last sample. Kept in a full batch by
    the next steps' samples, that straggler decodes at t0 + t1 max_batch a token (6.4 times slower than alone
    with the defaults: 524 s for an 8,192-token response against about 80 s at the end of a synchronous step),
    so a batch takes several steps' time from release to last sample, and the rate keeps rising with eta until
    eta + 1 steps span it: well past eta = 2 at sigma 0.6. AReaL's trainer takes the first batch-size finished
    trajectories, whatever their prompts, so no straggler holds a step and the bound only limits version lag:
    hence its saturation at eta = 2. (A longer tail, larger sigma or response_max, moves the model's further out.)
  - AReaL's 2.77x is its whole system against other synchronous systems on the same GPUs: besides asynchrony,
    interruptible rollout workers, dynamic batching of variable-length training data, a parallel reward service,
    and its models (1.5B-32B) and reasoning responses (up to tens of thousands of tokens). Here only the
    schedule changes; costs, batching and reward are the same in every mode.
  - Interrupted sequences keep their KV cache (AReaL recomputes it under the new weights): no re-prefill; the
    push pause is charged when an engine takes up a batch, not when the push lands (one pause a step either way).
  - Throughput only: no staleness-aware objective, and the same progress per step at every eta. One split for
    the whole run (AReaL rebalances); no KV-cache limit beyond max_batch slots; no network time but the push.
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
from typing import NamedTuple

import numpy as np

DEFAULT_DEVICES = (8, 64, 512, 1024)
DEFAULT_RATIOS = (0.1, 0.25, 0.5, 1.0)
DEFAULT_SIGMAS = (0.3, 0.6, 1.0)
PAPER_BAND = (
    16.2,
    24.1,
)  # % rollout-time reduction the seed reports for partial coexistence under GenRM workloads
PAPER_CUT = 16.0  # the summary line counts the grid points whose partial rollout cut reaches this %
DEFAULT_SHARE_BOUNDS = (0.0, 0.9)  # partial: the judging share s of a device while its engine runs


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
    k: int  # GenRM-only devices (disaggregated; 0 in full and partial: every device hosts a replica)
    step_s: float
    rollout_s: float
    busy: np.ndarray
    idle: np.ndarray
    share: float = 0.0  # partial: the judging share s of each device while its engine runs

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


@dataclass(frozen=True)
class Capacity:
    """A(t), the judging device-seconds offered by time t: piecewise linear through (knots, cum), nondecreasing,
    rising at `tail_rate` after the last knot."""

    knots: np.ndarray
    cum: np.ndarray
    tail_rate: float

    def at(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        tail = self.cum[-1] + self.tail_rate * (t - self.knots[-1])
        return np.where(t > self.knots[-1], tail, np.interp(t, self.knots, self.cum))

    def inverse(self, y: float) -> float:
        """The first time at which A(t) = y > 0."""
        if y > self.cum[-1]:
            return float(self.knots[-1] + (y - self.cum[-1]) / self.tail_rate)
        i = int(np.searchsorted(self.cum, y, side="left"))  # cum[i - 1] < y <= cum[i]: a rising segment
        slope = (self.cum[i] - self.cum[i - 1]) / (self.knots[i] - self.knots[i - 1])
        return float(self.knots[i - 1] + (y - self.cum[i - 1]) / slope)


def shared_capacity(ends: np.ndarray, share: float, wake: float) -> Capacity:
    """Partial coexistence: A(t) = sum_d [ s |[w, min(t, e_d)]| + |[e_d, t]| ], e_d = max(ends_d, w).

    ends: when each device's engine is done (already stretched by 1 / (1 - s)). Between consecutive e's the
    rate is s x (engines still running) + (engines done); nothing before the wake w."""
    e = np.sort(np.maximum(np.asarray(ends, dtype=float), wake))
    n = e.size
    knots = np.concatenate([[0.0, wake], e])
    done = np.arange(n + 1)  # engines done on [w, e_1), [e_1, e_2), ...
    rates = np.concatenate([[0.0], share * (n - done[:-1]) + done[:-1]])
    cum = np.concatenate([[0.0], np.cumsum(rates * np.diff(knots))])
    return Capacity(knots, cum, float(n))


def queue_end(arrivals: np.ndarray, judge_cost: float, capacity: Capacity, latency: float) -> float:
    """When the last score is in: a fluid queue of work c per sample served by capacity A(t), plus a latency floor.

    arrivals: sorted a_1..a_M. Last departure = A^-1( max_j (A(a_j) + (M - j + 1) c) ), at least a_M + latency.
    """
    m = arrivals.size
    if m == 0:
        return 0.0
    floor = float(arrivals[-1] + latency)
    if judge_cost <= 0:
        return floor
    need = (capacity.at(arrivals) + np.arange(m, 0, -1) * judge_cost).max()
    return max(capacity.inverse(float(need)), floor)


def judge_queue_end(arrivals: np.ndarray, judge_cost: float, k: int, latency: float) -> float:
    """When the last score is in: k replicas as one fluid server of rate k / judge_cost, plus a latency floor.

    arrivals: sorted finish times a_1..a_M. Last departure = max_j (a_j + (M - j + 1) * judge_cost / k).
    """
    m = arrivals.size
    if m == 0:
        return 0.0
    remaining = np.arange(m, 0, -1) * (judge_cost / k)
    return float(max((arrivals + remaining).max(), arrivals[-1] + latency))


def simulate_partial(gen: Generation, share: float, judge_cost: float, costs: Costs) -> ModeResult:
    """Partial coexistence (the seed's): gen ran unshared on all N devices; engines at 1 - share, judges beside them
    (see the module docstring)."""
    n, m, wake = gen.devices, gen.finish.size, costs.genrm_switch_s
    ends = gen.device_end / (1.0 - share)
    capacity = shared_capacity(ends, share, wake)
    rollout = queue_end(gen.finish / (1.0 - share), judge_cost, capacity, costs.genrm_latency_s)
    train = _train_phase(gen.tokens, n, costs)
    step = rollout + wake + train
    busy = gen.device_end + _partial_judge_busy(ends, share, wake, rollout, m * judge_cost) + wake + train
    idle = step - busy
    idle[np.abs(idle) < 1e-9 * step] = 0.0  # rounding: a device busy to the end of the step
    return ModeResult("partial", 0, step, rollout, busy, idle, share)


def _partial_judge_busy(
    ends: np.ndarray, share: float, wake: float, rollout: float, work: float
) -> np.ndarray:
    """Each device's wake (the capacity it offers the judge before w, cut at the end of the rollout phase) plus
    its part of the judging work, in proportion to the capacity it offers after the wake."""
    w = min(wake, rollout)
    waking = share * np.minimum(ends, w) + np.maximum(w - ends, 0.0)
    e = np.maximum(ends, wake)
    offered = share * np.maximum(np.minimum(rollout, e) - wake, 0.0) + np.maximum(rollout - e, 0.0)
    total = offered.sum()
    return waking + (work * offered / total if total > 0 else 0.0)


def simulate_disaggregated(gen: Generation, k: int, judge_cost: float, costs: Costs) -> ModeResult:
    """Disaggregated: gen ran on N - k devices, k devices judge only (see the module docstring)."""
    m = gen.finish.size
    scored = judge_queue_end(gen.finish, judge_cost, k, costs.genrm_latency_s)
    rollout = max(gen.time, scored)
    train = _train_phase(gen.tokens, gen.devices, costs)
    step = rollout + train
    judge_work = m * judge_cost / k
    busy = np.concatenate([gen.device_end + train, np.full(k, judge_work)])
    idle = np.concatenate([rollout - gen.device_end, np.full(k, (rollout - judge_work) + train)])
    return ModeResult("disaggregated", k, step, rollout, busy, idle)


def balanced_share(gen_work: float, judge_work: float, bounds: tuple[float, float]) -> float:
    """The load-balance rule: judging's part of the rollout phase's work, J / (G + J), clamped into bounds."""
    total = gen_work + judge_work
    share = judge_work / total if total > 0 else 0.0
    return min(max(share, bounds[0]), bounds[1])


def search_share(
    evaluate: Callable[[float], ModeResult], bounds: tuple[float, float], rounds: int = 4
) -> ModeResult:
    """Partial at the share with the shortest rollout phase: 21 evenly spaced shares in bounds, then `rounds`
    rounds of nine evenly spaced shares between the best one's neighbours."""
    tried = {float(s): evaluate(float(s)) for s in np.linspace(bounds[0], bounds[1], 21)}
    for _ in range(rounds):
        shares = sorted(tried)
        best = shares.index(min(shares, key=lambda s: (tried[s].rollout_s, s)))
        lo, hi = shares[max(best - 1, 0)], shares[min(best + 1, len(shares) - 1)]
        tried.update({float(s): evaluate(float(s)) for s in np.linspace(lo, hi, 9) if float(s) not in tried})
    return min(tried.values(), key=lambda r: (r.rollout_s, r.share))


def k_candidates(n: int, dense_up_to: int = 64, coarse: int = 48) -> list[int]:
    """GenRM device counts to try first: every k below `dense_up_to` devices, else a log + linear grid."""
    if n <= dense_up_to:
        return list(range(1, n))
    grid = np.concatenate([np.geomspace(1, n - 1, coarse // 2), np.linspace(1, 0.75 * n, coarse // 2)])
    return sorted({int(min(max(round(x), 1), n - 1)) for x in grid})


def search_k(n: int, evaluate: Callable[[int], ModeResult]) -> dict[int, ModeResult]:
    """Evaluate disaggregated placement over k: a coarse grid, then, around the best step time and around the
    best rollout time, nine evenly spaced k between the best's neighbours, until the neighbours are adjacent.
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
    """One grid point: full coexistence; partial at its best share and at the load-balance share;
    disaggregated at its best k, at the k of its shortest rollout, and at a fixed k when asked."""

    devices: int
    ratio: float
    sigma: float
    full: ModeResult
    partial: ModeResult  # the share with the shortest rollout phase, chosen per simulated step
    partial_rule: ModeResult  # the load-balance share J / (G + J) of each simulated step
    disaggregated: ModeResult  # the step-optimal k
    best_rollout: ModeResult  # disaggregated at the k with the shortest rollout phase
    fixed: ModeResult | None  # disaggregated at --k

    def cut(self, result: ModeResult, phase: str = "rollout") -> float:
        """% of full's rollout (or step) time that `result` saves (positive: faster than full)."""
        attr = f"{phase}_s"
        return 100 * (1 - getattr(result, attr) / getattr(self.full, attr))

    @property
    def partial_rollout_cut(self) -> float:
        return self.cut(self.partial)

    @property
    def disaggregated_rollout_cut(self) -> float:
        return self.cut(self.disaggregated)

    @property
    def winner(self) -> str:
        """The mode with the shortest step, joined by '=' with any other within 0.5% of it."""
        modes = {"full": self.full, "part": self.partial, "disagg": self.disaggregated}
        best = min(r.step_s for r in modes.values())
        return "=".join(name for name, r in modes.items() if r.step_s <= best * 1.005)


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
        share=float(np.mean([r.share for r in results])),
    )


def partial_results(
    gens: list[Generation], judge_cost: float, costs: Costs, bounds: tuple[float, float]
) -> tuple[ModeResult, ModeResult]:
    """Partial over the simulated steps: (at each step's best share, at each step's load-balance share)."""
    best, rule = [], []
    for g in gens:
        best.append(search_share(lambda s, g=g: simulate_partial(g, s, judge_cost, costs), bounds))
        share = balanced_share(float(g.device_end.sum()), g.finish.size * judge_cost, bounds)
        rule.append(simulate_partial(g, share, judge_cost, costs))
    return mean_result(best), mean_result(rule)


def run_grid(
    costs: Costs,
    devices: list[int],
    ratios: list[float],
    sigmas: list[float],
    scaling: str = "weak",
    k_spec: str | None = None,
    seed: int = 0,
    steps: int = 3,
    share_bounds: tuple[float, float] = DEFAULT_SHARE_BOUNDS,
) -> list[Cell]:
    """Simulate every (N, ratio, sigma), each the mean of `steps` steps with their own response lengths.

    Step s draws its standard normals from the stream (seed, s), so strong scaling sees the same samples at
    every N, and weak scaling's smaller workloads are prefixes of the larger ones. Generation on D devices
    depends only on (N, sigma, D): it is cached across GenRM ratios, k and modes.
    """
    check_share_bounds(share_bounds)
    cells = []
    for n in devices:
        if n < 2:
            raise ValueError(f"cluster size {n}: disaggregated placement needs at least 2 devices")
        m = costs.samples(n, scaling)
        zs = [np.random.default_rng([seed, s]).standard_normal(m) for s in range(steps)]
        for sigma in sigmas:
            draws = [response_lengths(z, costs, sigma) for z in zs]
            cache: dict[int, list[Generation]] = {}

            def gens(d: int, draws=draws, cache=cache) -> list[Generation]:
                if d not in cache:
                    cache[d] = [simulate_generation(lengths, d, costs) for lengths in draws]
                return cache[d]

            def disaggregated(k: int, c: float, gens=gens, n=n) -> ModeResult:
                return mean_result([simulate_disaggregated(g, k, c, costs) for g in gens(n - k)])

            for ratio in ratios:
                judge_cost = ratio * costs.gen_cost_per_sample()
                full = mean_result([simulate_full(g, judge_cost, costs) for g in gens(n)])
                partial, rule = partial_results(gens(n), judge_cost, costs, share_bounds)
                tried = search_k(n, lambda k, c=judge_cost: disaggregated(k, c))
                k_fixed = resolve_k(k_spec, n)
                fixed = disaggregated(k_fixed, judge_cost) if k_fixed else None
                best = min(tried.values(), key=lambda r: (r.step_s, r.k))
                best_rollout = min(tried.values(), key=lambda r: (r.rollout_s, r.k))
                cells.append(Cell(n, ratio, sigma, full, partial, rule, best, best_rollout, fixed))
    return cells


def check_share_bounds(bounds: tuple[float, float]) -> None:
    lo, hi = bounds
    if not 0.0 <= lo <= hi < 1.0:
        raise ValueError(f"share bounds {lo:g}..{hi:g}: need 0 <= --share-min <= --share-max < 1")


# ---------------------------------------------------------------------------------------------------- asynchronous


DEFAULT_ASYNC_ETAS = (0, 1, 2, 4, 8)
DEFAULT_ASYNC_DEVICES = (64, 256, 1024)
DEFAULT_ASYNC_SIGMA = 0.6
AREAL = {1: 2.09, 2: 2.77}  # AReaL (arXiv 2505.24298): throughput over synchronous at max staleness eta
SATURATION = 0.98  # saturates_at_eta: the least eta reaching this fraction of the best ratio over the etas


def step_lengths(costs: Costs, n: int, sigma: float, scaling: str, seed: int, steps: int) -> list[np.ndarray]:
    """Response lengths of `steps` training steps at N = n, step s from the stream (seed, s) as in run_grid."""
    m = costs.samples(n, scaling)
    rngs = [np.random.default_rng([seed, s]) for s in range(steps)]
    return [response_lengths(rng.standard_normal(m), costs, sigma) for rng in rngs]


def train_seconds(lengths: np.ndarray, devices: int, costs: Costs) -> float:
    """Log-probs + train of one step on `devices` trainer devices, no offload: tokens (logprob + train s/token) / D,
    tokens = sum(L) + M prompt_len."""
    tokens = float(lengths.sum()) + lengths.size * costs.prompt_len
    return tokens * (costs.logprob_s_per_token + costs.train_s_per_token) / devices


class Timeline(NamedTuple):
    """When each step's batch is generated (C_s: its last sample done) and trained (T_s: the trainer done)."""

    generated: np.ndarray
    trained: np.ndarray


def _in_series(gen: list[float], train: list[float], pause: float) -> Timeline:
    """Generation then training, in series: T_s = T_{s-1} + pause (s >= 1) + gen_s + train_s, C_s = T_s - train_s."""
    steps = np.asarray(gen) + np.asarray(train)
    steps[1:] += pause
    trained = np.cumsum(steps)
    return Timeline(trained - np.asarray(train), trained)


def sync_colocated(draws: list[np.ndarray], n: int, costs: Costs) -> Timeline:
    """Synchronous, colocated on N: T_s - T_{s-1} = T_gen(N) + trainer_switch + T_train(N) + weight_sync."""
    gen = [simulate_generation(lengths, n, costs).time for lengths in draws]
    tokens = [float(lengths.sum()) + lengths.size * costs.prompt_len for lengths in draws]
    return _in_series(gen, [_train_phase(x, n, costs) for x in tokens], 0.0)


def sync_disaggregated(draws: list[np.ndarray], generators: int, n: int, costs: Costs) -> Timeline:
    """Synchronous, G = `generators` engines and N - G trainers: T_s - T_{s-1} = push + T_gen(G) + T_train(N - G),
    push = weight_sync_s (batch s >= 1 waits for the weights trained on batch s - 1)."""
    gen = [simulate_generation(lengths, generators, costs).time for lengths in draws]
    train = [train_seconds(lengths, n - generators, costs) for lengths in draws]
    return _in_series(gen, train, costs.weight_sync_s)


def _deal(draws: list[np.ndarray], generators: int) -> tuple[np.ndarray, np.ndarray]:
    """Round robin: queue[s, d, i] = length of sample i G + d of step s (0 = padding); counts[s, d] real samples."""
    m = max(-(-lengths.size // generators) for lengths in draws)
    queue = np.zeros((len(draws), generators, m))
    counts = np.zeros((len(draws), generators))
    for s, lengths in enumerate(draws):
        padded = np.zeros(m * generators)
        padded[: lengths.size] = lengths
        queue[s] = padded.reshape(m, generators).T
        counts[s] = (queue[s] > 0).sum(axis=1)  # every real response has at least 1 token
    return queue, counts


class _Engines:
    """Working state of G generator devices in iteration space (private to simulate_async, which is pure).

    Per device: `free` the end iteration of each of the B slots' last sequence, `owner` its step (-1 once its
    finish time is recorded, or for padding), `e` the iteration of the last admission, `w` the wall time there
    after the pauses charged at it, `w_pre` before them (when the sequences ending at e finish), `done[d, s]` the
    latest recorded finish of step s."""

    def __init__(self, generators: int, steps: int, costs: Costs) -> None:
        b = costs.max_batch
        self.t0, self.t1 = costs.decode_constants()
        self.full = self.t0 + self.t1 * b  # one iteration of a full batch
        self.free = np.zeros((generators, b))
        self.owner = np.full((generators, b), -1)
        self.e, self.w, self.w_pre = np.zeros(generators), np.zeros(generators), np.zeros(generators)
        self.done = np.full((generators, steps + 1), -np.inf)  # column -1: where owner -1 writes (discarded)
        self.rows = np.arange(generators)

    def _candidate(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(slot, c, W(c), W_pre(c)): the slot that frees first, the next admission iteration c = max(its end, e)
        and the wall time there. Before c every slot is busy (c is the earliest end), so the batch is full:
        W(c) = w + (t0 + t1 B)(c - e)."""
        slot = self.free.argmin(axis=1)
        c = np.maximum(self.free[self.rows, slot], self.e)
        w_c = self.w + self.full * (c - self.e)
        return slot, c, w_c, np.where(c > self.e, w_c, self.w_pre)

    def _admit(self, slot, c, w_c, w_pre, lengths: np.ndarray, owners: np.ndarray) -> None:
        """Record the slot's previous occupant (it ended at c: finish W_pre(c)) and start `lengths` there at c;
        owners: their step, -1 for padding."""
        rows, old = self.rows, self.owner[self.rows, slot]
        self.done[rows, old] = np.maximum(self.done[rows, old], w_pre)
        self.free[rows, slot] = c + lengths
        self.owner[rows, slot] = owners
        self.e, self.w, self.w_pre = c, w_c, w_pre

    def admit(self, lengths: np.ndarray, owners: np.ndarray) -> None:
        """The next queued sequence of every device (not the first of its batch: its gate is open)."""
        self._admit(*self._candidate(), lengths, owners)

    def take_up(self, lengths: np.ndarray, owners: np.ndarray, pause: np.ndarray, gate: float) -> None:
        """The first sequence of a batch, released at wall time `gate`: a device whose slot frees before then
        decodes what it holds until then (_drain) or idles; then it pauses `pause` (push + prefill) and admits."""
        slot, c, w_c, w_pre = self._candidate()
        waits = w_c < gate
        if waits.any():
            c[waits], w_c[waits], w_pre[waits] = self._drain(waits, c[waits], w_c[waits], w_pre[waits], gate)
            slot = self.free.argmin(axis=1)  # still free at the new c
        self._admit(slot, c, w_c + pause, w_pre, lengths, owners)

    def _knots(self, free: np.ndarray, c: np.ndarray, w_c: np.ndarray) -> tuple[np.ndarray, ...]:
        """Decoding from iteration c with no admission: W(c + x) = W(c) + t0 x + t1 sum_j min(d_j, x), d_j =
        max(end_j - c, 0). Returns (order, d sorted, W at each d) per device."""
        order = np.argsort(free, axis=1)
        d = np.maximum(np.take_along_axis(free, order, axis=1) - c[:, None], 0.0)
        b = d.shape[1]
        tokens = np.cumsum(d, axis=1) - d + (b - np.arange(b)) * d  # sum_j min(d_j, d_k)
        return order, d, w_c[:, None] + self.t0 * d + self.t1 * tokens

    def _drain(self, rows: np.ndarray, c, w_c, w_pre, gate: float) -> tuple[np.ndarray, ...]:
        """Devices `rows` decode their active sequences from c until the first iteration e* with W(e*) >= gate
        (between knots d_{k-1} < x <= d_k the batch holds B - k sequences: slope t0 + t1 (B - k)); if all end
        before, e* = the last end and W(e*) = gate (idle). Records the finishes up to e*. Returns (e*, W, W_pre)."""
        order, d, w = self._knots(self.free[rows], c, w_c)
        b = d.shape[1]
        reach = w >= gate
        hit, k = reach.any(axis=1), np.clip(reach.argmax(axis=1), min(1, b - 1), b - 1)  # W(d_0) < gate
        i = np.arange(k.size)
        x0, w0 = d[i, k - 1], w[i, k - 1]
        x = np.minimum(np.ceil(x0 + (gate - w0) / (self.t0 + self.t1 * (b - k)) - 1e-9), d[i, k])
        w_x = w0 + (self.t0 + self.t1 * (b - k)) * (x - x0)
        e_star = c + np.where(hit, x, d[:, -1])
        owners = np.take_along_axis(self.owner[rows], order, axis=1)
        ended = (owners >= 0) & (d <= e_star[:, None] - c[:, None])
        finish = np.where(d > 0, w, w_pre[:, None])  # d = 0: ended at c, before the pauses charged there
        r = np.nonzero(rows)[0][:, None].repeat(b, axis=1)
        np.maximum.at(self.done, (r[ended], owners[ended]), finish[ended])
        back = np.argsort(order, axis=1)  # sorted position of each slot
        self.owner[rows] = np.take_along_axis(np.where(ended, -1, owners), back, axis=1)
        return e_star, np.where(hit, w_x, gate), np.where(hit, w_x, w[:, -1])

    def finish(self, step: int) -> float:
        """C_step: the latest finish of `step`'s samples on any device; those still decoding finish as if no more
        sequence were admitted (exact when called before the next batch's gate: see the module docstring)."""
        order, d, w = self._knots(self.free, self.e, self.w)
        owners = np.take_along_axis(self.owner, order, axis=1)
        live = np.where(d > 0, w, self.w_pre[:, None])
        pending = np.where(owners == step, live, -np.inf).max(initial=-np.inf)
        return float(max(self.done[:, step].max(), pending))


def simulate_async(draws: list[np.ndarray], generators: int, n: int, eta: int, costs: Costs) -> Timeline:
    """Asynchronous rollout with staleness bound eta on G = `generators` engines and N - G trainers (see the
    module docstring for the model)."""
    steps = len(draws)
    queue, counts = _deal(draws, generators)
    owners = np.where(queue > 0, np.arange(steps)[:, None, None], -1)
    pause = counts * costs.prompt_len / costs.prefill_tps
    pause[eta + 1 :] += costs.weight_sync_s  # batches after the first eta + 1 start on pushed weights
    train = [train_seconds(lengths, n - generators, costs) for lengths in draws]
    engines = _Engines(generators, steps, costs)
    done, ends, trainer_free = np.full(steps, np.nan), np.full(steps, np.nan), 0.0

    def close(s: int) -> None:  # T_s = max(C_s, T_{s-1} + push) + T_train(N - G)
        nonlocal trainer_free
        done[s] = engines.finish(s)
        ends[s] = max(done[s], trainer_free) + train[s]
        trainer_free = ends[s] + costs.weight_sync_s

    for s in range(steps):
        if s > eta:
            close(s - eta - 1)
        engines.take_up(
            queue[s, :, 0], owners[s, :, 0], pause[s], float(ends[s - eta - 1]) if s > eta else 0.0
        )
        for i in range(1, queue.shape[2]):
            engines.admit(queue[s, :, i], owners[s, :, i])
    for s in range(max(steps - eta - 1, 0), steps):
        close(s)
    return Timeline(done, ends)


def steady_period(timeline: Timeline, steps: int) -> float:
    """Seconds per step in steady state: the least-squares slope of T_s against s over the measured steps
    h..S-1 (h = S // 2: the first half fills the pipeline; S = `steps`). The timeline runs eta + 1 batches past
    S (simulated, not measured) so that the engines stay as loaded to the end of the window as in a long run
    (without them the last batches would finish in a draining batch, faster). A slope, not an end difference:
    the trainer waits on each batch's straggler, which moves a single T_s by much."""
    s = np.arange(steps // 2, steps)
    return float(np.polyfit(s, timeline.trained[s], 1)[0])


def steady_throughput(timeline: Timeline, draws: list[np.ndarray], steps: int | None = None) -> float:
    """Trained response tokens per second in steady state: R = mean_{h <= s < S} sum(L_s) / steady_period,
    S = `steps` (default: all of draws)."""
    steps = len(draws) if steps is None else steps
    tokens = np.mean([lengths.sum() for lengths in draws[steps // 2 : steps]])
    return float(tokens / steady_period(timeline, steps))


def search_split(n: int, evaluate: Callable[[int], float], start: int | None = None) -> tuple[int, float]:
    """The generator count G in 1..N-1 with the highest throughput, by pattern search: from G = `start` (default
    N / 2) with step N / 4, try G - step and G + step and move to the best of the three; halve the step when G
    stays best; stop once the step is below max(N / 64, 1). (Throughput is close to unimodal in G: the smaller
    of a generator rate rising and a trainer rate falling with G.) Returns (G, throughput)."""
    tried: dict[int, float] = {}

    def ev(g: int) -> int:
        g = min(max(g, 1), n - 1)
        if g not in tried:
            tried[g] = evaluate(g)
        return g

    g, step = ev(n // 2 if start is None else start), max(n // 4, 1)
    while step >= max(n // 64, 1):
        best = max((ev(g - step), g, ev(g + step)), key=lambda x: (tried[x], -x))
        if best == g:
            step //= 2
        g = best
    return g, tried[g]


@dataclass
class AsyncPoint:
    """One (N, eta): asynchronous rollout at its best split, against the synchronous runs on the same lengths."""

    devices: int
    eta: int
    generators: int  # G engines at the best split (N - G train)
    throughput: float  # trained response tokens per second, steady state
    colocated: float  # synchronous, colocated on N
    disaggregated: float  # synchronous, disaggregated at its best split (= eta 0 at its best G)
    gen_util: float  # generated tokens / (G x decode_tps x time): 1 = every engine always at a full batch
    train_util: float  # time the trainer computes (T_train(N - G) + push) / time

    @property
    def sync(self) -> float:
        """The better synchronous throughput: the baseline of every ratio."""
        return max(self.colocated, self.disaggregated)

    @property
    def ratio(self) -> float:
        return self.throughput / self.sync


def _utilisation(
    timeline: Timeline, draws, steps: int, generators: int, n: int, costs: Costs
) -> tuple[float, float]:
    """(engine, trainer) utilisation over the measured steps, per steady_period P: mean generated tokens per step
    / (G decode_tps P) and mean (T_train(N - G) + push) per step / P."""
    period, measured = steady_period(timeline, steps), draws[steps // 2 : steps]
    tokens = np.mean([lengths.sum() for lengths in measured])
    trained = np.mean([train_seconds(x, n - generators, costs) + costs.weight_sync_s for x in measured])
    return float(tokens / (generators * costs.decode_tps * period)), float(trained / period)


def run_async(
    costs: Costs,
    devices: list[int],
    etas: list[int],
    sigma: float = DEFAULT_ASYNC_SIGMA,
    scaling: str = "weak",
    seed: int = 0,
    steps: int = 20,
) -> list[AsyncPoint]:
    """Every (N, eta): the best split for asynchronous rollout (eta 0: synchronous disaggregated, computed in
    closed form; equal to simulate_async at eta 0), against synchronous colocated and disaggregated placement.
    `steps` steps are measured (their second half); eta + 1 more are simulated after them. The same lengths
    (common random numbers) for every eta, split and mode at one N."""
    if steps < 4:
        raise ValueError("--async-steps: need at least 4 steps (the second half is measured)")
    points = []
    for n in devices:
        if n < 2:
            raise ValueError(f"cluster size {n}: asynchronous rollout needs at least 2 devices")
        draws = step_lengths(costs, n, sigma, scaling, seed, steps + max(etas) + 1)
        colocated = steady_throughput(sync_colocated(draws[:steps], n, costs), draws, steps)
        runs: dict[tuple[int, int], Timeline] = {}

        def rate(g: int, eta: int, draws=draws, n=n, runs=runs) -> float:
            if (g, eta) not in runs:
                runs[g, eta] = (
                    sync_disaggregated(draws[:steps], g, n, costs)
                    if eta == 0
                    else simulate_async(draws[: steps + eta + 1], g, n, eta, costs)
                )
            return steady_throughput(runs[g, eta], draws, steps)

        _, disaggregated = search_split(n, lambda g, rate=rate: rate(g, 0))
        g = n // 2
        for eta in sorted(etas):  # each search starts from the previous eta's split
            g, best = search_split(n, lambda x, e=eta, rate=rate: rate(x, e), start=g)
            util = _utilisation(runs[g, eta], draws, steps, g, n, costs)
            points.append(AsyncPoint(n, eta, g, best, colocated, disaggregated, *util))
    return points


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
    ("s", 4, ".2f"),
    ("part rcut", 9, "+.1f"),
    ("part scut", 9, "+.1f"),
    ("rule s", 6, ".2f"),
    ("rule rcut", 9, "+.1f"),
    ("dis step", 8, ".1f"),
    ("dis roll", 8, ".1f"),
    ("dis idle", 8, ".1%"),
    ("k", 4, "d"),
    ("k/N", 5, ".1%"),
    ("dis rcut", 8, "+.1f"),
    ("dis scut", 8, "+.1f"),
    ("dis max", 7, "+.1f"),
    ("@k", 4, "d"),
    ("winner", 11, "s"),
)
FIXED_COLUMNS = (("k fix", 5, "d"), ("fix step", 8, ".1f"), ("fix roll", 8, ".1f"), ("fix rcut", 8, "+.1f"))
LEGEND = (
    "times in s; idle = idle device-s / (N x step); rcut / scut = rollout / step time saved against full, in % "
    "(positive: faster than full)\npart = partial at its best judging share s per step (s: the mean); rule = "
    "partial at the load-balance share J / (G + J); dis = disaggregated at its step-optimal k GenRM-only "
    "devices;\ndis max = its best rollout cut over k, @k that k; winner = fastest step (= joins modes within 0.5%)"
)


def cell_row(c: Cell) -> list:
    """The table's values for one cell, in COLUMNS (+ FIXED_COLUMNS) order."""
    n, p, d = c.devices, c.partial, c.disaggregated
    row = [
        n, c.ratio, c.sigma,
        c.full.step_s, c.full.rollout_s, c.full.idle_fraction,
        p.step_s, p.rollout_s, p.idle_fraction, p.share, c.cut(p), c.cut(p, "step"),
        c.partial_rule.share, c.cut(c.partial_rule),
        d.step_s, d.rollout_s, d.idle_fraction, d.k, d.k / n, c.cut(d), c.cut(d, "step"),
        c.cut(c.best_rollout), c.best_rollout.k,
        c.winner,
    ]  # fmt: skip
    if c.fixed is not None:
        row += [c.fixed.k, c.fixed.step_s, c.fixed.rollout_s, c.cut(c.fixed)]
    return row


def format_table(cells: list[Cell]) -> str:
    """Aligned text table: times in seconds, idle as % of N x step, cuts in % (positive: faster than full)."""
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


def _band_lines(name: str, cells: list[Cell], cut: Callable[[Cell], float], all_n: list[int]) -> list[str]:
    """Verdict lines for one mode's rollout cut: its range, the paper's band, above it, at least 16%."""
    lo, hi = PAPER_BAND
    cuts = [cut(c) for c in cells]
    total = len(cells)
    band = [c for c, x in zip(cells, cuts) if lo <= x <= hi]
    above = [c for c, x in zip(cells, cuts) if x > hi]
    return [
        f"- {name}: rollout cut {min(cuts):+.1f}% to {max(cuts):+.1f}%; at least {PAPER_CUT:g}% at "
        f"{sum(x >= PAPER_CUT for x in cuts)}/{total}.",
        f"  In the paper's {lo:g}-{hi:g}% band at {len(band)}/{total}: {_where(band, all_n)}.",
        f"  Above {hi:g}% at {len(above)}/{total}: {_where(above, all_n)}.",
    ]


def verdict(cells: list[Cell]) -> str:
    """A short verdict computed from the cells: where the paper's band is reproduced, where each mode wins."""
    all_n = sorted({c.devices for c in cells})
    total = len(cells)

    def mean_cut(key: str, value: float) -> float:
        sel = [c.partial_rollout_cut for c in cells if getattr(c, key) == value]
        return sum(sel) / len(sel)

    lines = [f"Verdict ({total} grid points; rollout cut = rollout-phase time saved against full):"]
    lines += _band_lines("Partial (the seed's), best share", cells, lambda c: c.partial_rollout_cut, all_n)
    lines += _band_lines("Partial, load-balance share", cells, lambda c: c.cut(c.partial_rule), all_n)
    lines += _band_lines("Disaggregated, step-optimal k", cells, lambda c: c.disaggregated_rollout_cut, all_n)
    lines.append(
        "- Mean partial rollout cut by GenRM cost ratio: "
        + ", ".join(f"{r:g}: {mean_cut('ratio', r):+.1f}%" for r in sorted({c.ratio for c in cells}))
        + "; by length spread sigma: "
        + ", ".join(f"{s:g}: {mean_cut('sigma', s):+.1f}%" for s in sorted({c.sigma for c in cells}))
        + "."
    )
    for winner in sorted({c.winner for c in cells}):
        won = [c for c in cells if c.winner == winner]
        lines.append(f"- Fastest step {winner} at {len(won)}/{total}: {_where(won, all_n)}.")
    return "\n".join(lines)


def summary_line(cells: list[Cell]) -> str:
    """The last line of the printout: the headline figures, key=value."""
    part = [c.partial_rollout_cut for c in cells]
    rule = [c.cut(c.partial_rule) for c in cells]
    total = len(cells)
    return (
        f"placement_sim: partial_rollout_cut_min_pct={min(part):.1f} partial_rollout_cut_max_pct={max(part):.1f} "
        f"partial_points_cut_ge_16pct={sum(x >= PAPER_CUT for x in part)}/{total} "
        f"partial_rule_points_cut_ge_16pct={sum(x >= PAPER_CUT for x in rule)}/{total} "
        f"partial_step_gain_max_pct={max(c.cut(c.partial, 'step') for c in cells):.1f} "
        f"disaggregated_rollout_cut_max_pct={max(c.disaggregated_rollout_cut for c in cells):.1f} "
        f"disaggregated_step_gain_max_pct={max(c.cut(c.disaggregated, 'step') for c in cells):.1f}"
    )


ASYNC_COLUMNS = (
    ("N", 5, "d"),
    ("eta", 3, "d"),
    ("gen", 5, "d"),
    ("gen/N", 6, ".1%"),
    ("tok/s", 10, ".0f"),
    ("x coloc", 7, ".2f"),
    ("x dis0", 7, ".2f"),
    ("x sync", 7, ".2f"),
    ("AReaL", 5, "s"),
    ("gen util", 8, ".1%"),
    ("train util", 10, ".1%"),
)
ASYNC_LEGEND = (
    "tok/s = trained response tokens per second (steady state); gen = engines at the best split (N - gen train);\n"
    "x coloc / x dis0 = throughput over synchronous colocated / synchronous disaggregated at its best split "
    "(eta 0);\nx sync = over the better of the two (the ratio the summary line reports); AReaL = its published "
    "ratio over synchronous;\ngen util = generated tokens / (gen x decode_tps x time); train util = trainer busy "
    "(train + push) / time"
)


def async_row(p: AsyncPoint) -> list:
    """The table's values for one point, in ASYNC_COLUMNS order."""
    areal = f"{AREAL[p.eta]:.2f}" if p.eta in AREAL else "-"
    return [
        p.devices, p.eta, p.generators, p.generators / p.devices, p.throughput,
        p.throughput / p.colocated, p.throughput / p.disaggregated, p.ratio, areal, p.gen_util, p.train_util,
    ]  # fmt: skip


def format_async_table(points: list[AsyncPoint]) -> str:
    lines = ["  ".join(f"{name:>{width}}" for name, width, _ in ASYNC_COLUMNS)]
    for p in points:
        lines.append(
            "  ".join(f"{format(v, fmt):>{w}}" for v, (_, w, fmt) in zip(async_row(p), ASYNC_COLUMNS))
        )
    return "\n".join(lines)


def saturation_eta(points: list[AsyncPoint]) -> int:
    """The least eta whose ratio reaches SATURATION x the best ratio over the etas (points of one N)."""
    top = max(p.ratio for p in points)
    return min(p.eta for p in points if p.ratio >= SATURATION * top)


def async_comparison(points: list[AsyncPoint]) -> str:
    """Per N, the curve's shape against AReaL's: gain reached at eta 1 as a share of the gain at eta 2 (AReaL:
    (2.09 - 1) / (2.77 - 1) = 62%), and where the curve saturates (AReaL: beyond eta 2)."""
    areal = (AREAL[1] - 1) / (AREAL[2] - 1)
    lines = [
        f"Shape against AReaL ({AREAL[1]:.2f}x at eta 1, {AREAL[2]:.2f}x at eta 2 over synchronous, saturating "
        f"beyond; gain at eta 1 / gain at eta 2 = {areal:.0%}):"
    ]
    for n in sorted({p.devices for p in points}):
        mine = [p for p in points if p.devices == n]
        by_eta = {p.eta: p.ratio for p in mine}
        best = max(mine, key=lambda p: p.ratio)
        share = (
            f"{(by_eta[1] - 1) / (by_eta[2] - 1):.0%}" if {1, 2} <= by_eta.keys() and by_eta[2] > 1 else "n/a"
        )
        knee = saturation_eta(mine)
        note = " (the largest eta tried: not saturated)" if knee == max(by_eta) and len(by_eta) > 1 else ""
        lines.append(
            f"- N={n}: "
            + ", ".join(f"eta {e}: {r:.2f}x" for e, r in sorted(by_eta.items()))
            + f"; gain at eta 1 / gain at eta 2 = {share}; best {best.ratio:.2f}x at eta {best.eta}, within "
            f"{1 - SATURATION:.0%} of it from eta {knee}{note}."
        )
    return "\n".join(lines)


def async_summary_line(points: list[AsyncPoint]) -> str:
    """The last line with --async: ratios over synchronous (the better of colocated and disaggregated) at the
    largest N; nan for an eta not simulated."""
    n = max(p.devices for p in points)
    mine = [p for p in points if p.devices == n]
    by_eta = {p.eta: p.ratio for p in mine}

    def r(eta: int) -> str:
        return f"{by_eta[eta]:.2f}" if eta in by_eta else "nan"

    return (
        f"placement_sim_async: ratio_eta1={r(1)} ratio_eta2={r(2)} ratio_eta4={r(4)} "
        f"saturates_at_eta={saturation_eta(mine)} areal_eta1={AREAL[1]:.2f} areal_eta2={AREAL[2]:.2f}"
    )


def describe_async(costs: Costs, sigma: float, scaling: str, steps: int, seed: int) -> str:
    t0, t1 = costs.decode_constants()
    per_token = 1e6 * (costs.logprob_s_per_token + costs.train_s_per_token)
    return (
        f"asynchronous rollout model: decode {costs.decode_tps:g} tok/s/device at batch {costs.max_batch}, "
        f"{costs.seq_decode_tps:g} tok/s alone (t0={1e3 * t0:.2f} ms, t1={1e3 * t1:.3f} ms/seq); responses "
        f"lognormal mean {costs.response_mean:g}, sigma {sigma:g}, max {costs.response_max} + prompt "
        f"{costs.prompt_len} tokens; {costs.prompts} prompts x {costs.samples_per_prompt} per "
        f"{costs.reference_devices} devices ({scaling} scaling); log-probs + train {per_token:g} us/token/device; "
        f"push {costs.weight_sync_s:g} s; colocated also pays trainer switch {costs.trainer_switch_s:g} s; "
        f"{steps} steps (second half measured), seed {seed}; no GenRM"
    )


def describe(costs: Costs, scaling: str, share_bounds: tuple[float, float]) -> str:
    t0, t1 = costs.decode_constants()
    return (
        f"cost model: decode {costs.decode_tps:g} tok/s/device at batch {costs.max_batch}, "
        f"{costs.seq_decode_tps:g} tok/s alone (t0={1e3 * t0:.2f} ms, t1={1e3 * t1:.3f} ms/seq); "
        f"responses mean {costs.response_mean:g} (max {costs.response_max}) + prompt {costs.prompt_len} tokens; "
        f"{costs.prompts} prompts x {costs.samples_per_prompt} per {costs.reference_devices} devices ({scaling} "
        f"scaling); GenRM cost = ratio x {costs.gen_cost_per_sample():.3f} device-s/sample, latency "
        f"{costs.genrm_latency_s:g} s, switch {costs.genrm_switch_s:g} s (full: x2 in series; partial: wake "
        f"beside generation + release in series; disaggregated: none); partial's judging share s in "
        f"{share_bounds[0]:g}..{share_bounds[1]:g}; trainer switch {costs.trainer_switch_s:g} s; log-probs + train "
        f"{1e6 * costs.logprob_s_per_token:g} + {1e6 * costs.train_s_per_token:g} us/token/device; weight sync "
        f"{costs.weight_sync_s:g} s"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=list(DEFAULT_DEVICES), help="cluster sizes N")
    p.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS), help="GenRM cost ratios")
    p.add_argument("--sigmas", type=float, nargs="+", default=list(DEFAULT_SIGMAS), help="length spreads")
    p.add_argument(
        "--k",
        default=None,
        help="also report disaggregated at a fixed GenRM-only device count (16) or fraction (0.25)",
    )
    p.add_argument(
        "--share-min", type=float, default=DEFAULT_SHARE_BOUNDS[0], help="partial: least judging share"
    )
    p.add_argument(
        "--share-max", type=float, default=DEFAULT_SHARE_BOUNDS[1], help="partial: most judging share"
    )
    p.add_argument("--scaling", choices=("weak", "strong"), default="weak")
    p.add_argument("--costs", default=None, help="JSON object of Costs fields")
    p.add_argument("--from-metrics", default=None, help="derive costs from a yatt_ray metrics.jsonl")
    p.add_argument("--measured-devices", type=int, default=1, help="devices of the run behind --from-metrics")
    p.add_argument("--csv", default=None, help="also write the table as CSV here")
    p.add_argument("--steps", type=int, default=3, help="simulated steps averaged per grid point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--async",
        dest="run_async",
        action="store_true",
        help="simulate asynchronous rollout instead: throughput against the staleness bound eta",
    )
    p.add_argument(
        "--async-etas", type=int, nargs="+", default=list(DEFAULT_ASYNC_ETAS), help="staleness bounds eta"
    )
    p.add_argument(
        "--async-devices", type=int, nargs="+", default=list(DEFAULT_ASYNC_DEVICES), help="cluster sizes N"
    )
    p.add_argument(
        "--async-sigma", type=float, default=DEFAULT_ASYNC_SIGMA, help="length spread of the async sweep"
    )
    p.add_argument(
        "--async-steps", type=int, default=20, help="simulated steps (the second half is measured)"
    )
    args = p.parse_args(argv)
    if min(args.async_etas) < 0:
        p.error("--async-etas: eta >= 0")
    try:
        check_share_bounds((args.share_min, args.share_max))
    except ValueError as e:
        p.error(str(e))
    return args


def main_async(args: argparse.Namespace, costs: Costs) -> list[AsyncPoint]:
    """--async: the table of throughput against eta, the comparison with AReaL, and its own last line."""
    print(describe_async(costs, args.async_sigma, args.scaling, args.async_steps, args.seed))
    start = time.perf_counter()
    points = run_async(
        costs,
        args.async_devices,
        args.async_etas,
        args.async_sigma,
        args.scaling,
        args.seed,
        args.async_steps,
    )
    print(f"\n{ASYNC_LEGEND}\n")
    print(format_async_table(points))
    print()
    print(async_comparison(points))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    print(async_summary_line(points))
    return points


def main(argv: list[str]) -> list[Cell] | list[AsyncPoint]:
    args = parse_args(argv)
    costs = load_costs(args.costs)
    ratios = list(args.ratios)
    bounds = (args.share_min, args.share_max)
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
    if args.run_async:
        return main_async(args, costs)
    print(describe(costs, args.scaling, bounds))
    start = time.perf_counter()
    cells = run_grid(
        costs, args.devices, ratios, args.sigmas, args.scaling, args.k, args.seed, args.steps, bounds
    )
    print(f"\n{LEGEND}\n")
    print(format_table(cells))
    if args.csv:
        write_csv(cells, args.csv)
        print(f"\nwrote {args.csv}")
    print()
    print(verdict(cells))
    print(
        f"\n({time.perf_counter() - start:.1f} s; mean of {args.steps} simulated steps per point, seed {args.seed})"
    )
    print(summary_line(cells))
    return cells


if __name__ == "__main__":
    main(sys.argv[1:])
