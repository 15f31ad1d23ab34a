"""SGLang 0.5.23's request lifecycle: the prompt/output split, hits once per node per request,
the order slots return to the allocator, and the newer names."""

from __future__ import annotations

import numpy as np

from kvjax.radix import RadixCache
from kvjax.request import Req
from tests.radix._helpers import Harness


def test_finish_splits_at_the_prompt_so_eviction_drops_output_first():
    """0.5.23 re-inserts the prompt part with priority + 1: the output becomes its own leaf,
    evicted before the prompt."""
    h = Harness(page_size=2, size=64)
    req = h.start([1, 2, 3, 4, 5, 6])  # prompt: 3 pages
    h.decode(req, [7, 8, 9, 10])  # output: 2 pages
    row = h.row(req)
    assert h.finish(req) == []
    prompt_node = h.tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    assert prompt_node.depth == 6 and len(prompt_node.children) == 1  # a node boundary there
    (output_node,) = prompt_node.children.values()
    assert output_node.depth == 10 and output_node.priority == 0 and prompt_node.priority == 1
    h.alloc.take()
    assert h.tree.evict(1) == 4  # the output leaf alone
    assert h.alloc.take() == row[6:10]
    assert h.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).prefix_len == 6
    h.check()


def test_running_request_splits_once_past_the_prompt():
    h = Harness(page_size=1, size=64, eviction_policy="priority")
    req = h.start([1, 2, 3], priority=3)
    h.decode(req, [4])
    h.tree.cache_unfinished_req(req)
    node = req.last_node
    assert node.depth == 4 and node.klen == 1 and node.parent.depth == 3
    assert (node.parent.priority, node.priority) == (4, 3)  # prompt path: priority + 1
    h.decode(req, [5])
    h.tree.cache_unfinished_req(req)
    assert req.last_node.parent is node and req.cache_inserted_len == 5
    h.finish(req)
    m = h.tree.match_prefix([1, 2, 3, 4, 5])
    assert m.prefix_len == 5 and m.last_node.priority == 3
    h.check()


def test_prompt_only_key_is_not_split():
    h = Harness(page_size=1)
    req = h.start([1, 2, 3, 4])
    h.finish(req)
    node = h.tree.match_prefix([1, 2, 3, 4]).last_node
    assert node.klen == 4 and node.priority == 0
    h.check()


def test_retracted_request_frees_its_slots_as_one_range():
    h = Harness(page_size=2, size=64)
    h.tree.insert([1, 2], h.alloc.alloc(2))
    req = h.start([1, 2, 3, 4, 5])
    h.decode(req, [6, 7])
    row = h.row(req)
    h.alloc.freed.clear()
    h.tree.release_kv_cache(req, checkpoint=False)  # 0.5.23's name for is_insert=False
    assert h.alloc.freed == [row[2:7]]  # one free: [cache_protected_len, kv_len)
    assert req.cache_inserted_len == 0 and req.last_node is None
    h.check()


def test_duplicates_are_freed_in_row_order_then_the_tail():
    h = Harness(page_size=1, size=64)
    a = h.start([1, 2, 3, 4])
    b = h.start([1, 2, 3, 4, 5, 6])
    h.finish(a)
    row = h.row(b)
    h.alloc.freed.clear()
    h.tree.cache_finished_req(b)
    assert h.alloc.freed == [row[:4]]  # duplicates, in row order; no tail at page 1
    h.check()


def test_newer_names_follow_the_familiar_ones():
    h = Harness(page_size=1, size=64)
    a = h.start([1, 2, 3, 4])
    h.tree.release_kv_cache(a, checkpoint=True)
    h.free_row(a)
    row = h.new_row()
    b = Req("b", [1, 2, 3, 4, 9], req_pool_idx=row)
    m = h.tree.match_kv_cache(b)
    assert m.prefix_len == 4 and b.cache_protected_len == 4 and b.last_node is m.last_node
    assert h.tree.protected_size() == 4  # adopted and locked
    h.pool.write(row, 0, m.indices)
    h.pool.write(row, 4, h.alloc.alloc(1))
    h.tree.checkpoint_kv_cache(b)
    assert b.cache_protected_len == 5 and b.cache_inserted_len == 5
    h.tree.release_kv_cache(b, checkpoint=True)
    assert h.tree.protected_size() == 0 and h.tree.total_size() == 5
    c = Req("c", [1, 2, 3, 4, 9], req_pool_idx=h.new_row())
    assert h.tree.match_kv_cache(c, [1, 2, 3, 4, 9]).prefix_len == 5  # given tokens: all of them
    h.tree.dec_lock_ref(c.lock_receipt)
    d = Req("d", [1, 2, 3, 4, 9], req_pool_idx=h.new_row())
    assert h.tree.match_kv_cache(d, max_prefix_len=2).prefix_len == 2
    assert d.cache_protected_len == 2 and h.tree.protected_size() == 2
    h.tree.dec_lock_ref(d.lock_receipt)
    h.check()


def test_lfu_counts_each_request_once_across_its_steps():
    t = RadixCache(eviction_policy="lfu")
    t.insert([1, 2, 3], np.arange(1, 4, dtype=np.int32))
    node = t.match_prefix([1, 2, 3]).last_node
    assert node.hit_count == 1
    t.insert([1, 2, 3, 4], np.arange(1, 5, dtype=np.int32), inserted_len=3)  # a later step
    assert node.hit_count == 1
    t.insert([1, 2, 3, 4], np.arange(1, 5, dtype=np.int32))  # another request
    assert node.hit_count == 2


def test_retracted_request_keeps_the_access_times_of_its_last_checkpoint():
    """0.5.23 refreshes a running request's path at every checkpoint; the resumed lifecycle
    replays the last one when the request is released without an insert, so LRU order agrees."""
    h = Harness(page_size=2, size=64)
    a = h.start([1, 2, 3, 4, 5])
    h.finish(a)  # caches [1, 2, 3, 4]
    b = h.start([1, 2, 3, 4, 5])  # matches [1, 2, 3, 4]
    h.tree.cache_unfinished_req(b)  # its first checkpoint walks (and refreshes) the path
    h.tree.insert([7, 8], h.alloc.alloc(2))
    h.tree.cache_unfinished_req(b)  # nothing new to cache: 0.5.23 only refreshes b's path
    h.tree.release_kv_cache(b, checkpoint=False)
    h.alloc.take()
    assert h.tree.evict(1) == 2 and h.tree.match_prefix([7, 8]).prefix_len == 0  # [7, 8] is older
    assert h.tree.match_prefix([1, 2, 3, 4]).prefix_len == 4
    h.check()
