"""`MegatronPolicy`: the per-worker trainer (log-probs, a training step, HF export, offload).

One instance lives in every training worker. Tensor-parallel ranks of one data-parallel group must call every
method with the same arguments (the group's controller broadcasts the batch); most methods are collectives.

Gradient convention: `loss_fn` already divides by the GLOBAL normaliser (e.g. the response tokens of the whole
step, over every micro-batch and every data-parallel rank). Gradients are therefore accumulated over
micro-batches and SUMMED over data-parallel ranks (Megatron DDP with `calculate_per_token_loss=True`, which
turns off its 1/dp scaling), never averaged.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from yatt_ray.train.hf_convert import LlamaShape, StateDict, megatron_to_hf
from yatt_ray.train.logprobs import token_logprobs_and_entropy
from yatt_ray.train.model import build_gpt_model, init_parallel_state, load_hf_weights, seed_everything
from yatt_ray.train.packing import pack_rows, unpack_next_token_values

LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]


class MegatronPolicy:
    """A Llama policy as a Megatron GPTModel under Megatron DDP, with plain AdamW and an optional reference.

    Args:
        model_dir: Hugging Face Llama directory (config.json, *.safetensors, tokenizer files).
        tp_size: tensor-parallel size; the world size must be a multiple of it (DP = world / tp).
        lr, weight_decay, betas: AdamW settings (no weight decay on 1-D params: the RMSNorm weights).
        grad_clip: max global grad norm (<= 0 turns clipping off; the norm is still reported).
        seed: torch and Megatron RNG seed.
        with_reference: also build a frozen copy of the initial weights for reference log-probs.
    """

    def __init__(
        self,
        model_dir: str | Path,
        tp_size: int = 1,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        seed: int = 0,
        with_reference: bool = False,
    ):
        from megatron.core import parallel_state as ps

        self.model_dir = Path(model_dir)
        self.shape = LlamaShape.from_hf_dir(self.model_dir)
        init_parallel_state(tp_size)
        seed_everything(seed)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.grad_clip = grad_clip
        self.model = self._wrap_ddp(self._load_model())
        self.optimizer = self._make_optimizer(lr, weight_decay, betas)
        self.reference = self._load_model().eval().requires_grad_(False) if with_reference else None
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        )
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- construction -------------------------------------------------------------------------------------

    def _load_model(self):
        model = build_gpt_model(self.shape)
        load_hf_weights(model, self.model_dir, self.shape)
        return model

    @staticmethod
    def _wrap_ddp(model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)

    def _make_optimizer(self, lr, weight_decay, betas) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))

    # ---- forward ------------------------------------------------------------------------------------------

    def _forward(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """input_ids, attention_mask [B, T] -> (logp, entropy) [B, T-1]; column t predicts token t+1."""
        packed = pack_rows(input_ids.to(self.device), attention_mask.to(self.device))
        logits = model(packed.input_ids, packed.position_ids, packed.attention_mask())  # [B, L, V/tp]
        logp, entropy = token_logprobs_and_entropy(logits[:, :-1], packed.input_ids[:, 1:], self.tp_group)
        total = input_ids.shape[1]
        return (
            unpack_next_token_values(packed, logp, total),
            unpack_next_token_values(packed, entropy, total),
        )

    @torch.no_grad()
    def log_probs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        micro_batch_size: int,
        reference: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log p(input_ids[:, t+1] | input_ids[:, :t+1]) and entropy, each [B, T-1] float32 (CPU).

        attention_mask [B, T]: 1 = real token; left or right padding. Columns whose next token is padding are 0.
        `reference=True` uses the frozen reference model (built with `with_reference=True`). Call `onload()`
        first if the weights were offloaded.
        """
        if reference and self.reference is None:
            raise RuntimeError("reference log-probs need MegatronPolicy(..., with_reference=True)")
        model = self.reference if reference else self.model
        assert model is not None
        model.eval()
        outs = [
            self._forward(model, ids, mask)
            for ids, mask in zip(input_ids.split(micro_batch_size), attention_mask.split(micro_batch_size))
        ]
        return torch.cat([o[0] for o in outs]).cpu(), torch.cat([o[1] for o in outs]).cpu()

    # ---- training -----------------------------------------------------------------------------------------

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, micro_batch_size: int) -> dict:
        """One optimizer step over `batch` (rows split into micro-batches; gradients accumulate).

        batch: at least input_ids [B, T] and attention_mask [B, T]; every tensor with B rows is sliced per
        micro-batch (and moved to the model's device), other values are passed whole. loss_fn(logp [b, T-1], entropy [b, T-1], micro_batch)
        -> (loss scalar, metrics {name: float or 0-d tensor}), normalised by the global normaliser.
        Returns {"grad_norm", "lr", **metrics}; metrics are summed over micro-batches and data-parallel
        ranks (so a metric normalised like the loss adds up to its whole-step value).
        """
        self.model.train()
        rows = batch["input_ids"].shape[0]
        totals: dict[str, float] = {}
        for start in range(0, rows, micro_batch_size):
            micro = {
                k: v[start : start + micro_batch_size].to(self.device) if _has_rows(v, rows) else v
                for k, v in batch.items()
            }
            logp, entropy = self._forward(self.model, micro["input_ids"], micro["attention_mask"])
            loss, metrics = loss_fn(logp, entropy, micro)
            loss.backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v.detach() if torch.is_tensor(v) else v)
        grad_norm = self._sync_and_clip()
        self.optimizer.step()
        self._zero_grads()
        return {"grad_norm": grad_norm, "lr": self.lr, **self._sum_over_dp(totals)}

    def _sync_and_clip(self) -> float:
        """All-reduce (sum) grads over DP, expose them as p.grad, clip by the global norm; return the norm."""
        self.model.finish_grad_sync()
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = p.main_grad
        norm = self._grad_norm(params)
        if self.grad_clip > 0 and norm > self.grad_clip:
            scale = self.grad_clip / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        return norm

    def _grad_norm(self, params: list[torch.nn.Parameter]) -> float:
        """L2 norm of the whole model's gradient; TP-replicated params (norm weights) counted once."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        own = [
            p.grad.detach()
            for p in params
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, self.tp_group)
        ]
        sq = torch.stack([g.double().pow(2).sum() for g in own]).sum().to(self.device)
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return math.sqrt(float(sq))

    def _zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        for p in self.model.parameters():
            p.grad = None

    def _sum_over_dp(self, totals: dict[str, float]) -> dict[str, float]:
        if not totals or dist.get_world_size(self.dp_group) == 1:
            return totals
        keys = sorted(totals)
        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return dict(zip(keys, t.tolist()))

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (for a schedule driven by the caller)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- export -------------------------------------------------------------------------------------------

    def hf_state_dict(self) -> StateDict | None:
        """Full HF-named weights gathered over the TP group (every TP rank must call); None off TP rank 0."""
        shard = {
            k: v.detach() for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")
        }
        tp = dist.get_world_size(self.tp_group)
        if tp == 1:
            return megatron_to_hf([{k: v.cpu() for k, v in shard.items()}], self.shape)
        is_root = dist.get_rank(self.tp_group) == 0
        shards: list[StateDict] = [{} for _ in range(tp)]
        for key, t in shard.items():
            parts = [torch.empty_like(t) for _ in range(tp)] if is_root else None
            dist.gather(t.contiguous(), parts, group=self.tp_group, group_dst=0)
            if parts is not None:
                for r, part in enumerate(parts):
                    shards[r][key] = part.cpu()
        return megatron_to_hf(shards, self.shape) if is_root else None

    def iter_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Gather now (collective, every TP rank), then yield [(hf_name, tensor)] lists of <= ~bucket_bytes.

        A tensor larger than bucket_bytes gets a bucket of its own. Non-zero TP ranks get an empty iterator.
        """
        sd = self.hf_state_dict()
        return iter(()) if sd is None else _buckets(sd, bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """Write config + model.safetensors + tokenizer files (collective); the writer is TP 0 of DP 0.

        Returns the directory on the writing rank, None elsewhere.
        """
        from safetensors.torch import save_file

        sd = self.hf_state_dict()
        if sd is None or dist.get_rank(self.dp_group) != 0:
            return None
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for src in self.model_dir.iterdir():
            if (
                src.is_file()
                and not src.name.endswith(".safetensors")
                and "safetensors.index" not in src.name
            ):
                shutil.copy2(src, out / src.name)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    # ---- offload ------------------------------------------------------------------------------------------

    def offload(self) -> None:
        """Move params (policy and reference), grad buffers and optimizer state to host memory.

        Device tensors keep their identity: each is copied to a host tensor and its device storage is freed
        (resized to 0), so optimizer and DDP references stay valid. Grad buffers hold nothing between steps
        and are only freed. On CPU the copy and free still happen (that is what the tests exercise).
        """
        if self._offloaded:
            return
        for t in self._offloadable():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(t)
            t.untyped_storage().resize_(0)
            self._offloaded.append((t, host))
        self.model.offload_grad_buffers(synchronize=torch.cuda.is_available(), empty_cache=True)

    def onload(self) -> None:
        """Undo `offload`: reallocate device storage, copy the host copies back, re-create zeroed grad buffers."""
        if not self._offloaded:
            return
        for t, host in self._offloaded:
            t.untyped_storage().resize_(host.numel() * host.element_size())
            t.copy_(host)
        self._offloaded = []
        self.model.restore_grad_buffers(synchronize=torch.cuda.is_available())

    def _offloadable(self) -> list[torch.Tensor]:
        """Params' data tensors and optimizer-state tensors, each storage once."""
        tensors = [p.data for p in self.model.parameters()]
        if self.reference is not None:
            tensors += [p.data for p in self.reference.parameters()]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 0]
        unique: dict[int, torch.Tensor] = {}
        for t in tensors:
            unique.setdefault(t.untyped_storage().data_ptr(), t)
        return list(unique.values())


def _has_rows(value, rows: int) -> bool:
    return torch.is_tensor(value) and value.ndim > 0 and value.shape[0] == rows


def _buckets(sd: StateDict, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
