"""Build a Llama-family Megatron-core `GPTModel` (Llama, Mistral, Qwen2, Qwen3; see `hf_convert`) and load
Hugging Face weights into it.

Order of use inside a training worker (Ray Train or torchrun has already created the default
torch.distributed process group: gloo on CPU, nccl on GPU):

    init_parallel_state(tp_size)         # Megatron TP / DP groups over the existing default group
    seed_everything(seed)                # torch + Megatron's tensor-parallel RNG tracker
    shape = LlamaShape.from_hf_dir(path)
    model = build_gpt_model(shape)
    load_hf_weights(model, path, shape)  # this TP rank's shard
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from yatt_ray.errors import ConfigError
from yatt_ray.train import fused
from yatt_ray.train.attention import shared_prefix_attention_class
from yatt_ray.train.cpu_shims import apply_cpu_shims
from yatt_ray.train.hf_convert import (
    LlamaShape,
    StateDict,
    check_tp_size,
    hf_to_megatron,
    rope_inv_freq,
)
from yatt_ray.train.megatron_import import import_megatron


def init_parallel_state(tp_size: int, timeout_minutes: float = 30.0) -> None:
    """Create Megatron's parallel groups (TP = tp_size, DP = world / tp_size) on the default process group.

    Every rank must call it (group creation is collective). Idempotent for the same tp_size; a different
    tp_size rebuilds the groups. Ranks r*tp .. r*tp+tp-1 form TP group r (Megatron's "tp-cp-ep-dp-pp" order).
    The new groups use the default group's backend (gloo on CPU) plus Megatron's extra gloo DP groups, and
    `timeout_minutes` as their collective timeout (the default group's own timeout does not carry over).
    """
    import torch.distributed as dist

    import_megatron()
    from megatron.core import parallel_state as ps

    apply_cpu_shims()
    if not dist.is_initialized():
        raise ConfigError(
            "torch.distributed is not initialised; init_parallel_state needs the default process group that "
            "Ray Train's TorchTrainer (or torchrun + dist.init_process_group) creates. Call it inside a "
            "training worker."
        )
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise ConfigError(
            f"tensor_parallel_size={tp_size} does not divide the world size {world}; choose num_workers as a "
            "multiple of tensor_parallel_size."
        )
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() == tp_size:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, distributed_timeout_minutes=timeout_minutes
    )


def seed_everything(seed: int) -> None:
    """Seed torch's default generator and Megatron's TP RNG tracker (needs `init_parallel_state` first)."""
    from megatron.core import tensor_parallel

    apply_cpu_shims()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(shape: LlamaShape, tp_size: int, dtype: torch.dtype = torch.float32):
    """A Megatron `TransformerConfig` for a Llama-family decoder (weights in `dtype`: float32 or bfloat16, the
    attention softmax in fp32 either way; no dropout, no fusions; biases only on q/k/v for Qwen2
    (`shape.qkv_bias`), RMSNorm on each head's queries and keys for Qwen3 (`shape.qk_norm`)).

    `calculate_per_token_loss=True` makes Megatron DDP SUM gradients over data-parallel ranks (no 1/dp
    pre-scaling): the library's losses are already divided by the global normaliser.
    """
    from megatron.core.transformer import TransformerConfig

    check_tp_size(shape, tp_size)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,  # the norm module itself comes from the layer spec (build_gpt_model)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rotary_interleaved=False,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=False,
        use_cpu_initialization=True,
        # Megatron tags TP-split weights (`tensor_model_parallel`, used by grad-norm and checkpointing) only
        # while initialising them, so initialisation stays on; zeros keep it cheap, since load_hf_weights
        # overwrites every weight anyway.
        perform_initialization=True,
        init_method=torch.nn.init.zeros_,
        output_layer_init_method=torch.nn.init.zeros_,
        embedding_init_method=torch.nn.init.zeros_,
        params_dtype=dtype,
        bf16=dtype
        == torch.bfloat16,  # Megatron's "inputs in bf16" switch: the attention softmax runs in fp32
        bias_activation_fusion=True,  # Megatron's SwiGLU branch, served by `fused.bias_swiglu_impl`
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        # RoPE straight from fc_qkv's output (`fused.apply_fused_qkv_rotary_pos_emb`); not with per-head q/k norms
        # or query groups split over TP ranks, which need the split heads first
        fused_single_qkv_rope=not shape.qk_norm and tp_size <= shape.num_kv_heads,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,
        # RoPE at given positions (packing.pack_shared_prefix places tokens off their column): Megatron's
        # multimodal RoPE with every channel in the first section and the same positions in all three rows
        # is exactly 1-D RoPE at `position_ids`; a Qwen VL decoder has its own sections (qwen_vl.py).
        mrope_section=list(shape.mrope_section or (shape.head_dim // 2, 0, 0)),
    )


ATTENTION = ("packed", "dense")


def build_gpt_model(
    shape: LlamaShape, dtype: torch.dtype = torch.float32, attention: str = "packed", recompute: bool = False
):
    """An uninitialised Megatron `GPTModel` (local spec, RMSNorm, SwiGLU, RoPE) for this rank's TP shard, its
    weights in `dtype`.

    With `shape.qk_norm` the local spec's q/k_layernorm is its RMSNorm (torch.nn.RMSNorm over head_dim, eps
    rms_norm_eps), applied per head before RoPE, as Qwen3 does. RoPE's inverse frequencies are set from
    `rope_inv_freq(shape)` after the build: Megatron's multimodal RoPE ("mrope", used here for RoPE at given
    positions) has no rope-scaling option (only `RotaryEmbedding` has llama3 scaling, and with fixed
    low/high-frequency factors and context length), but it reads its `inv_freq` attribute (a plain tensor,
    not a parameter or buffer, so not in the state dict) at every forward, so replacing it gives Llama 3.x's
    scaled RoPE exactly as transformers computes it (for plain RoPE the values are Megatron's own).

    `attention`: "packed" (the default) runs attention through `attention.shared_prefix_attention_class()`:
    fused causal kernels over each sample's [prompt; own tokens], memory linear in the packed length; "dense" is
    Megatron's unfused `DotProductAttention` over an [G, 1, L, L] mask, kept as the tests' reference.
    `recompute`: activation recomputation of every decoder layer (`recompute_layers`).

    On a GPU build it is moved to the current CUDA device. Forward: `forward_packed`, or (input_ids [B,T],
    position_ids [3,B,T] (`rope_positions`), attention_mask) -> logits [B, T, V/tp] (vocab-parallel, not
    gathered); attention_mask is a `SegmentLayout` (packed) or a [B,1,T,T] bool mask, True = masked (dense).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if attention not in ATTENTION:
        raise ConfigError(f"attention={attention!r}; choose one of {', '.join(ATTENTION)}")
    apply_cpu_shims()
    fused.install()
    config = transformer_config(shape, ps.get_tensor_model_parallel_world_size(), dtype)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)  # default: LayerNorm
    if attention == "packed":
        spec.submodules.self_attention.submodules.core_attention = shared_prefix_attention_class()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_positions,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="mrope",  # RoPE at the given position_ids; see transformer_config
        rotary_base=int(shape.rope_theta),
        rotary_percent=1.0,
    )
    model = model.to(dtype)  # what Megatron's Float16Module does: the local spec's torch norms are built fp32
    fused.use_fused_norms(model)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    rope = model.rotary_pos_emb
    rope.inv_freq = rope_inv_freq(shape).to(rope.inv_freq.device)
    if recompute:
        recompute_layers(model)
    return model


