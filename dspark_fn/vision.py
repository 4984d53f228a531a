"""Images into prompts: a release's processor and mlx-vlm's own vision tower
and projector (``mlx_vlm.models.<module>``, as the family's
``Release.images`` names it) turn text with image placeholders and images
into an ``ImagePrompt``: token ids with each image's soft tokens in place,
the image features, and the positions and spans the family needs. Nothing of
the vision side is computed here; the prefill takes the record.

The towers are read from the release checkpoint lazily: a target loaded with
its ``Vision`` costs nothing more until the first image arrives, and the
processor is loaded then too.
"""

import hashlib
import io
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import ops
from .files import read_config, read_safetensors
from .optional import vlm_missing
from .targets import TARGET_REGISTRY, text_model_config
from .types import ImagePrompt, PromptImage

# Decoded pixels an image may have: a small compressed file can decode into
# gigabytes (a decompression bomb), so the header's size is checked first.
MAX_IMAGE_PIXELS = 1 << 25


def image_families() -> dict:
    """The releases that take images, by model_type -> the mlx-vlm module that
    runs their vision side."""
    adapters = {id(adapter): adapter for adapter in TARGET_REGISTRY.values()}.values()
    return {release.model_type: release.images.module for adapter in adapters
            for release in adapter.releases if release.images is not None}


# Targets whose releases mlx-vlm has a vision side for, but whose forward takes no image features yet.
UNWIRED = {"deepseek_v4": "mlx-vlm 0.7.10 reads DeepSeek-V4's images (its own image metadata), but this target "
                          "takes no image features yet"}


def refusal(model_type: str) -> str:
    """Why a target of ``model_type`` takes no images, naming those that do."""
    takes = ", ".join(sorted(image_families()))
    why = f" ({UNWIRED[model_type]})" if model_type in UNWIRED else ""
    return (f"this target ({model_type}) takes no images{why}: images go to a multimodal release whose vision "
            f"side mlx-vlm has ({takes}); send text only, or load such a release")


@dataclass(eq=False)
class Vision:
    """A release's image side: its directory, the release declaration, its
    config; mlx-vlm's model holding only the towers and the processor are
    built at first use."""

    directory: Path
    release: object  # interfaces.Release
    config: dict
    dtype: object = None  # the towers' compute dtype (None: as stored)
    problem: str | None = None  # why it cannot read images (towers missing from the checkpoint), found at load
    encoded: int = 0  # images run through the towers so far
    _model: object = field(default=None, repr=False)
    _processor: object = field(default=None, repr=False)

    @property
    def side(self):
        return self.release.images

    @property
    def model(self):
        if self._model is None:
            self._model = tower_model(self.directory, self.release, self.config, self.dtype)
        return self._model

    @property
    def processor(self):
        if self._processor is None:
            self._processor = release_processor(self.directory, self.config)
        return self._processor

    @property
    def text_config(self) -> dict:
        return text_model_config(self.config)

    @property
    def model_config(self):
        """mlx-vlm's config of the release (no weights)."""
        return vlm_config(self.config)[1]


def load_vision(directory, config: dict | None = None, dtype=None) -> Vision | None:
    """The image side of the checkpoint in ``directory`` (its towers computing
    in ``dtype``, default as stored), or None when its model takes no images
    (a text model, or a release mlx-vlm has no vision side for)."""
    directory = Path(directory)
    config = config or read_config(directory, "target")
    release = TARGET_REGISTRY.release(config.get("model_type"))
    if release is None or release.images is None or "text_config" not in config:
        return None
    return Vision(directory, release, config, dtype, problem=vision_problem(directory, release, config))


def vision_problem(directory: Path, release, config: dict) -> str | None:
    """Why the release cannot read images (None: it can), found from tensor
    names alone; a text run never depends on it."""
    missing_package = vlm_missing("reading images")
    if missing_package:
        return missing_package
    try:
        _, weights, expected = towers_of(directory, release, config)  # nothing is read from disk
    except Exception as error:  # mlx-vlm cannot build this release's model: its text model still runs
        return f"{directory}: mlx-vlm cannot build this release's vision side ({type(error).__name__}: {error})"
    missing = sorted(expected - set(weights))
    return lacking(directory, missing) if missing else None


