"""Retention (issue 37, item 3): a request's ``retention_seconds`` keeps its prefix, as a bias that
decays, never a pin.

* every policy evicts unretained and expired leaves first, retained ones last (lowest retention
  priority first, then by the policy), checked against a from-scratch reference over random
  operations (inserts with and without retention, matches, locks, clock advances, evictions);
* decay: at its expiry a node is an ordinary node again; merging keeps the max priority and the
  latest expiry; a lapsed retention renewed lower is not left behind by the lazy heap;
* retention never blocks: a tree holding only retained nodes still evicts all of them; locks
  alone keep nodes;
* splits keep the retention on both halves; the request lifecycle retains the inserted path;
* the SWA, Mamba and host-tier components' own eviction orders put retained nodes last;
* bad input is one error naming the value, with nothing changed.
"""

from __future__ import annotations

import heapq
import math
import random

import numpy as np
import pytest

from kvjax.alloc import TokenToKVPoolAllocator, make_allocator
from kvjax.hybrid_req_pool import HybridReqToTokenPool
from kvjax.radix import HiRadixCache, MambaRadixCache, RadixCache, SWARadixCache
from kvjax.radix.component import TreeComponent
from kvjax.radix.retention import NO_RETENTION, retained_last, retention_key
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req
from kvjax.tiers import SimulatedCopyEngine

POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]


def _leaf_tokens(tree: RadixCache) -> set[int]:
    """The first token of every child of the root (the tests' leaves are one node each)."""
    return {node.token_ids()[0] for node in tree.root.children.values()}


# --- order -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_retained_leaf_goes_after_every_unretained_one(policy):
    tree = RadixCache(eviction_policy=policy)
    tree.insert([1, 1], retention_seconds=10)  # created first: first to go under fifo/lru
    for token in range(2, 8):
        tree.insert([token, token], priority=5)  # a higher plain priority than the retained one
    tree.match_prefix([7, 7])
    for left in range(6, 0, -1):
        tree.evict(1)
        assert 1 in _leaf_tokens(tree) and len(_leaf_tokens(tree)) == left
        tree.sanity_check()
    assert tree.evict(1) == 2 and tree.total_size() == 0  # then the retained one: no pin


@pytest.mark.parametrize("policy", POLICIES)
def test_retained_leaves_go_lowest_retention_priority_first(policy):
    tree = RadixCache(eviction_policy=policy)
    for token, priority in [(1, 3), (2, 1), (3, 2)]:
        tree.insert([token], priority=priority, retention_seconds=5)
    tree.insert([9])
    order = []
    while tree.total_size():
        before = _leaf_tokens(tree)
        tree.evict(1)
        order.extend(before - _leaf_tokens(tree))
    assert order == [9, 2, 3, 1]


class _Reference:
    """SGLang's way, with retention: a heap over every evictable leaf, rebuilt per call, keyed
    ``(retention_key, policy priority)``."""

    def __init__(self, tree: RadixCache) -> None:
        self.tree = tree

    def key(self, node):
        now = self.tree.retention_now
        tier, rp = retention_key(node, now)
        return (tier, rp, self.tree.policy.priority(node), node.id)

    def order(self, num_tokens: int) -> list:
        t = self.tree
        leaves = [n for n in t.nodes() if not n.children and n.lock_ref == 0]
        heap = [(self.key(n), n) for n in leaves]
        heapq.heapify(heap)
        out, got = [], 0
        while got < num_tokens and heap:
            _, n = heapq.heappop(heap)
            out.append(n)
            got += n.klen
            p = n.parent
            if p is not t.root and p.lock_ref == 0 and all(c in out for c in p.children.values()):
                heapq.heappush(heap, (self.key(p), p))
        return out


class _Listener(TreeComponent):
    """A component that keeps nothing: with it attached, FULL eviction takes the tree's generic
    path (``pop_candidate``) instead of the inlined one."""

    name = "listener"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("path", ["inlined", "generic"])
