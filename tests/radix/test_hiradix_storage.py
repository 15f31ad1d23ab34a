"""HiRadixCache with a storage tier (L3): backup after host backup, prefetch on a miss, policies."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tensorstore as ts

from kvjax.errors import ConfigError
from kvjax.radix import HiRadixCache
from kvjax.radix.node import HOST_ONLY
from kvjax.tiers.storage import StorageTier, page_hashes
from kvjax.tiers.storage_key import StorageKey

PAGE = (2, 4, 1, 2)  # layers, page_size, C, D
KEY = StorageKey(model="ckpt-test", page_shape=PAGE, store_dtype="uint16", kv_dtype="bfloat16")


def _cache(store: StorageTier | None = None, host_tokens: int = 16, **kw) -> HiRadixCache:
    store = store if store is not None else StorageTier("memory", key=KEY)
    kw.setdefault("prefetch_threshold", 8)
    return HiRadixCache(page_size=4, host_pool_tokens=host_tokens, storage=store, **kw)


def _fill(cache: HiRadixCache, host_slots: np.ndarray, seed: int) -> np.ndarray:
    """Write known bytes into the host pages of ``host_slots``; returns the layer-first buffer."""
    pool = cache.storage.pages
    buf = np.random.default_rng(seed).integers(1, 2**16, (PAGE[0], host_slots.size // 4, *PAGE[1:]), np.uint16)
    pool.write_pages(host_slots, buf)
    return buf


def _stored_then_gone(cache: HiRadixCache, tokens: list[int], seed: int = 0) -> np.ndarray:
    """Insert ``tokens``, land the backup (host, then storage), evict from device and host."""
    cache.insert(tokens)
    node = cache.match_prefix(tokens).last_node
    buf = _fill(cache, cache.host.data(node).slots, seed)
    cache.check_transfers(wait=True)
    cache.check_transfers(wait=True)  # storage writes finish
    cache.evict(len(tokens))
    cache.evict_host(len(tokens))
    assert cache.match_prefix(tokens).prefix_len == 0
    assert cache.match_prefix(tokens).host_hit_length == 0
    cache.check_invariants()
    return buf


def _balanced(cache: HiRadixCache) -> bool:
    host = cache.host_allocator
    s = cache.sizes()["host"]
    return host.available_size() + s.evictable + s.protected + cache.host.held_tokens == host.size


def test_backup_lands_in_storage_under_the_trees_page_hashes():
    cache = _cache()
    tokens = list(range(1, 13))
    cache.insert(tokens)
    node = cache.match_prefix(tokens).last_node
    assert cache.host.data(node).slots.tolist() == list(range(12))
    buf = _fill(cache, np.arange(12), seed=1)
    assert cache.storage.pages_backed_up == 0  # the host copy has not landed
    cache.check_transfers(wait=True)
    assert cache.storage.pages_backed_up == 3
    assert cache.storage.pending_writes == 0
    stored = cache.storage.storage.get(page_hashes(tokens, 4))
    np.testing.assert_array_equal(stored, buf.swapaxes(0, 1))


def test_a_prefix_evicted_from_device_and_host_comes_back_from_storage():
    cache = _cache()
    tokens = list(range(1, 13))
    buf = _stored_then_gone(cache, tokens, seed=2)
    query = [*tokens, 99, 98]
    match = cache.match_prefix(query)
    assert cache.start_prefetch("r", match, query) == 12
    assert cache.host.held_tokens == 12 and _balanced(cache)
    assert cache.check_prefetch_progress("r")
    assert cache.host.held_tokens == 0 and _balanced(cache)
    assert cache.storage.prefetched_tokens == 12
    m = cache.match_prefix(query)
    assert (m.prefix_len, m.host_hit_length) == (0, 12)
    node = m.last_host_node
    assert node.residency == HOST_ONLY
    slots = cache.host.data(node).slots
    assert slots.tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7]  # the free page first, then freed ones
    np.testing.assert_array_equal(cache.storage.pages.read_pages(slots), buf)
    loaded = cache.init_load_back(m)
    assert loaded.prefix_len == 12
    cache.check_transfers(wait=True)
    assert cache.match_prefix(query).prefix_len == 12
    cache.check_invariants()


def test_prefetch_continues_below_a_partial_device_match_and_respects_the_threshold():
    cache = _cache(host_tokens=32)
    tokens = list(range(1, 21))  # five pages
    _stored_then_gone(cache, tokens)
    cache.insert(tokens[:8])  # two pages back on the device
    cache.check_transfers(wait=True)
    m = cache.match_prefix(tokens)
    assert m.prefix_len == 8
    assert cache.start_prefetch("r", m, tokens) == 12
    assert cache.check_prefetch_progress("r")
    m = cache.match_prefix(tokens)
    assert (m.prefix_len, m.host_hit_length) == (8, 12)
    # Under the threshold: 4 stored tokens beyond the match are not prefetched.
    other = _cache(host_tokens=32, prefetch_threshold=8)
    short = list(range(50, 58))
    _stored_then_gone(other, short)
    other.insert(short[:4])
    assert other.start_prefetch("r", other.match_prefix(short), short) == 0
    assert other.host.held_tokens == 0 and _balanced(other)


def _wait_reads(cache: HiRadixCache, rid: str) -> None:
    """Until every storage read of ``rid``'s prefetch finished (file reads take a moment)."""
    reads = cache.storage.prefetch_for(rid)
    while not reads.done():
        time.sleep(0.001)


