"""`MultimodalItem`: one image (or other item) of a request: its content hash and where its
placeholder tokens lie in the prompt (SGLang's ``MultimodalDataItem``, one item per image).

Positions are a half-open range ``[start, end)`` of prompt positions (SGLang records inclusive
``(start, end)`` offsets, possibly several per item; kvjax gives each item one contiguous run,
what a LLaVA-style prompt has). The pixel values themselves stay with the caller (the encoder's
input); the item carries what the cache and the key need: the hash and, from it, the pad value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvjax.multimodal.item_hash import MODALITIES, hash_item
from kvjax.multimodal.pad_values import pad_value

__all__ = ["MultimodalItem"]


@dataclasses.dataclass(frozen=True)
class MultimodalItem:
    """One item of a request.

    Attributes:
        hash: the content hash (``hash_item``), an int in ``[0, 2**64)``; the embedding cache's key.
        start, end: its placeholder positions, ``[start, end)`` in the prompt; ``0 <= start < end``.
        modality: ``"image"``, ``"video"`` or ``"audio"``.

    Raises (on construction): ValueError naming the field for a hash, range or modality out of
    range.
    """

    hash: int
    start: int
    end: int
    modality: str = "image"

    def __post_init__(self) -> None:
        if isinstance(self.hash, bool) or not isinstance(self.hash, int) or not 0 <= self.hash < 1 << 64:
            raise ValueError(f"hash={self.hash!r}: give the item's content hash, an int in [0, 2**64) (hash_item)")
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: give a prompt position, an int >= 0")
        if self.end <= self.start:
            raise ValueError(
                f"[start, end)=[{self.start}, {self.end}): an item covers at least one placeholder position"
            )
        if self.modality not in MODALITIES:
            raise ValueError(f"modality={self.modality!r}: use one of {', '.join(MODALITIES)}")

    @classmethod
    def from_pixels(
        cls,
        pixel_values: np.ndarray,
        start: int,
        end: int,
        *,
        preprocessing: Mapping[str, Any] | None = None,
        modality: str = "image",
    ) -> MultimodalItem:
        """The item of ``pixel_values`` (hashed with ``preprocessing``) at positions ``[start, end)``."""
        return cls(hash_item(pixel_values, preprocessing=preprocessing, modality=modality), start, end, modality)

    @property
    def pad_value(self) -> int:
        """The token id its placeholder positions carry in the request's key (``pad_values``)."""
        return pad_value(self.hash)

    @property
    def num_tokens(self) -> int:
        """Its placeholder positions' count, ``end - start``."""
        return self.end - self.start
