"""Every loss aggregation mode gives the same policy step however the batch is split.

For each mode of `yatt_ray.algos.aggregation` the real loss closure (`yatt_ray.step.policy_loss_fn`, PPO clip +
entropy + KL in the loss) drives a real `MegatronPolicy` on a tiny Llama, three ways:

    (a) 1 rank, whole batch, one micro-batch;
    (b) 1 rank, whole batch, micro_batch_size=1 (one micro-batch per row);
    (c) 2 data-parallel ranks (gloo), each rank half the rows (its half as one micro-batch).

Every way passes the denominators of the WHOLE batch (global_tokens, global_seqs; norm_len = R), so the
per-micro-batch shares sum to the full-batch loss and the DP gradient sum to the full-batch gradient: grad
norm, the summed loss and metrics, and the updated weights agree. Responses (and prompts) have different
lengths, spread unevenly over the ranks, so the four modes really weigh tokens differently.

old_logp is the policy's own log-prob shifted per token by d in {+-0.05, +-0.5}: the ratio at the step's start
is exp(d), so PPO clipping is active on some tokens (0.5 is outside [log 0.8, log 1.2]) and the clip decisions
sit far from the boundaries, where float noise between the splits cannot flip them.

The negative control uses per-micro-batch denominators (each micro-batch's own token count): for token-mean
that changes the step between (a) and (b), so the comparison above can fail.

The 1-rank runs share the pytest process's world of size 1; all 2-rank runs happen in ONE spawned pair.
"""

import pytest
import torch
from dist_harness import run_ranks

from yatt_ray.batch import pack
from yatt_ray.config import AlgoConfig
from yatt_ray.step import policy_loss_fn
from yatt_ray.train import MegatronPolicy

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KW = {"tp_size": 1, "lr": 1e-4, "grad_clip": 1.0, "seed": 0}
KL_COEF = 0.05
# Adam's first update is lr * g / (|g| + eps): with the default eps 1e-8 a weight whose gradient is ~1e-8 (float
# noise between two splits is ~1e-9 there) moves by a noise-dependent part of lr. eps 1e-6 damps those weights
# (max weight difference between splits ~2e-7, against a step of ~1e-4) and leaves every other update as it is.
ADAM_EPS = 1e-6
STEPS = 2  # the second step starts from updated weights and a non-trivial Adam state
PROMPT_LENS = (3, 6, 2, 5)
RESPONSE_LENS = (7, 2, 5, 1)  # rank 0 (rows 0, 2): 12 tokens; rank 1 (rows 1, 3): 3 tokens
ADVANTAGES = (1.0, -0.7, -1.3, 0.4)  # per sequence, broadcast over its response tokens


def _algo(mode: str) -> AlgoConfig:
    return AlgoConfig(loss_agg=mode, entropy_coef=0.01, kl_coef=KL_COEF, kl_in_reward=False, tis_cap=None)


def _loss_fn(mode: str, width_p: int, width_r: int, tokens: float, seqs: float):
    """The real closure, with its loss added to the metrics (summed over micro-batches and DP ranks)."""
    inner = policy_loss_fn(_algo(mode), width_p, tokens, seqs, KL_COEF, width_r)

    def loss_fn(logp, entropy, mb):
        loss, metrics = inner(logp, entropy, mb)
        return loss, {**metrics, "loss": loss.detach()}

    return loss_fn


def _per_micro_batch_loss_fn(mode: str, width_p: int, width_r: int):
    """WRONG on purpose: denominators counted over each micro-batch instead of the whole batch."""

    def loss_fn(logp, entropy, mb):
        mask = mb["response_mask"]
        own = _loss_fn(mode, width_p, width_r, float(mask.sum()), float((mask.sum(1) > 0).sum()))
        return own(logp, entropy, mb)

    return loss_fn


def _train(model_dir, batch, loss_fn, micro_batch_size) -> dict:
    policy = MegatronPolicy(model_dir, **KW)
    for group in policy.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    steps = [policy.train_step(batch, loss_fn, micro_batch_size=micro_batch_size) for _ in range(STEPS)]
    return {"steps": steps, "sd": policy.hf_state_dict()}


def _run_mode(model_dir, batch, width_p, mode, tokens, seqs, micro_batch_size) -> dict:
    loss_fn = _loss_fn(mode, width_p, batch["response_mask"].shape[1], tokens, seqs)
    return _train(model_dir, batch, loss_fn, micro_batch_size)


def dp2_worker(rank, world_size, model_dir, batch, width_p, tokens, seqs):
    """DP=2: each rank trains on its half of the rows with the WHOLE batch's denominators, every mode."""
    half = {k: v[rank::world_size] for k, v in batch.items()}
    rows = half["input_ids"].shape[0]
    return {m: _run_mode(model_dir, half, width_p, m, tokens, seqs, micro_batch_size=rows) for m in MODES}


