"""Prompt images in the layout verl users have, decoded inside Ray Data tasks (never on the driver).

Layout. An image column (`data.image_key`, "images" by default) holds, per row, a list of entries, one per
image, in the order of the prompt's `<image>` placeholders. An entry is one of

    {"bytes": b"<png / jpeg / ... file bytes>"}            the encoded image itself
    {"path": "/abs/a.png"} or {"path": "s3://b/a.jpg"}      a local path or any fsspec URL
    {"bytes": ..., "path": ...}                            bytes win when non-empty, else the path
    "/abs/a.png"                                           a bare string: a path

Parquet stores the column as list<struct<bytes: binary, path: string>> (`image_arrow_type`, the Hugging Face
`datasets` Image feature's layout); a null or empty cell means a row without images. A relative path is opened
relative to `root` when one is given, else to the working directory of the process that decodes it (a Ray
Data worker's, which need not be the driver's): give absolute paths or URLs, or a `root`.

Prompts hold one `<image>` placeholder per image, either in a string ("<image>What is shown?") or in the
contents of a list of chat messages ([{"role": "user", "content": "<image>What is shown?"}]).
`count_placeholders` / `check_placeholders` count them, `prompt_text` renders a chat list to text.

Decoding. `decode_images_batch` is a Ray Data batch function (`Dataset.map_batches(decode_images_batch,
batch_format="numpy", fn_kwargs={...})`): it decodes each row's images in the Ray Data task, into pixel arrays
(raw uint8 pixels, or a processor's float32 `pixel_values`, e.g. `ClipPixels`), and adds a per-row
`image_error` string ('' when fine). numpy batches because the rest of the data path (`sources.build_dataset`,
`feed.MarkConsumed`, the feed's `iter_batches`) is numpy; Ray hands a list<struct> cell as an object array of
dicts, which `image_refs` takes, and turns per-row arrays of differing shapes into its variable-shaped tensor
column on the way out. With `on_bad_image="skip"` a row whose images cannot be used keeps its place with the
error set (the controller counts it, warns and marks it consumed, so the data position stays exact); with
"raise" the task raises BadImage naming the row.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
from PIL import Image

from yatt_ray.errors import ConfigError, DataError

IMAGE_PLACEHOLDER = "<image>"
ON_BAD_IMAGE = ("skip", "raise")
PIXELS = "pixel_values"  # per row: uint8 [I, H, W, 3] (no processor), the processor's float32 [I, 3, H, W]
# (LLaVA's CLIP) or [patches, C * temporal_patch * patch^2] (Qwen VL's, with GRID)
GRID = "image_grid_thw"  # per row, with a Qwen VL processor: int64 [I, 3], each image's (t, h, w) patch grid
SIZES = "image_sizes"  # per row: int64 [I, 2], each image's (height, width) as decoded
ERROR = "image_error"  # per row: '' when the row's images decoded, else why not (the BadImage message)
ACCEPTED = (
    'a list (or null) of entries {"bytes": <encoded image>}, {"path": "<local path or fsspec URL>"}, '
    '{"bytes": ..., "path": ...} (bytes win when non-empty) or a bare path string'
)

# RGB images -> float [I, 3, H, W], or {"pixel_values": [patches, D], "image_grid_thw": [I, 3]} (Qwen VL)
ProcessorFn = Callable[[list[Image.Image]], Any]


class BadImage(DataError):
    """A row's images cannot be used: an entry does not decode or its path does not exist (the message names
    the row id, the entry's index and the cause); raised by `decode_images_batch` for any unusable row."""


@dataclass(frozen=True)
class ImageRef:
    """One image entry of a row, normalised: its index in the row and either its bytes or its path."""

    index: int
    data: bytes | None = None
    path: str | None = None

    def describe(self) -> str:
        """'<n> bytes' or "path '<path>'", for messages."""
        return f"{len(self.data)} bytes" if self.data is not None else f"path {self.path!r}"


# ---- entries -------------------------------------------------------------------------------------------
def image_refs(value: Any, row_id: Any) -> list[ImageRef]:
    """One row's image cell as ImageRefs, in order; None or an empty list gives [].

    `value` is a list, tuple or 1-d object array (Ray's numpy form of a list<struct> cell) of entries (module
    docstring). DataError naming `row_id`, the entry and the accepted forms for anything else (a bare string
    or dict cell must be wrapped in a list).
    """
    if value is None:
        return []
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = list(value)
    if not isinstance(value, list | tuple):
        raise DataError(
            f"row {row_id!r}: the image cell is of type {type(value).__name__} ({_short(value)}); it must be "
            f"{ACCEPTED}"
            " (wrap a single image in a list)"
        )
    return [_entry(item, index, row_id) for index, item in enumerate(value)]


