"""HiRadixCache: the host-tier scenarios of SGLang 0.5.23 (sglang-0.5.23-hybrid-trees.md, host tier),
bad input, and fault injection (failed copies and a full host pool fall back to recompute)."""

from __future__ import annotations

import pytest

from kvjax.alloc import make_allocator
from kvjax.radix import HiRadixCache, HostTierComponent, LockError
from kvjax.tiers import HostSlotAllocator, SimulatedCopyEngine, host_pool_tokens


def device_tree(size=64, page_size=1, host=129, policy="write_through", engine=None):
    """A HiRadixCache over a real device allocator; the engine carries a label per slot."""
    alloc = make_allocator(size, page_size)
    engine = engine or SimulatedCopyEngine()
    tree = HiRadixCache(
        page_size=page_size,
        token_to_kv_pool_allocator=alloc,
        host_pool_tokens=host,
        copy_engine=engine,
        write_policy=policy,
    )
    return tree, alloc, engine


def put(tree, alloc, engine, tokens):
    """Allocate slots for ``tokens``, label each slot with its token, insert, free duplicates."""
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    for s, t in zip(slots, tokens, strict=True):
        engine.device[int(s)] = t
    prefix = tree.insert(list(tokens), slots)
    held = tree.match_prefix(list(tokens)).indices[:prefix]  # a revived node takes its slots
    alloc.free(slots[:prefix][slots[:prefix] != held])
    return slots


def chain_backed_up_then_evicted(num_tokens):
    """A tree holding [1..10] and its child [11..20], both backed up to the host, after device
    eviction of ``num_tokens`` (10: the child only; 20 or more: both)."""
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    put(tree, alloc, engine, range(1, 21))
    tree.check_transfers()
    tree.evict(num_tokens)
    return tree, alloc, engine


def balanced(tree, alloc):
    tree.check_invariants()
    assert alloc.available_size() + tree.total_size() == alloc.size
    h = tree.host_allocator
    s = tree.sizes()["host"]
    assert h.available_size() + s.evictable + s.protected == h.size


# --- sizing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page,expect", [(1, 129), (4, 132)])
def test_host_pool_size_64_device_tokens_ratio_2(page, expect):
    tokens = host_pool_tokens(64, page, hicache_ratio=2.0)
    tree = HiRadixCache(page_size=page, host_pool_tokens=tokens)
    assert tree.host_allocator.size == expect
    assert tree.host_allocator.alloc(expect) is not None  # no reserved host slot


# --- write policies -------------------------------------------------------------------------------


def test_write_through_backs_up_at_insert_and_locks_until_polled():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 13))
    node = tree.match_prefix(list(range(1, 13))).last_node
    assert tree.host.data(node) is not None and node.lock_ref == 1  # pending: locked
    assert tree.evict(12) == 0  # a pending transfer blocks eviction
    assert tree.check_transfers() == 1
    assert node.lock_ref == 0 and tree.host.data(node).transfer is None
    assert engine.host == {i: i + 1 for i in range(12)}  # host slots 0..11 hold tokens 1..12
    balanced(tree, alloc)


def test_write_through_selective_backs_up_at_the_second_hit():
    tree, alloc, engine = device_tree(policy="write_through_selective")
    put(tree, alloc, engine, range(1, 11))
    node = tree.match_prefix(list(range(1, 11))).last_node
    assert tree.host.data(node) is None
    put(tree, alloc, engine, range(1, 11))
    assert tree.host.data(node) is not None
    tree.check_transfers()
    balanced(tree, alloc)


def test_write_back_backs_up_only_at_eviction_synchronously():
    tree, alloc, engine = device_tree(policy="write_back")
    put(tree, alloc, engine, range(1, 11))
    put(tree, alloc, engine, range(1, 11))
    node = tree.match_prefix(list(range(1, 11))).last_node
    assert tree.host.data(node) is None and engine.log == []
    assert tree.evict(10) == 10
    assert tree.host.pending_backups == 0 and [k for k, *_ in engine.log] == ["backup"]
    m = tree.match_prefix(list(range(1, 11)))
    assert m.prefix_len == 0 and m.host_hit_length == 10 and m.last_host_node is node
    balanced(tree, alloc)


