"""`ChunkCache` (radix cache disabled) and the disabled `RadixCache`: SGLang's
``test_chunk_cache.py`` checklist, with kvjax's int32 indices."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.radix import ChunkCache, RadixCache
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req
from tests.radix._helpers import RecordingAllocator


def _table_pool(rows=4, width=5):
    """A 4x5 table holding ``arange(20)`` (SGLang's fixture)."""
    pool = ReqToTokenPool(rows, width)
    pool.req_to_token[:] = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    for _ in range(rows):
        pool.alloc(1)
    return pool


def _busy_allocator():
    """An allocator whose every slot is handed out (so the table's ids can be freed)."""
    alloc = RecordingAllocator(64, 1)
    alloc.alloc(alloc.available_size())
    return alloc


def test_flags_and_no_ops():
    c = ChunkCache()
    assert c.is_chunk_cache() and not c.is_tree_cache() and c.disable
    c.reset()  # a no-op that must not raise
    assert c.evict(5) == 0 and c.evict({"full": 5}) == {"full": 0}
    assert c.protected_size() == 0 and c.evictable_size() == 0 and c.total_size() == 0
    assert c.pretty_print() == ""
    c.sanity_check()
    assert c.take_events() == []


def test_match_insert_evict_lock_are_empty():
    c = ChunkCache()
    m = c.match_prefix([1, 2, 3])
    assert m.indices.dtype == np.int32 and m.indices.size == 0 and m.prefix_len == 0
    assert m.last_node is None and m.last_device_node is None and m.last_host_node is None
    assert c.insert([1, 2, 3], np.array([1, 2, 3])) == 0
    assert c.evict(10) == 0
    assert c.inc_lock_ref(None).delta == 0 and c.dec_lock_ref(None) == 0


def test_finished_frees_the_committed_slots():
    alloc = _busy_allocator()
    c = ChunkCache(req_to_token_pool=_table_pool(), token_to_kv_pool_allocator=alloc)
    req = Req("r", [1, 2, 3], req_pool_idx=1)
    c.cache_finished_req(req)
    assert alloc.take() == [5, 6, 7]


def test_finished_skips_the_protected_prefix():
    alloc = _busy_allocator()
    c = ChunkCache(req_to_token_pool=_table_pool(), token_to_kv_pool_allocator=alloc)
    req = Req("r", [1, 2, 3, 4], req_pool_idx=2, cache_protected_len=1)
    c.cache_finished_req(req)
    assert alloc.take() == [11, 12, 13]


def test_unfinished_sets_a_copy_of_prefix_indices():
    pool = _table_pool()
    c = ChunkCache(req_to_token_pool=pool)
    req = Req("r", [1, 2, 3, 4], req_pool_idx=2)
    c.cache_unfinished_req(req)
    assert req.prefix_indices.dtype == np.int32 and req.prefix_indices.tolist() == [10, 11, 12, 13]
    pool.req_to_token[2, :] = 0
    assert req.prefix_indices.tolist() == [10, 11, 12, 13]


def test_disabled_radix_cache_behaves_like_a_chunk_cache():
    alloc = _busy_allocator()
    pool = _table_pool()
    t = RadixCache(disable=True, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc)
    assert t.is_chunk_cache()
    req = Req("r", [1, 2], output_ids=[3], req_pool_idx=1)
    assert t.match_prefix([1, 2, 3]).prefix_len == 0
    t.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == [5, 6, 7]
    t.cache_finished_req(req)
    assert alloc.take() == [5, 6, 7]
    assert t.total_size() == 0 and t.evict(5) == 0


def test_lifecycle_needs_pool():
    with pytest.raises(ValueError, match="req_to_token_pool"):
        ChunkCache().cache_unfinished_req(Req("r", [1], req_pool_idx=0))
