"""`train.dtype=bf16` (fp32 main weights) and the sharded optimizer (ZeRO-1) against the plain fp32 trainer:
the same steps, real sharding, offload, and checkpoints cut to another data-parallel size."""

import json

import pytest
import torch
from dist_harness import run_ranks
from train_helpers import make_batch, make_loss_fn

from yatt_ray.checkpoint.state import load_trainer_state, pieces_from_adamw, trainer_state
from yatt_ray.train import MegatronPolicy

LR = 1e-3


def _policy(model_dir, **kw):
    return MegatronPolicy(model_dir, tp_size=1, lr=LR, grad_clip=1.0, seed=0, **kw)


def _setup():
    batch = make_batch(n_rows=4, length=10, seed=5)
    return batch, make_loss_fn(float(batch["attention_mask"][:, 1:].sum()))


def _half(batch, rank):
    return {k: v[rank::2] for k, v in batch.items()}


def dp2_worker(rank, world_size, model_dir, kw, steps, offload):
    """Two steps on this rank's half of the batch; the optimizer state after the first."""
    batch, loss_fn = _setup()
    p = _policy(model_dir, **kw)
    metrics, saved = [], None
    for step in range(steps):
        metrics.append(p.train_step(_half(batch, rank), loss_fn, micro_batch_size=1))
        if offload:
            p.offload()
            p.onload()
        if step == 0:
            saved = {"policy": trainer_state(p), "optimizer": p.optimizer.state_dict()}
            saved = {k: _copy(v) for k, v in saved.items()}
    owned = sum(pc.end - pc.start for pc in p.optimizer.pieces)
    moments = sum(s["exp_avg"].numel() for s in p.optimizer.state.values())
    total = sum(q.numel() for q in p.model.parameters())
    return {
        "metrics": metrics,
        "sd": p.hf_state_dict(),
        "saved": saved,
        "owned": owned,
        "moments": moments,
        "total": total,
    }


def _copy(tree):
    if torch.is_tensor(tree):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


@pytest.fixture(scope="module")
def dp2_runs(tiny_model_dir):
    runs = {}
    for name, kw, offload in [
        ("plain", {}, False),
        ("sharded", {"distributed_optimizer": True}, True),
        ("bf16_sharded", {"distributed_optimizer": True, "dtype": "bf16"}, False),
    ]:
        runs[name] = run_ranks(dp2_worker, 2, tiny_model_dir, kw, 2, offload, timeout_s=300)
    return runs