# --- eviction, match, load back -------------------------------------------------------------------


def test_device_eviction_demotes_backed_up_and_deletes_the_rest():
    tree, alloc, engine = device_tree(host=12)
    put(tree, alloc, engine, range(1, 11))
    tree.check_transfers()
    engine.fail_backups = 1
    put(tree, alloc, engine, [50] * 3 + list(range(60, 70)))  # its backup fails at the poll
    tree.check_transfers()
    assert tree.evict(100) == 23
    assert tree.host_only_count == 1
    assert tree.match_prefix([50, 50, 50]).host_hit_length == 0  # deleted
    assert tree.match_prefix(list(range(1, 11))).host_hit_length == 10  # host-only
    balanced(tree, alloc)


def test_match_reports_device_prefix_host_hit_and_deepest_host_node():
    tree, _, _ = chain_backed_up_then_evicted(10)  # the [11..20] leaf
    m = tree.match_prefix(list(range(1, 25)))
    assert m.prefix_len == 10 and m.host_hit_length == 10
    assert m.indices.tolist() == tree.match_prefix(list(range(1, 11))).indices.tolist()
    assert m.last_host_node.depth == 20 and m.last_node.depth == 10


def test_load_back_threshold_is_10_tokens():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 10))  # 9 tokens
    put(tree, alloc, engine, range(101, 111))  # 10 tokens
    tree.check_transfers()
    tree.evict(100)
    nine = tree.match_prefix(list(range(1, 10)))
    assert nine.host_hit_length == 9 and tree.load_back(nine.last_host_node) == 0
    assert tree.init_load_back(nine) is nine and tree.host_only_count == 2
    ten = tree.match_prefix(list(range(101, 111)))
    loaded = tree.init_load_back(ten)
    assert loaded.prefix_len == 10 and loaded.last_node is ten.last_host_node
    assert [engine.device[int(s)] for s in loaded.indices] == list(range(101, 111))  # nothing lost
    assert loaded.last_node.lock_ref == 1  # the load locks it until the poll
    tree.check_transfers()
    assert loaded.last_node.lock_ref == 0
    balanced(tree, alloc)


def test_load_back_is_all_or_nothing_and_respects_the_quota():
    tree, alloc, _ = chain_backed_up_then_evicted(100)
    m = tree.match_prefix(list(range(1, 21)))
    assert m.host_hit_length == 20
    assert tree.load_back(m.last_host_node, mem_quota=19) == 0 and tree.host_only_count == 2
    assert tree.load_back(m.last_host_node, mem_quota=20) == 20 and tree.host_only_count == 0
    tree.check_transfers()
    balanced(tree, alloc)


def test_load_back_evicts_device_leaves_first_and_fails_when_room_is_pinned():
    tree, alloc, engine = device_tree(size=24)
    put(tree, alloc, engine, range(1, 13))
    tree.check_transfers()
    tree.evict(12)
    put(tree, alloc, engine, range(100, 120))  # 20 of 24 device slots, backup pending (locked)
    m = tree.match_prefix(list(range(1, 13)))
    assert m.host_hit_length == 12
    assert tree.load_back(m.last_host_node) == 0  # the only room is pinned by a pending backup
    assert tree.host_only_count == 1
    tree.check_transfers()  # the backup lands: the leaf can be evicted (demoted)
    assert tree.load_back(m.last_host_node) == 12
    assert tree.match_prefix(list(range(100, 120))).host_hit_length == 20  # it was demoted
    tree.check_transfers()
    balanced(tree, alloc)