def _files(directory) -> ts.KvStore:
    """A second handle on the files of a store opened at ``directory`` (to damage its entries)."""
    return ts.KvStore.open({"driver": "file", "path": f"{directory}/"}).result()


def test_a_storage_miss_in_the_middle_stops_the_run(tmp_path):
    store = StorageTier(str(tmp_path), key=KEY)
    cache = _cache(store, host_tokens=32)
    tokens = list(range(1, 21))
    _stored_then_gone(cache, tokens)
    hashes = page_hashes(tokens, 4)
    _files(tmp_path).write(store.key(hashes[3]), b"torn").result()  # a page of the wrong size is a miss
    m = cache.match_prefix(tokens)
    assert cache.start_prefetch("r", m, tokens) == 12  # pages 0..2; page 3 is missing, 4 useless
    _wait_reads(cache, "r")
    assert cache.check_prefetch_progress("r")
    assert cache.match_prefix(tokens).host_hit_length == 12
    assert _balanced(cache)
    cache.check_invariants()


def test_a_page_that_fails_its_checksum_ends_the_prefetched_run_and_frees_the_rest(tmp_path):
    store = StorageTier(str(tmp_path), key=KEY)
    cache = _cache(store, host_tokens=32)
    tokens = list(range(1, 21))
    buf = _stored_then_gone(cache, tokens)
    name = store.key(page_hashes(tokens, 4)[2])
    files = _files(tmp_path)
    entry = bytearray(files.read(name).result().value)
    entry[-1] ^= 0x80  # one bit of the page's last byte
    files.write(name, bytes(entry)).result()
    m = cache.match_prefix(tokens)
    assert cache.start_prefetch("r", m, tokens) == 20  # headers are intact: five pages are asked for
    assert cache.host.held_tokens == 20
    _wait_reads(cache, "r")
    assert cache.check_prefetch_progress("r")
    assert cache.storage.prefetched_tokens == 8 and store.rejected == {"checksum": 1}
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == 8
    np.testing.assert_array_equal(cache.storage.pages.read_pages(cache.host.data(m.last_host_node).slots), buf[:, :2])
    assert cache.host.held_tokens == 0 and _balanced(cache)
    cache.check_invariants()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_each_policy_takes_the_pages_that_arrived(policy):
    cache = _cache(prefetch_policy=policy, prefetch_timeout_s=5.0)
    tokens = list(range(1, 13))
    _stored_then_gone(cache, tokens)
    m = cache.match_prefix(tokens)
    assert cache.start_prefetch("r", m, tokens) == 12
    assert cache.storage.pending_prefetches == 1
    _wait_reads(cache, "r")  # so that every policy sees them all
    assert cache.check_prefetch_progress("r")
    assert cache.match_prefix(tokens).host_hit_length == 12
    assert cache.storage.pending_prefetches == 0 and _balanced(cache)


