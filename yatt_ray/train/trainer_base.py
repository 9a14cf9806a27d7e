"""What every Megatron trainer of the library shares (`MegatronPolicy`, `MegatronCritic`).

A trainer is one Megatron `GPTModel` (subclasses say how to build it) in fp32 or bf16 under Megatron DDP, with
AdamW on fp32 main weights, optionally sharded over data-parallel ranks (`optimizer.MainParamOptimizer`), and:
- a no-grad pass over a batch in micro-batches whose per-row results come back in the original row order;
- a training step: micro-batches forward + backward (gradients accumulate), one DP all-reduce, clip, step;
  the all-reduce runs during the last micro-batch's backward, a bucket at a time as its gradients are complete
  (Megatron's `overlap_grad_reduce`; the earlier micro-batches run under `no_sync`);
- TP gathering of the full state dict, HF-directory writing, and offload / onload to host memory.

Gradient convention: the loss of a micro-batch is already divided by the GLOBAL normaliser (e.g. the response
tokens of the whole step, over every micro-batch and every data-parallel rank). Gradients are therefore
accumulated over micro-batches and SUMMED over data-parallel ranks (Megatron DDP with
`calculate_per_token_loss=True`, which turns off its 1/dp scaling), never averaged. With that convention the way
rows are split into micro-batches (fixed size, token budget) or over DP ranks does not change the step.

Micro-batches: `micro_batch_size` rows each, or, with `max_tokens_per_micro_batch`, planned by
`micro_batches.plan_micro_batches` (rows sorted by real length; see there); the budget wins when both are given.
Tensor-parallel ranks of one DP group get the same batch, so they plan the same micro-batches.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from yatt_ray.metrics.timeline import SpanRecorder
from yatt_ray.model_shape import LlamaShape
from yatt_ray.train.hf_convert import StateDict
from yatt_ray.train.micro_batches import micro_batch_indices, select_rows
from yatt_ray.train.model import init_parallel_state, seed_everything, tp_partial_grad_parameters
from yatt_ray.train.optimizer import MainParamOptimizer, main_grad

MicroLoss = Callable[[dict, dict], tuple[torch.Tensor, dict]]  # (micro on the device, micro on the host)
RowForward = Callable[..., Sequence[torch.Tensor]]  # (ids [b, T], mask [b, T], **extra rows) -> [b, ...] each
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.dtype -> the weights' torch dtype


class MegatronTrainerBase:
    """Megatron DDP + AdamW on main weights + micro-batch loops + offload around `_build_model`'s model.

    Args:
        model_dir: Hugging Face Llama directory the model is built from (config.json, *.safetensors, ...).
        tp_size: tensor-parallel size; the world size must be a multiple of it (DP = world / tp).
        lr, weight_decay, betas: AdamW settings (no weight decay on 1-D params: norm weights, biases).
        grad_clip: max global grad norm (<= 0 turns clipping off; the norm is still reported).
        seed: torch and Megatron RNG seed.
        dtype: "fp32" or "bf16" (the weights and compute; gradients and the optimizer's main weights are fp32).
        distributed_optimizer: shard the optimizer state over the data-parallel ranks (ZeRO-1).
        recompute_activations: run each decoder layer's forward again in the backward instead of keeping its
            activations (`model.recompute_layers`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        tp_size: int,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        grad_clip: float,
        seed: int,
        dtype: str = "fp32",
        distributed_optimizer: bool = False,
        recompute_activations: bool = False,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]

        self.model_dir = Path(model_dir)
        self.recompute = recompute_activations
        self.shape = LlamaShape.from_hf_dir(self.model_dir)
        self.seed = seed
        init_parallel_state(tp_size)  # imports Megatron (`import_megatron`) on first use
        from megatron.core import parallel_state as ps

        seed_everything(seed)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.grad_clip = grad_clip
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        )
        self.model = _wrap_ddp(self._build_model(), distributed_optimizer)
        self.optimizer = MainParamOptimizer(
            self.model, lr, weight_decay, betas, distributed_optimizer, self.dp_group
        )
        self._offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.forward_tokens = 0  # tokens the model ran over since the last train step began (packed)
        # set by the controller: a train step's parts become timeline spans (the gradient all-reduce as a wait)
        self.recorder: SpanRecorder | None = None
        self.compute_s = 0.0  # seconds of forward / backward / optimizer in train steps since the last read

    # ---- what subclasses provide ---------------------------------------------------------------------------

    def _build_model(self) -> torch.nn.Module:
        """The trainable (unwrapped) model in `self.dtype`, weights loaded; called once by __init__."""
        raise NotImplementedError

    def _frozen_modules(self) -> list[torch.nn.Module]:
        """Extra modules whose weights `offload` / `onload` move too (e.g. a reference model)."""
        return []

    def _side_params(self) -> list[torch.nn.Parameter]:
        """Trainable parameters outside the Megatron model (e.g. a vision projector): their gradients are
        summed over data-parallel ranks here, counted in the clipped norm, and `_side_optimizer` steps them."""
        return []

    def _side_optimizer(self) -> torch.optim.Optimizer | None:
        return None

    # ---- micro-batch loops ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _map_rows(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        micro_batch_size: int | None,
        max_tokens: int | None,
        forward: RowForward,
        group_size: int = 1,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Run `forward(ids [b, T], mask [b, T], **extra rows) -> tensors [b, ...]` per micro-batch, in eval
        mode, its inputs on the host (as `_train_step`'s `host`); groups of `group_size` consecutive rows stay
        in one micro-batch. `extra`: more [B, ...] tensors sliced with the rows (a vision policy's
        `pixel_values`, `image_count`).

        Returns each output for all B rows, in the original row order, on the CPU.
        """
        rows = input_ids.shape[0]
        if rows == 0:
            raise ValueError("the batch has no rows; nothing to compute")
        model.eval()
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, **(extra or {})}
        outs: list[torch.Tensor] = []
        for index in micro_batch_indices(attention_mask, micro_batch_size, max_tokens, group_size):
            micro = select_rows(batch, rows, index, "cpu")  # `forward` packs on the host, moves what it runs
            ids, mask = micro.pop("input_ids"), micro.pop("attention_mask")
            results = forward(ids, mask, **micro)
            if not outs:
                outs = [torch.zeros(rows, *r.shape[1:], dtype=r.dtype) for r in results]
            at = torch.tensor(index, dtype=torch.long)
            for out, r in zip(outs, results):
                out[at] = r.cpu()
        return outs

    def _train_step(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int | None,
        max_tokens: int | None,
        micro_loss: MicroLoss,
        group_size: int = 1,
    ) -> dict:
        """One optimizer step: `micro_loss(micro, host) -> (loss, metrics)` per micro-batch, backward each.

        Every tensor of `batch` with B rows is indexed per micro-batch: `micro` on the device (for the loss),
        `host` on the CPU (what the forward packs: reading the device's copy back would wait for every kernel
        queued before, the previous micro-batch's backward included, and leave the GPU idle while the host
        packs); other values are passed whole; groups of `group_size` consecutive rows stay in one
        micro-batch. Returns {"grad_norm", "lr", "forward_tokens", **metrics}, metrics summed over micro-batches and DP ranks;
        forward_tokens counts the tokens the model ran over (packed, summed over DP ranks).
        """
        self.model.train()
        rows = batch["input_ids"].shape[0]
        totals: dict[str, Any] = {}  # float or 0-d tensor on the device
        self.forward_tokens = 0
        with self._part("forward_backward"):
            indices = micro_batch_indices(batch["attention_mask"], micro_batch_size, max_tokens, group_size)
            if not indices:
                raise ValueError("the batch has no rows; nothing to train")
            for i, index in enumerate(indices):
                last = i == len(indices) - 1
                with nullcontext() if last else self.model.no_sync():
                    host = select_rows(batch, rows, index, "cpu")
                    micro = host if self.device == "cpu" else select_rows(batch, rows, index, self.device)
                    loss, metrics = micro_loss(micro, host)
                    loss.backward()
                for k, v in metrics.items():  # summed on the device: read once, at the end of the step
                    totals[k] = totals.get(k, 0.0) + (v.detach().double() if torch.is_tensor(v) else v)
        with self._part("grad_sync", busy=False):  # waits here for the slowest data-parallel rank
            grad_norm = self._sync_and_clip()
        with self._part("optimizer"):
            self.optimizer.step()
            side = self._side_optimizer()
            if side is not None:
                side.step()
            self._zero_grads()
        totals["forward_tokens"] = float(self.forward_tokens)  # summed over the DP ranks with the metrics
        norm, totals = self._read_step(grad_norm, totals)
        return {"grad_norm": norm, "lr": self.lr, **totals}

    @contextmanager
    def _part(self, name: str, busy: bool = True) -> Iterator[None]:
        """A part of a train step: a span when a recorder is set; busy parts add to `compute_s`."""
        start = time.perf_counter()
        with self.recorder.span(name, busy=busy) if self.recorder is not None else nullcontext():
            yield
        if busy:
            self.compute_s += time.perf_counter() - start

    def _sync_and_clip(self) -> torch.Tensor:
        """Sum gradients over DP (all-reduce, or reduce-scatter into the owned shards when the optimizer is
        sharded), clip by the global norm on the device (no value read back); return the norm (0-d float64).
        The DP reduction began during the last micro-batch's backward, bucket by bucket (Megatron's
        `overlap_grad_reduce`); it is waited for before anything else touches the gradient buffer (sums commute:
        DP then TP is the same sum as TP then DP)."""
        self.model.finish_grad_sync()
        if dist.get_world_size(self.tp_group) > 1:  # per-head norms (Qwen3): each TP rank saw its heads only
            for p in tp_partial_grad_parameters(self.model):
                dist.all_reduce(main_grad(p), group=self.tp_group)
        side = []  # summed over DP ranks like the model's (the loss is globally normalised)
        for p in self._side_params():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = grad
            if dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(grad, group=self.dp_group)
            side.append((p, grad))
        norm = self._grad_norm(side)
        if self.grad_clip > 0:  # on the device: scale 1 unless the norm is above the clip (a NaN norm: 1)
            scale = torch.where(norm > self.grad_clip, self.grad_clip / (norm + 1e-6), 1.0)
            self.optimizer.scale_grads(scale)
            if side:
                torch._foreach_mul_([grad for _, grad in side], scale.to(side[0][1].dtype))
        return norm

    def _grad_norm(self, side: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> torch.Tensor:
        """L2 norm of the whole gradient (the model's owned pieces and `side`'s (param, grad) pairs);
        TP-replicated params (norms, the value head) counted once."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        def counted(p) -> bool:
            return param_is_not_tensor_parallel_duplicate(p, self.tp_group)

        sq = self.optimizer.grad_square_sum(counted).to(self.device)
        for p, grad in side:
            if counted(p):
                sq += grad.detach().double().pow(2).sum()
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    def _zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        for p in self._side_params():
            p.grad = None

    def _read_step(self, grad_norm: torch.Tensor, totals: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """(The grad norm, the metrics summed over the data-parallel ranks) read to the host in one copy: the
        step's one wait for the device, after its last kernel was queued."""
        keys = sorted(totals)  # forward_tokens at least
        summed = torch.stack(
            [torch.as_tensor(totals[k], dtype=torch.float64, device=self.device) for k in keys]
        )
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(summed, group=self.dp_group)
        norm, *read = torch.cat([grad_norm.reshape(1).to(summed), summed]).tolist()
        return norm, dict(zip(keys, read))

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (for a schedule driven by the caller)."""
        side = self._side_optimizer()
        for group in [*self.optimizer.param_groups, *(side.param_groups if side is not None else [])]:
            group["lr"] = lr

    # ---- export --------------------------------------------------------------------------------------------

    def _gather_tp_shards(self) -> list[StateDict] | None:
        """Every TP rank's Megatron state dict (CPU, no `_extra_state`) on TP rank 0; None elsewhere.

        Collective over the TP group: every TP rank must call it.
        """
        shard = {
            k: v.detach() for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")
        }
        tp = dist.get_world_size(self.tp_group)
        if tp == 1:
            return [{k: v.cpu() for k, v in shard.items()}]
        is_root = dist.get_rank(self.tp_group) == 0
        shards: list[StateDict] = [{} for _ in range(tp)]
        for key, t in shard.items():
            parts = [torch.empty_like(t) for _ in range(tp)] if is_root else None
            dist.gather(t.contiguous(), parts, group=self.tp_group, group_dst=0)
            if parts is not None:
                for r, part in enumerate(parts):
                    shards[r][key] = part.cpu()
        return shards if is_root else None

    def _is_writer(self) -> bool:
        """TP rank 0 of DP rank 0: the one rank that writes files."""
        return dist.get_rank(self.tp_group) == 0 and dist.get_rank(self.dp_group) == 0

    # ---- offload -------------------------------------------------------------------------------------------

    def offload(self) -> int:
        """Move params (and those of `_frozen_modules`), grad buffers and optimizer state (main weights,
        moments) to host memory.

        Device tensors keep their identity: each storage is copied to host memory whole and freed (resized to
        0), so the optimizer's, DDP's and every view's references stay valid. Grad buffers hold nothing between
        steps and are only freed. On CPU the copy and free still happen (that is what the tests exercise).
        Returns the bytes moved to host memory.
        """
        if self._offloaded:
            return 0
        for storage in self._offloadable():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host.copy_(_as_bytes(storage))
            storage.resize_(0)
            self._offloaded.append((storage, host))
        self.model.offload_grad_buffers(synchronize=torch.cuda.is_available(), empty_cache=True)
        return sum(host.numel() for _, host in self._offloaded)

    def onload(self) -> None:
        """Undo `offload`: reallocate device storage, copy the host copies back, re-create zeroed grad buffers."""
        if not self._offloaded:
            return
        for storage, host in self._offloaded:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host)
        self._offloaded = []
        self.model.restore_grad_buffers(synchronize=torch.cuda.is_available())

    def _offloadable(self) -> list[torch.UntypedStorage]:
        """The storages of params and optimizer state, each once (a sharded optimizer's params are views of
        one DDP buffer; an fp32 main weight is a view of its param)."""
        tensors = [p.data for p in self.model.parameters()] + self.optimizer.tensors()
        for module in self._frozen_modules():
            tensors += [p.data for p in module.parameters()]
        side = self._side_optimizer()
        for state in side.state.values() if side is not None else []:
            tensors += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 0]
        unique: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            unique.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return list(unique.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


# parameters per gradient-reduction bucket; None: Megatron's default (max(40M, 1M x DP size))
GRAD_BUCKET_PARAMS: int | None = None


def _wrap_ddp(model: torch.nn.Module, distributed_optimizer: bool):
    """Megatron DDP with fp32 gradient buffers; with `distributed_optimizer` it reduce-scatters them into the
    owned shards and keeps the weights in one flat buffer per dtype that `start_param_sync` all-gathers.
    Buckets (`GRAD_BUCKET_PARAMS` parameters each) are reduced while the backward pass goes on: on GPUs on
    NCCL's stream beside the remaining backward (not measured here); on a 2-core CPU on gloo's thread (100m dp
    2, three buckets: train phase 3.85 / 3.88 s against 4.03 / 4.06 s reduced after the backward; a 67M GQA
    shape, two buckets: 3.01 s against 2.99 s, the wait saved and the backward slowed alike; with 4M-parameter
    buckets, 25 gloo calls whose copies and sums take the cores from the backward: 3.87 s, no gain)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=GRAD_BUCKET_PARAMS,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


SHARD_BYTES = 5 * 10**9  # the largest weights file of an export: Hugging Face's own default shard size


def write_hf_dir(
    source_dir: Path,
    out_dir: str | Path,
    state_dict: StateDict,
    config_update: dict | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a HF directory: `source_dir`'s non-weight files (config, tokenizer, ...) + the weights, one
    model.safetensors up to `shard_bytes`, past it model-0000i-of-0000n.safetensors shards of at most that size
    each and model.safetensors.index.json (what `save_pretrained` writes: a 7B policy in bf16 is 3 shards).

    `config_update` entries are merged into the copied config.json; so is the weights' dtype ("dtype", and
    "torch_dtype" where the config has that older key) when every floating tensor has the same one.
    """
    from huggingface_hub import save_torch_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for src in source_dir.iterdir():
        if src.resolve() == (out / src.name).resolve():
            continue  # saving over the source directory: keep its files
        if src.is_file() and not src.name.endswith(".safetensors") and "safetensors.index" not in src.name:
            shutil.copy2(src, out / src.name)
    config = json.loads((out / "config.json").read_text())
    dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # "torch_dtype": the older key, kept in step where the config has it
        name = str(dtypes.pop()).removeprefix("torch.")
        config.update({key: name for key in ("dtype", "torch_dtype") if key == "dtype" or key in config})
    config.update(config_update or {})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for old in out.glob("model*.safetensors*"):  # an export over an earlier one: no stale shard left behind
        old.unlink()
    save_torch_state_dict(state_dict, out, max_shard_size=shard_bytes, metadata={"format": "pt"})
    return out
