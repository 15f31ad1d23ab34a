"""Images from files, preprocessed as a checkpoint's ``preprocessor_config.json`` says (a CLIP image
processor, what LLaVA checkpoints ship), with Pillow.

`ImagePreprocessing` reads the processor's settings; calling it on a Pillow image follows
Transformers' CLIP image processor (its Pillow backend), step by step:

1. ``do_convert_rgb``: to RGB (an image with transparency composited on white first);
2. ``do_resize``: the shortest edge to ``size.shortest_edge``, the other edge to
   ``int(shortest_edge * long / short)`` (or both to ``size.height`` x ``size.width``), with the
   Pillow filter ``resample`` (3, bicubic, by default);
3. ``do_center_crop``: ``crop_size`` from the middle (offsets ``(edge - crop) // 2``);
4. ``do_rescale``: times ``rescale_factor`` (1/255), computed in float64, stored as float32;
5. ``do_normalize``: ``(x - image_mean) / image_std`` per channel, float32.

The result is float32 ``[3, height, width]`` (channels first), the encoder's input. `settings`
is what the content hash covers beside the pixels (``kvjax.multimodal.hash_item``).
A directory without ``preprocessor_config.json`` gets CLIP's defaults at the tower's
``image_size``. An image whose resized size is smaller than the crop is refused (Transformers
pads it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvjax.errors import ConfigError

__all__ = ["CLIP_MEAN", "CLIP_STD", "ImagePreprocessing", "read_image"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclasses.dataclass(frozen=True)
class ImagePreprocessing:
    """A CLIP image processor's settings (sizes in pixels; module docstring)."""

    shortest_edge: int | None = 224
    resize_to: tuple[int, int] | None = None  # (height, width) when size names both
    crop: tuple[int, int] | None = (224, 224)  # (height, width); None: no center crop
    resample: int = 3
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = CLIP_MEAN
    std: tuple[float, ...] | None = CLIP_STD
    convert_rgb: bool = True

    @classmethod
    def clip_defaults(cls, image_size: int) -> ImagePreprocessing:
        """CLIP's processor at ``image_size``: shortest edge and crop both ``image_size``."""
        return cls(shortest_edge=image_size, crop=(image_size, image_size))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ImagePreprocessing:
        """Read a ``preprocessor_config.json`` object (`ConfigError` naming a key it cannot use)."""
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        shortest: int | None = None
        resize_to: tuple[int, int] | None = None
        if raw.get("do_resize", True):
            if isinstance(size, Mapping) and "shortest_edge" in size:
                shortest = int(size["shortest_edge"])
            elif isinstance(size, Mapping) and "height" in size and "width" in size:
                resize_to = (int(size["height"]), int(size["width"]))
            else:
                raise ConfigError(
                    "preprocessor_config.size", size, "give {'shortest_edge': n} or {'height': h, 'width': w}"
                )
        crop: tuple[int, int] | None = None
        if raw.get("do_center_crop", True):
            crop_size = raw.get("crop_size", {"height": 224, "width": 224})
            if isinstance(crop_size, int):
                crop_size = {"height": crop_size, "width": crop_size}
            if not isinstance(crop_size, Mapping) or "height" not in crop_size or "width" not in crop_size:
                raise ConfigError("preprocessor_config.crop_size", crop_size, "give {'height': h, 'width': w}")
            crop = (int(crop_size["height"]), int(crop_size["width"]))
        normalize = raw.get("do_normalize", True)
        mean = tuple(float(v) for v in raw.get("image_mean", CLIP_MEAN)) if normalize else None
        std = tuple(float(v) for v in raw.get("image_std", CLIP_STD)) if normalize else None
        return cls(
            shortest_edge=shortest,
            resize_to=resize_to,
            crop=crop,
            resample=int(raw.get("resample", 3)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
            mean=mean,
            std=std,
            convert_rgb=bool(raw.get("do_convert_rgb", True)),
        )

    @classmethod
    def from_directory(cls, directory: str | Path, image_size: int) -> ImagePreprocessing:
        """The checkpoint's ``preprocessor_config.json``, or CLIP's defaults at ``image_size``."""
        path = Path(directory) / PREPROCESSOR_FILE
        if not path.is_file():
            return cls.clip_defaults(image_size)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("model", str(path), f"is not readable JSON ({e}); re-download it") from None
        if not isinstance(raw, dict):
            raise ConfigError("model", str(path), "must hold a JSON object; re-download it")
        return cls.from_dict(raw)

    def settings(self) -> dict[str, Any]:
        """The settings as plain JSON values (hashed with the pixels)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def __call__(self, image: Any) -> np.ndarray:
        """A Pillow image -> float32 ``[channels, height, width]`` (module docstring).

        Raises:
            ValueError: the resized image is smaller than the crop.
        """
        from PIL import Image

        if self.convert_rgb and image.mode != "RGB":
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255))
            image = Image.alpha_composite(background, rgba).convert("RGB")
        width, height = image.size
        if self.shortest_edge is not None:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
            image = image.resize((new_w, new_h), resample=self.resample)
        elif self.resize_to is not None:
            image = image.resize((self.resize_to[1], self.resize_to[0]), resample=self.resample)
        array = np.array(image)
        array = array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)  # [C, H, W]
        if self.crop is not None:
            ch, cw = self.crop
            h, w = array.shape[1:]
            if ch > h or cw > w:
                raise ValueError(
                    f"the image resized to {h}x{w} is smaller than the crop {ch}x{cw}; give a larger image"
                )
            top, left = (h - ch) // 2, (w - cw) // 2
            array = array[:, top : top + ch, left : left + cw]
        out = array.astype(np.float32)
        if self.rescale_factor is not None:
            out = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, np.float32)[:, None, None]
            std = np.asarray(self.std, np.float32)[:, None, None]
            out = ((out - mean) / std).astype(np.float32)
        return np.ascontiguousarray(out)


def read_image(path: str | Path, preprocessing: ImagePreprocessing) -> np.ndarray:
    """The image file ``path`` preprocessed, float32 ``[channels, height, width]``.

    Raises:
        ConfigError: the file cannot be read as an image (naming it), or is too small for the crop.
    """
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(
            "image", str(path), "reading images needs Pillow: pip install pillow (kvjax's 'vision' extra)"
        ) from None
    try:
        with Image.open(path) as opened:
            opened.load()
            image = opened.copy()
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise ConfigError("image", str(path), f"cannot be read as an image ({e}); give a PNG or JPEG file") from None
    try:
        return preprocessing(image)
    except ValueError as e:
        raise ConfigError("image", str(path), str(e)) from None