class _ScriptedReads:
    """An in-memory kvstore whose next reads follow a script: ``"ok"`` (the stored value),
    ``"fail"`` (an error) or ``"late"`` (a read that never finishes); reads past the script are
    ``"ok"``. Writes go to the store."""

    def __init__(self) -> None:
        self.store = ts.KvStore.open({"driver": "memory"}).result()
        self.script: list[str] = []
        self._late: list[ts.Promise] = []  # kept alive: their reads stay pending

    def read(self, key):
        outcome = self.script.pop(0) if self.script else "ok"
        if outcome == "ok":
            return self.store.read(key)
        promise, future = ts.Promise.new()
        if outcome == "fail":
            promise.set_exception(OSError("disk gone"))
        else:
            self._late.append(promise)
        return future

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_unfinished_reads_hold_admission_only_under_wait_complete_and_timeout():
    cases = (
        ("best_effort", 60.0, True),
        ("wait_complete", 60.0, False),
        ("timeout", 60.0, False),
        ("timeout", 0.0, True),
    )
    for policy, timeout_s, admitted in cases:
        reads = _ScriptedReads()
        cache = _cache(StorageTier(reads, key=KEY), prefetch_policy=policy, prefetch_timeout_s=timeout_s)
        tokens = list(range(1, 13))
        _stored_then_gone(cache, tokens)
        reads.script = ["ok"] * 3 + ["late"]  # the presence check's reads, then the first page's is late
        assert cache.start_prefetch("r", cache.match_prefix(tokens), tokens) == 12
        assert cache.check_prefetch_progress("r") is admitted
        if admitted:  # nothing of the leading run arrived: every slot is freed
            assert cache.storage.prefetched_tokens == 0
            assert cache.match_prefix(tokens).host_hit_length == 0
        else:
            cache.storage.cancel_prefetch("r")
        assert cache.host.held_tokens == 0 and _balanced(cache)
        cache.check_invariants()


def test_failed_reads_give_no_pages_and_balance_the_accounts():
    reads = _ScriptedReads()
    cache = _cache(StorageTier(reads, key=KEY))
    tokens = list(range(1, 13))
    _stored_then_gone(cache, tokens)
    # The presence check succeeds, then every read fails: r's three prefetch reads, s's presence check.
    reads.script = ["ok"] * 3 + ["fail"] * 6
    m = cache.match_prefix(tokens)
    assert cache.start_prefetch("r", m, tokens) == 12
    assert cache.check_prefetch_progress("r")
    assert cache.storage.prefetched_tokens == 0
    assert cache.match_prefix(tokens).host_hit_length == 0
    assert cache.host_allocator.available_size() == 16 and _balanced(cache)
    assert cache.start_prefetch("s", cache.match_prefix(tokens), tokens) == 0  # the store now "misses"
    cache.check_invariants()


def test_pages_inserted_meanwhile_are_dropped_and_rejected_knobs_raise():
    cache = _cache()
    tokens = list(range(1, 13))
    _stored_then_gone(cache, tokens)
    assert cache.start_prefetch("r", cache.match_prefix(tokens), tokens) == 12
    cache.insert(tokens)  # another request computed them meanwhile
    cache.check_transfers(wait=True)
    assert cache.check_prefetch_progress("r")
    assert cache.storage.prefetched_tokens == 0
    assert _balanced(cache)
    cache.check_invariants()
    for kw in ({"prefetch_policy": "eager"}, {"prefetch_timeout_s": -1.0}, {"prefetch_threshold": -1}):
        with pytest.raises(ConfigError):
            _cache(**kw)


