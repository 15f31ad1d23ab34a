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
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    put(tree, alloc, engine, range(1, 21))
    tree.check_transfers()
    tree.evict(10)  # the [11..20] leaf
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
    tree, alloc, engine = device_tree()
    put(tree, alloc, engine, range(1, 11))
    put(tree, alloc, engine, range(1, 21))
    tree.check_transfers()
    tree.evict(100)
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