def test_sharded_optimizer_takes_the_same_steps(dp2_runs):
    plain, sharded = dp2_runs["plain"][0], dp2_runs["sharded"][0]
    for a, b in zip(plain["metrics"], sharded["metrics"]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    for k, t in plain["sd"].items():  # the offload / onload cycles of the sharded run changed nothing
        torch.testing.assert_close(sharded["sd"][k], t, atol=1e-6, rtol=0)
    rank1 = dp2_runs["sharded"][1]["sd"]
    assert all(torch.equal(rank1[k], t) for k, t in sharded["sd"].items())  # the all-gather: one model


def test_each_rank_holds_half_the_optimizer_state(dp2_runs):
    plain = dp2_runs["plain"][0]
    assert plain["owned"] == plain["moments"] == plain["total"]
    ranks = dp2_runs["sharded"]
    for r in ranks:
        assert r["moments"] == r["owned"]
        assert 0.45 * r["total"] < r["owned"] < 0.55 * r["total"]
    assert sum(r["owned"] for r in ranks) == plain["total"]  # disjoint and complete


def test_bf16_tracks_fp32_and_keeps_fp32_main_weights(dp2_runs):
    fp32, bf16 = dp2_runs["plain"][0], dp2_runs["bf16_sharded"][0]
    for a, b in zip(fp32["metrics"], bf16["metrics"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.05, abs=1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.05)
    pieces = bf16["saved"]["optimizer"]["pieces"]
    assert pieces and all(p["main"].dtype == torch.float32 for p in pieces)
    weights = bf16["saved"]["policy"]["model"]
    assert all(t.dtype == torch.bfloat16 for k, t in weights.items() if not k.endswith("_extra_state"))
    for k, t in fp32["sd"].items():  # after two steps of lr 1e-3 the bf16 model is the fp32 model, rounded
        assert (bf16["sd"][k].float() - t).abs().max() < 2e-2, k


def test_bf16_log_probs_are_close_to_fp32(tiny_model_dir, single_process_world):
    batch, _ = _setup()
    fp32 = _policy(tiny_model_dir).log_probs(batch["input_ids"], batch["attention_mask"], 4)[0]
    bf16 = _policy(tiny_model_dir, dtype="bf16").log_probs(batch["input_ids"], batch["attention_mask"], 4)[0]
    mask = batch["attention_mask"][:, 1:].bool()
    diff = (bf16 - fp32).abs()[mask]
    assert bf16.dtype == torch.float32
    assert 0 < diff.max() < 0.1  # bf16 differs (it runs in bf16), but not by much


@pytest.mark.parametrize("source", ["sharded", "bf16_sharded"])
def test_sharded_checkpoint_resumes_on_one_rank(dp2_runs, tiny_model_dir, single_process_world, source):
    """Both ranks' shards after step 1, loaded into one unsharded fp32 rank: its step 2 on the whole batch is
    the two-rank run's step 2 (a bf16 run's fp32 main weights come back exactly)."""
    batch, loss_fn = _setup()
    ranks = dp2_runs[source]
    resumed = _policy(tiny_model_dir)
    load_trainer_state(resumed, ranks[0]["saved"]["policy"], [r["saved"]["optimizer"] for r in ranks])
    mains = {p["name"]: p["main"] for r in ranks for p in r["saved"]["optimizer"]["pieces"] if "main" in p}
    if source == "bf16_sharded":
        assert mains
        for pc in resumed.optimizer.pieces:  # the fp32 main weights, not the bf16-rounded ones
            assert torch.equal(pc.main, _cut(ranks, pc.name, pc.param.numel()))
    metrics = resumed.train_step(batch, loss_fn, micro_batch_size=2)
    assert metrics["grad_norm"] == pytest.approx(
        ranks[0]["metrics"][1]["grad_norm"], rel=0.05 if mains else 1e-5
    )
    if not mains:
        for k, t in ranks[0]["sd"].items():
            torch.testing.assert_close(resumed.hf_state_dict()[k], t, atol=1e-5, rtol=0)


def _cut(ranks, name, numel):
    out = torch.empty(numel)
    for r in ranks:
        for p in r["saved"]["optimizer"]["pieces"]:
            if p["name"] == name:
                out[p["start"] : p["end"]] = p["main"]
    return out


def test_missing_shard_is_a_clear_error(dp2_runs, tiny_model_dir, single_process_world):
    ranks = dp2_runs["sharded"]
    resumed = _policy(tiny_model_dir)
    with pytest.raises(ValueError, match="a rank's checkpoint file is missing"):
        load_trainer_state(resumed, ranks[0]["saved"]["policy"], [ranks[0]["saved"]["optimizer"]])
    twice = [ranks[0]["saved"]["optimizer"]] * 2  # one shard given twice still leaves the other half out
    with pytest.raises(ValueError, match="a rank's checkpoint file is missing"):
        load_trainer_state(resumed, ranks[0]["saved"]["policy"], twice)


def test_an_adamw_checkpoint_of_before_pieces_loads(tiny_model_dir, single_process_world):
    """The torch AdamW state older checkpoints hold maps onto the parameters it was built over."""
    p = _policy(tiny_model_dir)
    trainable = [q for q in p.model.parameters() if q.requires_grad]
    order = [q for q in trainable if q.ndim > 1] + [q for q in trainable if q.ndim <= 1]
    groups = [order[: sum(q.ndim > 1 for q in order)], order[sum(q.ndim > 1 for q in order) :]]
    old = torch.optim.AdamW([{"params": g} for g in groups], lr=LR)
    for i, q in enumerate(order):  # moments that name their parameter
        old.state[q] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.full_like(q, i),
            "exp_avg_sq": torch.full_like(q, i + 0.5),
        }
    load_trainer_state(p, {"model": p.model.state_dict(), "optimizer": old.state_dict()})
    index = {id(q): i for i, q in enumerate(order)}
    for pc in p.optimizer.pieces:
        state = p.optimizer.state[pc.main]
        assert float(state["step"]) == 3.0
        assert torch.equal(state["exp_avg"], torch.full((pc.end - pc.start,), float(index[id(pc.param)])))
    assert pieces_from_adamw(old.state_dict(), p.model)["pieces"][0]["numel"] == order[0].numel()


def tp2_worker(rank, world_size, model_dir):
    batch, loss_fn = _setup()
    p = MegatronPolicy(model_dir, tp_size=2, lr=LR, grad_clip=1.0, seed=0, dtype="bf16")
    return p.train_step(batch, loss_fn, micro_batch_size=2)


def test_bf16_under_tensor_parallelism_takes_the_one_rank_step(tiny_model_dir, single_process_world):
    batch, loss_fn = _setup()
    one = _policy(tiny_model_dir, dtype="bf16").train_step(batch, loss_fn, micro_batch_size=2)
    tp2 = run_ranks(tp2_worker, 2, tiny_model_dir)
    for m in tp2:
        assert m["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-2)
        assert m["loss"] == pytest.approx(one["loss"], rel=2e-2, abs=1e-3)


def test_bf16_critic_values_and_step_track_fp32(tiny_model_dir, single_process_world):
    from train_helpers import make_value_batch, make_value_loss_fn, real_tokens

    from yatt_ray.train import MegatronCritic

    batch = make_value_batch(n_rows=4, length=10, seed=2)
    loss_fn = make_value_loss_fn(real_tokens(batch))
    out = {}
    for dtype in ("fp32", "bf16"):
        critic = MegatronCritic(tiny_model_dir, lr=LR, seed=0, dtype=dtype)
        values = critic.values(batch["input_ids"], batch["attention_mask"], micro_batch_size=4)
        out[dtype] = values, critic.train_step(batch, loss_fn, micro_batch_size=2)
    (v32, m32), (v16, m16) = out["fp32"], out["bf16"]
    assert v16.dtype == torch.float32 and (v16 - v32).abs().max() < 0.05
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.05)


def test_a_bf16_export_says_bf16_and_loads_as_it_was_saved(tiny_model_dir, single_process_world, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = _policy(tiny_model_dir, dtype="bf16")
    out = policy.save_hf(tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert hf.dtype == torch.bfloat16
    sd = policy.hf_state_dict()
    assert all(torch.equal(hf.state_dict()[k], t) for k, t in sd.items())
