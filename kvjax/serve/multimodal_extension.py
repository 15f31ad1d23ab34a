"""`MultimodalExtension`: images in the serving loop (a ``ServingExtension``), SGLang's multimodal
path over kvjax's host pieces (``kvjax.multimodal``).

* `MultimodalExtension.request` turns a prompt with image placeholders and the images' pixel
  values (preprocessed arrays ``[C, H, W]``) into a ``ServingReq``: each image is an item
  (``MultimodalItem``: its content hash over the pixels and the ``preprocessing`` settings, its
  placeholder run), the prompt is padded (``pad_input_ids``: each image's positions carry its pad
  value, so the tree, the tiers and the KV events tell images apart) and the request's items and
  pixels are kept until it finishes. Everything is checked first: a wrong image shape or an
  image count that does not match the placeholders raises ``ValueError`` and registers nothing.
* ``step_metadata`` gives every step a ``MultimodalMetadata`` part (``[T, hidden]`` rows and a
  ``[T]`` mask, ``T`` the step's padded token count; nothing flagged in a decode step), so the
  jitted step sees one structure. For each prefill row, the chunk ``[start, seq_len)`` gets its
  image rows from ``chunk_embeddings`` through the ``EmbeddingCache``: an image whose positions
  all lie in the matched prefix is neither looked up nor encoded (its KV comes from the tree), an
  image seen before is served from the cache, the misses of a chunk are encoded in one call, and
  an image split by chunked prefill is encoded once (its later rows come from the cache).
* ``before_release``: a finished request's items are dropped; a retracted one keeps them (it is
  prefilled again, through the same path).

Counters: the encoder's ``runs`` / ``images_encoded`` and the embedding cache's ``stats()``
(`stats`); the scheduler it is attached to counts this scheduler's share in its ``ServeStats``
(``images_encoded``, ``encoder_runs``, ``image_cache_hits``, ``image_cache_misses``,
``image_cache_evictions``). The extension's work is on the host; its cache is the caller's object, sized from the
plan (``EmbeddingCache.from_plan``: ``vlm_cache_size_mb``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from kvjax.attention.metadata_builder import token_bucket
from kvjax.multimodal import (
    EmbeddingCache,
    MultimodalItem,
    check_vocab_size,
    chunk_embeddings,
    hash_item,
    pad_input_ids,
    placeholder_ranges,
)
from kvjax.serve.extension import ServingExtension, StepBatch
from kvjax.serve.multimodal_metadata import MultimodalMetadata
from kvjax.serve.serving_req import ServingReq

__all__ = ["ImageEncoderProtocol", "MultimodalExtension"]


class ImageEncoderProtocol(Protocol):
    """What the extension needs of an encoder (``kvjax.serve.image_encoder.ImageEncoder``):
    ``encoder(pixels [N, C, H, W]) -> [N, tokens_per_image, hidden_size]``."""

    @property
    def tokens_per_image(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    def __call__(self, pixel_values: np.ndarray) -> np.ndarray: ...


@dataclasses.dataclass
class _Images:
    """A request's items (prompt order) and the pixel values of each, by content hash."""

    items: tuple[MultimodalItem, ...]
    pixels: dict[int, np.ndarray]


