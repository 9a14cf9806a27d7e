"""GRPO on a vision-language policy (LLaVA, Qwen2-VL, Qwen2.5-VL): images streamed by Ray Data to the controllers.

Run it:
    python examples/vision.py                                # the demo: tiny LLaVA, visual sum task, CPU
    python examples/vision.py demo.vision_model=qwen2_5_vl   # the same demo with a tiny Qwen2.5-VL
    python examples/vision.py model.train_vision=projector   # any key.sub=value override
    python examples/vision.py --config examples/configs/grpo_qwen_vl_geo3k.yaml model.path=/ckpt/Qwen2.5-VL-7B-Instruct

With no model and data given it builds a tiny LLaVA (or Qwen2.5-VL) locally, warms it up so that it is sometimes right, and
trains it with GRPO; the closing report shows reward and accuracy at the start and the end. The data rows
hold verl's image layout (`images`: a list of {"bytes"} or {"path"} entries, `<image>` placeholders in the
prompt); decoding and the image processor run in Ray Data tasks, never on the driver.
"""

from pathlib import Path

from yatt_ray.cli import main

if __name__ == "__main__":
    main(Path(__file__).parent / "configs" / "grpo_vision.yaml", description=__doc__)