def test_evict_host_frees_only_host_only_leaves_lru():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    put(tree, alloc, engine, range(21, 31))
    put(tree, alloc, engine, range(41, 51))
    tree.check_transfers()
    tree.match_prefix(list(range(1, 11)))
    tree.evict(20)  # [21..30] and [41..50] (LRU) become host-only
    tree.match_prefix(list(range(21, 31)))  # touch it
    assert tree.evict_host(5) == 10  # whole node: the least recently used host-only leaf
    assert tree.match_prefix(list(range(41, 51))).host_hit_length == 0
    assert tree.match_prefix(list(range(21, 31))).host_hit_length == 10
    assert tree.evict_host(100) == 10  # never the host copy of the device node [1..10]
    assert tree.sizes()["host"].protected == 10
    balanced(tree, alloc)


# --- write_back reclaims host copies of device nodes (SGLang's _reclaim_full_host_duplicates) ----


@pytest.mark.parametrize("policy,freed", [("write_back", 12), ("write_through", 0), ("write_through_selective", 0)])
def test_evict_host_after_a_load_back_reclaims_the_copy_only_under_write_back(policy, freed):
    # Page 1, device 64, host ratio 2: insert [1..12]; evict(100); match and load back; poll;
    # evict_host(100). SGLang 0.5.23 frees 12 under write_back (the node is on both tiers).
    tree, alloc, engine = device_tree(64, 1, host_pool_tokens(64, 1, hicache_ratio=2.0), policy)
    key = list(range(1, 13))
    put(tree, alloc, engine, key)
    if policy == "write_through_selective":
        put(tree, alloc, engine, key)  # the second hit backs it up
    tree.check_transfers()
    assert tree.evict(100) == 12
    m = tree.init_load_back(tree.match_prefix(key))
    assert m.prefix_len == 12
    tree.check_transfers()
    node = m.last_node
    assert tree.evict_host(100) == freed
    assert (tree.host.data(node) is None) == (freed == 12)
    assert tree.host_allocator.available_size() == 129 - 12 + freed
    after = tree.match_prefix(key)
    assert (after.prefix_len, after.host_hit_length, after.last_node) == (12, 0, node)
    balanced(tree, alloc)
    if policy == "write_back":
        assert tree.evict(100) == 12  # backed up again at eviction, from the device copy
        assert tree.match_prefix(key).host_hit_length == 12
        assert [engine.host[int(x)] for x in tree.host.data(node).slots] == key
        balanced(tree, alloc)


def test_write_back_backup_reclaims_host_room_from_a_device_node():
    # Device 32, host ratio 0.5 (17 host slots): insert [1..12]; evict(100); insert [20..27];
    # insert [1..12]; evict(8). [1..12] is on both tiers; backing [20..27] up needs 3 more host
    # slots and reclaims its copy: 9 host slots free, [20..27] a host hit of 8 (SGLang 0.5.23).
    tree, alloc, engine = device_tree(32, 1, host_pool_tokens(32, 1, hicache_ratio=0.5), "write_back")
    assert tree.host_allocator.size == 17
    put(tree, alloc, engine, range(1, 13))
    assert tree.evict(100) == 12
    put(tree, alloc, engine, range(20, 28))
    put(tree, alloc, engine, range(1, 13))  # revives the host-only [1..12], keeping its copy
    assert tree.evict(8) == 8
    assert tree.host_allocator.available_size() == 9
    assert tree.host.skipped_backups == 0 and tree.host.reclaimed_duplicates == 12
    m = tree.match_prefix(list(range(20, 28)))
    assert (m.prefix_len, m.host_hit_length, m.full_kv_hit_length) == (0, 8, 8)
    assert tree.match_prefix(list(range(1, 13))).prefix_len == 12  # still on the device
    balanced(tree, alloc)


