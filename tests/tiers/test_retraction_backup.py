"""Decode retraction backup: a retracted request's KV kept aside (host pool or CPU copy) and
restored instead of recomputed; fallbacks recompute; the host pool's accounting holds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.demo_config import demo_config
from kvjax.device_updates import PendingDeviceUpdates
from kvjax.errors import ConfigError
from kvjax.plan.host_sizing import validate_retraction_host_capacity
from kvjax.pools import CachePools, MHAKVPool
from kvjax.radix import HiRadixCache
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.tiers import SimulatedCopyEngine
from kvjax.transfers.retraction_backup import RetractionBackup


def test_cpu_tensor_backup_restores_into_new_pages_from_the_new_prefix():
    pool = MHAKVPool.create(num_pages=6, page_size=2, num_layers=2, num_kv_heads=1, head_dim=4)
    kv = tuple(jnp.arange(np.prod(a.shape), dtype=jnp.uint32).reshape(a.shape).astype(a.dtype) for a in pool.kv)
    pools = CachePools(kv=pool.replace(kv=kv))
    updates = PendingDeviceUpdates(pools)
    before = [np.asarray(a) for a in kv]
    rb = RetractionBackup("cpu_tensor", 2, pending=updates)
    assert rb.backup("r", np.array([2, 3, 4, 5, 6]), 0, 5)  # pages 1, 2, 3 (a partial last page)
    assert rb.pages_from("r", 2) == 2
    assert rb.restore("r", np.array([8, 9, 10, 11]), from_token=2)  # pages 2, 3 -> 4, 5
    assert updates.owner_pools is pools and [u.what for u in updates.updates()] == ["retraction restore"]
    after = [np.asarray(a) for a in updates.apply(pools).kv.kv]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][4:6], before[layer][2:4])
    assert "r" not in rb and rb.restored_tokens == 3


def test_a_windowed_part_copies_its_mapped_window_and_restores_past_the_new_prefix():
    """A second pool indexed through a slot mapping, over the last 4 tokens only (as the sliding
    side of a hybrid sliding-window pool): tokens [0, 10) on pages 1..5 of "kv"; the window
    [6, 10) maps to pages 6, 7 of "win"; restored from token 8 into the fresh page 9 of "kv", which
    maps to page 2 of "win": only the window's part past the new prefix comes back."""
    from kvjax.transfers.retraction_backup import CopyPart
    from kvjax.transfers.transfer import PoolRef

    def filled(offset: int) -> MHAKVPool:
        pool = MHAKVPool.create(num_pages=12, page_size=2, num_layers=1, num_kv_heads=1, head_dim=4)
        return pool.replace(kv=tuple((jnp.arange(np.prod(a.shape)) + offset).reshape(a.shape) for a in pool.kv))

    pools = CachePools(kv=filled(0), win=filled(10_000))
    updates = PendingDeviceUpdates(pools)
    mapping = np.zeros(32, np.int32)
    mapping[8:12] = np.arange(12, 16)  # positions 6..9 (slots 8..11) -> "win" pages 6, 7; 0..5 unmapped
    window = CopyPart(PoolRef("win"), window=4, translate=lambda slots: mapping[slots])
    rb = RetractionBackup("cpu_tensor", 2, pending=updates, parts=("kv", window))
    assert rb.pool_names == ("kv", "win")
    assert rb.backup("r", np.arange(2, 12), 0, 10)  # "kv" pages 1..5; "win" pages 6, 7 (positions 6..9)
    before_win = np.asarray(pools["win"].kv[0])
    assert not rb.backup("x", np.arange(2, 6), 0, 4), "a window the mapping does not cover: no backup"
    assert rb.pages_from("r", 8) == 1
    mapping[18:20] = [4, 5]  # the fresh "kv" page 9 (positions 8, 9 past the new prefix) -> "win" page 2
    assert rb.restore("r", np.arange(18, 20), from_token=8)
    after = updates.apply(pools)
    np.testing.assert_array_equal(np.asarray(after["kv"].kv[0])[9:10], np.asarray(pools["kv"].kv[0])[5:6])
    win = np.asarray(after["win"].kv[0])
    np.testing.assert_array_equal(win[2:3], before_win[7:8])  # position 8's page (its window page 7)
    np.testing.assert_array_equal(win[[0, 1, 3, 4, 5, 6, 7]], before_win[[0, 1, 3, 4, 5, 6, 7]])
    assert rb.restored_tokens == 2 and rb.fallbacks == 1


