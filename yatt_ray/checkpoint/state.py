"""What one training worker's checkpoint holds, and putting it back: trainer state and RNG states.

A trainer (`MegatronPolicy`, `MegatronCritic`) saves its Megatron model's ``state_dict`` (this rank's
tensor-parallel shard) and its AdamW ``state_dict``. Data-parallel replicas are identical, so only data-parallel
rank 0's ranks save trainers; every rank saves its RNG states (python, numpy, torch CPU, torch CUDA when there
is one, and Megatron's tensor-parallel RNG tracker).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def trainer_state(trainer) -> dict[str, Any]:
    """The live (not copied) model and optimizer state of a `MegatronTrainerBase`; the writer snapshots it.
    A vision policy whose encoder trains (model.train_vision) adds the encoder and its optimizer."""
    state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
    side = trainer._side_optimizer()
    if side is not None:
        state.update(encoder=trainer.encoder.state_dict(), encoder_optimizer=side.state_dict())
    return state


def load_trainer_state(trainer, state: dict[str, Any]) -> None:
    """Copy a `trainer_state` back into `trainer` (same shapes: same model and tensor-parallel size)."""
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    side = trainer._side_optimizer()
    if side is not None:
        if "encoder" not in state:
            raise ValueError(
                "the checkpoint holds no vision encoder state but model.train_vision trains the encoder; "
                "resume with the model.train_vision the run started with"
            )
        trainer.encoder.load_state_dict(state["encoder"])
        side.load_state_dict(state["encoder_optimizer"])


def rng_state() -> dict[str, Any]:
    """Every RNG a training step draws from, as tensors and plain containers (no other pickled objects)."""
    from megatron.core import tensor_parallel

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # a tensor, not an ndarray: checkpoints are read with torch.load(weights_only=True)
        "numpy": (name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "megatron": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured (the CUDA states only when both runs have CUDA)."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
