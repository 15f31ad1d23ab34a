"""`MultimodalMetadata`: a step's image rows, the part of ``AttentionMetadata`` a vision-language
model reads after embedding its tokens (field ``"mm"``, in ``AttentionMetadata.extra``).

A LLaVA-style language model embeds the step's ``T`` tokens (padded), then replaces the rows
flagged by ``mask`` with ``embeddings`` (`merge_image_rows`): a prefill chunk's image positions
get the encoder's outputs (``kvjax.multimodal.chunk_embeddings``), every other row keeps its token
embedding. The part is present in every step of a scheduler that serves images (decode steps
too, with nothing flagged), so the jitted step sees one structure; a step without it embeds the
tokens only.

Token ids at image positions are pad values (``kvjax.multimodal.pad_values``: ``>= 1_000_000``,
above the vocabulary); they are never looked up for real: ids outside ``[0, vocab)`` are clamped
to 0 before the lookup and their rows replaced.

Shapes: ``embeddings`` float32 ``[T, hidden]`` (the language model's width), ``mask`` bool
``[T]``; numpy on the host, device arrays inside the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FIELD", "MultimodalMetadata", "merge_image_rows", "safe_token_ids"]

FIELD = "mm"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MultimodalMetadata:
    """A step's image rows (module docstring): ``embeddings [T, hidden]`` where ``mask [T]``."""

    FIELD: ClassVar[str] = FIELD

    embeddings: jax.Array
    mask: jax.Array

    @classmethod
    def empty(cls, tokens: int, hidden: int) -> MultimodalMetadata:
        """Nothing flagged: ``tokens`` zero rows of width ``hidden`` (numpy)."""
        make: Any = cls  # numpy leaves on the host
        part: MultimodalMetadata = make(np.zeros((tokens, hidden), np.float32), np.zeros(tokens, bool))
        return part


def safe_token_ids(tokens: jax.Array, vocab_size: int) -> jax.Array:
    """``tokens`` with every id outside ``[0, vocab_size)`` (a pad value) set to 0 (inside jit)."""
    return jnp.where((tokens >= 0) & (tokens < vocab_size), tokens, 0)


def merge_image_rows(x: jax.Array, meta: Any) -> jax.Array:
    """``x [T, hidden]`` (the token embeddings) with the rows ``meta``'s part flags replaced by its
    image embeddings (cast to ``x``'s dtype); ``x`` as it is when ``meta`` has no part."""
    extra = getattr(meta, "extra", None) or {}
    part = extra.get(FIELD)
    if part is None:
        return x
    if part.embeddings.shape != x.shape:
        raise ValueError(
            f"the step's image rows are {tuple(part.embeddings.shape)} but its embeddings {tuple(x.shape)}: the "
            "multimodal part must be [T, hidden] of the step's padded tokens and the model's width"
        )
    return jnp.where(part.mask[:, None], part.embeddings.astype(x.dtype), x)
