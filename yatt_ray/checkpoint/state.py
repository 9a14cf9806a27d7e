"""What one training worker's checkpoint holds, and putting it back: trainer state and RNG states.

A trainer (`MegatronPolicy`, `MegatronCritic`) saves its Megatron model's ``state_dict`` (this rank's
tensor-parallel shard) from data-parallel rank 0 only (data-parallel replicas hold the same weights), and its
optimizer state (`optimizer.MainParamOptimizer.state_dict`: pieces of parameters by name and range) from every
rank that owns a part of it: data-parallel rank 0 alone, or every rank when the optimizer is sharded
(`train.distributed_optimizer`). Every rank saves its RNG states (python, numpy, torch CPU, torch CUDA when
there is one, and Megatron's tensor-parallel RNG tracker).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from yatt_ray.checkpoint.store import CheckpointError


def trainer_state(trainer) -> dict[str, Any]:
    """The live (not copied) model state of a `MegatronTrainerBase`; the writer snapshots it. A vision policy
    whose encoder trains (model.train_vision) adds the encoder and its optimizer (replicated over DP)."""
    state = {"model": trainer.model.state_dict()}
    side = trainer._side_optimizer()
    if side is not None:
        state.update(encoder=trainer.encoder.state_dict(), encoder_optimizer=side.state_dict())
    return state


def owns_optimizer_state(trainer, dp_rank: int) -> bool:
    """Whether this rank's checkpoint holds optimizer state: DP rank 0, or every rank of a sharded optimizer."""
    return dp_rank == 0 or trainer.optimizer.distributed


def load_trainer_state(trainer, state: dict[str, Any], optimizer: list[dict] | None = None) -> None:
    """Copy a `trainer_state` back into `trainer` (same model and tensor-parallel size), then the optimizer from
    `optimizer`: the saved ranks' optimizer states (see `MainParamOptimizer.load_state_dict`). A checkpoint
    written before optimizer pieces existed holds a torch AdamW state under state["optimizer"]."""
    trainer.model.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer = [pieces_from_adamw(state["optimizer"], trainer.model)]
    if optimizer is None:
        raise ValueError("the checkpoint holds no optimizer state for this trainer")
    trainer.optimizer.load_state_dict(optimizer)
    side = trainer._side_optimizer()
    if side is None and "encoder" in state:
        raise CheckpointError(
            "the checkpoint holds a trained vision encoder (its run had model.train_vision=projector or all), "
            "but this run has model.train_vision=none, which would drop what was trained; resume with the "
            "model.train_vision the run started with"
        )
    if side is not None:
        if "encoder" not in state:
            raise CheckpointError(
                "the checkpoint holds no vision encoder state but model.train_vision trains the encoder; "
                "resume with the model.train_vision the run started with"
            )
        trainer.encoder.load_state_dict(state["encoder"])
        side.load_state_dict(state["encoder_optimizer"])


def pieces_from_adamw(saved: dict[str, Any], model) -> dict[str, Any]:
    """A torch AdamW ``state_dict`` of the whole model (what checkpoints held before optimizer pieces: param
    groups [2-D and larger, 1-D] of the trainable parameters in `model.parameters()` order) as one rank's
    optimizer pieces, every parameter whole."""
    from yatt_ray.train.optimizer import PIECES_FORMAT

    trainable = [p for p in model.parameters() if p.requires_grad]
    order = [p for p in trainable if p.ndim > 1] + [p for p in trainable if p.ndim <= 1]
    names = {p: n for n, p in model.module.named_parameters()}
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    if len(indices) != len(order):
        raise ValueError(
            f"the checkpoint's optimizer state has {len(indices)} parameters, the model {len(order)}"
        )
    pieces = []
    for index, param in zip(indices, order):
        entry: dict[str, Any] = {
            "name": names[param],
            "start": 0,
            "end": param.numel(),
            "numel": param.numel(),
        }
        moments = saved["state"].get(index)
        if moments:
            entry.update(
                step=float(moments["step"]),
                exp_avg=moments["exp_avg"].reshape(-1),
                exp_avg_sq=moments["exp_avg_sq"].reshape(-1),
            )
        pieces.append(entry)
    return {"format": PIECES_FORMAT, "pieces": pieces}


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
