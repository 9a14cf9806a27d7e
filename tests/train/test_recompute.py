"""Activation recomputation (`train.recompute_activations`): the same step, with less kept for the backward."""

import pytest
import torch
from train_helpers import make_batch, make_loss_fn

from yatt_ray.train import MegatronPolicy

pytestmark = pytest.mark.usefixtures("single_process_world")


def test_recomputed_layers_give_the_same_step(tiny_model_dir):
    batch = make_batch(n_rows=4, length=10, seed=5)
    loss_fn = make_loss_fn(float(batch["attention_mask"][:, 1:].sum()))
    steps = []
    for recompute in (False, True):
        p = MegatronPolicy(tiny_model_dir, lr=1e-4, seed=0, recompute_activations=recompute)
        calls = []
        for layer in p.model.module.decoder.layers:  # count each layer's MLP forwards
            layer.mlp.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        metrics = p.train_step(batch, loss_fn, micro_batch_size=4)
        steps.append((metrics, p.hf_state_dict(), len(calls)))
    (plain, sd_plain, n_plain), (recomputed, sd_re, n_re) = steps
    assert n_re == 2 * n_plain > 0  # every layer ran forward again in the backward
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6) and plain["grad_norm"] > 0
    for k in sd_plain:
        torch.testing.assert_close(sd_re[k], sd_plain[k], atol=1e-6, rtol=0)
