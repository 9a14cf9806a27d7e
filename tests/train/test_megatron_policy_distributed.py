"""TP=2 and DP=2 on gloo (spawned local processes) agree with TP=1 / DP=1 in the pytest process."""

import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from train_helpers import make_batch, make_loss_fn

from yatt_ray.train import MegatronPolicy, head_logprobs_and_entropy

LR = 1e-4  # Adam's first step is ~lr * sign(grad): near-zero grads make float noise ~1% of a step


def _batch_and_tokens():
    batch = make_batch(n_rows=4, length=10, seed=3)
    return batch, float(batch["attention_mask"][:, 1:].sum())


def _grouped_batch():
    """Two prompts' groups of 4 samples (left-padded) whose first response tokens differ: packed with
    group_size=4, each body's last token predicts every sample's first token (the extra predictions)."""
    g = torch.Generator().manual_seed(4)
    rows = []
    for prompt_len in (3, 5):
        prompt = torch.randint(4, 100, (prompt_len,), generator=g).tolist()
        rows += [prompt + [10 + j] + torch.randint(4, 100, (j,), generator=g).tolist() for j in range(4)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(len(rows), generator=g)}


def _grouped_passes(p: MegatronPolicy) -> dict:
    """Log-probs, entropies and a train step of `_grouped_batch` packed in groups of 4."""
    batch = _grouped_batch()
    logp, entropy = p.log_probs(batch["input_ids"], batch["attention_mask"], micro_batch_size=8, group_size=4)
    tokens = float(batch["attention_mask"][:, 1:].sum())
    metrics = p.train_step(batch, make_loss_fn(tokens), micro_batch_size=8, group_size=4)
    return {"logp": logp, "entropy": entropy, "metrics": metrics}


