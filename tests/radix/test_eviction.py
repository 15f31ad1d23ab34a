"""Eviction policies: names, the order each one evicts in, and the persistent heap against a
from-scratch reference (SGLang rebuilds a heap over all leaves on every call)."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

import kvjax
from kvjax.radix import EVICTION_POLICIES, RadixCache, get_eviction_policy
from kvjax.radix.eviction import SLRUPolicy

POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]


def test_all_policies_registered():
    assert sorted(EVICTION_POLICIES) == sorted(POLICIES)
    for name in POLICIES:
        assert get_eviction_policy(name).name == name
        assert get_eviction_policy(name.upper()).name == name
    assert get_eviction_policy("mru").monotone is False
    assert all(get_eviction_policy(n).monotone for n in POLICIES if n != "mru")


def test_unknown_policy_is_a_config_error_listing_names():
    with pytest.raises(kvjax.ConfigError) as e:
        RadixCache(eviction_policy="random")
    assert isinstance(e.value, ValueError)
    for name in POLICIES:
        assert name in str(e.value)


def test_slru_threshold_config():
    policy = get_eviction_policy("slru", protected_threshold=3)
    assert isinstance(policy, SLRUPolicy) and policy.protected_threshold == 3
    with pytest.raises(kvjax.ConfigError):
        get_eviction_policy("slru", protected_threshold=0)
    with pytest.raises(kvjax.ConfigError):
        get_eviction_policy("lru", bogus=1)


def _three_leaves(policy):
    """Leaves A=[1], B=[2], C=[3] created in that order; then A is inserted again (hit) and
    B is matched (accessed). Returns (tree, evicted order)."""
    t = RadixCache(eviction_policy=policy)
    t.insert([1], np.array([1]))
    t.insert([2], np.array([2]), priority=2)
    t.insert([3], np.array([3]), priority=1)
    t.insert([1], np.array([9]))  # hit on A
    t.match_prefix([2])  # access B
    order: list = []
    for _ in range(3):
        before = {k: v for k, v in t.root.children.items()}
        t.evict(1)
        gone = set(before) - set(t.root.children)
        order.extend(gone)
    t.sanity_check()
    return order


@pytest.mark.parametrize(
    "policy,expected",
    [
        ("lru", [3, 1, 2]),  # last access: C (create) < A (insert) < B (match)
        ("mru", [2, 1, 3]),
        ("fifo", [1, 2, 3]),
        ("filo", [3, 2, 1]),
        ("lfu", [3, 2, 1]),  # hits: A 2, B 1, C 1; ties by access time (C older)
        ("priority", [1, 3, 2]),  # priorities A 0, B 2, C 1
        ("slru", [3, 2, 1]),  # A reached 2 hits: protected
    ],
)
def test_policy_order(policy, expected):
    assert _three_leaves(policy) == expected


class _Reference:
    """Evicts like SGLang: heap over every evictable leaf, rebuilt per call."""

    def __init__(self, tree):
        self.tree = tree

    def order(self, num_tokens):
        t = self.tree
        prio = t.policy.priority
        leaves = [n for n in t.nodes() if not n.children and n.lock_ref == 0]
        heap = [(prio(n), n.id, n) for n in leaves]
        heapq.heapify(heap)
        out, got = [], 0
        while got < num_tokens and heap:
            _, _, n = heapq.heappop(heap)
            out.append(n)
            got += n.klen
            p = n.parent
            siblings = [c for c in p.children.values() if c not in out]
            if p is not t.root and p.lock_ref == 0 and not siblings:
                heapq.heappush(heap, (prio(p), p.id, p))
        return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_heap_matches_rebuild_reference(policy, page_size):
    rng = random.Random(hash((policy, page_size)) & 0xFFFF)
    t = RadixCache(page_size=page_size, eviction_policy=policy)
    ref = _Reference(t)
    locks = []
    slot = page_size
    for step in range(400):
        op = rng.random()
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 6) * page_size)]
        if op < 0.45:
            n = len(key)
            vals = np.arange(slot, slot + n)
            slot += n
            t.insert(key, vals, priority=rng.randrange(3))
        elif op < 0.65:
            t.match_prefix(key)
        elif op < 0.75:
            m = t.match_prefix(key)
            locks.append(t.inc_lock_ref(m.last_node))
        elif op < 0.85 and locks:
            t.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        else:
            want = rng.randrange(1, 4) * page_size
            expect = [n.id for n in ref.order(want)]
            before = {n.id: n for n in t.nodes()}
            evicted = t.evict(want)
            after = {n.id for n in t.nodes()}
            gone = [i for i in before if i not in after]
            assert sorted(gone) == sorted(expect), (step, policy)
            assert evicted == sum(before[i].klen for i in gone)
        t.sanity_check()


def test_heap_stays_bounded_under_repeated_touches():
    t = RadixCache(eviction_policy="mru")
    t.insert([1, 2], np.array([1, 2]))
    for _ in range(5000):
        t.match_prefix([1, 2])
    assert t.eviction_queue_size() <= 6 * len(t.eviction_candidates()) + 2049
    assert t.evict(1) == 2