def tower_model(directory: Path, release, config: dict, dtype=None):
    """mlx-vlm's model of the release with the towers' weights loaded (read
    lazily: when the first image is encoded) and no language model: the text
    model is the target's."""
    model, weights, expected = towers_of(directory, release, config, dtype)
    missing = sorted(expected - set(weights))
    if missing:
        raise ValueError(lacking(directory, missing))
    model.load_weights([(key, value) for key, value in weights.items() if key in expected], strict=False)
    return model


def towers_of(directory: Path, release, config: dict, dtype=None) -> tuple:
    """``(mlx-vlm's model of the release without its language model, the
    checkpoint's tower tensors under its names, the names the image path
    reads)``; nothing is read from disk until evaluated."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    module, model_config = vlm_config(config)
    model = module.Model(model_config)
    model.language_model = nn.Module()  # never evaluated: the target runs the text model
    weights = model.sanitize(release.tower_weights(read_safetensors(directory, "target")))
    if dtype is not None:
        weights = {key: value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
                   for key, value in weights.items()}
    towers = [sub for sub in model.children().values() if isinstance(sub, getattr(module, "VisionModel", ()))]
    for tower in towers:  # as mlx-vlm's loader does: the tower's own layout fixes (conv kernels)
        weights = tower.sanitize(weights) if hasattr(tower, "sanitize") else weights
    ops.quantize_as_stored(model, weights)
    expected = {f"{name}.{key}" for name in release.images.modules
                for key, _ in tree_flatten(getattr(model, name).parameters())}
    return model, weights, expected


def lacking(directory: Path, missing: list) -> str:
    return (f"{directory}: the release checkpoint lacks {len(missing)} tensors of its vision side "
            f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}), so it cannot read images")


def vlm_config(config: dict) -> tuple:
    """``(mlx-vlm's module of the release, its ModelConfig)``, as mlx-vlm's loader builds them."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    module, _ = get_model_and_args(dict(config))
    settings = {"text_config": {}, "vision_config": {}, **config}
    return module, update_module_configs(module.ModelConfig.from_dict(settings), module, settings,
                                         ["text", "vision", "perceiver", "projector", "audio"])


def release_processor(directory: Path, config: dict):
    """The release's processor as mlx-vlm loads it (its own torch-free image
    processors, which importing the release's mlx-vlm module installs)."""
    from mlx_vlm.utils import load_image_processor, load_processor

    vlm_config(config)
    processor = load_processor(directory, add_detokenizer=False)
    image_processor = load_image_processor(directory)
    if image_processor is not None:
        processor.image_processor = image_processor
    return processor


# ---- images in


# The formats images are read in: the web's own. PIL knows dozens more, some
# through outside programs (EPS runs Ghostscript), which a client's bytes
# must not reach.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


def opened_image(source, index: int = 0):
    """A PIL image from a path, bytes or a PIL image, its header read and
    nothing decoded (its ``size`` is known); a file that is not an image is
    refused with a ``ValueError`` naming image ``index`` (1-based in the
    message)."""
    from PIL import Image, UnidentifiedImageError

    name = f"image {index + 1}"
    if isinstance(source, Image.Image):
        return source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source,
                              formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise ValueError(f"{name} would decode into too many pixels (a decompression bomb?): {error}") from None
    except FileNotFoundError:
        raise ValueError(f"{name}: no such file {source}") from None
    except UnidentifiedImageError:
        raise ValueError(f"{name} is not an image this reader knows ({', '.join(IMAGE_FORMATS)})") from None
    except OSError as error:
        raise ValueError(f"{name} could not be read: {error}") from None


def read_image(source, index: int = 0, max_pixels: int = MAX_IMAGE_PIXELS):
    """An RGB PIL image from a path, bytes or a PIL image; a file that is not
    an image, is cut short, or would decode into more than ``max_pixels``
    pixels is refused with a ``ValueError`` naming image ``index`` (1-based in
    the message) before it is decoded."""
    from PIL import ImageOps

    name = f"image {index + 1}"
    image = opened_image(source, index)
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"{name} is {width} x {height} pixels ({width * height:,}); images may decode into at most "
                         f"{max_pixels:,} pixels (a decompression bomb is refused before it is decoded)")
    try:
        image.load()
    except OSError as error:
        raise ValueError(f"{name} could not be decoded (truncated or corrupt): {error}") from None
    return ImageOps.exif_transpose(image).convert("RGB")


