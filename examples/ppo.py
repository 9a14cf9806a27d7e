"""PPO with a critic: rollout (vLLM) -> rule reward -> log-probs and values -> GAE -> critic and policy updates.

Run it:
    python examples/ppo.py                                    # the demo: tiny model, addition task, CPU
    python examples/ppo.py train.steps=20 critic.warmup_steps=2
    python examples/ppo.py --config my.yaml model.path=/ckpt/llama data.train_files=[s3://bucket/train.parquet]
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python examples/ppo.py

The value model is a Megatron copy of the policy's trunk with a scalar head, colocated with the actor on the
same workers (full coexistence) and trained in the same step. With no model and data given it builds a tiny
Llama locally, warms it up so that it is sometimes right, and trains it; the closing report shows reward and
accuracy at the start and the end. Departures from the PPO paper as used for RLHF: the outcome reward sits
on the last response token, KL to the reference is a per-token reward penalty, and by default one
optimizer step per rollout batch (algo.ppo_epochs=1).
"""

from pathlib import Path

from yatt_ray.cli import main

if __name__ == "__main__":
    main(Path(__file__).parent / "configs" / "ppo.yaml", description=__doc__)
