"""The storage tier (L3): pages by chained hash in tensorstore, prefetch policies, misses."""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts

from kvjax.errors import ConfigError
from kvjax.radix import RadixCache
from kvjax.tiers.storage import Prefetch, StorageTier, page_hashes
from kvjax.tiers.storage_entry import encode_entry
from kvjax.tiers.storage_key import StorageKey

PAGE = (2, 4, 2, 8)  # layers, page_size, 2 * kv_heads, head_dim


def _pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**16, (n, *PAGE), dtype=np.uint16)


def _key(**kw) -> StorageKey:
    return StorageKey(**{"model": "ckpt-a", "page_shape": PAGE, "store_dtype": "uint16", "kv_dtype": "bfloat16", **kw})


def _tier(location="memory", **kw) -> StorageTier:
    return StorageTier(location, key=_key(**kw))


def test_page_hashes_equal_the_trees_event_hashes_and_chain_across_calls():
    events: list = []
    tree = RadixCache(page_size=4, event_sink=events, hash_seed=7)
    tokens = list(range(100, 113))  # three whole pages and one token
    tree.insert(tokens)
    stored = [h for e in events for h in e.block_hashes]
    assert page_hashes(tokens, 4, seed=7) == stored
    head = page_hashes(tokens[:4], 4, seed=7)
    assert head + page_hashes(tokens[4:], 4, seed=7, prior_hash=head[-1]) == stored
    assert page_hashes(tokens, 4, seed=7, extra_key="lora-1") != stored  # namespaces differ
    assert page_hashes(tokens[:3], 4) == []


def test_backup_then_prefetch_round_trips_pages_in_a_directory(tmp_path):
    hashes = page_hashes(list(range(32)), 4)
    pages = _pages(len(hashes))
    tier = _tier(str(tmp_path / "l3"))
    write = tier.backup(hashes, pages)
    assert write.wait() == len(hashes) and write.done()
    again = _tier(str(tmp_path / "l3"))  # another process with the same store finds the pages
    assert again.leading_hits(hashes) == len(hashes)
    np.testing.assert_array_equal(again.get(hashes), pages)
    assert tier.backup(hashes, pages).skipped == len(hashes)  # stored pages are not written twice


def test_a_missing_page_ends_the_run_and_namespaces_are_isolated():
    tier = _tier()
    hashes = page_hashes(list(range(40)), 4)
    pages = _pages(len(hashes))
    keep = [0, 1, 2, 4, 5]  # page 3 was never stored
    tier.backup([hashes[i] for i in keep], pages[keep]).wait()
    assert tier.leading_hits(hashes) == 3
    np.testing.assert_array_equal(tier.prefetch(hashes).take("wait_complete"), pages[:3])
    assert not _tier(namespace="tenant-b").contains(hashes[0])
    assert tier.contains(hashes[0])


def test_a_value_of_the_wrong_size_is_a_miss_not_a_page():
    store = ts.KvStore.open({"driver": "memory"}).result()
    tier = _tier(store)
    [h] = page_hashes(list(range(4)), 4)
    store.write(tier.key(h), b"short").result()
    assert not tier.contains(h) and tier.leading_hits([h]) == 0
    assert tier.get([h]).shape == (0, *PAGE)


class _Future:
    """A read that completes when the test says so."""

    def __init__(self, value: bytes | None, done: bool) -> None:
        self.value, self._done, self.cancelled = value, done, False
        self.stamp = type("Stamp", (), {"generation": b"g"})()

    def done(self) -> bool:
        return self._done

    def result(self):
        assert self._done, "a test future was waited on before it completed"

        class Result:
            state = "value" if self.value is not None else "missing"
            value = self.value or b""
            stamp = self.stamp

        return Result()

    def cancel(self) -> None:
        self.cancelled = True


def test_prefetch_policies_take_the_leading_run_that_arrived():
    tier = _tier()
    pages = _pages(3)
    hashes = page_hashes(list(range(12)), 4)

    def entries(done_flags):
        return [
            _Future(encode_entry(1, tier.prefix, h, p.tobytes()), done)
            for h, p, done in zip(hashes, pages, done_flags, strict=True)
        ]

    futures = entries((True, False, True))
    fetch = Prefetch(tier, hashes, futures)
    assert fetch.arrived() == 1  # page 2 arrived but page 1 did not: only page 0 is usable
    got = fetch.take("best_effort")
    np.testing.assert_array_equal(got, pages[:1])
    assert futures[1].cancelled and not futures[2].cancelled
    with pytest.raises(RuntimeError, match="taken already"):
        fetch.take("best_effort")

    assert Prefetch(tier, hashes, entries((True, True, False))).take("timeout", timeout_s=0.01).shape[0] == 2