def test_the_lazy_heaps_match_a_rebuilt_reference(policy, page_size, path):
    rng = random.Random(hash(("retention", policy, page_size)) & 0xFFFF)
    components = [_Listener()] if path == "generic" else []
    t = RadixCache(page_size=page_size, eviction_policy=policy, components=components)
    assert t.has_components == (path == "generic")
    ref = _Reference(t)
    locks = []
    slot = page_size
    now = 0.0
    evictions = 0
    for step in range(500):
        op = rng.random()
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 6) * page_size)]
        if op < 0.45:
            n = len(key)
            seconds = rng.choice([None, None, 0, 1.5, 4.0, 10.0])
            t.insert(key, np.arange(slot, slot + n), priority=rng.randrange(3), retention_seconds=seconds)
            slot += n
        elif op < 0.6:
            t.match_prefix(key)
        elif op < 0.68:
            locks.append(t.inc_lock_ref(t.match_prefix(key).last_node))
        elif op < 0.76 and locks:
            t.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        elif op < 0.84:
            now += rng.choice([0.5, 1.0, 3.0])
            assert t.advance_retention_clock(now) == now
        else:
            want = rng.randrange(1, 4) * page_size
            expect = [n.id for n in ref.order(want)]
            before = {n.id: n for n in t.nodes()}
            evicted = t.evict(want)
            after = {n.id for n in t.nodes()}
            gone = [i for i in before if i not in after]
            assert sorted(gone) == sorted(expect), (step, policy)
            assert evicted == sum(before[i].klen for i in gone)
            evictions += 1
        t.sanity_check()
    assert evictions > 30
    assert t.eviction_queue_size() <= 4 * len(t.evictable_leaves) + 1024 + 3 * 500


# --- decay and merging ------------------------------------------------------------------------------


def test_protection_decays_at_the_expiry():
    tree = RadixCache()
    tree.insert([1], retention_seconds=5)
    tree.insert([2])  # more recent: LRU would keep it over [1]
    tree.advance_retention_clock(4.999)
    tree.evict(1)
    assert _leaf_tokens(tree) == {1}  # still retained
    tree.insert([2])
    tree.advance_retention_clock(5.0)  # the clock reached the expiry: an ordinary node again
    tree.evict(1)
    assert _leaf_tokens(tree) == {2}
    tree.sanity_check()


def test_the_clock_never_runs_backwards_and_bad_readings_change_nothing():
    tree = RadixCache()
    assert tree.retention_now == 0.0
    assert tree.advance_retention_clock(7) == 7.0
    assert tree.advance_retention_clock(3.0) == 7.0  # an earlier reading is ignored
    for bad in (math.nan, math.inf, -math.inf, "8", True, None):
        with pytest.raises(ValueError, match="retention clock reading"):
            tree.advance_retention_clock(bad)
    assert tree.retention_now == 7.0


def test_several_requests_keep_the_max_priority_and_the_latest_expiry():
    tree = RadixCache()
    tree.insert([1, 2, 3], priority=2, retention_seconds=10)
    tree.insert([1, 2, 3], priority=7, retention_seconds=1)
    tree.insert([1, 2, 3], priority=1, retention_seconds=4)
    node = tree.match_prefix([1, 2, 3]).last_node
    assert (node.retain_priority, node.retain_until) == (7, 10.0)
    tree.advance_retention_clock(3)
    tree.insert([1, 2, 3], priority=0, retention_seconds=20)  # a retained request's hit extends it
    assert (node.retain_priority, node.retain_until) == (7, 23.0)
    tree.insert([1, 2, 3])  # a hit without retention does not
    assert node.retain_until == 23.0


def test_a_lapsed_retention_renewed_lower_is_ordered_by_its_new_priority():
    tree = RadixCache()
    tree.insert([1], priority=9, retention_seconds=5)
    tree.insert([2], priority=4, retention_seconds=50)
    tree.insert([3])
    tree.evict(1)  # [3]; the queued pushes are flushed: [1] sits in the retained tier at priority 9
    assert _leaf_tokens(tree) == {1, 2}
    tree.advance_retention_clock(10)  # [1] lapsed; no eviction has moved it yet
    tree.insert([1], priority=1, retention_seconds=50)  # a fresh retention, lower
    node = tree.match_prefix([1]).last_node
    assert (node.retain_priority, node.retain_until) == (1, 60.0)
    tree.evict(1)
    assert _leaf_tokens(tree) == {2}  # priority 1 goes before priority 4
    tree.sanity_check()


