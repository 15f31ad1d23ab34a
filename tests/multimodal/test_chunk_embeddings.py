"""The encoder outputs of one prefill chunk through the embedding cache (SGLang's
``_get_chunked_embedding_by_item``): items in the prefix skipped, an image split across chunks
encoded once and served from the cache to the next chunk, misses encoded together, an item too
large for the cache re-encoded per chunk, bad encoder output refused with the cache unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.multimodal import EmbeddingCache, MultimodalItem
from kvjax.multimodal.chunk_embeddings import chunk_embeddings

HIDDEN = 4


def _emb(item: MultimodalItem) -> np.ndarray:
    """A recognisable embedding: row r of the item of hash h is full of h * 100 + r."""
    return (item.hash * 100 + np.arange(item.num_tokens, dtype=np.float32))[:, None].repeat(HIDDEN, 1)


class Encoder:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, items):
        self.calls.append([i.hash for i in items])
        return [_emb(i) for i in items]


# a prompt of 40 positions: image 1 at [4, 12), image 2 at [20, 30)
ITEMS = [MultimodalItem(1, 4, 12), MultimodalItem(2, 20, 30)]


def _reference(start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    full, mask = np.zeros((40, HIDDEN), np.float32), np.zeros(40, bool)
    for item in ITEMS:
        full[item.start : item.end] = _emb(item)
        mask[item.start : item.end] = True
    return full[start:end], mask[start:end]


@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 40])
def test_chunks_reassemble_the_whole_prompts_rows_and_encode_each_image_once(chunk):
    cache, encode = EmbeddingCache(10**6), Encoder()
    for start in range(0, 40, chunk):
        end = min(start + chunk, 40)
        got = chunk_embeddings(ITEMS, start, end, cache, encode)
        rows, mask = got.dense(end - start, HIDDEN)
        want_rows, want_mask = _reference(start, end)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_array_equal(mask, want_mask)
    assert sorted(h for call in encode.calls for h in call) == [1, 2]
    cache.check_invariants()


def test_items_in_the_prefix_need_neither_the_encoder_nor_the_cache():
    cache, encode = EmbeddingCache(10**6), Encoder()
    got = chunk_embeddings(ITEMS, 12, 20, cache, encode)  # after image 1, before image 2
    assert got.pieces == () and got.skipped_in_prefix == 1 and encode.calls == []
    assert cache.stats().misses == 0


def test_misses_are_encoded_together_and_hits_come_from_the_cache():
    cache, encode = EmbeddingCache(10**6), Encoder()
    first = chunk_embeddings(ITEMS, 0, 40, cache, encode)
    assert encode.calls == [[1, 2]] and first.encoded == (1, 2) and first.from_cache == ()
    again = chunk_embeddings(ITEMS, 0, 40, cache, encode)  # the same images in another request
    assert encode.calls == [[1, 2]] and again.from_cache == (1, 2) and again.encoded == ()
    s = cache.stats()
    assert (s.hits, s.misses) == (2, 2)


def test_the_same_image_twice_is_looked_up_and_encoded_once():
    cache, encode = EmbeddingCache(10**6), Encoder()
    twice = [MultimodalItem(5, 0, 3), MultimodalItem(5, 6, 9)]
    got = chunk_embeddings(twice, 0, 10, cache, encode)
    assert encode.calls == [[5]] and len(got.pieces) == 2 and cache.stats().misses == 1


def test_an_image_larger_than_the_cache_is_served_and_encoded_again_by_the_next_chunk():
    cache, encode = EmbeddingCache(8), Encoder()  # smaller than any embedding here
    a = chunk_embeddings(ITEMS, 0, 8, cache, encode)
    b = chunk_embeddings(ITEMS, 8, 16, cache, encode)
    assert encode.calls == [[1], [1]] and len(cache) == 0 and cache.stats().not_kept == 2
    np.testing.assert_array_equal(np.concatenate([a.pieces[0][1], b.pieces[0][1]]), _emb(ITEMS[0]))


@pytest.mark.parametrize(
    ("encoder", "message"),
    [
        (lambda items: [], "gave 0 embeddings for 1 items"),
        (lambda items: [np.zeros((3, HIDDEN))], r"shape \(3, 4\)"),
        (lambda items: [np.zeros(8)], r"shape \(8,\)"),
    ],
)
def test_bad_encoder_output_is_refused_and_nothing_is_cached(encoder, message):
    cache = EmbeddingCache(10**6)
    with pytest.raises(ValueError, match=message):
        chunk_embeddings(ITEMS[:1], 0, 12, cache, encoder)
    assert len(cache) == 0


@pytest.mark.parametrize(("start", "end"), [(3, 3), (-1, 2), (5, 4)])
def test_an_empty_chunk_is_refused(start, end):
    with pytest.raises(ValueError, match=r"chunk \[start, end\)"):
        chunk_embeddings(ITEMS, start, end, EmbeddingCache(10), Encoder())
