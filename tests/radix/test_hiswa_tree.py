"""HiSWARadixCache (FULL + SWA + host) standalone with the simulated copy engine, and the SWA page
transfer engine over real pools: demotion forgets SWA, the host hit stops where the last window
cannot be restored, load-back restores SWA for the last window only, and the two host pools
round-trip the bytes of both device pools."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.radix import HiSWARadixCache, TreeOptions, create_tree_cache


def tree(window: int = 4, full: int = 64, swa: int = 32) -> tuple[HiSWARadixCache, SWATokenToKVPoolAllocator]:
    alloc = SWATokenToKVPoolAllocator(full, swa, 1)
    t = HiSWARadixCache(
        page_size=1, sliding_window_size=window, host_pool_tokens=128, allocator=alloc, load_back_threshold=4
    )
    return t, alloc


def live(t: HiSWARadixCache) -> list[tuple[list[int], str, bool]]:
    out = []
    for n in sorted(t.nodes(), key=lambda n: n.depth):
        out.append((n.token_ids(), "device" if n.value is not None else "host", not t.swa.is_tombstone(n)))
    return out


def balanced(t: HiSWARadixCache, alloc: SWATokenToKVPoolAllocator) -> bool:
    t.sanity_check()
    alloc.check_invariants()
    host = t.host_allocator
    hs = t.sizes()["host"]
    return (
        alloc.full_available_size() + t.full_evictable_size() + t.full_protected_size() == alloc.size_full
        and alloc.swa_available_size() + t.swa_evictable_size() + t.swa_protected_size() == alloc.size_swa
        and host.available_size() + hs.evictable + hs.protected == host.size
    )


def test_demote_then_load_back_restores_swa_for_the_last_window_only():
    t, alloc = tree()
    t.insert(list(range(1, 13)), alloc.alloc(12))
    t.check_transfers(wait=True)
    assert t.evict(12, 0) == (12, 12)  # both nodes demoted: device copies and SWA freed
    assert live(t) == [(list(range(1, 9)), "host", False), ([9, 10, 11, 12], "host", False)]
    assert balanced(t, alloc)
    m = t.match_prefix(list(range(1, 13)))
    assert (m.prefix_len, m.host_hit_length) == (0, 12)
    loaded = t.init_load_back(m)
    assert loaded.prefix_len == 12
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64 - 12, 32 - 4)
    t.check_transfers(wait=True)
    assert live(t) == [(list(range(1, 9)), "device", False), ([9, 10, 11, 12], "device", True)]
    assert t.match_prefix(list(range(1, 13))).prefix_len == 12
    assert t.match_prefix(list(range(1, 9))).prefix_len == 0  # its SWA was not restored
    assert balanced(t, alloc)


def test_host_hit_stops_where_the_window_cannot_be_restored():
    t, alloc = tree()
    slots = alloc.alloc(12)
    alloc.free_swa(slots[:8])  # decode freed [0, 8) before the insert: a tombstone upper node
    t.insert(list(range(1, 13)), slots, swa_evicted_seqlen=8)
    t.check_transfers(wait=True)  # backed up: the tombstone's host copy carries no SWA
    t.evict(12, 0)
    assert live(t) == [(list(range(1, 9)), "host", False), ([9, 10, 11, 12], "host", False)]
    m = t.match_prefix(list(range(1, 13)))
    assert (m.prefix_len, m.host_hit_length) == (0, 12)  # the last window has SWA on the host
    m8 = t.match_prefix(list(range(1, 9)))
    assert (m8.prefix_len, m8.host_hit_length) == (0, 0)  # [1..8]'s last window has none
    assert t.load_back(m8.walk_node) == 8  # loaded on request, it comes back without SWA
    t.check_transfers(wait=True)
    assert live(t)[0] == (list(range(1, 9)), "device", False)  # loaded without SWA
    assert balanced(t, alloc)


def test_registry_builds_it_for_swa_plans_with_the_host_tier():
    options = TreeOptions(
        tree_components=("full", "swa"), sliding_window_size=4, attach_host_tier=True, host_pool_tokens=64
    )
    t = create_tree_cache(options, token_to_kv_pool_allocator=SWATokenToKVPoolAllocator(32, 16, 1))
    assert isinstance(t, HiSWARadixCache) and t.sliding_window_size == 4
    with pytest.raises(NotImplementedError, match="cpu_tensor"):
        create_tree_cache(
            replace(options, disable_radix_cache=True), token_to_kv_pool_allocator=SWATokenToKVPoolAllocator(32, 16, 1)
        )


def test_swa_transfer_engine_round_trips_both_pools():
    import jax.numpy as jnp

    from kvjax.device_updates import PendingDeviceUpdates
    from kvjax.pools import CachePools
    from kvjax.pools.mha import MHAKVPool
    from kvjax.pools.swa import SWAKVPool
    from kvjax.tiers import HostKVPool, TransferStatus
    from kvjax.transfers.swa_transfer import SWAPageTransferEngine

    ps = 2

    def mha(pages: int, layers: int, seed: int) -> MHAKVPool:
        pool = MHAKVPool.create(
            num_pages=pages, page_size=ps, num_layers=layers, num_kv_heads=1, head_dim=8, dtype="float32"
        )
        rng = np.random.default_rng(seed)
        return pool.replace(kv=tuple(jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)) for x in pool.kv))

    full, swa = mha(8, 1, 0), mha(4, 2, 1)
    updates = PendingDeviceUpdates(CachePools({"swa": SWAKVPool(full, swa, (1,), (0, 2))}))
    alloc = SWATokenToKVPoolAllocator(16, 8, ps)
    full_host = HostKVPool.for_device_layers(full.kv, 16)
    swa_host = HostKVPool.for_device_layers(swa.kv, 16)
    engine = SWAPageTransferEngine(updates, full_host, swa_host, alloc)
    slots = alloc.alloc(4)  # two pages, both paired
    alloc.free_swa(slots[:2])  # the first page left the window
    host = full_host.allocator.alloc(4)
    before_full = np.asarray(full.kv[0]).copy()  # the load donates the device layers
    before_swa = [np.asarray(x).copy() for x in swa.kv]
    h = engine.start_backup(slots, host)
    assert engine.poll(h, wait=True) is TransferStatus.DONE
    np.testing.assert_array_equal(
        full_host.read_pages(host, np.float32)[0], before_full[slots.reshape(-1, ps)[:, 0] // ps]
    )
    # Load into fresh pairs: full layers everywhere, SWA only where paired.
    dst = alloc.alloc(4)
    alloc.free_swa(dst[:2])
    h = engine.start_load(host, dst)
    after = updates.apply(updates.owner_pools)["swa"]  # the owner of the step applies the recorded load
    assert engine.poll(h, wait=True) is TransferStatus.DONE
    src_pages = slots.reshape(-1, ps)[:, 0] // ps
    dst_pages = dst.reshape(-1, ps)[:, 0] // ps
    np.testing.assert_array_equal(np.asarray(after.full.kv[0])[dst_pages], before_full[src_pages])
    src_swa = alloc.full_to_swa_index_mapping[slots[2]] // ps
    dst_swa = alloc.full_to_swa_index_mapping[dst[2]] // ps
    for layer in range(2):
        np.testing.assert_array_equal(np.asarray(after.swa.kv[layer])[dst_swa], before_swa[layer][src_swa])


@pytest.mark.parametrize("evicted", [0, 8])
def test_insert_over_host_only_nodes_takes_the_incoming_pairs(evicted: int):
    t, alloc = tree()
    t.insert(list(range(1, 13)), alloc.alloc(12))
    t.check_transfers(wait=True)
    t.evict(12, 0)
    slots = alloc.alloc(12)
    if evicted:
        alloc.free_swa(slots[:evicted])  # the request's decode freed them
    assert t.insert(list(range(1, 13)), slots, swa_evicted_seqlen=evicted) == 12  # host-only: already cached
    t.check_transfers(wait=True)
    assert [v for _, v, _ in live(t)] == ["device", "device"]
    assert [s for _, _, s in live(t)] == ([True, True] if not evicted else [False, True])
    assert t.match_prefix(list(range(1, 13))).indices.tolist() == slots.tolist()  # the tree took them all
    assert alloc.full_available_size() == 64 - 12 and alloc.swa_available_size() == 32 - (12 - evicted)
    assert balanced(t, alloc)


def test_full_kv_hit_length_is_full_kv_on_device_or_host_whatever_swa_says():
    t, alloc = tree()
    slots = alloc.alloc(12)
    alloc.free_swa(slots[:8])  # decode freed [0, 8): SWA live for [9..12] only
    t.insert(list(range(1, 13)), slots, swa_evicted_seqlen=8)
    assert balanced(t, alloc)
    m = t.match_prefix(list(range(1, 11)))
    assert (m.prefix_len, m.device_kv_hit_length, m.full_kv_hit_length) == (0, 10, 10)
    t.check_transfers(wait=True)
    t.evict(12, 0)  # demoted: FULL KV on the host only
    m = t.match_prefix(list(range(1, 13)))
    assert (m.prefix_len, m.device_kv_hit_length, m.full_kv_hit_length) == (0, 0, 12)
    assert balanced(t, alloc)


def test_the_hybrid_host_tree_is_one_preset_of_the_swa_tree():
    from kvjax.radix import HiRadixCache, SWARadixCache

    t = HiSWARadixCache(page_size=1, sliding_window_size=4, host_pool_tokens=16)
    assert isinstance(t, SWARadixCache) and isinstance(t, HiRadixCache)  # the latter: registered, not inherited
    assert HiRadixCache not in type(t).__mro__
    assert t.components == (t.component("full"), t.swa, t.host)
