"""`MambaRadixCache`: SGLang 0.5.23's Mamba conformance scenario, the per-path cap, bad input,
copy-on-write and the finished/unfinished lifecycle with a request table."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.alloc import TokenToKVPoolAllocator, make_allocator
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError
from kvjax.hybrid_req_pool import HybridReqToTokenPool
from kvjax.radix import MambaRadixCache
from kvjax.request import Req


def sizes(tree: MambaRadixCache) -> tuple[int, int, int, int]:
    return (
        tree.full_evictable_size(),
        tree.full_protected_size(),
        tree.mamba_evictable_size(),
        tree.mamba_protected_size(),
    )


def test_sglang_mamba_unittest_scenario():
    # test_mamba_unittest.test_mamba_radix_cache_1: 128 KV slots, 10 rows, 20 state slots, page 1.
    kv = TokenToKVPoolAllocator(128)
    table = HybridReqToTokenPool(10, 128, mamba_size=20)
    tree = MambaRadixCache(page_size=1, allocator=kv, req_to_token_pool=table)
    states = table.mamba_allocator
    slots = {}
    for name, key in [
        ("r1", [1, 2, 3]),
        ("r2", [1, 2, 3, 4, 5, 6, 7]),
        ("r3", [10, 11, 12]),
        ("r4", [1, 2, 3, 4, 5, 60, 70]),
    ]:
        req = Req(name, [])
        table.alloc_reqs([req])
        slots[name] = req.mamba_pool_idx
        result = tree.insert(key, kv.alloc(len(key)), mamba_value=req.mamba_pool_idx)
        assert not result.mamba_exist
    assert list(slots.values()) == [1, 2, 3, 4]
    assert (states.available_size(), kv.available_size()) == (16, 128 - 20)
    # a split stamps the suffix [6, 7] fresh, so the least recent FULL leaf is [10, 11, 12]
    evicted = tree.evict(num_tokens=1)
    assert (evicted.num_tokens_evicted, evicted.mamba_num_evicted) == (3, 1)
    assert states.available_size() == 17 and not states.is_live([slots["r3"]])[0]
    # the insert walks do not refresh checkpoints: [1, 2, 3]'s (slot 1) is the least recent
    evicted = tree.evict(num_tokens=0, mamba_num=1)
    assert (evicted.num_tokens_evicted, evicted.mamba_num_evicted) == (0, 1)
    assert not states.is_live([slots["r1"]])[0]
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.prefix_len == 0 and len(m.indices) == 0 and m.full_kv_hit_length == 5
    m = tree.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert m.prefix_len == 7 and m.last_node.klen == 2 and m.extras["mamba"].slot == slots["r4"]
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.prefix_len == 7 and m.last_node.klen == 2 and m.extras["mamba"].slot == slots["r2"]
    evicted = tree.evict(num_tokens=0, mamba_num=1)  # [60, 70]: a leaf, deleted with its KV
    assert (evicted.num_tokens_evicted, evicted.mamba_num_evicted) == (2, 1)
    m = tree.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert m.prefix_len == 0 and m.last_node is tree.root
    # copy-on-write of the match's checkpoint into a new request's slot
    req9 = Req("r9", [1, 2, 3, 4, 5, 6, 7])
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7], req=req9, cow_mamba=True)
    assert m.prefix_len == 7 and req9.mamba_cow_src_index == slots["r2"]
    assert tree.take_state_copies() == [(slots["r2"], req9.mamba_pool_idx)]
    tree.sanity_check()
    assert sizes(tree) == (7, 0, 1, 0)


def test_match_refreshes_recency_only_up_to_the_checkpoint_it_ends_at():
    """0.5.23 refreshes FULL recency from the node where the match finally ends up to the root.
    Matches of [1..4] end at the root ([1..4] has no checkpoint), so [1..4] stays older than
    [20..23]: evicting 5 tokens takes [5..8] and then [1..4], one checkpoint (kvjax stamped
    the walked [1..4] and evicted [20..23] too: 2 checkpoints)."""
    kv = TokenToKVPoolAllocator(64)
    table = HybridReqToTokenPool(4, 64, mamba_size=8)
    tree = MambaRadixCache(page_size=1, allocator=kv, req_to_token_pool=table)

    def insert(name: str, key: list[int]) -> None:
        req = Req(name, [])
        table.alloc_reqs([req])
        tree.insert(key, kv.alloc(len(key)), mamba_value=req.mamba_pool_idx)

    insert("a", list(range(1, 9)))
    assert tree.match_prefix([1, 2, 3, 4]).prefix_len == 0
    insert("b", [20, 21, 22, 23])
    assert tree.match_prefix([1, 2, 3, 4]).prefix_len == 0
    evicted = tree.evict(num_tokens=5)
    assert (evicted.num_tokens_evicted, evicted.mamba_num_evicted) == (8, 1)
    assert tree.match_prefix([20, 21, 22, 23]).prefix_len == 4
    tree.sanity_check()


def test_mamba_max_states_per_path():
    # "With 2, matches on [1..4] and [1..8] return 0 while their FULL KV stays."
    tree = MambaRadixCache(page_size=1, mamba_pool_size=8, mamba_max_states_per_path=2)
    alloc = tree.mamba_allocator
    for end in (4, 8, 12, 16):
        tree.insert(list(range(1, end + 1)), mamba_value=int(alloc.alloc(1)[0]))
    assert tree.mamba_evictable_size() == 2 and alloc.available_size() == 6
    for end, want in ((4, 0), (8, 0), (12, 12), (16, 16)):
        m = tree.match_prefix(list(range(1, end + 1)))
        assert (m.prefix_len, m.full_kv_hit_length) == (want, end)
    assert tree.total_size() == 16
    tree.sanity_check()


def test_insert_on_a_node_with_a_checkpoint_hands_the_slot_back():
    tree = MambaRadixCache(page_size=1, mamba_pool_size=4)
    a, b = (int(s) for s in tree.mamba_allocator.alloc(2))
    assert not tree.insert([1, 2, 3], mamba_value=a).mamba_exist
    result = tree.insert([1, 2, 3], mamba_value=b)
    assert result.mamba_exist and result.results["mamba"] == b
    assert tree.match_prefix([1, 2, 3]).extras["mamba"].slot == a


def test_bad_input_leaves_the_tree_unchanged():
    kv = TokenToKVPoolAllocator(32)
    tree = MambaRadixCache(page_size=1, allocator=kv, mamba_pool_size=4)
    states = tree.mamba_allocator
    a = int(states.alloc(1)[0])
    tree.insert([1, 2, 3], kv.alloc(3), mamba_value=a)
    before = (tree.pretty_print(), sizes(tree), states.available_size(), kv.available_size())
    node = tree.match_prefix([1, 2, 3]).last_node
    with pytest.raises(ValueError, match="already has a checkpoint"):
        tree.attach_checkpoint(node, int(states.alloc(1)[0]))
    with pytest.raises(InvalidSlotError, match="already a checkpoint"):
        tree.insert([1, 2, 3, 4], kv.alloc(4), mamba_value=a)
    with pytest.raises(InvalidSlotError, match="free"):
        tree.insert([5, 6], kv.alloc(2), mamba_value=4)  # slot 4 was never handed out
    states.free([2])  # the slot given to attach_checkpoint above
    with pytest.raises(DoubleFreeError, match="double free"):
        states.free([2])
    kv.free(np.arange(4, 10, dtype=np.int32))  # the rejected inserts' KV slots
    assert (tree.pretty_print(), sizes(tree), states.available_size(), kv.available_size()) == before
    tree.sanity_check()
    with pytest.raises(ConfigError, match="enable_mamba_extra_buffer"):
        MambaRadixCache(page_size=4, mamba_pool_size=4)
    assert MambaRadixCache(page_size=4, mamba_pool_size=4, enable_mamba_extra_buffer=True).page_size == 4


def test_state_locks_cover_the_node_only_and_follow_the_receipt():
    tree = MambaRadixCache(page_size=1, mamba_pool_size=4)
    alloc = tree.mamba_allocator
    tree.insert([1, 2], mamba_value=int(alloc.alloc(1)[0]))
    tree.insert([1, 2, 3, 4], mamba_value=int(alloc.alloc(1)[0]))
    leaf = tree.match_prefix([1, 2, 3, 4]).last_node
    receipt = tree.inc_lock_ref(leaf)
    assert sizes(tree) == (0, 4, 1, 1), "FULL locks the path, MAMBA only the node"
    assert tree.evict(num_tokens=0, mamba_num=2).mamba_num_evicted == 1  # [1, 2]'s, a tombstone now
    assert tree.match_prefix([1, 2]).prefix_len == 0 and tree.full_protected_size() == 4
    tree.dec_lock_ref(receipt)
    assert sizes(tree) == (4, 0, 1, 0)
    # a lock taken on a state tombstone never unlocks a checkpoint given later
    mid = tree.match_prefix([1, 2, 3, 4]).last_node.parent
    receipt = tree.inc_lock_ref(mid)
    tree.attach_checkpoint(mid, int(alloc.alloc(1)[0]))
    tree.dec_lock_ref(receipt)
    assert sizes(tree) == (4, 0, 2, 0)
    tree.sanity_check()


def lifecycle_tree(extra_buffer: bool = False, page: int = 1):
    kv = make_allocator(64, page)
    table = HybridReqToTokenPool(4, 64, mamba_size=8, enable_mamba_extra_buffer=extra_buffer)
    tree = MambaRadixCache(
        page_size=page, allocator=kv, req_to_token_pool=table, enable_mamba_extra_buffer=extra_buffer
    )
    return kv, table, tree


def run_prefill(kv, table, tree, req):
    """Admit: match (cow), rows and slots, KV for the rest of the prompt."""
    tree.match_and_lock(req)
    table.alloc_reqs([req])
    start = req.cache_protected_len
    n = len(req.origin_input_ids)
    table.write(req.req_pool_idx, 0, req.prefix_indices)
    page = kv.page_size
    table.write(req.req_pool_idx, start, kv.alloc((n - start + page - 1) // page * page)[: n - start])


def test_lifecycle_donates_checkpoints_and_forks_them_back():
    kv, table, tree = lifecycle_tree()
    states = table.mamba_allocator
    a = Req("a", [1, 2, 3, 4, 5, 6])
    run_prefill(kv, table, tree, a)
    assert (a.mamba_pool_idx, a.mamba_cow_src_index) == (1, None)
    a.fill_ids = a.origin_input_ids[:4]  # a chunk of 4 tokens ran
    tree.cache_unfinished_req(a)
    assert tree.take_state_copies() == [(1, 2)], "the request's state is copied into the checkpoint slot"
    assert tree.mamba_protected_size() == 1 and a.cache_protected_len == 4
    a.fill_ids = a.origin_input_ids
    a.output_ids = [7]
    a.kv_committed_len = 6
    tree.cache_finished_req(a)
    table.free_req(a)
    assert a.mamba_pool_idx is None and states.available_size() == 8 - 2, "slot 1 became the checkpoint"
    assert tree.take_state_copies() == []
    b = Req("b", [1, 2, 3, 4, 5, 6, 9, 9])
    run_prefill(kv, table, tree, b)
    assert b.cache_protected_len == 6 and b.mamba_cow_src_index == 1 and b.mamba_pool_idx == 3
    assert tree.take_state_copies() == [(1, 3)]
    b.kv_committed_len = 8
    tree.cache_finished_req(b, is_insert=False)  # retraction: KV and state slot back
    table.free_req(b)
    assert states.available_size() == 6 and tree.mamba_protected_size() == 0
    tree.sanity_check()
    table.check_invariants()
    kv_in_tree = tree.total_size()
    assert kv.available_size() + kv_in_tree == 64


def test_lifecycle_extra_buffer_donates_the_tracked_ping_pong_slot():
    kv, table, tree = lifecycle_tree(extra_buffer=True, page=2)
    states = table.mamba_allocator
    a = Req("a", [1, 2, 3, 4, 5])
    run_prefill(kv, table, tree, a)
    assert a.mamba_pool_idx == 1 and a.mamba_ping_pong_track_buffer.tolist() == [2, 3]
    a.mamba_last_track_idx, a.mamba_last_track_seqlen = 0, 4  # the model tracked the state after 4 tokens
    tree.cache_unfinished_req(a)
    assert a.cache_protected_len == 4 and a.mamba_ping_pong_track_buffer.tolist() == [4, 3]
    assert tree.match_prefix([1, 2, 3, 4, 5]).extras["mamba"].slot == 2
    a.mamba_last_track_idx, a.mamba_last_track_seqlen = 1, 4
    a.kv_committed_len = 5
    tree.cache_finished_req(a)  # the node at 4 has a checkpoint: slot 3 goes back with the rest
    table.free_req(a)
    assert states.available_size() == 8 - 1
    tree.sanity_check()
    table.check_invariants()
