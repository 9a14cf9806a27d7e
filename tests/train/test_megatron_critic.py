"""MegatronCritic at TP=1 in one process: values vs a Hugging Face reference, a step, save / load, budgets."""

import json

import pytest
import torch
from train_helpers import make_batch, make_loss_fn, make_value_batch, make_value_loss_fn, real_tokens

from yatt_ray.train import MegatronCritic, MegatronPolicy

pytestmark = pytest.mark.usefixtures("single_process_world")

HEAD_STD = 0.1  # values of order 1 (hidden 128), so a 1e-5 tolerance is a real check


def critic(model_dir, **kw):
    kw = {"head_init_std": HEAD_STD, "lr": 1e-4, "grad_clip": 1.0, "seed": 0} | kw
    return MegatronCritic(model_dir, tp_size=1, **kw)


def valid_columns(mask):
    """Columns t whose state (token t) and next token (t+1) are both real; the others hold 0."""
    return (mask[:, :-1] * mask[:, 1:]).bool()


def hf_values_and_grad_norm(model_dir, head_weight, head_bias, batch, loss_fn):
    """values[:, t] = head(LlamaModel's final-norm hidden state at t), and the grad norm of loss_fn on them."""
    from transformers import AutoModel

    trunk = AutoModel.from_pretrained(model_dir)  # LlamaModel: the policy dir's lm_head is left out
    head = torch.nn.Linear(head_weight.shape[1], 1)
    head.weight.data.copy_(head_weight)
    head.bias.data.copy_(head_bias)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    hidden = trunk(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state  # after model.norm
    values = head(hidden)[:, :-1, 0].where(valid_columns(mask), 0.0)
    loss, _ = loss_fn(values, batch)
    loss.backward()
    params = [*trunk.parameters(), *head.parameters()]
    return values.detach(), float(torch.sqrt(sum(p.grad.pow(2).sum() for p in params)))


def head_of(c):
    head = c.model.module.output_layer
    return head.weight.detach().clone(), head.bias.detach().clone()


def test_values_and_grad_norm_match_hf_reference(tiny_model_dir):
    batch = make_value_batch(n_rows=4, length=10, seed=4)
    loss_fn = make_value_loss_fn(real_tokens(batch))
    c = critic(tiny_model_dir)
    values = c.values(batch["input_ids"], batch["attention_mask"], micro_batch_size=3)
    assert values.shape == (4, 9) and values.dtype == torch.float32
    ref, ref_norm = hf_values_and_grad_norm(tiny_model_dir, *head_of(c), batch, loss_fn)
    assert values.abs().max() > 0.1  # not a trivially small head
    torch.testing.assert_close(values, ref, atol=1e-5, rtol=0)
    assert torch.all(values[1, :1] == 0) and torch.all(values[3, :3] == 0)  # next token is padding

    # right padding: the same values at unshifted columns
    pads = (1 - batch["attention_mask"]).sum(1)
    right = {
        k: torch.stack([torch.roll(t, -int(n)) for t, n in zip(batch[k], pads)])
        for k in batch
        if k != "returns"
    }
    r_values = c.values(right["input_ids"], right["attention_mask"], micro_batch_size=4)
    for i in range(4):
        n = int(pads[i])
        torch.testing.assert_close(r_values[i, : 9 - n], values[i, n:], atol=1e-5, rtol=0)

    out = c.train_step(batch, loss_fn, micro_batch_size=2)
    assert out["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert out["tokens"] == real_tokens(batch)
    after = c.values(batch["input_ids"], batch["attention_mask"], micro_batch_size=4)
    assert (after - values).abs().max() > 1e-3


def test_default_head_is_small_seeded_and_the_same_on_every_build(tiny_model_dir):
    a = head_of(MegatronCritic(tiny_model_dir, seed=3))
    b = head_of(MegatronCritic(tiny_model_dir, seed=3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], torch.zeros(1))
    assert 0 < a[0].std() < 3 / 129
    zero = head_of(MegatronCritic(tiny_model_dir, head_init_std=0.0))
    assert torch.equal(zero[0], torch.zeros(1, 128))


def test_save_and_load_round_trip_is_exact(tiny_model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    batch = make_value_batch(n_rows=3, length=8, seed=5)
    c = critic(tiny_model_dir)
    c.train_step(batch, make_value_loss_fn(real_tokens(batch)), micro_batch_size=3)
    out = c.save(tmp_path / "critic")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and len(config["id2label"]) == 1

    loaded = critic(out, head_init_std=None)  # a saved head is loaded, never re-initialised
    sd, sd2 = c.hf_state_dict(), loaded.hf_state_dict()
    assert sd.keys() == sd2.keys() and "score.weight" in sd and "lm_head.weight" not in sd
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    values = c.values(ids, mask, 3)
    assert torch.equal(values, loaded.values(ids, mask, 3))

    hf = AutoModelForTokenClassification.from_pretrained(out).eval()  # the format is plain HF
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1, 0]
    torch.testing.assert_close(values, logits.where(valid_columns(mask), 0.0), atol=1e-5, rtol=0)


def test_offload_onload_keeps_values(tiny_model_dir):
    batch = make_value_batch(n_rows=2, length=8, seed=6)
    c = critic(tiny_model_dir)
    c.train_step(batch, make_value_loss_fn(real_tokens(batch)), 2)
    before = c.values(batch["input_ids"], batch["attention_mask"], 2)
    c.offload()
    assert c.model.module.output_layer.weight.untyped_storage().size() == 0
    c.onload()
    c.train_step(batch, make_value_loss_fn(real_tokens(batch)), 2)  # the optimizer state came back too
    assert not torch.equal(before, c.values(batch["input_ids"], batch["attention_mask"], 2))


# ---- token budget (dynamic micro-batches) ----------------------------------------------------------------


def shuffled_batch(maker, seed):
    """6 rows of real lengths 10..5 in a shuffled order, so the planner really reorders rows."""
    batch = maker(n_rows=6, length=10, seed=seed)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    return {k: v[perm] for k, v in batch.items()}


BUDGET = 18  # plan for lengths [7, 10, 5, 9, 6, 8]: [[1], [3, 5], [0, 4], [2]]


def test_policy_token_budget_gives_the_same_log_probs_and_step(tiny_model_dir):
    batch = shuffled_batch(make_batch, seed=7)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    p = MegatronPolicy(tiny_model_dir, tp_size=1, lr=1e-4, seed=0)
    fixed = p.log_probs(ids, mask, micro_batch_size=6)
    budget = p.log_probs(ids, mask, max_tokens_per_micro_batch=BUDGET)
    for a, b in zip(fixed, budget):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)

    loss_fn = make_loss_fn(real_tokens(batch))
    q = MegatronPolicy(tiny_model_dir, tp_size=1, lr=1e-4, seed=0)
    m_fixed = p.train_step(batch, loss_fn, micro_batch_size=2)
    m_budget = q.train_step(batch, loss_fn, micro_batch_size=2, max_tokens_per_micro_batch=BUDGET)
    assert m_budget["grad_norm"] == pytest.approx(m_fixed["grad_norm"], rel=1e-6)
    assert m_budget["loss"] == pytest.approx(m_fixed["loss"], rel=1e-6)
    sd_p, sd_q = p.hf_state_dict(), q.hf_state_dict()
    for k in sd_p:
        torch.testing.assert_close(sd_q[k], sd_p[k], atol=1e-6, rtol=0)


def test_critic_token_budget_gives_the_same_values_and_step(tiny_model_dir):
    # (1e-5: a micro-batch of another size runs oneDNN matmuls of another shape, so sums round differently)
    batch = shuffled_batch(make_value_batch, seed=8)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    loss_fn = make_value_loss_fn(real_tokens(batch))
    a, b = critic(tiny_model_dir), critic(tiny_model_dir)
    torch.testing.assert_close(
        b.values(ids, mask, max_tokens_per_micro_batch=BUDGET), a.values(ids, mask, 6), atol=1e-5, rtol=0
    )
    m_fixed = a.train_step(batch, loss_fn, micro_batch_size=4)
    m_budget = b.train_step(batch, loss_fn, max_tokens_per_micro_batch=BUDGET)
    assert m_budget["grad_norm"] == pytest.approx(m_fixed["grad_norm"], rel=1e-5)
    assert m_budget["loss"] == pytest.approx(m_fixed["loss"], rel=1e-5)
    torch.testing.assert_close(b.values(ids, mask, 6), a.values(ids, mask, 6), atol=1e-5, rtol=0)
