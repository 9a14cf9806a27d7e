"""GRPO with parallel controllers: rollout (vLLM) -> rule reward -> log-probs -> advantages -> train -> sync.

Run it:
    python examples/grpo.py                                   # the demo: tiny model, addition task, CPU
    python examples/grpo.py train.steps=10 train.dp_size=1    # any key.sub=value override
    python examples/grpo.py --config my.yaml model.path=/ckpt/llama data.train_files=[s3://bucket/train.parquet]
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python examples/grpo.py

With no model and data given it builds a tiny Llama locally, warms it up for a few seconds so that it is
sometimes right, and trains it with GRPO; the closing report shows reward and accuracy at the start and
the end. Departures from the GRPO paper: a single policy update per rollout batch (so the ratio is 1 at the
start of each update), and token-mean loss aggregation over the global batch.
"""

from pathlib import Path

from yatt_ray.cli import main

if __name__ == "__main__":
    main(Path(__file__).parent / "configs" / "grpo.yaml", description=__doc__)
