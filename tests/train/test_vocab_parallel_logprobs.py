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