class MultimodalExtension(ServingExtension):
    """Images through the serving loop (module docstring).

    Args:
        encoder: the image encoder (pixel values -> embedding rows).
        cache: the embedding cache the encoder's outputs go through.
        placeholder_token_id: the prompt's image placeholder id (LLaVA's ``image_token_id``).
        vocab_size: the language model's vocabulary (pad values must lie above it).
        image_shape: ``(C, H, W)`` every image must have (the encoder's input), or None.
        preprocessing: the settings that produced the pixel values (hashed with them), or None.
    """

    def __init__(
        self,
        encoder: ImageEncoderProtocol,
        cache: EmbeddingCache[Any],
        *,
        placeholder_token_id: int,
        vocab_size: int,
        image_shape: tuple[int, int, int] | None = None,
        preprocessing: Mapping[str, Any] | None = None,
    ) -> None:
        check_vocab_size(vocab_size)
        self.encoder = encoder
        self.cache = cache
        self.placeholder_token_id = int(placeholder_token_id)
        self.image_shape = image_shape if image_shape is not None else getattr(encoder, "image_shape", None)
        self.preprocessing = preprocessing
        self.hidden_size = int(encoder.hidden_size)
        self.tokens_per_image = int(encoder.tokens_per_image)
        self._images: dict[int, tuple[ServingReq, _Images]] = {}
        self._empty: dict[int, MultimodalMetadata] = {}
        self._stats: Any = None  # the attached scheduler's ServeStats

    @classmethod
    def for_encoder(
        cls,
        encoder: Any,
        cache: EmbeddingCache[Any],
        vocab_size: int,
        *,
        preprocessing: Mapping[str, Any] | None = None,
    ) -> MultimodalExtension:
        """The extension of a loaded ``ImageEncoder`` (its placeholder id and image shape)."""
        return cls(
            encoder,
            cache,
            placeholder_token_id=encoder.placeholder_token_id,
            vocab_size=vocab_size,
            image_shape=encoder.image_shape,
            preprocessing=preprocessing,
        )

    # --- requests ---------------------------------------------------------------------------------

    def _pixels(self, images: Sequence[np.ndarray] | np.ndarray) -> list[np.ndarray]:
        arrays = [np.asarray(image) for image in images]
        for i, image in enumerate(arrays):
            if image.ndim != 3 or image.dtype.kind not in "fiu":
                raise ValueError(
                    f"image {i} of shape {image.shape} and dtype {image.dtype}: give preprocessed pixel values, a "
                    "numeric array [channels, height, width]"
                )
            if self.image_shape is not None and tuple(image.shape) != tuple(self.image_shape):
                raise ValueError(
                    f"image {i} of shape {tuple(image.shape)}: the encoder takes {tuple(self.image_shape)} "
                    "(preprocess it as the checkpoint's preprocessor says)"
                )
        return [np.ascontiguousarray(image, np.float32) for image in arrays]

    def request(
        self,
        rid: Any,
        input_ids: Sequence[int] | np.ndarray,
        images: Sequence[np.ndarray] | np.ndarray,
        *,
        max_new_tokens: int,
        **fields: Any,
    ) -> ServingReq:
        """A ``ServingReq`` of ``input_ids`` (one run of ``tokens_per_image`` placeholders per image,
        in order) and ``images`` (pixel values ``[C, H, W]`` each), its prompt padded; ``fields``:
        the other ``ServingReq`` arguments. The images are kept for the request's prefill.

        Raises:
            ValueError: an image of the wrong shape or dtype, or an image count that does not
                match the prompt's placeholders (nothing registered).
        """
        pixels = self._pixels(images)
        ranges = placeholder_ranges(input_ids, self.placeholder_token_id, [self.tokens_per_image] * len(pixels))
        items = tuple(
            MultimodalItem(hash_item(p, preprocessing=self.preprocessing), start, end)
            for p, (start, end) in zip(pixels, ranges, strict=True)
        )
        padded = pad_input_ids(input_ids, items, self.placeholder_token_id)
        req = ServingReq(rid, padded, max_new_tokens=max_new_tokens, **fields)
        if items:
            by_hash = {item.hash: p for item, p in zip(items, pixels, strict=True)}
            self._images[id(req)] = (req, _Images(items, by_hash))
        return req

    def items(self, req: ServingReq) -> tuple[MultimodalItem, ...]:
        """The request's items (empty for a text-only or unknown request)."""
        held = self._images.get(id(req))
        return held[1].items if held is not None else ()

    def image_hashes(self, images: Sequence[np.ndarray] | np.ndarray) -> list[int]:
        """The content hash ``request`` gives each of ``images`` (pixel values ``[C, H, W]``, with
        this extension's ``preprocessing``); registers nothing.

        Raises:
            ValueError: an image of the wrong shape or dtype (as ``request``).
        """
        return [hash_item(p, preprocessing=self.preprocessing) for p in self._pixels(images)]

    def request_images(self, req: ServingReq) -> tuple[list[int], tuple[np.ndarray, ...]] | None:
        """What ``request`` was given for ``req``, to make an equal request elsewhere: the
        unpadded prompt (each item's positions back to ``placeholder_token_id``) and the kept
        pixel values (float32 ``[C, H, W]``, one per item, in prompt order; not copies: read
        them, never change them). None for a request this extension holds no images of.

        Invariant: ``request(rid, *request_images(req), ...)`` with ``req``'s other fields gives
        a request whose padded prompt and items equal ``req``'s.
        """
        held = self._images.get(id(req))
        if held is None or held[0] is not req:
            return None
        images = held[1]
        prompt = [int(t) for t in req.origin_input_ids]
        for item in images.items:
            prompt[item.start : item.end] = [self.placeholder_token_id] * (item.end - item.start)
        return prompt, tuple(images.pixels[item.hash] for item in images.items)

    def discard(self, req: ServingReq) -> None:
        """Drop ``req``'s images (a request that will never be served here, e.g. one submitted
        on a process other than 0 of multi-process serving); nothing for an unknown request."""
        held = self._images.get(id(req))
        if held is not None and held[0] is req:
            del self._images[id(req)]

    @property
    def registered(self) -> int:
        """Requests whose images are held (until they finish)."""
        return len(self._images)

    def stats(self) -> dict[str, Any]:
        """The embedding cache's counters (``EmbeddingCacheStats``) and the encoder's runs and
        images encoded, as one flat dict."""
        out: dict[str, Any] = dataclasses.asdict(self.cache.stats())
        out["hit_rate"] = self.cache.stats().hit_rate
        out["encoder_runs"] = int(getattr(self.encoder, "runs", 0))
        out["images_encoded"] = int(getattr(self.encoder, "images_encoded", 0))
        return out

    # --- hooks ------------------------------------------------------------------------------------

    def attach(self, scheduler: Any) -> None:
        """Count this scheduler's image work in its ``ServeStats`` (``images_encoded``,
        ``encoder_runs``, ``image_cache_hits`` / ``_misses`` / ``_evictions``)."""
        self._stats = getattr(scheduler, "stats", None)

    def _counters(self) -> tuple[int, ...]:
        c = self.cache
        enc = self.encoder
        return (
            int(getattr(enc, "images_encoded", 0)),
            int(getattr(enc, "runs", 0)),
            c.hits,
            c.misses,
            c.evictions,
        )

    def _count(self, before: tuple[int, ...]) -> None:
        if self._stats is None:
            return
        names = ("images_encoded", "encoder_runs", "image_cache_hits", "image_cache_misses", "image_cache_evictions")
        for name, old, new in zip(names, before, self._counters(), strict=True):
            setattr(self._stats, name, getattr(self._stats, name) + new - old)

    def step_metadata(self, batch: StepBatch) -> MultimodalMetadata:
        tokens = token_bucket(int(np.asarray(batch.slots).shape[0]))
        if batch.is_decode or not self._images:
            if tokens not in self._empty:
                self._empty[tokens] = MultimodalMetadata.empty(tokens, self.hidden_size)
            return self._empty[tokens]
        rows = np.zeros((tokens, self.hidden_size), np.float32)
        mask = np.zeros(tokens, bool)
        before = self._counters()
        at = 0
        for req, start, end in zip(batch.reqs, np.asarray(batch.starts), np.asarray(batch.seq_lens), strict=True):
            held = self._images.get(id(req))
            if held is not None and end > start:
                images = held[1]

                def encode(items: Sequence[MultimodalItem], images: _Images = images) -> list[np.ndarray]:
                    return list(self.encoder(np.stack([images.pixels[item.hash] for item in items])))

                chunk = chunk_embeddings(images.items, int(start), int(end), self.cache, encode)
                for offset, piece in chunk.pieces:
                    piece = np.asarray(piece)
                    rows[at + offset : at + offset + piece.shape[0]] = piece
                    mask[at + offset : at + offset + piece.shape[0]] = True
            at += int(end - start)
        self._count(before)
        part: Any = MultimodalMetadata
        return part(rows, mask)

    def before_release(self, req: ServingReq, finished: bool) -> None:
        if finished:
            self._images.pop(id(req), None)

    def in_lockstep(self, layout: Any, rank: int, shared: dict[str, Any]) -> bool:
        """Not run under lockstep DP (its part is not padded for the ranks' stacked steps)."""
        return False
