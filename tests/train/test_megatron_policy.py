"""MegatronPolicy at TP=1 in one process: log-probs, padding, a training step, export and offload."""

import pytest
import torch
from train_helpers import make_batch, make_loss_fn

from yatt_ray.train import MegatronPolicy

pytestmark = pytest.mark.usefixtures("single_process_world")


def policy(model_dir, **kw):
    return MegatronPolicy(model_dir, tp_size=1, lr=1e-4, grad_clip=1.0, seed=0, **kw)


def hf_logp_and_grad_norm(model_dir, batch, loss_fn):
    """Per-token logp, and the grad norm of the same loss, computed with transformers' LlamaForCausalLM."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    valid = (mask[:, :-1] * mask[:, 1:]).bool()
    logp, entropy = logp.where(valid, 0.0), entropy.where(valid, 0.0)
    loss, _ = loss_fn(logp, entropy, batch)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in hf.parameters() if p.grad is not None))
    return logp.detach(), float(norm)


def test_log_probs_match_hf_and_padding_does_not_matter(tiny_model_dir):
    p = policy(tiny_model_dir)
    batch = make_batch(n_rows=4, length=10)
    logp, entropy = p.log_probs(batch["input_ids"], batch["attention_mask"], micro_batch_size=3)
    assert logp.shape == entropy.shape == (4, 9)

    ref_logp, _ = hf_logp_and_grad_norm(tiny_model_dir, batch, make_loss_fn(1.0))
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)

    # each left-padded row equals the same tokens without padding, shifted right by the pad count
    for i in range(4):
        real = batch["attention_mask"][i].bool()
        pads = int((~real).sum())
        ids = batch["input_ids"][i, real][None]
        alone, alone_ent = p.log_probs(ids, torch.ones_like(ids), micro_batch_size=1)
        torch.testing.assert_close(logp[i, pads:], alone[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i, pads:], alone_ent[0], atol=1e-5, rtol=0)
        assert torch.all(logp[i, :pads] == 0)

    # the same rows right-padded give the same values, at unshifted columns
    pads = (1 - batch["attention_mask"]).sum(1)
    roll = [torch.roll(t, -int(n)) for t, n in zip(batch["input_ids"], pads)]
    right_mask = torch.stack([torch.roll(t, -int(n)) for t, n in zip(batch["attention_mask"], pads)])
    r_logp, _ = p.log_probs(torch.stack(roll), right_mask, micro_batch_size=4)
    for i in range(4):
        n = int(pads[i])
        torch.testing.assert_close(r_logp[i, : 9 - n], logp[i, n:], atol=1e-5, rtol=0)
        assert torch.all(r_logp[i, 9 - n :] == 0)


def test_train_step_grad_norm_matches_hf_autograd(tiny_model_dir):
    batch = make_batch(n_rows=4, length=10)
    tokens = float(batch["attention_mask"][:, 1:].sum())
    loss_fn = make_loss_fn(tokens)
    _, ref_norm = hf_logp_and_grad_norm(tiny_model_dir, batch, loss_fn)

    p = policy(tiny_model_dir, with_reference=True)
    before, _ = p.log_probs(batch["input_ids"], batch["attention_mask"], 4)
    out = p.train_step(batch, loss_fn, micro_batch_size=4)
    assert out["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert out["lr"] == 1e-4 and out["tokens"] == tokens

    after, _ = p.log_probs(batch["input_ids"], batch["attention_mask"], 4)
    ref_after, _ = p.log_probs(batch["input_ids"], batch["attention_mask"], 4, reference=True)
    assert (after - before).abs().max() > 1e-3  # the policy moved ...
    torch.testing.assert_close(ref_after, before, atol=0, rtol=0)  # ... the reference did not


def test_groups_sharing_a_prompt_match_hf_in_log_probs_and_gradient(tiny_model_dir):
    """Samples of one prompt packed together (`group_size`): the body's last token predicts every sample's
    first response token (an extra prediction per sample after the first). Log-probs, entropies and the
    gradient equal HF's on the unpacked rows, with samples that begin alike, differently, or end early."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for prompt_len in (3, 5):
        prompt = torch.randint(4, 100, (prompt_len,), generator=g).tolist()
        rows += [prompt + r for r in ([7, 8, 9], [7, 20], [31, 8, 9, 10], [44])]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding, as the rollout batch has it
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    batch = {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(len(rows), generator=g)}
    loss_fn = make_loss_fn(float(mask[:, 1:].sum()))
    ref_logp, ref_norm = hf_logp_and_grad_norm(tiny_model_dir, batch, loss_fn)

    p = policy(tiny_model_dir)
    logp, entropy = p.log_probs(ids, mask, micro_batch_size=8, group_size=4)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    alone_logp, alone_entropy = p.log_probs(ids, mask, micro_batch_size=8, group_size=1)
    torch.testing.assert_close(entropy, alone_entropy, atol=1e-5, rtol=0)
    p.forward_tokens = 0
    out = p.train_step(batch, loss_fn, micro_batch_size=8, group_size=4)
    assert out["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    # each group's prompt once, then each sample's response tokens: no token is run twice (before, every
    # sample also ran a copy of the prompt's last token: 8 more)
    assert out["forward_tokens"] == sum(len(r) for r in rows) - 3 * (3 + 5)


def test_micro_batches_give_the_same_step(tiny_model_dir):
    batch = make_batch(n_rows=4, length=10, seed=1)
    loss_fn = make_loss_fn(float(batch["attention_mask"][:, 1:].sum()))
    results = []
    for mbs in (1, 4):
        p = policy(tiny_model_dir)
        metrics = p.train_step(batch, loss_fn, micro_batch_size=mbs)
        results.append((metrics, p.hf_state_dict()))
    (m1, sd1), (m4, sd4) = results
    assert m1["grad_norm"] == pytest.approx(m4["grad_norm"], rel=1e-5)
    assert m1["loss"] == pytest.approx(m4["loss"], rel=1e-5)
    for k in sd1:
        torch.testing.assert_close(sd1[k], sd4[k], atol=1e-5, rtol=0)


def test_rows_with_zero_advantage_left_out_give_the_same_step(tiny_model_dir):
    """What `train.skip_zero_advantage` relies on: with no entropy term, rows whose advantages are 0 add
    nothing to the gradient, so training the other rows (same normaliser) gives the same weights."""
    batch = make_batch(n_rows=4, length=10, seed=3)
    batch["advantages"][[1, 3]] = 0.0
    loss_fn = make_loss_fn(float(batch["attention_mask"][:, 1:].sum()), entropy_coef=0.0)
    full, part = policy(tiny_model_dir), policy(tiny_model_dir)
    before = full.hf_state_dict()
    m_full = full.train_step(batch, loss_fn, micro_batch_size=4)
    m_part = part.train_step({k: v[[0, 2]] for k, v in batch.items()}, loss_fn, micro_batch_size=4)
    assert m_part["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5) and m_full["grad_norm"] > 0
    a, b = full.hf_state_dict(), part.hf_state_dict()
    assert not all(torch.equal(a[k], before[k]) for k in a)  # the step moved the weights
    for k in a:  # Adam's first step is ~lr g / |g|: a gradient near 0 turns fp32 rounding into ~lr / 10
        torch.testing.assert_close(a[k], b[k], atol=2e-6, rtol=0)


def test_offload_onload_keeps_training_identical(tiny_model_dir):
    batch = make_batch(n_rows=2, length=8, seed=2)
    loss_fn = make_loss_fn(float(batch["attention_mask"][:, 1:].sum()))
    plain, cycled = policy(tiny_model_dir, with_reference=True), policy(tiny_model_dir, with_reference=True)
    for _ in range(2):
        plain.train_step(batch, loss_fn, 2)
        cycled.train_step(batch, loss_fn, 2)
        cycled.offload()
        param = next(cycled.model.parameters())
        assert param.untyped_storage().size() == 0  # really released
        moments = [t for state in cycled.optimizer.state.values() for t in state.values() if t.numel() > 1]
        assert moments and all(t.untyped_storage().size() == 0 for t in moments)
        cycled.onload()
    a, b = plain.hf_state_dict(), cycled.hf_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = plain.log_probs(batch["input_ids"], batch["attention_mask"], 2, reference=True)[0]
    rb = cycled.log_probs(batch["input_ids"], batch["attention_mask"], 2, reference=True)[0]
    assert torch.equal(ra, rb)


def test_save_hf_and_buckets(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = policy(tiny_model_dir)
    batch = make_batch(n_rows=2, length=8)
    p.train_step(batch, make_loss_fn(float(batch["attention_mask"][:, 1:].sum())), 2)
    sd = p.hf_state_dict()
    out = p.save_hf(tmp_path / "export")

    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert (
        AutoTokenizer.from_pretrained(out)("12").input_ids
        == AutoTokenizer.from_pretrained(tiny_model_dir)("12").input_ids
    )

    buckets = list(p.iter_hf_buckets(bucket_bytes=40_000))
    assert [n for b in buckets for n, _ in b] == list(sd)
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 40_000 or len(b) == 1
    assert len(buckets) > 1


def test_a_large_export_is_sharded_and_loads_whole(tiny_model_dir, tmp_path):
    """Past `shard_bytes` the export is model-0000i-of-0000n.safetensors + the index (what from_pretrained
    and the library's own reader follow); a later export into the folder leaves no stale shard behind."""
    from transformers import AutoModelForCausalLM

    from yatt_ray.train.model import read_hf_state_dict
    from yatt_ray.train.trainer_base import write_hf_dir

    sd = policy(tiny_model_dir).hf_state_dict()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    out = write_hf_dir(tiny_model_dir, tmp_path / "export", sd, shard_bytes=total // 3)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and (out / "model.safetensors.index.json").is_file(), shards
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert read_hf_state_dict(out).keys() == sd.keys()
    write_hf_dir(tiny_model_dir, out, sd)  # one file again
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