@pytest.fixture(scope="module")
def data(tiny_model_dir, single_process_world):
    """The packed batch with old_logp / ref_logp / advantages [N, R], its prompt width and denominators."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(4, 100, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    packed = pack(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0)
    batch, width_p = packed.tensors(), packed.prompt_width
    mask = batch["response_mask"]
    n, width_r = mask.shape
    policy = MegatronPolicy(tiny_model_dir, **KW)
    logp, _ = policy.log_probs(batch["input_ids"], batch["attention_mask"], micro_batch_size=n)
    logp = logp[:, width_p - 1 :]
    shift = torch.tensor([0.05, -0.5, -0.05, 0.5]).repeat(width_r)[: n * width_r].reshape(n, width_r)
    batch["old_logp"] = (logp - shift) * mask  # ratio exp(shift) at the start of the step
    batch["ref_logp"] = (logp + 0.1 * torch.randn(n, width_r, generator=g)) * mask
    batch["advantages"] = torch.tensor(ADVANTAGES)[:, None] * mask
    tokens, seqs = float(mask.sum()), float((mask.sum(1) > 0).sum())
    assert (tokens, seqs) == (sum(RESPONSE_LENS), len(RESPONSE_LENS))
    return batch, width_p, tokens, seqs


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, data):
    """(a) and (b) for every mode, in the pytest process."""
    batch, width_p, tokens, seqs = data
    n = batch["input_ids"].shape[0]
    return {
        m: {
            "whole": _run_mode(tiny_model_dir, batch, width_p, m, tokens, seqs, micro_batch_size=n),
            "rows": _run_mode(tiny_model_dir, batch, width_p, m, tokens, seqs, micro_batch_size=1),
        }
        for m in MODES
    }


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, data):
    """(c) for every mode: one spawned pair of gloo ranks."""
    return run_ranks(dp2_worker, 2, tiny_model_dir, *data)


def _assert_same_step(got: dict, want: dict, what: str) -> None:
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), f"{what}, step {step}: grad_norm"
        # Means of O(1) per-token terms of both signs: float noise ~1e-7 in absolute terms, whatever the mean.
        for key in ("loss", "pg_loss", "entropy", "clipfrac"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), f"{what}, step {step}: {key}"
    assert got["sd"].keys() == want["sd"].keys()
    for k, v in got["sd"].items():
        torch.testing.assert_close(
            v, want["sd"][k], atol=1e-6, rtol=0, msg=lambda m, k=k: f"{what}, {k}: {m}"
        )


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_do_not_change_the_step(one_rank, mode):
    runs = one_rank[mode]
    first = runs["whole"]["steps"][0]
    assert first["grad_norm"] > 0 and first["loss"] != 0
    assert 0 < first["clipfrac"] < 1  # PPO clipping is active on some tokens, not all
    _assert_same_step(runs["rows"], runs["whole"], f"{mode}: micro_batch_size=1 vs whole batch")


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_ranks_do_not_change_the_step(one_rank, two_ranks, mode):
    for rank in range(2):
        _assert_same_step(
            two_ranks[rank][mode], one_rank[mode]["whole"], f"{mode}: DP=2 rank {rank} vs 1 rank"
        )


def test_the_modes_really_differ(one_rank):
    """Uneven lengths: each mode gives its own loss and gradient (else the tests above prove little)."""
    losses = [one_rank[m]["whole"]["steps"][0]["loss"] for m in MODES]
    norms = [one_rank[m]["whole"]["steps"][0]["grad_norm"] for m in MODES]
    for i in range(len(MODES)):
        for j in range(i):
            assert losses[i] != pytest.approx(losses[j], rel=1e-3), (MODES[i], MODES[j])
            assert norms[i] != pytest.approx(norms[j], rel=1e-3), (MODES[i], MODES[j])


def test_per_micro_batch_denominators_change_the_step(tiny_model_dir, data, one_rank):
    """Negative control: token-mean over each micro-batch's own tokens weighs every ROW alike, not every token."""
    batch, width_p, _, _ = data
    wrong = _per_micro_batch_loss_fn("token-mean", width_p, batch["response_mask"].shape[1])
    got = _train(tiny_model_dir, batch, wrong, micro_batch_size=1)
    want = one_rank["token-mean"]["whole"]
    assert got["steps"][0]["grad_norm"] != pytest.approx(want["steps"][0]["grad_norm"], rel=1e-2)
    assert got["steps"][0]["loss"] != pytest.approx(want["steps"][0]["loss"], rel=1e-2)
    weight_diff = max((v - want["sd"][k]).abs().max().item() for k, v in got["sd"].items())
    assert weight_diff > 1e-5  # far beyond the 1e-6 tolerance of the comparisons above
    # The same loss on ONE micro-batch is right (the micro-batch's own counts are the global ones).
    whole = _train(tiny_model_dir, batch, wrong, micro_batch_size=batch["input_ids"].shape[0])
    _assert_same_step(whole, want, "per-micro-batch denominators, one micro-batch")