def test_write_back_reclaim_spares_device_leaves_in_its_first_pass():
    tree, alloc, engine = device_tree(policy="write_back")
    leaf_key, inner_key = list(range(30, 42)), list(range(1, 13))
    put(tree, alloc, engine, leaf_key)
    put(tree, alloc, engine, inner_key)
    assert tree.evict(100) == 24  # leaf_key (older) is backed up first: first in reclaim order
    for key in (leaf_key, inner_key):
        assert tree.init_load_back(tree.match_prefix(key)).prefix_len == 12
    tree.check_transfers()
    put(tree, alloc, engine, inner_key + [13, 14, 15, 16])  # inner_key's node has a device child now
    leaf, inner = tree.match_prefix(leaf_key).last_node, tree.match_prefix(inner_key).last_node
    assert tree.evict_host(1) == 12  # the first pass skips the device leaf
    assert tree.host.data(inner) is None and tree.host.data(leaf) is not None
    assert tree.evict_host(1) == 12  # the second pass takes it
    assert tree.host.data(leaf) is None
    balanced(tree, alloc)


def test_write_back_never_reclaims_a_copy_a_pending_load_reads():
    tree, alloc, engine = device_tree(policy="write_back")
    key = list(range(1, 13))
    put(tree, alloc, engine, key)
    tree.evict(100)
    m = tree.init_load_back(tree.match_prefix(key))
    assert tree.host.pending_loads == 1
    assert tree.evict_host(100) == 0  # in flight: locked, host copy kept
    tree.check_transfers()
    assert tree.evict_host(100) == 12
    assert tree.host.data(m.last_node) is None
    balanced(tree, alloc)


def test_write_back_reclaims_for_a_retraction_hold():
    tree, alloc, engine = device_tree(32, 1, 17, "write_back")
    key = list(range(1, 13))
    put(tree, alloc, engine, key)
    tree.evict(100)
    tree.init_load_back(tree.match_prefix(key))
    tree.check_transfers()
    held = tree.host.alloc_held(10)  # 5 free: the device node's copy makes room
    assert held is not None and tree.host.held_tokens == 10
    tree.host.free_held(held)
    assert tree.host_allocator.available_size() == 17


# --- full_kv_hit_length: FULL KV on the device or the host -----------------------------------------


def test_full_kv_hit_length_counts_host_only_kv():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 13))
    tree.check_transfers()
    tree.evict(100)  # demoted
    m = tree.match_prefix(list(range(1, 13)))
    assert (m.prefix_len, m.device_kv_hit_length, m.full_kv_hit_length, m.host_hit_length) == (0, 0, 12, 12)
    put(tree, alloc, engine, range(1, 5))  # [1..4] back on the device, [5..12] host-only
    tree.check_transfers()
    m = tree.match_prefix(list(range(1, 9)) + [99])
    assert (m.prefix_len, m.device_kv_hit_length, m.full_kv_hit_length, m.host_hit_length) == (4, 4, 8, 4)
    assert tree.match_prefix([99, 1]).full_kv_hit_length == 0


def test_room_for_a_new_backup_deletes_the_lru_host_only_node():
    tree, alloc, engine = device_tree(host=20)
    put(tree, alloc, engine, range(1, 11))
    put(tree, alloc, engine, range(21, 31))
    tree.check_transfers()
    tree.evict(20)
    tree.match_prefix(list(range(21, 31)))
    put(tree, alloc, engine, range(41, 51))  # host full: [1..10] (LRU) makes room
    assert tree.match_prefix(list(range(1, 11))).host_hit_length == 0
    assert tree.match_prefix(list(range(21, 31))).host_hit_length == 10
    tree.check_transfers()
    balanced(tree, alloc)


