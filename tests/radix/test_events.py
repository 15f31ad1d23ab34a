"""KV events: BlockStored / BlockRemoved / AllBlocksCleared, chained seeded page hashes that
depend on position and namespace and survive node splits; sinks and the queue."""

from __future__ import annotations

import numpy as np

from kvjax.radix import AllBlocksCleared, BlockRemoved, BlockStored, RadixCache


def _stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


def test_events_only_when_enabled():
    t = RadixCache(page_size=2)
    t.insert([1, 2, 3, 4], np.arange(4))
    assert t.take_events() == []
    t = RadixCache(page_size=2, enable_kv_cache_events=True)
    t.insert([1, 2, 3, 4], np.arange(4))
    ev = t.take_events()
    assert len(_stored(ev)) == 1 and t.take_events() == []


def test_block_sizes_and_token_ids():
    t = RadixCache(page_size=4, enable_kv_cache_events=True)
    t.insert(list(range(1, 11)), np.arange(10, 20))  # 2 whole pages cached
    (e,) = t.take_events()
    assert e.block_size == 4 and len(e.block_hashes) == 2
    assert e.token_ids == list(range(1, 9)) and len(e.token_ids) == e.block_size * len(e.block_hashes)
    assert e.parent_block_hash is None


def test_hashes_depend_on_position():
    t = RadixCache(page_size=4, enable_kv_cache_events=True)
    t.insert([1, 2, 3, 4, 1, 2, 3, 4], np.arange(8))
    (e,) = t.take_events()
    assert len(e.block_hashes) == 2 and e.block_hashes[0] != e.block_hashes[1]


def test_parent_chain_and_split_stability():
    t = RadixCache(page_size=2, enable_kv_cache_events=True)
    t.insert([1, 2, 3, 4, 5, 6], np.arange(6))
    (first,) = t.take_events()
    t.insert([1, 2, 3, 4, 9, 9], np.arange(10, 16))  # splits after two pages
    (second,) = t.take_events()
    assert second.parent_block_hash == first.block_hashes[1]
    # The split nodes keep exactly the hashes they were stored with.
    parent = t.match_prefix([1, 2, 3, 4]).last_node
    assert parent.hashes == first.block_hashes[:2]
    assert parent.children[5].hashes == first.block_hashes[2:]
    # The same path in a fresh tree (no split) hashes identically: stable across splits.
    u = RadixCache(page_size=2, enable_kv_cache_events=True)
    u.insert([1, 2, 3, 4, 9, 9], np.arange(6))
    (e,) = u.take_events()
    assert e.block_hashes == first.block_hashes[:2] + second.block_hashes


def test_removed_events_carry_the_stored_hashes():
    t = RadixCache(page_size=2, enable_kv_cache_events=True)
    t.insert([1, 2, 3, 4], np.arange(4))
    t.insert([1, 2, 7, 7], np.arange(4, 8))
    stored = {h for e in _stored(t.take_events()) for h in e.block_hashes}
    assert t.evict(100) == 6
    removed = t.take_events()
    assert all(isinstance(e, BlockRemoved) and e.block_hashes for e in removed)
    assert {h for e in removed for h in e.block_hashes} == stored


def test_reset_emits_all_blocks_cleared():
    t = RadixCache(enable_kv_cache_events=True)
    t.insert([1], np.array([1]))
    t.take_events()
    t.reset()
    assert t.take_events() == [AllBlocksCleared()]


def test_sinks_list_and_callable():
    got: list = []
    t = RadixCache(event_sink=got)  # a sink alone turns events on
    t.insert([1, 2], np.arange(2))
    assert len(got) == 1 and t.take_events() == []
    seen: list = []
    t = RadixCache(event_sink=seen.append)
    t.insert([1, 2], np.arange(2))
    t.evict(5)
    assert [type(e) for e in seen] == [BlockStored, BlockRemoved]


def test_namespace_and_seed_change_hashes():
    def hashes(**kw):
        t = RadixCache(enable_kv_cache_events=True, **{k: v for k, v in kw.items() if k == "hash_seed"})
        t.insert([1, 2, 3], np.arange(3), extra_key=kw.get("extra_key"))
        return t.take_events()[0].block_hashes

    base = hashes()
    assert hashes() == base  # deterministic
    assert hashes(extra_key="lora") != base
    assert hashes(hash_seed=7) != base


def test_bigram_events_hash_pages():
    t = RadixCache(page_size=2, is_eagle=True, enable_kv_cache_events=True)
    t.insert([1, 2, 3, 4, 5], np.arange(5))
    (e,) = t.take_events()
    assert len(e.block_hashes) == 2 and e.token_ids == [1, 2, 3, 4, 5]
    t.sanity_check()