def test_host_pool_backup_holds_host_slots_and_falls_back_on_a_failed_copy():
    tree = HiRadixCache(page_size=2, host_pool_tokens=8, copy_engine=SimulatedCopyEngine())
    host = tree.host
    rb = RetractionBackup("host_pool", 2, host=host)
    host.engine.device.update({s: f"kv{s}" for s in range(2, 8)})
    assert rb.backup("r", np.array([2, 3, 4, 5]), 0, 4)
    assert host.held_tokens == 4 and tree.host_allocator.available_size() == 4
    tree.check_invariants()
    assert rb.restore("r", np.array([6, 7, 8, 9]))
    assert [host.engine.device[s] for s in (6, 7, 8, 9)] == ["kv2", "kv3", "kv4", "kv5"]
    assert host.held_tokens == 0 and tree.host_allocator.available_size() == 8
    host.engine.fail_backups = 1
    assert rb.backup("r", np.array([2, 3]), 0, 2)
    assert not rb.restore("r", np.array([6, 7])) and rb.fallbacks == 1 and host.held_tokens == 0
    assert not rb.backup("big", np.arange(2, 12), 0, 10)  # more than the host pool: recompute
    assert host.held_tokens == 0 and rb.fallbacks == 2
    tree.check_invariants()


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="decode_retraction_backup"):
        RetractionBackup("disk", 1)
    with pytest.raises(ValueError, match="host tier"):
        RetractionBackup("host_pool", 1)


def test_host_capacity_for_retraction_is_validated_at_plan_time():
    validate_retraction_host_capacity(1024, 1000, 16)
    with pytest.raises(ConfigError, match="context_length 1024"):
        validate_retraction_host_capacity(272, 1024, 16)
    config = CacheConfig(max_total_tokens=128, context_length=1024, disaggregation_decode_retraction_backup="host_pool")
    with pytest.raises(ConfigError, match="1024 tokens at page 16"):
        build_kv_cache(ModelSpec.preset("tiny"), config)


def test_decode_retraction_restores_from_the_host_pool_with_the_same_tokens():
    spec = ModelSpec.preset("tiny")
    params = init_params(spec)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, 12)] for _ in range(4)]
    runs = {}
    for backup in (None, "host_pool"):
        # The host tier serving tests' settings (compiled shapes are shared)
        backup_to = {"disaggregation_decode_retraction_backup": backup}
        config = demo_config(page_size=4, max_total_tokens=96, chunked_prefill_size=64, hicache_ratio=12.0, **backup_to)
        sched = Scheduler(spec, build_kv_cache(spec, config), params, max_batch_size=2)
        done = sched.run([ServingReq(i, p, max_new_tokens=40) for i, p in enumerate(prompts)])
        runs[backup] = (sched, {r.rid: r.output_ids for r in done})
    plain, host = runs[None][0], runs["host_pool"][0]
    assert runs[None][1] == runs["host_pool"][1]
    assert plain.stats.retractions > 0 and host.stats.retractions > 0
    [ext] = host.extensions
    assert ext.retraction is not None and ext.retraction.restored_tokens > 0
    assert host.stats.prefill_tokens_computed < plain.stats.prefill_tokens_computed
    assert host.leak_free() and ext.host_balanced() and ext.retraction.held == 0
    host.cache.tree_cache.sanity_check()