def test_zero_and_none_retain_nothing():
    tree = RadixCache()
    tree.insert([1], retention_seconds=0)
    tree.insert([2], retention_seconds=None)
    assert all(n.retain_until <= tree.retention_now for n in tree.nodes())
    assert all(n.retain_until == NO_RETENTION for n in tree.nodes())


# --- never a pin ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tree_of_retained_nodes_still_frees_everything_unlocked(policy):
    alloc = make_allocator(64, 1)
    tree = RadixCache(eviction_policy=policy, token_to_kv_pool_allocator=alloc)
    locked = None
    for i in range(8):
        slots = alloc.alloc(8)
        tree.insert([100 + i] + list(range(7)), slots, priority=i % 3, retention_seconds=1000)
        if i == 3:
            locked = tree.inc_lock_ref(tree.match_prefix([103] + list(range(7))).last_node)
    assert alloc.available_size() == 0
    assert tree.evict(64) == 56  # every retained, unlocked node: an allocation is never refused
    assert alloc.available_size() == 56 and tree.total_size() == 8
    tree.dec_lock_ref(locked)
    assert tree.evict(8) == 8 and alloc.available_size() == 64
    tree.sanity_check()


# --- structure -------------------------------------------------------------------------------------


def test_a_split_keeps_the_retention_on_both_halves():
    tree = RadixCache(page_size=2)
    tree.insert([1, 2, 3, 4, 5, 6], priority=3, retention_seconds=8)
    tree.insert([1, 2, 3, 4, 9, 9])  # splits the retained node after 4 tokens
    upper = tree.match_prefix([1, 2, 3, 4]).last_node
    lower = tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    other = tree.match_prefix([1, 2, 3, 4, 9, 9]).last_node
    assert lower.parent is upper and other.parent is upper
    assert (upper.retain_priority, upper.retain_until) == (3, 8.0)
    assert (lower.retain_priority, lower.retain_until) == (3, 8.0)
    assert other.retain_until == NO_RETENTION
    tree.evict(1)
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).prefix_len == 6  # the unretained branch went first
    tree.sanity_check()


def test_the_request_lifecycle_retains_the_path_it_inserted():
    alloc = make_allocator(64, 1)
    pool = ReqToTokenPool(4, 64)
    tree = RadixCache(token_to_kv_pool_allocator=alloc, req_to_token_pool=pool)
    tree.advance_retention_clock(100)
    system = list(range(10, 20))

    def run(rid, tokens, **kw):
        req = Req(rid, tokens, req_pool_idx=pool.alloc(1)[0], **kw)
        tree.match_and_lock(req)
        n = len(tokens)
        cached = len(req.prefix_indices)
        pool.write(req.req_pool_idx, cached, alloc.alloc(n - cached))
        tree.cache_unfinished_req(req)
        tree.cache_finished_req(req)
        pool.free(req.req_pool_idx)

    run("plain", system + [1, 2])
    run("kept", system + [3, 4], priority=2, retention_seconds=30)
    kept = tree.match_prefix(system + [3, 4]).last_node
    assert (kept.retain_priority, kept.retain_until) == (2, 130.0)
    assert (kept.parent.retain_priority, kept.parent.retain_until) == (2, 130.0)  # the shared system prompt
    plain = tree.match_prefix(system + [1, 2]).last_node
    assert plain.retain_until == NO_RETENTION
    tree.evict(2)
    assert tree.match_prefix(system + [3, 4]).prefix_len == 12
    assert tree.match_prefix(system + [1, 2]).prefix_len == 10
    tree.sanity_check()


# --- the trees with components --------------------------------------------------------------------