def _entry(item: Any, index: int, row_id: Any) -> ImageRef:
    if isinstance(item, str):
        if item:
            return ImageRef(index, path=item)
    elif isinstance(item, Mapping):
        data, path = item.get("bytes"), item.get("path")
        if data is not None and not isinstance(data, bytes | bytearray | memoryview):
            raise DataError(
                f"row {row_id!r} image {index}: 'bytes' is of type {type(data).__name__}, not bytes; it must hold the "
                f"encoded image file (png, jpeg, ...). Each entry is {ACCEPTED}"
            )
        if data:
            return ImageRef(index, data=bytes(data))
        if isinstance(path, str) and path:
            return ImageRef(index, path=path)
    raise DataError(
        f"row {row_id!r} image {index} is {_short(item)}, which names no image; each entry is {ACCEPTED}"
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_image(ref: ImageRef, row_id: Any, root: str | None = None) -> Image.Image:
    """The image of `ref`, decoded and converted to RGB (alpha dropped, palettes expanded); the file is read
    whole through fsspec (`root` prefixes a relative path). BadImage naming the row, the entry and the cause
    when the path does not exist or the bytes do not decode."""
    where = f"row {row_id!r} image {ref.index} ({ref.describe()})"
    data = ref.data
    if data is None:
        url = _location(str(ref.path), root)
        try:
            with fsspec.open(url, "rb") as f:
                data = f.read()
        except FileNotFoundError as exc:
            raise BadImage(
                f"{where} does not exist ({url!r}); fix the path in the image column (data.image_key), give "
                "absolute paths or URLs (relative ones resolve in the Ray Data worker), or drop the row"
            ) from exc
        except OSError as exc:
            raise BadImage(f"{where} cannot be read ({type(exc).__name__}: {exc}); check the path") from exc
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, ValueError, SyntaxError, ...
        raise BadImage(
            f"{where} does not decode as an image ({type(exc).__name__}: {exc}); re-encode it as png or jpeg, "
            "or drop the row"
        ) from exc


def _location(path: str, root: str | None) -> str:
    if root is None or "://" in path or path.startswith("/"):
        return path
    return root.rstrip("/") + "/" + path


# ---- prompts -------------------------------------------------------------------------------------------
def count_placeholders(prompt: Any, placeholder: str = IMAGE_PLACEHOLDER, row_id: Any = None) -> int:
    """How often `placeholder` occurs in a string prompt, or in all contents of a chat-message list."""
    if isinstance(prompt, str):
        return prompt.count(placeholder)
    return sum(m["content"].count(placeholder) for m in chat_messages(prompt, row_id))


def check_placeholders(prompt: Any, n_images: int, row_id: Any, placeholder: str = IMAGE_PLACEHOLDER) -> None:
    """DataError naming the row and both counts unless the prompt holds one `placeholder` per image."""
    found = count_placeholders(prompt, placeholder, row_id)
    if found != n_images:
        raise DataError(
            f"row {row_id!r}: the prompt holds {found} {placeholder!r} placeholder(s) but the row has {n_images} "
            f"image(s); each image needs one {placeholder!r} where it goes in the prompt: fix the prompt "
            "(data.prompt_key) or the image list (data.image_key)"
        )


def chat_messages(prompt: Any, row_id: Any = None) -> list[dict[str, str]]:
    """A chat prompt (list, tuple or 1-d object array of {"role": str, "content": str}) as a list of plain
    dicts {"role", "content"}; DataError naming the row, the message and the expected form otherwise."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
        prompt = list(prompt)
    expected = (
        'a string, or a list of chat messages [{"role": "user", "content": "<image>..."}] with string role and '
        "content"
    )
    if not isinstance(prompt, list | tuple) or not prompt:
        raise DataError(f"row {row_id!r}: the prompt is {_short(prompt)}; it must be {expected}")
    messages = []
    for i, m in enumerate(prompt):
        if not (
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"row {row_id!r}: message {i} of the chat prompt is {_short(m)}; the prompt must be {expected} "
                "(structured content parts are not read: put the text and its <image> placeholders in one string)"
            )
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def prompt_text(prompt: Any, tokenizer: Any = None, row_id: Any = None, system_prompt: str = "") -> str:
    """The text the policy sees for `prompt`.

    A string stays as it is. A chat list goes through `tokenizer.apply_chat_template(messages,
    add_generation_prompt=True, tokenize=False)` when `tokenizer` has a chat template; otherwise (no tokenizer,
    or one without a template, like the tiny character-level one) the messages' contents are joined by "\\n",
    roles dropped, so a one-message chat gives exactly the text of its string form ("<image>Sum:"). DataError
    (see `chat_messages`) for a malformed list.

    `system_prompt` (data.system_prompt; "" = none): a chat list without a system message gets
    {"role": "system", "content": system_prompt} in front (one that has a system message keeps its own); a
    string becomes the chat [system, {"role": "user", "content": prompt}] and is rendered as a chat list
    (template, or the contents joined: "<system>\\n<prompt>").
    """
    if isinstance(prompt, str) and not system_prompt:
        return prompt
    messages = with_system_prompt(prompt, system_prompt, row_id)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return "\n".join(m["content"] for m in messages)


def with_system_prompt(prompt: Any, system_prompt: str = "", row_id: Any = None) -> list[dict[str, str]]:
    """`prompt` (a string, or a chat list as `chat_messages` takes it) as chat messages, led by the system
    message `system_prompt` unless it is "" or the chat already has a system message (anywhere in it)."""
    messages = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else chat_messages(prompt, row_id)
    )
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


# ---- batches -------------------------------------------------------------------------------------------
def check_on_bad_image(value: str) -> str:
    """`value` when it is one of ON_BAD_IMAGE, else ConfigError naming `data.on_bad_image` and the choices."""
    if value not in ON_BAD_IMAGE:
        raise ConfigError(
            f"data.on_bad_image={value!r} is not one of {', '.join(ON_BAD_IMAGE)}: skip keeps a row whose images "
            "cannot be used out of training (counted in data/bad_images), raise stops the run on it"
        )
    return value


def decode_images_batch(
    batch: dict[str, np.ndarray],
    image_column: str = "images",
    processor_fn: ProcessorFn | None = None,
    on_bad_image: str = "skip",
    id_column: str = "id",
    prompt_column: str | None = "prompt",
    root: str | None = None,
    keep_image_column: bool = False,
    max_images: int | None = None,
) -> dict[str, np.ndarray]:
    """A Ray Data numpy batch function: every row's images decoded to pixels, in the task that runs it.

    Adds, for the batch's B rows (object arrays of per-row arrays; I = the row's image count):
      PIXELS  without `processor_fn`: uint8 [I, H, W, 3], H and W the largest of the row's images, each image
              at the top left and zero-padded (equal sizes: no padding); with it: `processor_fn(images)` as
              float32 [I, 3, H', W'], or, for a processor that returns a dict (Qwen VL's `QwenPixels`), its
              "pixel_values" [patches, D] and, in GRID, its "image_grid_thw" int64 [I, 3].
      SIZES   int64 [I, 2]: each image's (height, width) as decoded (before the processor).
      ERROR   str: '' for a good row; for a bad one the reason, and PIXELS of shape [0, 0, 0, 3] (uint8) or
              [0, 3, 0, 0] (float32) and SIZES [0, 2]. A row without images is good, with I = 0.
    A row is bad when its cell is malformed (`image_refs`), holds more than `max_images` images
    (data.max_images; None = any number), its prompt's placeholders do not match its images (checked when
    `prompt_column` is a column of the batch) or an image does not load (`load_image`).
    `on_bad_image`: "skip" keeps bad rows with ERROR set (see `bad_image_rows`); "raise" raises BadImage
    naming the row. The image column is dropped unless `keep_image_column` (its bytes need not travel on).
    `processor_fn` errors are not data errors: they propagate. The ids come from `id_column` (the row's index
    in the batch when absent).
    """
    check_on_bad_image(on_bad_image)
    if image_column not in batch:
        raise DataError(
            f"the batch has no image column {image_column!r} (its columns: {sorted(batch)}); set "
            "data.image_key=<column> to the column holding the images"
        )
    cells = batch[image_column]
    ids = batch[id_column] if id_column in batch else np.arange(len(cells))
    prompts = batch[prompt_column] if prompt_column is not None and prompt_column in batch else None
    pixels, grids, sizes, errors = [], [], [], []
    for i, cell in enumerate(cells):
        prompt = None if prompts is None else prompts[i]
        values, grid, size, error = _decode_row(
            cell, _plain(ids[i]), prompt, processor_fn, on_bad_image, root, max_images
        )
        pixels.append(values)
        grids.append(grid)
        sizes.append(size)
        errors.append(error)
    out = {k: v for k, v in batch.items() if keep_image_column or k != image_column}
    out[PIXELS], out[SIZES] = _objects(pixels), _objects(sizes)
    if getattr(processor_fn, "gives_grid", False):
        out[GRID] = _objects(grids)
    out[ERROR] = np.asarray(errors, dtype=object)
    return out


def _decode_row(
    cell: Any,
    row_id: Any,
    prompt: Any,
    processor_fn: ProcessorFn | None,
    on_bad_image: str,
    root: str | None,
    max_images: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """One row of `decode_images_batch`: (its PIXELS, GRID, SIZES and ERROR entries). A bad row (see there)
    gets empty arrays and the reason, or raises BadImage with `on_bad_image="raise"`."""
    try:
        refs = image_refs(cell, row_id)
        if max_images is not None and len(refs) > max_images:
            raise DataError(
                f"row {row_id!r} has {len(refs)} images, more than data.max_images={max_images}; raise "
                "data.max_images or drop the row"
            )
        if prompt is not None:
            check_placeholders(prompt, len(refs), row_id)
        images = [load_image(ref, row_id, root) for ref in refs]
    except DataError as exc:
        if on_bad_image == "raise" and isinstance(exc, BadImage):
            raise
        if on_bad_image == "raise":
            raise BadImage(str(exc)) from exc
        empty_grid, empty_sizes = np.zeros((0, 3), dtype=np.int64), np.zeros((0, 2), dtype=np.int64)
        return _empty_pixels(processor_fn is not None), empty_grid, empty_sizes, str(exc)
    values, grid = _pixels(images, processor_fn)
    sizes = np.array([(im.height, im.width) for im in images], dtype=np.int64).reshape(-1, 2)
    return values, grid, sizes, ""


def bad_image_rows(batch: Mapping[str, Any], id_column: str = "id") -> list[tuple[Any, str]]:
    """(row id, error) for each row of a decoded batch whose ERROR is set, in batch order."""
    if ERROR not in batch:
        raise DataError(
            f"the batch has no {ERROR!r} column (its columns: {sorted(batch)}); run decode_images_batch on it first"
        )
    errors = batch[ERROR]
    ids = batch[id_column] if id_column in batch else range(len(errors))
    return [(_plain(ids[i]), str(e)) for i, e in enumerate(errors) if e]


def _pixels(images: list[Image.Image], processor_fn: ProcessorFn | None) -> tuple[np.ndarray, np.ndarray]:
    """(pixels, grid): uint8 [I, H, W, 3] zero-padded to the largest image, or the processor's float32
    [I, 3, H', W'] (or its dict's pixel_values [patches, D]); grid [I, 3] int64 from a dict (else [0, 3])."""
    no_grid = np.zeros((0, 3), dtype=np.int64)
    if processor_fn is not None:
        if not images:
            return _empty_pixels(True), no_grid
        out = processor_fn(images)
        if isinstance(out, Mapping):
            grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
            values = np.asarray(out["pixel_values"], dtype=np.float32)
            if len(grid) != len(images) or values.ndim != 2 or len(values) != int(grid.prod(-1).sum()):
                raise ValueError(
                    f"processor_fn {processor_fn!r} returned pixel_values {values.shape} and image_grid_thw "
                    f"{grid.shape} for {len(images)} image(s); it must give [sum t*h*w, D] and [I, 3]"
                )
            return values, grid
        values = np.asarray(out, dtype=np.float32)
        if values.ndim != 4 or values.shape[0] != len(images) or values.shape[1] != 3:
            raise ValueError(
                f"processor_fn {processor_fn!r} returned an array of shape {values.shape} for {len(images)} "
                "image(s); it must return [I, 3, H, W] (one CHW array per image)"
            )
        return values, no_grid
    if not images:
        return _empty_pixels(False), no_grid
    height, width = max(im.height for im in images), max(im.width for im in images)
    raw = np.zeros((len(images), height, width, 3), dtype=np.uint8)
    for k, im in enumerate(images):
        raw[k, : im.height, : im.width] = np.asarray(im, dtype=np.uint8)
    return raw, no_grid


def _empty_pixels(processed: bool) -> np.ndarray:
    return np.zeros((0, 3, 0, 0), np.float32) if processed else np.zeros((0, 0, 0, 3), np.uint8)


def _objects(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """A 1-d object array holding one array per row (assigned one by one: numpy would broadcast a list)."""
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


# ---- processors ----------------------------------------------------------------------------------------
class ClipPixels:
    """A picklable `processor_fn`: the CLIP image processor saved in `processor_dir` (a local folder with
    `preprocessor_config.json`, as `save_pretrained` writes it), applied to a row's RGB images.

    `__call__(images: list[PIL.Image]) -> float32 [I, 3, H, W]` (`pixel_values`, resized, cropped and
    normalised as the config says). The processor is loaded on first use and cached per process (module level),
    so each Ray Data worker loads it once however many tasks it runs; the instance itself holds only the path,
    so it pickles small. transformers 5's PIL/numpy backend (`CLIPImageProcessorPil`) is used when present:
    the same numbers on every machine, and torchvision is never imported (transformers 4: `CLIPImageProcessor`,
    which is that backend).
    """

    def __init__(self, processor_dir: str) -> None:
        self.processor_dir = str(processor_dir)

    def __call__(self, images: list[Image.Image]) -> np.ndarray:
        processor = _clip_processor(self.processor_dir)
        return np.asarray(processor(images=images, return_tensors="np")["pixel_values"], dtype=np.float32)

    def __repr__(self) -> str:
        return f"ClipPixels({self.processor_dir!r})"


@functools.lru_cache(maxsize=8)
def _clip_processor(processor_dir: str) -> Any:
    import transformers

    # transformers 5: the PIL/numpy backend by name; transformers 4: CLIPImageProcessor is that backend
    processor_class = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    try:
        return processor_class.from_pretrained(processor_dir)
    except OSError as exc:
        raise ConfigError(
            f"no CLIP image processor in {processor_dir!r} ({exc}); give a local folder written by "
            "CLIPImageProcessor.save_pretrained (it holds preprocessor_config.json)"
        ) from exc


class QwenPixels:
    """A picklable `processor_fn` for Qwen2-VL / Qwen2.5-VL policies: the Qwen image processor saved in
    `processor_dir` (its `preprocessor_config.json`; the PIL backend, no torchvision), applied to a row's RGB
    images -> {"pixel_values": float32 [patches, C * temporal_patch * patch^2], "image_grid_thw": [I, 3]}.

    Image limits (the processor's own rule, `smart_resize`): each image is resized, keeping its aspect ratio,
    to sides that are multiples of patch * merge (28 px) with min_pixels <= H * W <= max_pixels, so an image
    takes between min_pixels / 784 and max_pixels / 784 tokens. `min_pixels` / `max_pixels` (data.min_pixels,
    data.max_pixels) override the directory's; None keeps them. Loaded once per process, like `ClipPixels`."""

    gives_grid = True

    def __init__(
        self, processor_dir: str, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> None:
        self.processor_dir = str(processor_dir)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels

    def __call__(self, images: list[Image.Image]) -> dict[str, np.ndarray]:
        processor = _qwen_processor(self.processor_dir, self.min_pixels, self.max_pixels)
        out = processor(images=images, return_tensors="np")
        return {
            "pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
            "image_grid_thw": np.asarray(out["image_grid_thw"], dtype=np.int64),
        }

    def __repr__(self) -> str:
        return (
            f"QwenPixels({self.processor_dir!r}, min_pixels={self.min_pixels}, max_pixels={self.max_pixels})"
        )


@functools.lru_cache(maxsize=8)
def _qwen_processor(processor_dir: str, min_pixels: int | None, max_pixels: int | None) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        processor = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    except OSError as exc:
        raise ConfigError(
            f"no Qwen image processor in {processor_dir!r} ({exc}); the model directory needs the "
            "preprocessor_config.json that Qwen2.5-VL checkpoints ship"
        ) from exc
    size = dict(processor.size)
    if min_pixels is not None:
        size["shortest_edge"] = min_pixels
    if max_pixels is not None:
        size["longest_edge"] = max_pixels
    processor.size = size
    return processor


def pixels_processor(model_dir: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The `processor_fn` of a vision-language model directory: `QwenPixels` for Qwen VL, else `ClipPixels`."""
    from yatt_ray.model_dir import is_qwen_vl, read_config

    if is_qwen_vl(read_config(model_dir)):
        return QwenPixels(model_dir, min_pixels, max_pixels)
    return ClipPixels(model_dir)


# ---- driver-side checks --------------------------------------------------------------------------------
def check_image_column(schema_names: Sequence[str], url: str, image_key: str) -> None:
    """On the driver, from metadata only: DataError naming the file, the column and the fix when the image
    column `image_key` (data.image_key) is not among the file's columns `schema_names`."""
    if image_key not in schema_names:
        raise DataError(
            f"data file {url!r} has no image column {image_key!r} (data.image_key); its columns are "
            f"{sorted(schema_names)}. Set data.image_key=<column> to the column holding the images"
        )


def image_arrow_type():
    """The parquet / arrow type of an image column: list<struct<bytes: binary, path: string>>."""
    import pyarrow as pa

    return pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