def _vocab_parallel_check(tp_group, rank: int, tp: int):
    """Logp / entropy and the grads w.r.t. the hidden states and this rank's vocab slice of the output weight,
    from fixed random hidden states and weight."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=g).requires_grad_()
    weight = torch.randn(128, 16, generator=g)
    targets = torch.randint(0, 128, (2, 6), generator=g)
    w1, w2 = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    shard = weight.chunk(tp, dim=0)[rank].clone().requires_grad_()
    logp, entropy = head_logprobs_and_entropy(hidden, shard, targets, tp_group)
    grad_hidden, grad_shard = torch.autograd.grad((w1 * logp + w2 * entropy).sum(), (hidden, shard))
    return logp.detach(), entropy.detach(), grad_shard, grad_hidden


def tp2_worker(rank, world_size, model_dir, batch, tokens):
    p = MegatronPolicy(model_dir, tp_size=2, lr=LR, grad_clip=1.0, seed=0)
    logp, entropy = p.log_probs(batch["input_ids"], batch["attention_mask"], micro_batch_size=3)
    vocab_parallel = _vocab_parallel_check(p.tp_group, dist.get_rank(p.tp_group), 2)
    metrics = p.train_step(batch, make_loss_fn(tokens), micro_batch_size=2)
    return {
        "logp": logp,
        "entropy": entropy,
        "vp": vocab_parallel,
        "metrics": metrics,
        "sd": p.hf_state_dict(),  # after the first step (DP=2 takes one); then the grouped passes
        "grouped": _grouped_passes(p),
    }


def dp2_worker(rank, world_size, model_dir, batch, tokens):
    p = MegatronPolicy(model_dir, tp_size=1, lr=LR, grad_clip=1.0, seed=0)
    half = {k: v[rank::2] for k, v in batch.items()}  # each DP rank: half the rows, GLOBAL token count
    metrics = p.train_step(half, make_loss_fn(tokens), micro_batch_size=1)
    return {"metrics": metrics, "sd": p.hf_state_dict()}


def overlap_worker(rank, world_size, model_dir, batch, tokens, distributed_optimizer):
    """Three steps of half the rows in 2, 1, 2 micro-batches, gradients reduced in small buckets while the last
    micro-batch's backward runs (from the second step on: the first step learns which gradients to expect)."""
    from yatt_ray.train import trainer_base

    trainer_base.GRAD_BUCKET_PARAMS = 20_000  # the tiny model's ~0.2M parameters in several buckets
    p = MegatronPolicy(model_dir, lr=LR, grad_clip=1.0, seed=0, distributed_optimizer=distributed_optimizer)
    half = {k: v[rank::2] for k, v in batch.items()}
    norms = [p.train_step(half, make_loss_fn(tokens), micro_batch_size=m)["grad_norm"] for m in (1, 2, 1)]
    return {"norms": norms, "sd": p.hf_state_dict(), "buckets": len(p.model.bucket_groups)}


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_gradients_reduced_during_backward_take_the_one_rank_steps(
    tiny_model_dir, single_process_world, distributed_optimizer
):
    batch, tokens = _batch_and_tokens()
    one = MegatronPolicy(tiny_model_dir, lr=LR, grad_clip=1.0, seed=0)
    norms = [one.train_step(batch, make_loss_fn(tokens), micro_batch_size=4)["grad_norm"] for _ in range(3)]
    expected = one.hf_state_dict()
    dp2 = run_ranks(overlap_worker, 2, tiny_model_dir, batch, tokens, distributed_optimizer)
    for r in range(2):
        assert dp2[r]["buckets"] > 2
        assert dp2[r]["norms"] == pytest.approx(norms, rel=1e-5)
        for k, v in dp2[r]["sd"].items():
            torch.testing.assert_close(v, expected[k], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tp1(tiny_model_dir, single_process_world):
    batch, tokens = _batch_and_tokens()
    p = MegatronPolicy(tiny_model_dir, tp_size=1, lr=LR, grad_clip=1.0, seed=0)
    logp, entropy = p.log_probs(batch["input_ids"], batch["attention_mask"], micro_batch_size=4)
    metrics = p.train_step(batch, make_loss_fn(tokens), micro_batch_size=4)
    return {
        "logp": logp,
        "entropy": entropy,
        "vp": _vocab_parallel_check(None, 0, 1),
        "metrics": metrics,
        "sd": p.hf_state_dict(),  # after the first step (DP=2 takes one); then the grouped passes
        "grouped": _grouped_passes(p),
    }


@pytest.fixture(scope="module")
def tp2(tiny_model_dir):
    return run_ranks(tp2_worker, 2, tiny_model_dir, *_batch_and_tokens())


def test_tp2_log_probs_equal_tp1(tp1, tp2):
    for r in range(2):
        torch.testing.assert_close(tp2[r]["logp"], tp1["logp"], atol=1e-5, rtol=0)
        torch.testing.assert_close(tp2[r]["entropy"], tp1["entropy"], atol=1e-5, rtol=0)


def test_tp2_packed_groups_equal_tp1(tp1, tp2):
    """Shared-prefix groups under TP=2: the extra predictions of a body's last token are scored on the
    vocabulary shards like every other place (log-probs, entropies and the step's grad norm as at TP=1)."""
    want = tp1["grouped"]
    for r in range(2):
        got = tp2[r]["grouped"]
        torch.testing.assert_close(got["logp"], want["logp"], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["entropy"], want["entropy"], atol=1e-5, rtol=0)
        assert got["metrics"]["grad_norm"] == pytest.approx(want["metrics"]["grad_norm"], rel=1e-5)


def test_vocab_parallel_logprobs_and_grads_tp2(tp1, tp2):
    full_logp, full_entropy, full_grad, full_grad_hidden = tp1["vp"]
    for r in range(2):
        logp, entropy, _, grad_hidden = tp2[r]["vp"]
        torch.testing.assert_close(logp, full_logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, full_entropy, atol=1e-5, rtol=0)
        torch.testing.assert_close(grad_hidden, full_grad_hidden, atol=1e-5, rtol=0)  # summed over the slices
    grad = torch.cat([tp2[0]["vp"][2], tp2[1]["vp"][2]], dim=0)  # each rank its slice's rows of W
    torch.testing.assert_close(grad, full_grad, atol=1e-5, rtol=0)


def test_tp2_train_step_equals_tp1(tp1, tp2):
    assert tp2[1]["sd"] is None  # gathered on TP rank 0 only
    for r in range(2):
        assert tp2[r]["metrics"]["grad_norm"] == pytest.approx(tp1["metrics"]["grad_norm"], rel=1e-5)
        assert tp2[r]["metrics"]["loss"] == pytest.approx(tp1["metrics"]["loss"], rel=1e-5)
    sd = tp2[0]["sd"]
    assert sd.keys() == tp1["sd"].keys()
    for k in sd:
        torch.testing.assert_close(sd[k], tp1["sd"][k], atol=1e-5, rtol=0)


def test_dp2_half_batches_equal_one_rank_full_batch(tiny_model_dir, tp1):
    """Gradients SUM over DP ranks (loss already divided by the global token count): same grad norm & step."""
    dp2 = run_ranks(dp2_worker, 2, tiny_model_dir, *_batch_and_tokens())
    for r in range(2):
        m = dp2[r]["metrics"]
        assert m["grad_norm"] == pytest.approx(tp1["metrics"]["grad_norm"], rel=1e-5)
        assert m["loss"] == pytest.approx(tp1["metrics"]["loss"], rel=1e-5)  # summed over DP ranks
        assert m["tokens"] == tp1["metrics"]["tokens"]
        assert m["forward_tokens"] == tp1["metrics"]["forward_tokens"]  # each rank's half, summed over DP
        for k, v in dp2[r]["sd"].items():
            torch.testing.assert_close(v, tp1["sd"][k], atol=1e-5, rtol=0)


def failing_worker(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the harness


def test_harness_reports_a_failing_rank_without_hanging():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*boom on rank 1"):
        run_ranks(failing_worker, 2, timeout_s=60, collective_timeout_s=30)
    assert time.monotonic() - start < 30