def image_digest(image) -> str:
    """The content hash of a decoded image: its size and RGB pixels, however it was stored or sent."""
    digest = hashlib.sha256(f"{image.width}x{image.height}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def placeholder(processor) -> str:
    """The text that stands for one image before the processor expands it."""
    return getattr(processor, "image_token", None) or processor.tokenizer.image_token


def image_prompt(params, text: str, images: list, *, max_pixels: int = MAX_IMAGE_PIXELS,
                 max_tokens: int | None = None) -> ImagePrompt:
    """``text`` (laid out by the chat template, one image placeholder per
    image) and ``images`` (paths, bytes or PIL images) as an ``ImagePrompt``:
    the release's processor expands each placeholder into the image's soft
    tokens; each image's features come from mlx-vlm's vision tower when the
    prefill asks for them. Everything that can be refused is, with a
    ``ValueError`` naming it, before anything runs: a target that takes no
    images, unreadable images, placeholders that do not match the images, a
    prompt longer than ``max_tokens``."""
    vision = params.vision
    if vision is None:
        raise ValueError(refusal(params.spec.target.model_type))
    if vision.problem is not None:
        raise ValueError(vision.problem)
    pictures = [read_image(source, index, max_pixels) for index, source in enumerate(images)]
    processor = vision.processor
    mark = placeholder(processor)
    if text.count(mark) != len(pictures):
        raise ValueError(f"the prompt has {text.count(mark)} image placeholder(s) ({mark!r}) for {len(pictures)} "
                         f"image(s): give one placeholder per image (the chat template writes them)")
    whole = processed(vision, text, pictures)
    ids = whole["input_ids"]
    image_token = image_token_id(vision.config)
    total = int((ids == image_token).sum())
    if max_tokens is not None and len(ids) > max_tokens:
        raise ValueError(f"the prompt with its {len(pictures)} image(s) takes {len(ids)} tokens ({total} of them "
                         f"image tokens); the context holds {max_tokens}: send fewer or smaller images")
    per_image = [processed(vision, mark, [picture]) for picture in pictures]
    counts = [int((inputs["input_ids"] == image_token).sum()) for inputs in per_image]
    if sum(counts) != total:
        raise ValueError(f"the processor gave the prompt {total} image tokens but its images {sum(counts)}")
    side = vision.side
    positions = None
    if side.positions is not None:
        positions = np.asarray(side.positions(vision.model_config, ids, whole), np.int64)
    spans = image_spans(ids == image_token) if side.bidirectional(vision.text_config) else None
    entries = tuple(PromptImage(image_digest(picture), count, partial(encode, vision, inputs, count))
                    for picture, count, inputs in zip(pictures, counts, per_image))
    return ImagePrompt(tokens=tuple(int(t) for t in ids), image_token=image_token, images=entries,
                       positions=positions, spans=spans)


def image_token_id(config: dict) -> int:
    """The id a release's processor writes for each image soft token."""
    for key in ("image_token_id", "image_token_index"):
        if config.get(key) is not None:
            return int(config[key])
    raise ValueError(f"the release config ({config.get('model_type')}) names no image token (image_token_id)")


def processed(vision: Vision, text: str, pictures: list) -> dict:
    """The processor's output for ``text`` and ``pictures`` (as mlx-vlm's
    ``generate`` prepares it), the ids as a numpy row."""
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    inputs = prepare_inputs(vision.processor, images=pictures, prompts=[text],
                            add_special_tokens=should_add_special_tokens(vision.config["model_type"],
                                                                         vision.processor))
    # numpy, not MLX: a server reads requests on other threads than the one that runs the model
    inputs = {key: np.array(value) if isinstance(value, mx.array) else value for key, value in inputs.items()}
    inputs["input_ids"] = inputs["input_ids"][0]
    return inputs


def encode(vision: Vision, inputs: dict, count: int) -> mx.array:
    """``[count, d]``: one image's features from mlx-vlm's tower and projector."""
    inputs = {key: mx.array(value) if isinstance(value, np.ndarray) else value for key, value in inputs.items()}
    features = vision.side.features(vision.model, inputs)
    vision.encoded += 1
    if features.shape[0] != count:
        raise ValueError(f"the vision tower gave {features.shape[0]} features for an image of {count} tokens")
    return features


def image_spans(is_image: np.ndarray) -> np.ndarray:
    """``[L]``: the index of the run of image tokens each token is in (-1 for text)."""
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    return np.where(is_image, np.cumsum(starts) - 1, -1)
