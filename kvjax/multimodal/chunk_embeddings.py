"""`chunk_embeddings`: the encoder outputs one prefill chunk of a request needs, through the
embedding cache (SGLang's ``_get_chunked_embedding_by_item``).

A prefill chunk covers prompt positions ``[start, end)`` (``start``: the KV already there, the
matched prefix plus earlier chunks). For each item of the request:

* an item that ends at or before ``start`` is skipped: its KV is in the cache already (a prefix
  hit or an earlier chunk), so neither the encoder nor the embedding cache is asked;
* an item that starts at or after ``end`` is skipped: a later chunk needs it;
* every other item overlaps the chunk: it is looked up in the embedding cache by its hash; the
  misses are encoded together, in prompt order, by one call of ``encode`` and put into the cache
  (an item larger than the cache is served but not kept: a later chunk of the same image then
  encodes it again, as in SGLang, whose cache is best-effort too);
* the chunk gets the rows of each overlapping item that fall inside ``[start, end)``: an image
  split by chunked prefill gives its first rows to one chunk and the rest to the next.

Every rank that runs the same chunks makes the same lookups in the same order, so its cache makes
the same decisions (``embedding_cache``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvjax.multimodal.embedding_cache import EmbeddingCache
from kvjax.multimodal.item import MultimodalItem

__all__ = ["ChunkEmbeddings", "chunk_embeddings"]

#: ``encode(items) -> one embedding [item.num_tokens, hidden] per item``, in the items' order.
Encoder = Callable[[Sequence[MultimodalItem]], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class ChunkEmbeddings:
    """The image rows of one chunk ``[start, end)``.

    Attributes:
        pieces: ``(offset, rows)`` per overlapping item, in prompt order: ``rows`` (``[k, hidden]``,
            a slice of the item's embedding) belong at chunk positions ``[offset, offset + k)``
            (``offset`` counted from ``start``).
        encoded: the hashes of the items the encoder ran on in this call.
        from_cache: the hashes of the items the embedding cache served.
        skipped_in_prefix: how many items lay wholly before ``start`` (their KV is reused).
    """

    pieces: tuple[tuple[int, Any], ...]
    encoded: tuple[int, ...]
    from_cache: tuple[int, ...]
    skipped_in_prefix: int

    def dense(self, length: int, hidden: int, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
        """``(embeddings [length, hidden], mask [length] bool)``: the pieces scattered into a
        zero array of the chunk's ``length`` positions, and where they are (numpy, on the host)."""
        out = np.zeros((length, hidden), dtype)
        mask = np.zeros(length, bool)
        for offset, rows in self.pieces:
            rows = np.asarray(rows)
            out[offset : offset + rows.shape[0]] = rows
            mask[offset : offset + rows.shape[0]] = True
        return out, mask


def _checked(item: MultimodalItem, embedding: Any) -> Any:
    shape = getattr(embedding, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != item.num_tokens:
        raise ValueError(
            f"the encoder gave item [{item.start}, {item.end}) an embedding of shape {shape}: it needs "
            f"[{item.num_tokens}, hidden], one row per placeholder position (check the image's placeholder count)"
        )
    return embedding


def chunk_embeddings(
    items: Sequence[MultimodalItem], start: int, end: int, cache: EmbeddingCache[Any], encode: Encoder
) -> ChunkEmbeddings:
    """The image rows of the chunk ``[start, end)`` of a request with ``items`` (in prompt order),
    from ``cache`` or, on a miss, from ``encode`` (module docstring).

    Raises:
        ValueError: ``[start, end)`` is empty or negative, or ``encode`` returned another count of
            embeddings or an embedding whose row count is not its item's placeholder count
            (nothing is put into the cache then).
    """
    if not 0 <= start < end:
        raise ValueError(f"chunk [start, end)=[{start}, {end}): give 0 <= start < end")
    overlapping = [item for item in items if item.end > start and item.start < end]
    skipped = sum(1 for item in items if item.end <= start)
    held: dict[int, Any] = {}
    misses: list[MultimodalItem] = []
    for item in overlapping:
        if item.hash in held or any(m.hash == item.hash for m in misses):
            continue  # the same image twice in one chunk: one lookup
        value = cache.get(item.hash)
        if value is None:
            misses.append(item)
        else:
            held[item.hash] = value
    from_cache = tuple(held)
    if misses:
        outputs = list(encode(misses))
        if len(outputs) != len(misses):
            raise ValueError(
                f"the encoder gave {len(outputs)} embeddings for {len(misses)} items: it must give one per item"
            )
        checked = [_checked(item, out) for item, out in zip(misses, outputs, strict=True)]
        for item, out in zip(misses, checked, strict=True):
            held[item.hash] = out
            cache.put(item.hash, out)
    pieces = []
    for item in overlapping:
        lo, hi = max(item.start, start), min(item.end, end)
        pieces.append((lo - start, _checked(item, held[item.hash])[lo - item.start : hi - item.start]))
    return ChunkEmbeddings(tuple(pieces), tuple(m.hash for m in misses), from_cache, skipped)
