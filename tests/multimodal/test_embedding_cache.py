"""The embedding cache: byte-bounded LRU (SGLang's MultiModalStaticCache, per item), counters,
an item larger than the cache served but not kept, the same decisions on every rank, and a
reference model it agrees with on random call sequences."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import CacheConfig, ModelSpec
from kvjax.multimodal import EmbeddingCache
from kvjax.plan import plan_kv_cache


def _emb(nbytes: int, fill: float = 1.0) -> np.ndarray:
    assert nbytes % 4 == 0
    return np.full(nbytes // 4, fill, np.float32)


def test_hit_miss_and_lru_order():
    c = EmbeddingCache(100)
    assert c.get(1) is None
    assert c.put(1, _emb(40)) and c.put(2, _emb(40))
    assert c.get(1) is not None  # 1 is now the most recent
    assert c.put(3, _emb(40))  # evicts 2, the least recently used
    assert c.keys() == [1, 3] and 2 not in c
    s = c.stats()
    assert (s.hits, s.misses, s.evictions, s.evicted_bytes, s.bytes_used, s.entries) == (1, 1, 1, 40, 80, 2)
    assert s.hit_rate == 0.5
    c.check_invariants()


def test_put_of_a_held_key_only_refreshes_it():
    c = EmbeddingCache(100)
    first = _emb(40, 1.0)
    c.put(1, first)
    c.put(2, _emb(40))
    assert c.put(1, _emb(80, 2.0))  # held: the held value stays, 1 becomes the most recent
    assert c.get(1) is first and c.keys() == [2, 1] and c.bytes_used == 80


def test_eviction_makes_room_for_one_large_entry():
    c = EmbeddingCache(100)
    for k in range(5):
        c.put(k, _emb(20))
    assert c.put(9, _emb(60))
    assert c.keys() == [3, 4, 9] and c.stats().evictions == 3 and c.bytes_used == 100
    c.check_invariants()


def test_an_item_larger_than_the_cache_is_served_but_not_kept():
    c = EmbeddingCache(100)
    c.put(1, _emb(60))
    big = _emb(104)
    value, hit = c.get_or_encode(7, lambda: big)
    assert value is big and not hit  # served
    assert 7 not in c and c.keys() == [1] and c.bytes_used == 60  # not kept, nothing evicted for it
    s = c.stats()
    assert (s.not_kept, s.evictions, s.misses) == (1, 0, 1)


def test_a_zero_byte_cache_keeps_nothing_but_empty_items():
    c = EmbeddingCache(0)
    assert not c.put(1, _emb(4)) and len(c) == 0
    assert c.put(2, _emb(0)) and len(c) == 1


def test_get_or_encode_runs_the_encoder_on_a_miss_only():
    c = EmbeddingCache(1000)
    calls = []

    def encode():
        calls.append(1)
        return _emb(8)

    assert c.get_or_encode(5, encode)[1] is False
    assert c.get_or_encode(5, encode)[1] is True
    assert len(calls) == 1


def test_sized_from_the_config_and_the_plan():
    config = CacheConfig(max_total_tokens=64, context_length=64, vlm_cache_size_mb=3)
    assert EmbeddingCache.from_config(config).max_bytes == 3 * 2**20
    plan = plan_kv_cache(ModelSpec.preset("tiny"), config)
    assert EmbeddingCache.from_plan(plan).max_bytes == plan.mm_embedding_cache_bytes == 3 * 2**20


def test_discard_and_clear_keep_the_counters():
    c = EmbeddingCache(100)
    c.put(1, _emb(40))
    c.get(1)
    assert c.discard(1) and not c.discard(1) and c.bytes_used == 0
    c.put(2, _emb(40))
    c.clear()
    assert len(c) == 0 and c.bytes_used == 0 and c.stats().hits == 1 and c.stats().evictions == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.get(-1), "key=-1"),
        (lambda c: c.get(2**64), "key="),
        (lambda c: c.get("abc"), "key='abc'"),
        (lambda c: c.put(True, _emb(4)), "key=True"),
        (lambda c: c.put(1, [1, 2]), "nbytes=None"),
        (lambda c: c.discard(1.5), "key=1.5"),
    ],
)
def test_bad_input_is_one_clear_error_and_changes_nothing(call, message):
    c = EmbeddingCache(100)
    c.put(3, _emb(8))
    before = (c.keys(), c.stats())
    with pytest.raises(ValueError, match=message):
        call(c)
    assert (c.keys(), c.stats()) == before


@pytest.mark.parametrize("max_bytes", [-1, 1.5, True, None])
def test_a_bad_size_is_refused(max_bytes):
    with pytest.raises(ValueError, match="max_bytes="):
        EmbeddingCache(max_bytes)


# -- the same decisions everywhere, and a reference model ----------------------------------------

_OPS = st.lists(
    st.tuples(st.sampled_from(["get", "put", "get_or_encode"]), st.integers(0, 7), st.integers(0, 12)),
    max_size=60,
)


def _run(cache: EmbeddingCache, ops, fill: float) -> list:
    """Run ``ops`` ((op, key, size in 4-byte units)); returns each call's decision."""
    decisions = []
    for op, key, units in ops:
        if op == "get":
            decisions.append(cache.get(key) is not None)
        elif op == "put":
            decisions.append(cache.put(key, _emb(4 * units, fill)))
        else:
            decisions.append(cache.get_or_encode(key, lambda u=units: _emb(4 * u, fill))[1])
        cache.check_invariants()
    return decisions


class _Reference:
    """The LRU the docstring describes, as plainly as possible: a list of (key, size), oldest first."""

    def __init__(self, max_bytes: int) -> None:
        self.max, self.held = max_bytes, []
        self.counts = collections.Counter()

    def get(self, key):
        for i, (k, _size) in enumerate(self.held):
            if k == key:
                self.held.append(self.held.pop(i))
                self.counts["hits"] += 1
                return True
        self.counts["misses"] += 1
        return False

    def put(self, key, size):
        if any(k == key for k, _ in self.held):
            self.get(key)
            self.counts["hits"] -= 1
            return True
        if size > self.max:
            self.counts["not_kept"] += 1
            return False
        while sum(s for _, s in self.held) + size > self.max:
            self.held.pop(0)
            self.counts["evictions"] += 1
        self.held.append((key, size))
        return True


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, max_bytes=st.integers(0, 64))
def test_agrees_with_the_reference_and_decides_from_keys_and_sizes_only(ops, max_bytes):
    """Two ranks fed the same calls with different embedding contents (same sizes) decide alike,
    and both agree with the reference LRU at every call."""
    rank0, rank1 = EmbeddingCache(max_bytes), EmbeddingCache(max_bytes)
    decisions = _run(rank0, ops, fill=1.0)
    assert _run(rank1, ops, fill=-3.0) == decisions
    assert rank0.keys() == rank1.keys() and rank0.stats() == rank1.stats()
    ref = _Reference(max_bytes)
    expected = []
    for op, key, units in ops:
        if op == "get":
            expected.append(ref.get(key))
        elif op == "put":
            expected.append(ref.put(key, 4 * units))
        else:
            hit = ref.get(key)
            if not hit:
                ref.put(key, 4 * units)
            expected.append(hit)
    assert decisions == expected
    assert rank0.keys() == [k for k, _ in ref.held]
    s = rank0.stats()
    assert (s.hits, s.misses, s.evictions, s.not_kept) == tuple(
        ref.counts[n] for n in ("hits", "misses", "evictions", "not_kept")
    )
