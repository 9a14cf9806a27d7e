"""Vocab-parallel log-probs / entropy against full-vocabulary log_softmax (TP=2 is in the distributed tests)."""

import torch

from yatt_ray.train import token_logprobs_and_entropy


def reference(logits, targets):
    logp_all = torch.log_softmax(logits.double(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_full_vocab_values_and_gradients_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 128, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 128, (3, 5), generator=g)
    w1, w2 = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

    logp, entropy = token_logprobs_and_entropy(logits, targets, tp_group=None)
    ref_logp, ref_entropy = reference(logits, targets)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=0)

    (grad,) = torch.autograd.grad((w1 * logp + w2 * entropy).sum(), logits)
    (ref_grad,) = torch.autograd.grad((w1 * ref_logp + w2 * ref_entropy).sum(), logits)
    torch.testing.assert_close(grad.double(), ref_grad.double(), atol=1e-5, rtol=0)


def test_stable_for_huge_logits():
    logits = torch.tensor([[[1e4, 0.0, -1e4, 1e4]]])
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[0]]))
    torch.testing.assert_close(logp, torch.tensor([[-0.693147]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([[0.693147]]), atol=1e-5, rtol=0)


def test_qwen_vocabulary_in_chunks_matches_log_softmax_and_keeps_bf16_logits(monkeypatch):
    """Vocabulary 151,936 (Qwen2's), several chunks of rows: values and gradients as log_softmax's, for
    float32 and bfloat16 logits; the bf16 logits' gradient stays bf16 (no float32 [T, V] copy is kept)."""
    import yatt_ray.train.logprobs as lp

    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 3 * 151_936)  # 3 rows a chunk: 7 rows -> chunks of 3, 3, 1
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, 7, 151_936, generator=g) * 3
    targets = torch.randint(0, 151_936, (1, 7), generator=g)
    w1, w2 = torch.randn(1, 7, generator=g), torch.randn(1, 7, generator=g)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-4)):
        logits = base.to(dtype).requires_grad_()
        logp, entropy = token_logprobs_and_entropy(logits, targets)
        ref_logp, ref_entropy = reference(logits.float(), targets)
        torch.testing.assert_close(logp.double(), ref_logp, atol=atol, rtol=0)
        torch.testing.assert_close(entropy.double(), ref_entropy, atol=atol, rtol=0)
        (grad,) = torch.autograd.grad((w1 * logp + w2 * entropy).sum(), logits)
        (ref_grad,) = torch.autograd.grad((w1 * ref_logp + w2 * ref_entropy).sum(), logits)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), ref_grad.double(), atol=atol, rtol=0)
