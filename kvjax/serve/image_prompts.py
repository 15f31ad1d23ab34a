"""Images for ``generate``: each prompt's image placeholders matched with the images given, in
order, and the prompts' requests made through a `MultimodalExtension`.

A prompt names an image either with one placeholder id (LLaVA's ``<image>`` token, which the
processor expands; here it is expanded to ``tokens_per_image`` placeholders) or with a run of
exactly ``tokens_per_image`` placeholders (already expanded); runs of several whole images count
as that many images. Images are given for all prompts together, in order: prompt 1's
placeholders take the first images, and so on. Every check happens before anything is built, each
a `ConfigError` naming the value and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.multimodal import EmbeddingCache
from kvjax.serve.multimodal_extension import MultimodalExtension
from kvjax.serve.serving_req import ServingReq

__all__ = ["expand_placeholders", "image_requests"]


def expand_placeholders(ids: Sequence[int], placeholder: int, tokens_per_image: int) -> tuple[list[int], int]:
    """``(ids with each lone placeholder expanded to tokens_per_image, images named)``.

    Raises:
        ConfigError: a run of placeholders that is neither one id nor whole images.
    """
    out: list[int] = []
    images = 0
    i = 0
    while i < len(ids):
        if ids[i] != placeholder:
            out.append(int(ids[i]))
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == placeholder:
            j += 1
        run = j - i
        if run == 1:
            out += [placeholder] * tokens_per_image
            images += 1
        elif run % tokens_per_image == 0:
            out += [placeholder] * run
            images += run // tokens_per_image
        else:
            raise ConfigError(
                "prompt",
                f"{run} image placeholders (id {placeholder}) at position {i}",
                f"name an image with one placeholder or with {tokens_per_image} (the model's tokens per image)",
            )
        i = j
    return out, images


def image_requests(
    reqs: Sequence[ServingReq],
    images: Sequence[np.ndarray],
    encoder: Any,
    cache: EmbeddingCache[Any],
    vocab_size: int,
    *,
    preprocessing: dict[str, Any] | None = None,
) -> tuple[MultimodalExtension, list[ServingReq]]:
    """The extension serving ``encoder`` through ``cache`` and ``reqs`` remade through it, each
    with its placeholders' images (module docstring); the requests' prompts are already expanded.

    Raises:
        ConfigError: the images do not match the placeholders in count or shape (nothing kept).
    """
    mm = MultimodalExtension.for_encoder(encoder, cache, vocab_size, preprocessing=preprocessing)
    tpi = mm.tokens_per_image
    counts = [sum(1 for t in r.origin_input_ids if t == mm.placeholder_token_id) // tpi for r in reqs]
    if sum(counts) != len(images):
        raise ConfigError(
            "images",
            len(images),
            f"the prompts name {sum(counts)} image(s) (placeholder id {mm.placeholder_token_id}, per prompt "
            f"{counts}); give one image (--image) per image placeholder, in order",
        )
    out: list[ServingReq] = []
    at = 0
    try:
        for req, n in zip(reqs, counts, strict=True):
            out.append(
                mm.request(
                    req.rid,
                    req.origin_input_ids,
                    list(images[at : at + n]),
                    max_new_tokens=req.max_new_tokens,
                    stop_token_ids=req.stop_token_ids,
                    extra_key=req.extra_key,
                    priority=req.priority,
                    retention_seconds=req.retention_seconds,
                )
            )
            at += n
    except ValueError as e:
        raise ConfigError("images", len(images), str(e)) from None
    return mm, out