def test_add_host_only_leaf_rejects_bad_input_leaving_the_tree_unchanged():
    cache = _cache()
    cache.insert(list(range(1, 9)))
    node = cache.match_prefix(list(range(1, 9))).last_node
    other = _cache()
    before = (cache.host_only_count, cache.total_size(), len(list(cache.nodes())))
    for parent, tokens, ek in (
        (node, [20, 21, 22], None),  # a partial page
        (cache.root_node, [1, 2, 3, 4], None),  # the first page is there already
        (node, [20, 21, 22, 23], "ns"),  # another namespace than the parent's
        (other.root_node, [1, 2, 3, 4], None),  # a foreign parent
    ):
        with pytest.raises(ValueError):
            cache.add_host_only_leaf(parent, tokens, ek)
    assert (cache.host_only_count, cache.total_size(), len(list(cache.nodes()))) == before
    leaf = cache.add_host_only_leaf(node, [20, 21, 22, 23])
    assert (leaf.residency, leaf.value, leaf.depth, leaf.parent) == (HOST_ONLY, None, 12, node)
    assert cache.host_only_count == 1


def test_write_back_stores_at_device_eviction_and_namespaces_come_back_apart():
    cache = _cache(write_policy="write_back", host_tokens=32)
    tokens = list(range(1, 13))
    cache.insert(tokens, extra_key="lora-a")
    cache.check_transfers(wait=True)
    assert cache.storage.pages_backed_up == 0  # write-back: nothing until FULL evicts it
    cache.evict(12)
    assert cache.storage.pages_backed_up == 3
    cache.check_transfers(wait=True)
    cache.evict_host(12)
    other = cache.match_prefix(tokens, "lora-b")
    assert cache.start_prefetch("b", other, tokens, "lora-b") == 0  # another namespace's pages
    m = cache.match_prefix(tokens, "lora-a")
    assert cache.start_prefetch("a", m, tokens, "lora-a") == 12
    assert cache.check_prefetch_progress("a")
    assert cache.match_prefix(tokens, "lora-a").host_hit_length == 12
    assert cache.match_prefix(tokens, "lora-b").host_hit_length == 0
    assert _balanced(cache)
    cache.check_invariants()


def test_prefetch_for_names_a_request_without_one():
    with pytest.raises(KeyError, match="'nobody'"):
        _cache().storage.prefetch_for("nobody")


class _OtherProcess:
    """An agreement with one other process whose answers are ``theirs[tag]`` (MIN with ours);
    records what was asked."""

    is_local = False

    def __init__(self, theirs: dict[str, int]) -> None:
        self.theirs = theirs
        self.asked: list[tuple[str, list[int]]] = []

    def agree_min(self, tag: str, values: list[int]) -> list[int]:
        self.asked.append((tag, list(values)))
        return [min(v, self.theirs[tag]) for v in values]


def test_hits_readiness_and_pages_taken_are_the_minimum_over_processes():
    cache = _cache(host_tokens=32)
    tokens = list(range(1, 21))  # five pages stored
    _stored_then_gone(cache, tokens)
    other = _OtherProcess({"storage hits": 4, "prefetch ready": 0, "prefetch pages": 2})
    cache.storage.agreement = other
    query = [*tokens, 99]
    assert cache.start_prefetch("r", cache.match_prefix(query), query) == 16  # 4 pages: the other's hits
    assert cache.host.held_tokens == 16 and _balanced(cache)
    assert not cache.check_prefetch_progress("r")  # ready here, not on the other process
    other.theirs["prefetch ready"] = 1
    assert cache.check_prefetch_progress("r")
    assert cache.storage.prefetched_tokens == 8  # the 2 pages the other received
    assert cache.match_prefix(query).host_hit_length == 8
    assert cache.host.held_tokens == 0 and _balanced(cache)
    assert [tag for tag, _ in other.asked] == ["storage hits", "prefetch ready", "prefetch ready", "prefetch pages"]
    assert cache.storage.pages_held_back == (5 - 4) + (4 - 2)
    cache.check_invariants()
