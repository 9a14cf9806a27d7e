"""GRPO on a vision-language (LLaVA) policy: images streamed by Ray Data to the parallel controllers.

Run it:
    python examples/vision.py                                # the demo: tiny LLaVA, visual sum task, CPU
    python examples/vision.py model.train_vision=projector   # any key.sub=value override
    python examples/vision.py --config my.yaml model.path=/ckpt/llava data.train_files=[s3://bucket/train.parquet]

With no model and data given it builds a tiny LLaVA locally, warms it up so that it is sometimes right, and
trains it with GRPO; the closing report shows reward and accuracy at the start and the end. The data rows
hold verl's image layout (`images`: a list of {"bytes"} or {"path"} entries, `<image>` placeholders in the
prompt); decoding and the image processor run in Ray Data tasks, never on the driver.
"""

from pathlib import Path

from yatt_ray.cli import main

if __name__ == "__main__":
    main(Path(__file__).parent / "configs" / "grpo_vision.yaml", description=__doc__)
