"""Page transfers between an MHA device pool and its host pool, through the gather/scatter kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.device_updates import PendingDeviceUpdates, PendingWriteError, StaleDeviceStateError
from kvjax.errors import InvalidSlotError
from kvjax.pools import CachePools, MHAKVPool
from kvjax.tiers import CopyError, HostKVPool, SimulatedCopyEngine, TransferStatus
from kvjax.transfers.transfer import PageTransferEngine


def _updates(pool):
    """The pending device updates of a cache holding ``pool`` as ``"kv"`` (the engine's only link
    to device state)."""
    return PendingDeviceUpdates(CachePools(kv=pool))


def _apply(updates):
    """What the owner of the step does before its next step: apply the recorded updates."""
    return updates.apply(updates.owner_pools)


def _filled_pool(page_size=2, pages=6, layers=2, head_dim=4):
    pool = MHAKVPool.create(num_pages=pages, page_size=page_size, num_layers=layers, num_kv_heads=1, head_dim=head_dim)
    kv = tuple(
        jnp.arange(np.prod(a.shape), dtype=jnp.uint32).reshape(a.shape).astype(a.dtype) + 1000 * i
        for i, a in enumerate(pool.kv)
    )
    return pool.replace(kv=kv)


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "staged"])
@pytest.mark.parametrize("staging", ["numpy", "pinned_host"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_backup_then_load_restores_the_pages(staging, layout, direct):
    pool = _filled_pool()
    original = [np.array(a) for a in pool.kv]
    updates = _updates(pool)
    host = HostKVPool.for_device_layers(pool.kv, 8, layout)
    engine = PageTransferEngine(updates, host, staging=staging, direct=direct)
    assert engine.direct is (direct is None)  # one CPU device: the direct path applies
    src = np.array([2, 3, 8, 9, 10, 11])  # pages 1, 4, 5
    hslots = host.allocator.alloc(6)
    h = engine.start_backup(src, hslots)
    assert engine.poll(h, wait=True) is TransferStatus.DONE
    dst = np.array([12, 13, 4, 5, 6, 7])  # pages 6, 2, 3
    h = engine.start_load(hslots, dst)
    assert engine.poll(h) is TransferStatus.PENDING and updates.owner_pools.kv is pool  # recorded, not applied
    pools = _apply(updates)
    assert engine.poll(h, wait=True) is TransferStatus.DONE
    after = [np.asarray(a) for a in pools.kv.kv]
    for layer in range(2):
        for s, d in [(1, 6), (4, 2), (5, 3)]:
            np.testing.assert_array_equal(after[layer][d], original[layer][s])
        np.testing.assert_array_equal(after[layer][1], original[layer][1])  # untouched pages stay
    jax.block_until_ready(pools)


def test_bad_slots_are_refused_before_anything_starts():
    pool = _filled_pool()
    updates = _updates(pool)
    host = HostKVPool.for_device_layers(pool.kv, 8)
    engine = PageTransferEngine(updates, host)
    with pytest.raises(InvalidSlotError):
        engine.start_backup(np.array([0, 1]), np.array([0, 1]))  # the trash page
    with pytest.raises(InvalidSlotError):
        engine.start_backup(np.array([3, 4]), np.array([0, 1]))  # not a whole page
    with pytest.raises(CopyError):
        engine.start_load(np.array([0, 1]), np.array([1, 2]))
    assert updates.owner_pools.kv is pool and updates.count == 0


def test_simulated_engine_lands_at_the_next_poll_and_injects_faults():
    eng = SimulatedCopyEngine(device={5: "a", 6: "b"})
    h = eng.start_backup(np.array([5, 6]), np.array([0, 1]))
    assert eng.host == {}  # started, not landed
    assert eng.poll(h) is TransferStatus.DONE and eng.host == {0: "a", 1: "b"}
    eng.fail_backups = 1
    h = eng.start_backup(np.array([5]), np.array([3]))
    assert eng.poll(h) is TransferStatus.FAILED and 3 not in eng.host
    eng.fail_loads = 1
    with pytest.raises(CopyError):
        eng.start_load(np.array([0]), np.array([9]))
    h = eng.start_load(np.array([0]), np.array([9]))
    assert eng.device[9] == "a" and eng.poll(h) is TransferStatus.DONE


def test_mla_latent_pages_round_trip_through_the_host_pool():
    from kvjax.pools.mla import MLAKVPool

    pool = MLAKVPool.create(num_pages=4, page_size=2, num_layers=2, kv_lora_rank=8, qk_rope_head_dim=4)
    kv = tuple(jnp.arange(np.prod(a.shape), dtype=jnp.uint32).reshape(a.shape).astype(a.dtype) for a in pool.kv)
    updates = _updates(pool.replace(kv=kv))
    before = [np.asarray(a) for a in kv]
    host = HostKVPool.for_device_layers(kv, 4)
    assert host.page_row == (2, kv[0].shape[-1])
    engine = PageTransferEngine(updates, host)
    slots = host.allocator.alloc(4)
    assert engine.poll(engine.start_backup(np.array([2, 3, 4, 5]), slots), wait=True) is TransferStatus.DONE
    load = engine.start_load(slots, np.array([6, 7, 8, 9]))
    pools = _apply(updates)
    assert engine.poll(load, wait=True) is TransferStatus.DONE
    after = [np.asarray(a) for a in pools.kv.kv]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][3:5], before[layer][1:3])
        np.testing.assert_array_equal(after[layer][1:3], before[layer][1:3])


def _host_with_pages(pool, num_pages):
    """A host pool whose page ``p`` of layer ``l`` holds ``100 * l + p`` everywhere."""
    host = HostKVPool.for_device_layers(pool.kv, num_pages * pool.page_size)
    host.allocator.alloc(host.size)
    for layer in range(host.num_layers):
        host.layout.layer_view(host.storage, layer)[:] = (100 * layer + np.arange(num_pages))[:, None, None, None]
    return host


@pytest.mark.parametrize("host_pages", [[5, 6, 7], [7, 5, 6], [1, 2, 3]], ids=["run_at_end", "two_runs", "run"])
def test_direct_load_reads_host_runs_in_place_and_drops_the_padding(host_pages):
    pool = _filled_pool(pages=8, head_dim=8)  # 64-byte pages: every host page is aligned
    updates = _updates(pool)
    before = [np.array(a) for a in pool.kv]
    host = _host_with_pages(pool, 8)
    engine = PageTransferEngine(updates, host)
    hslots = np.concatenate([[2 * p, 2 * p + 1] for p in host_pages])
    handle = engine.start_load(hslots, np.array([6, 7, 2, 3, 10, 11]))  # device pages 3, 1, 5
    one_run = host_pages == sorted(host_pages)
    # a single run is put on the device without a copy: the handle keeps the host view alive
    assert all(np.shares_memory(np.asarray(b), host.storage) for b in handle.sources) is one_run
    pools = _apply(updates)
    assert engine.poll(handle, wait=True) is TransferStatus.DONE and handle.sources == ()
    after = [np.asarray(a) for a in pools.kv.kv]
    for layer in range(2):
        for device_page, host_page in zip([3, 1, 5], host_pages, strict=True):
            assert (after[layer][device_page] == 100 * layer + host_page).all()
        for untouched in (0, 2, 4, 6, 7):  # the trash page and pages outside the load
            np.testing.assert_array_equal(after[layer][untouched], before[layer][untouched])


def test_direct_backup_copies_at_once_and_leaves_the_layers_donatable():
    pool = _filled_pool()
    before = [np.array(a) for a in pool.kv]
    updates = _updates(pool)
    host = HostKVPool.for_device_layers(pool.kv, 8)
    engine = PageTransferEngine(updates, host)
    hslots = host.allocator.alloc(4)
    handle = engine.start_backup(np.array([8, 9, 2, 3]), hslots)  # pages 4, 1
    assert handle.status is TransferStatus.DONE  # one copy, done when it returns
    np.testing.assert_array_equal(host.read_pages(hslots)[1], np.stack([before[1][4], before[1][1]]))
    layers = updates.owner_pools.kv.kv
    jax.jit(lambda x: tuple(a + 1 for a in x), donate_argnums=0)(layers)
    assert all(a.is_deleted() for a in layers)  # no view of the layers outlived the backup


def test_direct_path_is_refused_where_it_does_not_apply():
    pool = MHAKVPool.create(num_pages=4, page_size=2, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    updates = _updates(pool.replace(kv=tuple(a.astype(jnp.bfloat16) for a in pool.kv)))
    host = HostKVPool.for_device_layers(updates.owner_pools.kv.kv, 4)
    assert not PageTransferEngine(updates, host).direct  # bf16 has no numpy view: the staged path
    with pytest.raises(ValueError, match="direct=True"):
        PageTransferEngine(updates, host, direct=True)


def test_staged_backups_land_on_the_writer_thread_and_a_cancelled_one_never_lands():
    import threading

    pool = _filled_pool()
    updates = _updates(pool)
    host = HostKVPool.for_device_layers(pool.kv, 8)
    engine = PageTransferEngine(updates, host, staging="numpy", direct=False)
    writers = []
    write_pages = host.write_pages
    host.write_pages = lambda *a: (writers.append(threading.current_thread().name), write_pages(*a))[1]
    slots = host.allocator.alloc(4)
    cancelled = engine.start_backup(np.array([2, 3, 4, 5]), slots)
    engine.cancel(cancelled)
    assert engine.poll(cancelled, wait=True) is TransferStatus.DONE and writers == []
    assert not host.storage.any()  # nothing landed
    handle = engine.start_backup(np.array([2, 3, 4, 5]), slots)
    assert engine.poll(handle, wait=True) is TransferStatus.DONE
    assert writers and writers[0].startswith("kvjax-host-write")  # off the caller's thread
    np.testing.assert_array_equal(host.read_pages(slots)[0], np.asarray(pool.kv[0])[1:3])


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "staged"])
def test_a_load_never_touches_the_callers_pools_until_the_owner_applies_it(direct):
    pool = _filled_pool()
    pools = CachePools(kv=pool)
    updates = PendingDeviceUpdates(pools)
    host = HostKVPool.for_device_layers(pool.kv, 8)
    engine = PageTransferEngine(updates, host, direct=direct)
    hslots = host.allocator.alloc(4)
    assert engine.poll(engine.start_backup(np.array([2, 3, 4, 5]), hslots), wait=True) is TransferStatus.DONE
    load = engine.start_load(hslots, np.array([8, 9, 10, 11]))  # pages 1, 2 -> 4, 5
    assert not any(a.is_deleted() for a in pool.kv)  # the caller's arrays are untouched
    with pytest.raises(RuntimeError, match="apply_pending"):
        engine.poll(load, wait=True)  # nothing to wait for before the owner applies it
    with pytest.raises(PendingWriteError):
        engine.start_backup(np.array([8, 9]), host.allocator.alloc(2))  # a page the load has yet to write
    new = updates.apply(pools)
    assert updates.owner_pools is new and updates.count == 0
    assert engine.poll(load, wait=True) is TransferStatus.DONE
    np.testing.assert_array_equal(np.asarray(new.kv.kv[1])[4:6], np.asarray(_filled_pool().kv[1])[1:3])


def test_a_backup_refuses_pools_donated_since_they_were_handed_in():
    pool = _filled_pool()
    updates = _updates(pool)
    host = HostKVPool.for_device_layers(pool.kv, 8)
    engine = PageTransferEngine(updates, host)
    jax.jit(lambda x: tuple(a + 1 for a in x), donate_argnums=0)(pool.kv)  # a step the owner did not hand in
    hslots = host.allocator.alloc(2)
    with pytest.raises(StaleDeviceStateError, match="set_pools"):
        engine.start_backup(np.array([2, 3]), hslots)
