"""Image-aware prefix keys: a prompt's placeholder positions carry its image's pad value, so the
prefix tree, the host and storage tiers and the KV events tell two images apart and reuse the
KV of the same one, at page sizes 1, 4 and 16, with an image that ends mid-page, through the
tree directly and through the request lifecycle (``Req.token_range`` / ``fill_range``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.alloc import make_allocator
from kvjax.multimodal import MultimodalItem, pad_input_ids, placeholder_ranges
from kvjax.page_hash import PageHasher
from kvjax.radix import BlockStored, HiRadixCache, RadixCache
from kvjax.request import Req
from kvjax.tiers import SimulatedCopyEngine
from kvjax.tiers.storage import StorageTier, page_hashes
from kvjax.tiers.storage_key import StorageKey
from tests.radix._helpers import Harness

IMG = 3  # the placeholder token id
BEFORE, IMAGE, AFTER = 21, 20, 13  # the image covers [21, 41): it ends mid-page at page sizes 4 and 16
PREP = {"size": 8, "mean": [0.5, 0.5, 0.5]}
PAGE_SIZES = [1, 4, 16]


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 8, 8)).astype(np.float32)


def _prompt(image_seed: int, *, after_seed: int = 0, preprocessing=PREP) -> list[int]:
    """Text, one image's placeholders, text; the image's positions padded with its pad value."""
    text = np.random.default_rng(100 + after_seed).integers(10, 500, AFTER).tolist()
    ids = list(range(10, 10 + BEFORE)) + [IMG] * IMAGE + text
    ((start, end),) = placeholder_ranges(ids, IMG, [IMAGE])
    item = MultimodalItem.from_pixels(_pixels(image_seed), start, end, preprocessing=preprocessing)
    return pad_input_ids(ids, [item], IMG)


def _aligned(n: int, page_size: int) -> int:
    return n // page_size * page_size


A = _prompt(1)
B = _prompt(2)  # another image behind the same text
A_OTHER_TEXT = _prompt(1, after_seed=1)  # the same image, other text after it
A_OTHER_PREP = _prompt(1, preprocessing={**PREP, "size": 9})  # the same pixels, preprocessed otherwise
N = len(A)


def test_the_prompts_differ_exactly_where_they_should():
    first_diff = lambda x, y: next(i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t)  # noqa: E731
    assert first_diff(A, B) == first_diff(A, A_OTHER_PREP) == BEFORE
    assert first_diff(A, A_OTHER_TEXT) == BEFORE + IMAGE
    assert _prompt(1) == A


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_tree_reuses_the_same_image_and_never_another(page_size):
    tree = RadixCache(page_size=page_size)
    tree.insert(A, np.arange(1, N + 1))
    assert tree.match_prefix(A).prefix_len == _aligned(N, page_size)
    assert tree.match_prefix(B).prefix_len == _aligned(BEFORE, page_size)  # no false hit
    assert tree.match_prefix(A_OTHER_PREP).prefix_len == _aligned(BEFORE, page_size)
    # the image ends mid-page: that page holds text after it too, and matches only when both agree
    assert tree.match_prefix(A_OTHER_TEXT).prefix_len == _aligned(BEFORE + IMAGE, page_size)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_without_pad_values_two_images_would_share_their_kv(page_size):
    """The failure pad values prevent: raw placeholder ids make two images one key."""
    raw = list(range(10, 10 + BEFORE)) + [IMG] * IMAGE + list(range(50, 50 + AFTER))
    tree = RadixCache(page_size=page_size)
    tree.insert(raw, np.arange(1, N + 1))
    assert tree.match_prefix(list(raw)).prefix_len == _aligned(N, page_size)  # any image: a full hit


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_request_lifecycle_reads_the_padded_key(page_size):
    """Requests through match_and_lock, cache_finished_req (``token_range``): the second request
    with the same image starts from its KV, one with another image from the text before it."""
    h = Harness(page_size=page_size, size=256, rows=4, width=128)
    first = h.start(A)
    assert first.cached_tokens == 0
    h.finish(first)
    again = h.start(A)
    assert again.cached_tokens == _aligned(N - 1, page_size)  # all but the last token may match
    other = h.start(B)
    assert other.cached_tokens == _aligned(BEFORE, page_size)
    h.finish(again)
    h.finish(other)
    h.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_chunk_that_ends_inside_the_image_is_reused_by_the_same_image_only(page_size):
    """Chunked prefill splits the image: the first chunk's pages (``fill_range``) are cached while
    the request runs; a request with the same image reuses them, one with another image does not."""
    h = Harness(page_size=page_size, size=256, rows=4, width=128)
    chunk = BEFORE + IMAGE // 2  # ends inside the image
    row = h.new_row()
    req = Req("chunked", list(A), req_pool_idx=row)
    h.tree.match_and_lock(req)
    h.pool.write(row, 0, h.alloc.alloc(_aligned(chunk, page_size) + page_size)[:chunk])
    req.kv_committed_len = chunk
    req.fill_ids = req.token_range(0, chunk)
    h.tree.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == _aligned(chunk, page_size)
    same = Req("same", list(A))
    assert h.tree.match_prefix(same.fill_range(0, N - 1)).prefix_len == _aligned(chunk, page_size)
    other = Req("other", list(B))
    assert h.tree.match_prefix(other.fill_range(0, N - 1)).prefix_len == _aligned(BEFORE, page_size)
    h.tree.cache_finished_req(req, is_insert=False)
    h.free_row(req)
    h.check()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kv_events_carry_the_image_and_a_router_recomputes_them(page_size):
    tree = RadixCache(page_size=page_size, enable_kv_cache_events=True)
    tree.insert(A, np.arange(1, N + 1))
    (stored_a,) = [e for e in tree.take_events() if isinstance(e, BlockStored)]
    tree.insert(B, np.arange(N + 1, 2 * N + 1))
    (stored_b,) = [e for e in tree.take_events() if isinstance(e, BlockStored)]
    shared_pages = BEFORE // page_size
    # B's event starts where it leaves A: after the pages before the image, under A's last such page
    assert stored_b.parent_block_hash == (stored_a.block_hashes[shared_pages - 1] if shared_pages else None)
    assert not set(stored_b.block_hashes) & set(stored_a.block_hashes)
    assert stored_a.token_ids == A[: _aligned(N, page_size)]  # pad values on the wire
    hasher = PageHasher()
    assert stored_a.block_hashes == hasher.page_hashes(None, A, page_size, None)
    assert hasher.page_hashes(None, B, page_size, None)[shared_pages:] == stored_b.block_hashes


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_host_tier_hit_stops_at_another_image(page_size):
    alloc = make_allocator(256, page_size)
    tree = HiRadixCache(
        page_size=page_size, token_to_kv_pool_allocator=alloc, host_pool_tokens=256, copy_engine=SimulatedCopyEngine()
    )
    slots = alloc.alloc(_aligned(N, page_size) + page_size)
    tree.insert(A, slots[:N])
    alloc.free(slots[_aligned(N, page_size) :])
    tree.check_transfers()
    tree.evict(N)
    assert tree.match_prefix(A).prefix_len == 0
    assert tree.match_prefix(A).host_hit_length == _aligned(N, page_size)
    assert tree.match_prefix(B).host_hit_length == _aligned(BEFORE, page_size)
    assert tree.match_prefix(A_OTHER_TEXT).host_hit_length == _aligned(BEFORE + IMAGE, page_size)
    tree.check_invariants()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_storage_page_hashes_differ_from_the_images_first_page(page_size):
    a, b = page_hashes(A, page_size), page_hashes(B, page_size)
    shared = BEFORE // page_size
    assert a[:shared] == b[:shared] and all(x != y for x, y in zip(a[shared:], b[shared:], strict=True))
    assert page_hashes(A, page_size) == a


def test_storage_tier_prefetches_the_same_images_pages_only():
    """A prompt backed up to storage and evicted from device and host: the same image prefetches
    every page; another image behind the same text only the pages before it."""
    page_size, page = 4, (2, 4, 1, 2)
    key = StorageKey(model="mm-test", page_shape=page, store_dtype="uint16", kv_dtype="bfloat16")
    tree = HiRadixCache(
        page_size=page_size, host_pool_tokens=64, storage=StorageTier("memory", key=key), prefetch_threshold=4
    )
    n = _aligned(N, page_size)
    tree.insert(A[:n])
    tree.check_transfers(wait=True)
    tree.check_transfers(wait=True)  # the storage writes land
    tree.evict(n)
    tree.evict_host(n)
    assert tree.match_prefix(A).host_hit_length == 0
    text = _aligned(BEFORE, page_size)
    # B: the text's pages only; then A: the rest of its pages, after the text's (now on the host)
    for rid, prompt, fetched, hit in (("b", B, text, text), ("a", A, n - text, n)):
        m = tree.match_prefix(prompt)
        assert m.host_hit_length == hit - fetched
        assert tree.start_prefetch(rid, m, prompt) == fetched
        assert tree.check_prefetch_progress(rid)
        assert tree.match_prefix(prompt).host_hit_length == hit
    tree.check_invariants()