def test_insert_over_a_host_only_node_revives_it_keeping_the_host_copy():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    tree.check_transfers()
    node = tree.match_prefix(list(range(1, 11))).last_node
    host_slots = tree.host.data(node).slots.copy()
    tree.evict(10)
    slots = alloc.alloc(10)
    assert tree.insert(list(range(1, 11)), slots) == 10  # counted as already present
    assert node.value.tolist() == slots.tolist()  # device-resident from the incoming slots
    assert tree.host.data(node).slots.tolist() == host_slots.tolist()
    assert tree.match_prefix(list(range(1, 11))).prefix_len == 10
    balanced(tree, alloc)


def test_split_of_a_pending_node_completes_both_parts():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    tree.match_prefix(list(range(1, 5)))  # splits the pending node at 4
    assert tree.check_transfers() == 1
    parts = [n for n in tree.nodes()]
    assert len(parts) == 2 and all(tree.host.data(n).transfer is None and not n.lock_ref for n in parts)
    balanced(tree, alloc)


# --- bad input ------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_state_unchanged():
    with pytest.raises(ValueError, match="write_policy"):
        HostTierComponent(HostSlotAllocator(8), write_policy="write_sometimes")
    with pytest.raises(ValueError, match="page size"):
        HiRadixCache(page_size=2, host_allocator=HostSlotAllocator(8, 4))
    with pytest.raises(ValueError, match="host_allocator or host_pool_tokens"):
        HiRadixCache(page_size=1)
    tree, alloc, engine = device_tree()
    other = HiRadixCache(page_size=1, host_pool_tokens=16)
    other.insert(list(range(1, 11)))
    foreign = other.match_prefix(list(range(1, 11))).last_node
    with pytest.raises(ValueError, match="not a node of this tree"):
        tree.load_back(foreign)
    with pytest.raises(ValueError, match="must be an integer"):
        tree.evict({"host": -1})
    balanced(tree, alloc)


def test_reset_waits_for_transfers_and_frees_both_tiers():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    node = tree.match_prefix(list(range(1, 11))).last_node
    tree.reset()
    assert alloc.available_size() == alloc.size and tree.host_allocator.available_size() == 129
    with pytest.raises(LockError):  # a node from before the reset
        tree.inc_lock_ref(node)


# --- faults: everything falls back to recompute, accounting balances -------------------------------


def test_failed_backup_frees_host_slots_and_recomputes():
    tree, alloc, engine = device_tree()
    engine.fail_backups = 1
    put(tree, alloc, engine, range(1, 11))
    tree.check_transfers()
    assert tree.host.failed_backups == 1 and tree.host_allocator.available_size() == 129
    tree.evict(10)
    assert tree.match_prefix(list(range(1, 11))).host_hit_length == 0  # recompute
    balanced(tree, alloc)


def test_full_host_pool_skips_the_backup():
    tree, alloc, engine = device_tree(host=8)
    put(tree, alloc, engine, range(1, 11))
    assert tree.host.skipped_backups == 1 and tree.host.pending_backups == 0
    tree.evict(10)
    assert tree.total_size() == 0 and tree.host_only_count == 0
    balanced(tree, alloc)


def test_load_that_cannot_start_changes_nothing():
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    tree.check_transfers()
    tree.evict(10)
    engine.fail_loads = 1
    m = tree.match_prefix(list(range(1, 11)))
    before = alloc.available_size()
    assert tree.init_load_back(m) is m
    assert alloc.available_size() == before and tree.host_only_count == 1
    assert tree.init_load_back(tree.match_prefix(list(range(1, 11)))).prefix_len == 10
    tree.check_transfers()
    balanced(tree, alloc)


def test_standalone_simulation_without_device_arrays():
    tree = HiRadixCache(page_size=4, host_pool_tokens=host_pool_tokens(64, 4, hicache_ratio=2.0))
    tree.insert(list(range(16)))
    tree.check_transfers()
    tree.evict(16)
    m = tree.match_prefix(list(range(16)))
    assert (m.prefix_len, m.host_hit_length) == (0, 16)
    assert tree.init_load_back(m).prefix_len == 16
    tree.check_transfers()
    tree.check_invariants()