def recompute_layers(model) -> None:
    """Activation recomputation (`train.recompute_activations`): while gradients are recorded, each decoder
    layer keeps only its input hidden states [T, B, h] for the backward and runs its forward again there.

    Per token and layer a bf16 layer otherwise saves about (6 h + 3 F + qkv) x 2 bytes (`placement.
    activation_bytes`); with recomputation h x 2, plus one layer's full set while it is recomputed: for a
    7B Qwen2.5 (28 layers, h 3,584, F 18,944) 4.6 MB a token against 0.37 MB, at the cost of a second forward
    of every layer (~1/3 more train compute). Non-reentrant `torch.utils.checkpoint`, so the packed
    attention's segment layout (not a tensor) passes through as it is; no dropout, so no RNG state to replay.
    Megatron's own full recompute saves its arguments with `save_for_backward`, which takes tensors only.
    """
    from torch.utils.checkpoint import checkpoint

    for layer in model.decoder.layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def tp_partial_grad_parameters(model) -> list[torch.nn.Parameter]:
    """Parameters replicated over the TP ranks whose gradient each rank computes from its own heads only:
    Qwen3's per-head `q_layernorm` / `k_layernorm` weights (empty for the other families). With tp > 1 their
    gradients must be summed over the TP group after the data-parallel sync, or the ranks' copies drift apart
    (Megatron's `finalize_model_grads` does this; `MegatronDDP.finish_grad_sync` alone does not)."""
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad
        and ("self_attention.q_layernorm." in name or "self_attention.k_layernorm." in name)
    ]