def test_bad_arguments_are_refused_by_name_and_write_nothing():
    tier = _tier()
    hashes = page_hashes(list(range(8)), 4)
    with pytest.raises(ConfigError, match="pages"):
        tier.backup(hashes, _pages(1))
    with pytest.raises(ConfigError, match="pages"):
        tier.backup(hashes, _pages(2).astype(np.int32))
    assert tier.leading_hits(hashes) == 0 and tier.pages_written == 0
    with pytest.raises(ConfigError, match="prefetch policy='eager'"):
        tier.prefetch(hashes).take("eager")
    with pytest.raises(ConfigError, match="timeout_s=-1"):
        tier.prefetch(hashes).take("timeout", timeout_s=-1)
    with pytest.raises(ConfigError, match="page_shape"):
        _key(page_shape=(0, 4))
    with pytest.raises(ConfigError, match="model fingerprint"):
        _key(model="")
    with pytest.raises(ConfigError, match="layers"):
        _key(layers=(0,))
    with pytest.raises(ConfigError, match="key"):
        StorageTier("memory", key="model")  # type: ignore[arg-type]


def test_pages_of_a_sharded_pool_are_one_entry_per_rank_under_keys_with_the_rank():
    store = ts.KvStore.open({"driver": "memory"}).result()
    ranks = ((0, slice(0, 1)), (1, slice(1, 2)))  # each rank one K/V head pair of the 2 in the page
    key = _key(page_shape=(2, 4, 2, 8), tp_size=2)
    tier = StorageTier(store, key=key, shards=ranks)
    assert [(k.tp_rank, k.page_shape[2]) for k in tier.shard_keys] == [(0, 1), (1, 1)]
    assert len({k.digest for k in tier.shard_keys} | {key.digest}) == 3
    hashes = page_hashes(list(range(12)), 4)
    pages = _pages(len(hashes))
    assert tier.backup(hashes, pages).wait() == len(hashes)
    again = StorageTier(store, key=key, shards=ranks)  # a cold reader of the same TP size
    assert again.leading_hits(hashes) == len(hashes)
    np.testing.assert_array_equal(again.get(hashes), pages)
    assert not StorageTier(store, key=_key(tp_size=1)).contains(hashes[0])  # another TP size: another key
    store.write(tier.key(hashes[1], shard=1), None).result()  # rank 1's entry of page 1 is gone
    assert again.leading_hits(hashes) == 1, "a page counts only when every rank's entry is stored"
    np.testing.assert_array_equal(again.get(hashes), pages[:1])
    assert tier.backup(hashes, pages).skipped == 2  # only page 1 is written again (both entries)
    with pytest.raises(ConfigError, match="shards"):
        StorageTier(store, key=key, shards=((0, slice(0, 1)), (0, slice(1, 2))))


def test_each_process_stores_and_reads_only_its_own_ranks_heads_of_a_page():
    # Two processes over one sharded pool: process 0's devices hold head pair 0, process 1's pair 1.
    store = ts.KvStore.open({"driver": "memory"}).result()
    key = _key(page_shape=(2, 4, 2, 8), tp_size=2)
    mine = StorageTier(store, key=key, shards=((1, slice(1, 2)),), partial_shards=True)  # process 1
    hashes = page_hashes(list(range(12)), 4)
    pages = _pages(len(hashes))
    assert mine.backup(hashes, pages).wait() == len(hashes)
    whole = StorageTier(store, key=key, shards=((0, slice(0, 1)), (1, slice(1, 2))))
    assert whole.leading_hits(hashes) == 0, "rank 0's entries were never written by process 1"
    again = StorageTier(store, key=key, shards=((1, slice(1, 2)),), partial_shards=True)
    assert again.leading_hits(hashes) == len(hashes)
    np.testing.assert_array_equal(again.get(hashes)[:, :, :, 1:2], pages[:, :, :, 1:2])  # its heads, exact
    for bad in (((1, slice(1, 3)),), ((0, slice(1, 2)), (1, slice(0, 1)))):  # past the axis; out of order
        with pytest.raises(ConfigError, match="shards"):
            StorageTier(store, key=key, shards=bad, partial_shards=True)
    with pytest.raises(ConfigError, match="tiling"):
        StorageTier(store, key=key, shards=((1, slice(1, 2)),))  # a part only where the whole is due
