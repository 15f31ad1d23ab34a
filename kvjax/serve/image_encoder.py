"""`ImageEncoder`: a LLaVA checkpoint's vision side (CLIP tower + projector), loaded and jitted.

``load_image_encoder(directory)`` reads ``config.json`` (``LlavaSettings``) and the tower's and
projector's tensors from the directory's safetensors files, under whichever prefix the
checkpoint uses: ``vision_tower.vision_model.*`` / ``vision_tower.*`` (older and current
``save_pretrained``) or ``model.vision_tower.*`` (Transformers 5's in-memory names), and
``multi_modal_projector.*`` or ``model.multi_modal_projector.*``. Every expected tensor is
checked (name and shape) before any is read; a problem is a `ConfigError` naming the tensor.

Calling the encoder runs the jitted ``LlavaImageEncoder`` on ``pixel_values [N, C, H, W]`` and
returns float32 numpy ``[N, tokens_per_image, text hidden]`` (Transformers'
``get_image_features``); ``runs`` counts the calls and ``images_encoded`` the images, so a caller
can tell an image served from the embedding cache from one encoded again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import ConfigError
from kvjax.serve.checkpoint import SafetensorsTensors, flatten_params, read_config, set_param
from kvjax.serve.families.llava import LlavaImageEncoder, LlavaSettings
from kvjax.serve.model_config import DTYPES

__all__ = ["ImageEncoder", "load_image_encoder"]

#: The checkpoint prefixes of each top-level part, in the order they are tried.
PREFIXES: Mapping[str, tuple[str, ...]] = {
    "vision_tower": (
        "vision_tower.vision_model.",
        "vision_tower.",
        "model.vision_tower.vision_model.",
        "model.vision_tower.",
    ),
    "multi_modal_projector": ("multi_modal_projector.", "model.multi_modal_projector."),
}


def tensor_name(path: tuple[str, ...]) -> str:
    """A parameter path below a part's prefix as the checkpoint's name: ``layers_3`` ->
    ``layers.3`` (the encoder's list), every other part as it is (``linear_1`` stays)."""
    return ".".join(f"layers.{p[len('layers_') :]}" if p.startswith("layers_") else p for p in path)


@dataclasses.dataclass
class ImageEncoder:
    """A loaded LLaVA image encoder (module docstring).

    Attributes:
        settings: the checkpoint's vision settings.
        params: the encoder's weights (``vision_tower`` and ``multi_modal_projector``).
        dtype: the weights' dtype; outputs are returned as float32 numpy.
        runs: calls that ran the encoder; images_encoded: images they encoded.
    """

    settings: LlavaSettings
    params: dict[str, Any]
    dtype: str = "float32"
    runs: int = 0
    images_encoded: int = 0

    def __post_init__(self) -> None:
        module = LlavaImageEncoder(self.settings, jnp.dtype(self.dtype))
        self._apply = jax.jit(lambda params, pixels: module.apply({"params": params}, pixels))

    @property
    def tokens_per_image(self) -> int:
        return self.settings.tokens_per_image

    @property
    def hidden_size(self) -> int:
        return self.settings.text_hidden_size

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(channels, image_size, image_size)``: one image's pixel values."""
        v = self.settings.vision
        return (v.num_channels, v.image_size, v.image_size)

    @property
    def placeholder_token_id(self) -> int:
        """The prompt's image placeholder id (``image_token_id``)."""
        return self.settings.image_token_id

    def __call__(self, pixel_values: np.ndarray) -> np.ndarray:
        """``[N, C, H, W] -> float32 [N, tokens_per_image, text hidden]``.

        Raises:
            ValueError: ``pixel_values`` is not ``[N, channels, image_size, image_size]``.
        """
        v = self.settings.vision
        pixels = np.asarray(pixel_values)
        want = (v.num_channels, v.image_size, v.image_size)
        if pixels.ndim != 4 or pixels.shape[1:] != want or pixels.shape[0] < 1:
            raise ValueError(
                f"pixel_values of shape {pixels.shape}: give [images, {want[0]}, {want[1]}, {want[2]}], each image "
                f"preprocessed to image_size {v.image_size}"
            )
        out = self._apply(self.params, pixels.astype(np.float32))
        self.runs += 1
        self.images_encoded += pixels.shape[0]
        return np.asarray(jax.device_get(out), np.float32)


def _prefix(tensors: SafetensorsTensors, part: str, probe: str, where: str) -> str:
    for prefix in PREFIXES[part]:
        if prefix + probe in tensors:
            return prefix
    raise ConfigError(
        "tensor",
        PREFIXES[part][0] + probe,
        f"missing from {where} (tried the prefixes {list(PREFIXES[part])}); save the checkpoint with "
        "LlavaForConditionalGeneration.save_pretrained",
    )


def load_image_encoder(directory: str | Path, *, dtype: str | None = None) -> ImageEncoder:
    """The image encoder of the LLaVA checkpoint in ``directory`` (module docstring); ``dtype``:
    the weights' dtype (default: the checkpoint's ``dtype`` / ``torch_dtype``, else float32).

    Raises:
        ConfigError: not a LLaVA checkpoint, a vision tower or setting kvjax does not serve
            (``LlavaSettings.from_config``), or a missing or mis-shaped tensor (nothing loaded).
    """
    path, raw = read_config(directory, servable=False)
    if raw.get("model_type") != "llava":
        raise ConfigError("model_type", raw.get("model_type"), "an image encoder loads from a llava checkpoint only")
    settings = LlavaSettings.from_config(raw)
    dtype = dtype or raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"use one of {list(DTYPES)}")
    v = settings.vision
    module = LlavaImageEncoder(settings, jnp.dtype(dtype))
    shapes = jax.eval_shape(
        lambda: module.init(jax.random.key(0), jnp.zeros((1, v.num_channels, v.image_size, v.image_size)))
    )["params"]
    where = str(path)
    with SafetensorsTensors(path) as tensors:
        prefixes = {
            "vision_tower": _prefix(tensors, "vision_tower", "embeddings.class_embedding", where),
            "multi_modal_projector": _prefix(tensors, "multi_modal_projector", "linear_1.weight", where),
        }
        names = {}
        for param_path, want in flatten_params(shapes):
            name = prefixes[param_path[0]] + tensor_name(param_path[1:])
            if name not in tensors:
                raise ConfigError("tensor", name, f"missing from {where} (expected shape {tuple(want.shape)})")
            if tensors.shape(name) != tuple(want.shape):
                raise ConfigError(
                    "tensor",
                    name,
                    f"has shape {tensors.shape(name)} in {where} but config.json implies {tuple(want.shape)}",
                )
            names[param_path] = name
        params: dict[str, Any] = {}
        for param_path, name in names.items():
            set_param(params, param_path, jnp.asarray(tensors.get(name), dtype=jnp.dtype(dtype)))
    return ImageEncoder(settings, params, dtype)
