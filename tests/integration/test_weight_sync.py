"""Trainer -> engine weight sync: after a training step and a bucketed push, the vLLM engine agrees with the
Megatron trainer. Greedy tokens are compared token for token with the trainer's weights exported to a Hugging
Face model; the engine's log-probs of those tokens match the trainer's own log-probs within 1e-4 (float32;
seen ~1e-6).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from yatt_ray.batch import pack
from yatt_ray.models.tiny import EOS_ID, build_tiny_model
from yatt_ray.rollout.base import GenerateRequest, SamplingSpec

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PROMPTS = [[1, 5, 6, 76, 7, 8, 84], [1, 13, 76, 14, 84], [1, 9, 9, 76, 4 + 1, 84]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def world():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_engine_matches_trainer_after_step_and_sync(world, tmp_path):
    from transformers import AutoModelForCausalLM

    from yatt_ray.rollout.vllm_engine import VLLMEngine
    from yatt_ray.train import MegatronPolicy

    model_dir = build_tiny_model(tmp_path / "model")
    policy = MegatronPolicy(model_dir, lr=1e-2, seed=0)
    engine = VLLMEngine(model_dir, seed=0, max_model_len=64, kv_cache_gb=0.25)
    try:
        # one large step moves the weights far from the engine's copy
        packed = pack(PROMPTS, [[10, 11, EOS_ID]] * 3, [[0.0] * 3] * 3, pad_id=0)
        batch, width = packed.tensors(), packed.prompt_width

        def loss_fn(logp, entropy, mb):
            return -(logp[:, width - 1 :] * mb["response_mask"]).sum() / 9.0, {}

        policy.train_step(batch, loss_fn, micro_batch_size=3)
        spec = SamplingSpec(n=1, max_new_tokens=8, temperature=0.0, stop_token_ids=(EOS_ID,))
        stale = [c[0].token_ids for c in engine.generate(GenerateRequest(PROMPTS, spec))]

        for bucket in policy.iter_hf_buckets(bucket_bytes=64 * 1024):  # many small buckets
            engine.load_weights(bucket)
        engine.finish_weight_sync()
        outs = [c[0] for c in engine.generate(GenerateRequest(PROMPTS, spec))]

        policy.save_hf(tmp_path / "exported")
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
        for prompt, out in zip(PROMPTS, outs):
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=EOS_ID, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
            assert out.token_ids == ref
        assert [o.token_ids for o in outs] != stale, "the step should have changed the greedy output"

        packed = pack(PROMPTS, [o.token_ids for o in outs], [o.logprobs for o in outs], pad_id=0)
        batch, width = packed.tensors(), packed.prompt_width
        logp, _ = policy.log_probs(batch["input_ids"], batch["attention_mask"], micro_batch_size=3)
        trainer = logp[:, width - 1 :] * batch["response_mask"]
        engine_lp = batch["rollout_logp"] * batch["response_mask"]
        assert (trainer - engine_lp).abs().max().item() < TOLERANCE
    finally:
        engine.close()
