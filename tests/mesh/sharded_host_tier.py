"""What the host tier tests over sharded pools share (``test_tp_host_tier``: KV heads over TP ranks,
``test_dcp_host_tier``: pages striped over DCP ranks): the serving rounds that load prefixes back
from the host, and the engine checks of one cache (``tests.caches.host_tier_cache``): random
pages, a backup, a load in place and a retraction backup restored."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.parity_harness import serve_batches_through_the_host


def serve_with_host_loads(sched: Scheduler, max_new: int) -> dict[str, ServingReq]:
    """Serve the parity prompts in three batches (each evicting the one before to the host), then
    the chat's second turn (its first turn comes back from the host); assert loads happened,
    the host and device accounting balance, and return the requests by name."""
    tree = sched.cache.tree_cache
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    done = serve_batches_through_the_host(sched, max_new)
    tree.check_transfers(wait=True)
    assert host.loads > 0 and host.loaded_tokens > 0, "a prefix should come back from the host"
    assert sched.stats.evicted_tokens > 0
    assert sched.leak_free() and host.host_balanced()
    tree.sanity_check()
    sched.cache.token_to_kv_pool_allocator.check_invariants()
    return done


def fill(cache: Any, seed: int) -> list[np.ndarray]:
    """Random pages in every layer (equal copies of each replicated head); the new pools handed in."""
    from kvjax.transfers.device_pages import page_layers, with_page_layers

    pool = cache.pools.kv
    layers = page_layers(pool)
    rng = np.random.default_rng(seed)
    replicas = cache.host_pool.kv_head_replicas
    values = []
    for x in layers:
        v = rng.standard_normal(x.shape).astype(np.float32)
        if x.ndim == 4 and replicas > 1:  # [pages, page, 2 * heads, D]: copies of the group's first head
            heads = v.reshape(*x.shape[:2], x.shape[2] // 2, 2, x.shape[3])
            v = heads[:, :, (np.arange(heads.shape[2]) // replicas) * replicas].reshape(x.shape)
        values.append(v)
    # Written by a compiled program, so each buffer is one XLA allocated (and aligned) as it does a
    # pool's: a buffer put from numpy may be aligned too little for XLA's CPU backend to donate in
    # place, and the in-place checks below compare buffer addresses.
    new = tuple(_owned(jax.device_put(v, x.sharding)) for v, x in zip(values, layers, strict=True))
    cache.set_pools(cache.pools.replace(kv=with_page_layers(pool, new)))
    return values


@jax.jit
def _owned(x: jax.Array) -> jax.Array:
    return x + jnp.zeros((), x.dtype)


def load_buffer(layers: Any, engine: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and sharding of the buffer a load of 2 pages of ``layers`` scatters from."""
    from jax.sharding import NamedSharding

    from kvjax.transfers.transfer import _buffer_spec

    x = layers[0]
    shape = (len(layers), 2, *x.shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(engine._mesh, _buffer_spec(engine._specs[0])))


def back_up_pages_2_and_3(cache: Any, page: int) -> np.ndarray:
    """Back up device pages 2 and 3 (``page`` slots each) into 2 new host pages, waited for; returns
    the host slots."""
    from kvjax.tiers.copy_engine import TransferStatus

    engine = cache.tree_cache.host.engine
    host_slots = cache.host_pool.allocator.alloc(2 * page)
    backup = engine.start_backup(np.arange(2 * page, 4 * page), host_slots)
    assert engine.poll(backup, wait=True) is TransferStatus.DONE
    return host_slots


def assert_a_load_writes_in_place(cache: Any, host_slots: np.ndarray, before: list[np.ndarray], page: int) -> None:
    """Load ``host_slots`` (``back_up_pages_2_and_3``'s) into device pages 5 and 6 and check: they
    equal pages 2 and 3 of ``before`` (``fill``'s values), every other page is untouched, each
    device's layer buffer is reused (donated), and the compiled scatter has no collective."""
    from kvjax.tiers.copy_engine import TransferStatus
    from kvjax.transfers.device_pages import page_layers
    from kvjax.transfers.transfer import _scatter_per_shard

    engine = cache.tree_cache.host.engine
    pointers = [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in page_layers(cache.pools.kv)]
    load = engine.start_load(host_slots, np.arange(5 * page, 7 * page))
    pools = cache.apply_pending(cache.pools)
    assert engine.poll(load, wait=True) is TransferStatus.DONE
    after = page_layers(pools.kv)
    assert [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in after] == pointers
    for old, new in zip(before, after, strict=True):
        new = np.asarray(new)
        np.testing.assert_array_equal(new[5:7], old[2:4])
        np.testing.assert_array_equal(np.delete(new, [5, 6], axis=0), np.delete(old, [5, 6], axis=0))
    text = (
        _scatter_per_shard(engine._mesh, engine._specs)
        .lower(after, load_buffer(after, engine), np.zeros(2, np.int32))
        .compile()
        .as_text()
    )
    assert not any(op in text for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all"))


def assert_a_retraction_backup_restores(cache: Any, before: list[np.ndarray], page: int) -> None:
    """The ``host_pool`` retraction backup of a request's device pages 1 and 2 (``page`` slots
    each) into held host slots, restored into pages 8 and 9: restored once, nothing held, and
    pages 8 and 9 equal pages 1 and 2 of ``before`` (``fill``'s values) on every shard."""
    from kvjax.transfers.device_pages import page_layers
    from kvjax.transfers.retraction_backup import RetractionBackup

    retraction = RetractionBackup("host_pool", page, host=cache.tree_cache.host)
    assert retraction.backup("q", np.arange(page, 3 * page), 0, 2 * page)
    assert retraction.restore("q", np.arange(8 * page, 10 * page))
    pools = cache.apply_pending(cache.pools)
    retraction.poll(wait=True)
    assert retraction.restored == 1 and retraction.held == 0
    for old, new in zip(before, page_layers(pools.kv), strict=True):
        np.testing.assert_array_equal(np.asarray(new)[8:10], old[1:3])
