"""MegatronCritic: TP=2 equals TP=1 (values and a step), and DP=2 half batches equal one rank's full batch.

Both multi-rank checks run in ONE spawned 2-process gloo world (first TP=2, then the groups are rebuilt as
DP=2), compared with TP=1 in the pytest process.
"""

import pytest
import torch
from dist_harness import run_ranks
from train_helpers import make_value_batch, make_value_loss_fn, real_tokens

from yatt_ray.train import MegatronCritic

KW = {"lr": 1e-4, "grad_clip": 1.0, "seed": 0, "head_init_std": 0.1}


def _batch():
    return make_value_batch(n_rows=4, length=10, seed=9)


def _run(critic, batch, micro_batch_size):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    values = critic.values(ids, mask, micro_batch_size=3)
    metrics = critic.train_step(batch, make_value_loss_fn(real_tokens(_batch())), micro_batch_size)
    return {
        "values": values,
        "metrics": metrics,
        "after": critic.values(ids, mask, micro_batch_size=4),
        "sd": critic.hf_state_dict(),
    }


def tp2_then_dp2_worker(rank, world_size, model_dir):
    batch = _batch()
    tp2 = _run(MegatronCritic(model_dir, tp_size=2, **KW), batch, micro_batch_size=2)
    dp2_critic = MegatronCritic(model_dir, tp_size=1, **KW)  # rebuilds the groups: TP=1, DP=2
    half = {k: v[rank::2] for k, v in batch.items()}  # each DP rank: half the rows, GLOBAL token count
    dp2 = _run(dp2_critic, half, micro_batch_size=1)
    return {"tp2": tp2, "dp2": dp2}


@pytest.fixture(scope="module")
def tp1(tiny_model_dir, single_process_world):
    return _run(MegatronCritic(tiny_model_dir, tp_size=1, **KW), _batch(), micro_batch_size=4)


@pytest.fixture(scope="module")
def ranks(tiny_model_dir):
    return run_ranks(tp2_then_dp2_worker, 2, tiny_model_dir)


def test_tp2_values_and_step_equal_tp1(tp1, ranks):
    assert ranks[1]["tp2"]["sd"] is None  # gathered on TP rank 0 only
    for r in range(2):
        tp2 = ranks[r]["tp2"]
        torch.testing.assert_close(tp2["values"], tp1["values"], atol=1e-5, rtol=0)
        assert tp2["metrics"]["grad_norm"] == pytest.approx(tp1["metrics"]["grad_norm"], rel=1e-5)
        assert tp2["metrics"]["loss"] == pytest.approx(tp1["metrics"]["loss"], rel=1e-5)
        torch.testing.assert_close(tp2["after"], tp1["after"], atol=1e-5, rtol=0)
    sd = ranks[0]["tp2"]["sd"]
    assert sd.keys() == tp1["sd"].keys()
    for k in sd:
        torch.testing.assert_close(sd[k], tp1["sd"][k], atol=1e-5, rtol=0)


def test_dp2_half_batches_equal_one_rank_full_batch(tp1, ranks):
    """Gradients SUM over DP ranks (loss already divided by the global token count): same grad norm & step."""
    for r in range(2):
        dp2 = ranks[r]["dp2"]
        assert dp2["metrics"]["grad_norm"] == pytest.approx(tp1["metrics"]["grad_norm"], rel=1e-5)
        assert dp2["metrics"]["loss"] == pytest.approx(tp1["metrics"]["loss"], rel=1e-5)  # summed over DP
        assert dp2["metrics"]["tokens"] == tp1["metrics"]["tokens"]
        for k, v in dp2["sd"].items():
            torch.testing.assert_close(v, tp1["sd"][k], atol=1e-5, rtol=0)
    torch.testing.assert_close(ranks[0]["dp2"]["after"], tp1["after"][0::2], atol=1e-5, rtol=0)
    torch.testing.assert_close(ranks[1]["dp2"]["after"], tp1["after"][1::2], atol=1e-5, rtol=0)