def gpt_module(model):
    """The GPTModel inside Megatron's DDP / Float16Module wrappers (each keeps it as `.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def hidden_state_output(model) -> None:
    """Make `model` (a GPTModel, or its wrapper) return its last hidden states [B, T, H] (after the final norm)
    instead of the logits: its output layer's forward becomes the identity. The layer and its weight stay
    (checkpoints, export and weight sync see them as before); `output_weight(model)` gives the weight to
    `logprobs.head_logprobs_and_entropy`, which never materialises the [T, V] logits."""
    gpt_module(model).output_layer.forward = _hidden_through


def _hidden_through(
    hidden: torch.Tensor, weight=None, runtime_gather_output=None
) -> tuple[torch.Tensor, None]:
    """The output layer's call signature, returning its input (see `hidden_state_output`)."""
    return hidden, None


def output_weight(model) -> torch.Tensor:
    """[V/tp, H] this rank's slice of `model`'s output weight: the word embedding's when tied."""
    gpt = gpt_module(model)
    return (
        gpt.shared_embedding_or_output_weight()
        if gpt.share_embeddings_and_output_weights
        else gpt.output_layer.weight
    )


def rope_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] token positions -> the [3, B, T] position_ids of the model's (multimodal-form) RoPE."""
    return position_ids[None].expand(3, *position_ids.shape)


def forward_packed(model, packed) -> torch.Tensor:
    """`model` (a GPTModel from `build_gpt_model`, or its DDP wrapper) over `packing.SharedPrefixRows`:
    outputs [G, L, ...] at the packed positions (logits [G, L, V/tp] for a policy)."""
    return model(packed.input_ids, rope_positions(packed.position_ids), attention_input(model, packed))


FLAT_MULTIPLE = 32  # on a CPU the flat row's length is rounded up to a multiple of this (see `model_rows`)


def model_rows(model, packed):
    """The rows `model` runs over: under the packed attention the packed rows' real tokens as one flat row
    (`SharedPrefixRows.flat`: no padding through the layers, the LM head or the log-probs); under the dense
    reference (`attention="dense"`) the padded rows themselves.

    On a CPU the flat row is rounded up to a multiple of FLAT_MULTIPLE tokens. oneDNN builds (and caches) a
    kernel for every matrix shape it meets, ~1 ms a matmul, and a flat row's length changes with every batch,
    so every step built all of them again. Measured on the 25M-parameter shape of `release/bench_vs_trl.py`
    (one process, 2 threads, a new batch of 32 x 8 every step, median of steps 16-32): 0.80 / 0.79 s a step
    unrounded, 0.72 / 0.73 s rounded to 32 (16: the same; 64: 0.76 / 0.76 s), peak RSS 2.1 -> 1.35 GiB; the
    same batch every step pays only for the padding (0.69 / 0.66 s against 0.74 / 0.68 s). The demo's train
    phase (`examples/grpo.py`, a tiny model whose matmuls take microseconds): 0.068 -> 0.043 s a step. GPUs build
    no kernel per shape: the row stays unrounded there."""
    if not isinstance(_first_core_attention(model), shared_prefix_attention_class()):
        return packed
    on_cpu = next(model.parameters()).device.type == "cpu"
    return packed.flat(FLAT_MULTIPLE if on_cpu else 1)


def attention_input(model, packed):
    """What `model`'s attention takes for `packed`: its `SegmentLayout` (packed attention) or its dense
    [G, 1, L, L] mask (`attention="dense"`)."""
    core = _first_core_attention(model)
    if isinstance(core, shared_prefix_attention_class()):
        return packed.attention_layout().to(packed.input_ids.device)
    return packed.attention_mask()


def _first_core_attention(model):
    for name, module in model.named_modules():
        if name.endswith("self_attention.core_attention"):
            return module
    raise ConfigError("the model has no self_attention.core_attention module; build it with build_gpt_model")


def read_hf_state_dict(model_dir: str | Path) -> StateDict:
    """All tensors of a HF directory's `*.safetensors` files (single file or sharded with an index)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors weights in {str(model_dir)!r}; save the model with "
            "save_pretrained(..., safe_serialization=True)."
        )
    sd: StateDict = {}
    for name in files:
        sd.update(load_file(str(model_dir / name)))
    return sd


def load_hf_weights(model, model_dir: str | Path, shape: LlamaShape) -> None:
    """Copy this TP rank's shard of the HF weights in `model_dir` into `model` (every parameter must be set)."""
    from megatron.core import parallel_state as ps

    shard = hf_to_megatron(
        read_hf_state_dict(model_dir),
        shape,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
    )
    load_megatron_shard(model, shard, model_dir)


def load_megatron_shard(model, shard: StateDict, source: str | Path) -> None:
    """`model.load_state_dict(shard)`, raising ConfigError unless every parameter is set and no key is left.

    `_extra_state` keys may be missing (Megatron's per-module metadata). `source` names the weights' origin.
    """
    result = model.load_state_dict(shard, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"HF weights in {str(source)!r} do not fit the Megatron model: missing={missing}, "
            f"unexpected={result.unexpected_keys}; the checkpoint and config.json disagree."
        )
