"""Trainer and RNG state through a real checkpoint (async writer, memory:// store) and back: training continues
exactly as if it had never stopped."""

import random
import uuid

import numpy as np
import pytest
import torch
from train_helpers import make_batch, make_loss_fn

from yatt_ray.checkpoint import AsyncCheckpointWriter, CheckpointStore, load
from yatt_ray.checkpoint.state import load_trainer_state, rng_state, set_rng_state, trainer_state
from yatt_ray.train import MegatronPolicy

pytestmark = pytest.mark.usefixtures("single_process_world")


def policy(model_dir):
    return MegatronPolicy(model_dir, tp_size=1, lr=1e-2, grad_clip=1.0, seed=0)


def test_restored_policy_takes_the_same_next_step(tiny_model_dir):
    batch = make_batch(n_rows=4, length=10, seed=3)
    loss_fn = make_loss_fn(float(batch["attention_mask"][:, 1:].sum()))
    trained = policy(tiny_model_dir)
    trained.train_step(batch, loss_fn, micro_batch_size=2)  # AdamW moments are non-zero from here on
    with AsyncCheckpointWriter(CheckpointStore(f"memory://state-{uuid.uuid4().hex}")) as writer:
        handle = writer.save(
            1, {"policy": trainer_state(trained), "policy_optimizer": trained.optimizer.state_dict()}
        )
        assert handle.result(timeout=60) is not None
        saved = writer.load(handle.ref)
    after_save = trained.train_step(batch, loss_fn, micro_batch_size=2)  # the original goes on

    resumed = policy(tiny_model_dir)  # a fresh process would build this from the HF directory
    load_trainer_state(resumed, saved["policy"], [saved["policy_optimizer"]])
    after_resume = resumed.train_step(batch, loss_fn, micro_batch_size=2)
    assert after_resume["loss"] == after_save["loss"] and after_resume["grad_norm"] == after_save["grad_norm"]
    a, b = trained.hf_state_dict(), resumed.hf_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    from megatron.core import tensor_parallel

    def draws():
        with tensor_parallel.get_cuda_rng_tracker().fork():
            dropout_draw = torch.rand(3)
        return random.random(), float(np.random.rand()), torch.rand(3), dropout_draw

    with AsyncCheckpointWriter(CheckpointStore(str(tmp_path))) as writer:
        ref = writer.save_sync(7, {"rng": rng_state()})
    expected = draws()
    draws()  # move every generator on
    set_rng_state(load(CheckpointStore(str(tmp_path)), ref)["rng"])
    again = draws()
    assert again[:2] == expected[:2]
    assert torch.equal(again[2], expected[2]) and torch.equal(again[3], expected[3])
