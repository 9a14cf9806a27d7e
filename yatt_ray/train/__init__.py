"""The Megatron-core training backend: HF <-> Megatron conversion, model build, log-probs, the trainer.

Importing this package does not import Megatron; the functions that need it import it when called.
"""

from yatt_ray.train.cpu_shims import apply_cpu_shims
from yatt_ray.train.critic import MegatronCritic
from yatt_ray.train.hf_convert import check_tp_size, hf_to_megatron, megatron_to_hf
from yatt_ray.train.logprobs import head_logprobs_and_entropy
from yatt_ray.train.micro_batches import plan_micro_batches
from yatt_ray.train.model import (
    build_gpt_model,
    init_parallel_state,
    load_hf_weights,
    load_megatron_shard,
    read_hf_state_dict,
    seed_everything,
    transformer_config,
)
from yatt_ray.train.packing import SharedPrefixRows, pack_shared_prefix
from yatt_ray.train.policy import MegatronPolicy

__all__ = [
    "MegatronCritic",
    "MegatronPolicy",
    "SharedPrefixRows",
    "apply_cpu_shims",
    "build_gpt_model",
    "check_tp_size",
    "hf_to_megatron",
    "init_parallel_state",
    "load_hf_weights",
    "load_megatron_shard",
    "megatron_to_hf",
    "pack_shared_prefix",
    "plan_micro_batches",
    "read_hf_state_dict",
    "seed_everything",
    "head_logprobs_and_entropy",
    "transformer_config",
]
