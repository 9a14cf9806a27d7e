"""Log-probs / entropy from hidden states and the output weight against float64 log_softmax of the full logits
(TP=2 is in the distributed tests)."""

import pytest
import torch

import yatt_ray.train.logprobs as lp
from yatt_ray.train import head_logprobs_and_entropy


def reference(hidden, weight, targets):
    """float64 log_softmax of the logits as the output layer made them (in the inputs' dtype: bf16 rounds)."""
    logits = hidden.double() @ weight.double().T if hidden.dtype == torch.float32 else hidden @ weight.T
    logp_all = torch.log_softmax(logits.double(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def check_against_reference(hidden, weight, targets, atol):
    """Values and the gradients w.r.t. hidden and weight of w1 * logp + w2 * entropy against `reference`."""
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(targets.shape, generator=g), torch.randn(targets.shape, generator=g)
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = head_logprobs_and_entropy(hidden, weight, targets)
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logp, ref_entropy = reference(hidden, weight, targets)
    torch.testing.assert_close(logp.double(), ref_logp, atol=atol, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=atol, rtol=0)
    grads = torch.autograd.grad((w1 * logp + w2 * entropy).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((w1 * ref_logp + w2 * ref_entropy).sum(), (hidden, weight))
    for grad, ref, like in zip(grads, ref_grads, (hidden, weight)):
        assert grad.dtype == like.dtype  # no float32 copy of a bf16 weight or hidden state is returned
        scale = ref.abs().max().item()
        torch.testing.assert_close(grad.double(), ref.double(), atol=atol * max(1.0, scale), rtol=0)


def test_values_and_gradients_match_log_softmax_of_the_logits():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 5, 16, generator=g), torch.randn(128, 16, generator=g)
    check_against_reference(hidden, weight, torch.randint(0, 128, (3, 5), generator=g), atol=1e-5)


def test_stable_for_huge_logits():
    weight = torch.tensor([[1e4], [0.0], [-1e4], [1e4]])
    logp, entropy = head_logprobs_and_entropy(torch.ones(1, 1, 1), weight, torch.tensor([[0]]))
    torch.testing.assert_close(logp, torch.tensor([[-0.693147]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([[0.693147]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_qwen_vocabulary_in_chunks_of_columns(monkeypatch, dtype, atol):
    """Vocabulary 151,936 (Qwen2's) walked in chunks of 40,000 columns (the last one short), the running max
    rising from chunk to chunk (the rescaling is exercised): values and gradients as log_softmax's, for float32
    and bfloat16 (whose matmuls round the logits: the looser tolerance)."""
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 7 * 40_000)  # 7 rows: 4 chunks
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 7, 32, generator=g)
    weight = torch.randn(151_936, 32, generator=g) * 0.5
    weight[120_000:] *= 1.5  # the largest logits tend to sit in the last chunks
    targets = torch.tensor([[0, 39_999, 40_000, 79_999, 120_000, 151_935, 5]])
    assert len(lp.chunk_columns(7, 151_936, cuda=False)) == 4
    check_against_reference(hidden.to(dtype), weight.to(dtype), targets, atol)


def test_only_the_gradients_asked_for_are_computed():
    """A frozen weight (the reference model) gets no gradient, a frozen hidden state none either."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 8, generator=g).requires_grad_()
    weight = torch.randn(32, 8, generator=g)
    logp, _ = head_logprobs_and_entropy(hidden, weight, torch.arange(4))
    (grad,) = torch.autograd.grad(logp.sum(), hidden)
    assert grad.shape == hidden.shape and weight.grad is None
    with torch.no_grad():
        logp, entropy = head_logprobs_and_entropy(hidden, weight, torch.arange(4))
    assert not logp.requires_grad and not entropy.requires_grad