def test_retained_last_keeps_the_given_order_within_a_priority():
    tree = RadixCache()
    for token, priority, seconds in [(1, 2, 9), (2, 0, None), (3, 1, 9), (4, 2, 9), (5, 0, None)]:
        tree.insert([token], priority=priority, retention_seconds=seconds)
    nodes = sorted(tree.root.children.values(), key=lambda n: n.token_ids()[0])
    assert [n.token_ids()[0] for n in retained_last(nodes, tree.retention_now)] == [2, 5, 3, 1, 4]


def test_swa_eviction_tombstones_unretained_windows_first():
    tree = SWARadixCache(page_size=1, sliding_window_size=4)
    tree.insert([1, 2, 3], retention_seconds=10)
    tree.insert([7, 8, 9])
    tree.insert([4, 5, 6])
    freed = tree.evict({"swa": 4})
    assert freed["swa"] >= 4
    assert tree.match_prefix([1, 2, 3]).prefix_len == 3
    assert tree.match_prefix([7, 8, 9]).prefix_len == 0 and tree.match_prefix([4, 5, 6]).prefix_len == 0
    tree.check_invariants()


def test_mamba_eviction_drops_unretained_checkpoints_first():
    kv = TokenToKVPoolAllocator(64)
    table = HybridReqToTokenPool(4, 64, mamba_size=8)
    tree = MambaRadixCache(page_size=1, allocator=kv, req_to_token_pool=table)
    slots = {}
    for name, key, seconds in [("kept", [1, 2, 3], 10.0), ("a", [4, 5, 6], None), ("b", [7, 8, 9], None)]:
        req = Req(name, [])
        table.alloc_reqs([req])
        slots[name] = req.mamba_pool_idx
        tree.insert(key, kv.alloc(3), mamba_value=req.mamba_pool_idx, retention_seconds=seconds)
    evicted = tree.evict(num_tokens=0, mamba_num=2)
    assert evicted.mamba_num_evicted == 2
    assert tree.match_prefix([1, 2, 3]).extras["mamba"].slot == slots["kept"]
    evicted = tree.evict(num_tokens=0, mamba_num=1)  # then the retained one: no pin
    assert evicted.mamba_num_evicted == 1
    tree.check_invariants()


def test_host_copies_keep_the_retention_and_go_last_from_the_host():
    alloc = make_allocator(64, 1)
    engine = SimulatedCopyEngine()
    tree = HiRadixCache(page_size=1, token_to_kv_pool_allocator=alloc, host_pool_tokens=64, copy_engine=engine)
    for start, seconds in [(1, 10.0), (20, None), (40, None)]:
        tokens = list(range(start, start + 10))
        slots = alloc.alloc(10)
        for s, t in zip(slots, tokens, strict=True):
            engine.device[int(s)] = t
        tree.insert(tokens, slots, retention_seconds=seconds)
    tree.check_transfers()
    assert tree.evict(30) == 30  # every device copy: the retained one last, demoted to the host
    retained = tree.match_prefix(list(range(1, 11)))
    assert retained.host_hit_length == 10
    node = retained.last_host_node
    assert node.host_only and node.retain_until == 10.0  # the host copy keeps the retention
    assert tree.evict_host(20) == 20
    assert tree.match_prefix(list(range(1, 11))).host_hit_length == 10  # unretained host copies went first
    assert tree.match_prefix(list(range(20, 30))).host_hit_length == 0
    tree.advance_retention_clock(10)
    assert tree.evict_host(10) == 10
    tree.check_invariants()


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, "5", True, [3]])
def test_bad_retention_is_one_error_naming_the_value_and_changes_nothing(bad):
    tree = RadixCache()
    tree.insert([1, 2])
    before = [(n.id, n.retain_until, n.last_access) for n in tree.nodes()]
    with pytest.raises(ValueError, match="retention_seconds") as e:
        tree.insert([1, 2, 3, 4], retention_seconds=bad)
    assert repr(bad) in str(e.value)
    assert [(n.id, n.retain_until, n.last_access) for n in tree.nodes()] == before
    assert tree.total_size() == 2
    with pytest.raises(ValueError, match="request 'r': retention_seconds"):
        Req("r", [1, 2], retention_seconds=bad)
