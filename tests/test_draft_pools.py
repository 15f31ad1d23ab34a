"""Draft (speculative) KV pools: planned beside the target's, built by the registry, copied with
the target's pages by the host tier."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import CacheConfig, ConfigError, ModelSpec, build_kv_cache
from kvjax.tiers.copy_engine import TransferStatus
from kvjax.transfers.draft_pools import PairedCopyEngine
from tests.specs import dense, swa

# --- build --------------------------------------------------------------------------------------


def eagle_cache(**kw):
    kw.setdefault("max_total_tokens", 1024)
    kw.setdefault("max_running_requests", 8)
    kw.setdefault("context_length", 256)
    return build_kv_cache(ModelSpec.preset("tiny"), CacheConfig(speculative_algorithm="EAGLE", **kw))


def test_build_makes_the_draft_pool_and_a_step_writes_it_at_the_targets_slots():
    cache = eagle_cache(page_size=16)
    kv, draft = cache.pools.kv, cache.pools["kv_draft"]
    assert cache.pools.names == ("kv", "kv_draft") and cache.draft_host_pool is None
    assert draft.num_layers == 1 and draft.kv[0].shape == kv.kv[0].shape == cache.plan.pool("kv_draft").shape
    assert draft.nbytes() == cache.plan.pool("kv_draft").nbytes
    loc = cache.allocator.alloc_extend(np.array([0]), np.array([5]), np.array([-1]))
    k = np.arange(5 * kv.num_kv_heads * kv.head_dim, dtype=np.float32).reshape(5, kv.num_kv_heads, kv.head_dim)

    def step(pools, loc, k):
        return pools.replace(
            kv=pools.kv.set_kv_buffer(1, loc, k, k), kv_draft=pools["kv_draft"].set_kv_buffer(0, loc, -k, -k)
        )

    old = cache.pools["kv_draft"].kv[0]
    cache.set_pools(jax.jit(step, donate_argnums=0)(cache.pools, loc, k))
    assert old.is_deleted()
    np.testing.assert_array_equal(cache.pools.kv.get_kv(1, loc)[0], k)
    np.testing.assert_array_equal(cache.pools["kv_draft"].get_kv(0, loc)[0], -k)


def _mark(cache, name, first, pages):
    pool = cache.pools[name]
    marked = tuple(a.at[pages].set(jnp.asarray(first + i, a.dtype)) for i, a in enumerate(pool.kv))
    cache.set_pools(cache.pools.replace(**{name: pool.replace(kv=marked)}))


def _host_round_trip(cache):
    tree = cache.tree_cache
    ps = cache.plan.alloc_page_size
    tokens = list(range(2 * ps + int(cache.plan.is_eagle)))  # EAGLE's bigram keys: one token more
    slots = cache.token_to_kv_pool_allocator.alloc((3 if cache.plan.is_eagle else 2) * ps)[: len(tokens)]
    assert slots[: 2 * ps].tolist() == list(range(ps, 3 * ps))
    names = [n for n in ("kv", "kv_draft") if n in cache.pools.names]
    for j, name in enumerate(names):
        _mark(cache, name, 7 + 10 * j, slice(1, 3))
    tree.insert(tokens, slots)
    tree.check_transfers(wait=True)
    assert tree.evict(2 * ps) == 2 * ps
    for name in names:
        blank = tuple(a.at[1:3].set(0) for a in cache.pools[name].kv)
        cache.set_pools(cache.pools.replace(**{name: cache.pools[name].replace(kv=blank)}))
    m = tree.init_load_back(tree.match_prefix(tokens))
    assert m.prefix_len == 2 * ps
    cache.apply_pending()  # the owner of the step applies the recorded loads
    tree.check_transfers(wait=True)
    return np.unique(m.indices // ps), cache.host_pool.allocator.available_size()


def test_host_tier_backs_up_and_loads_back_the_draft_pool_with_the_target():
    cache = eagle_cache(enable_hierarchical_cache=True, hicache_mem_layout="page_first")
    assert cache.draft_host_pool.size == cache.host_pool.size  # host slots one to one
    assert cache.draft_host_pool.num_layers == 1 and cache.draft_host_pool.layout.name == "page_first"
    pages, host_available = _host_round_trip(cache)
    for i, layer in enumerate(cache.pools.kv.kv):
        assert (np.asarray(layer)[pages] == 7 + i).all()
    assert (np.asarray(cache.pools["kv_draft"].kv[0])[pages] == 17).all()  # the draft's KV came back too
    # Accounting is the target's: the same host slots used as without a draft; the draft host
    # pool's own allocator is never used.
    plain = build_kv_cache(
        ModelSpec.preset("tiny"),
        CacheConfig(max_total_tokens=1024, max_running_requests=8, context_length=256, enable_hierarchical_cache=True),
    )
    assert plain.draft_host_pool is None
    assert _host_round_trip(plain)[1] == host_available
    assert cache.draft_host_pool.allocator.available_size() == cache.draft_host_pool.size


class _FakeEngine:
    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, 0

    def start_backup(self, device_slots, host_slots):
        return [TransferStatus.PENDING]

    start_load = start_backup

    def poll(self, handle, wait=False):
        if wait or handle[0] is not TransferStatus.PENDING:
            handle[0] = self.outcome
        return handle[0]

    def cancel(self, handle):
        self.cancelled += 1


def test_paired_engine_is_done_when_both_landed_and_failed_when_either_failed():
    ok, bad = _FakeEngine(TransferStatus.DONE), _FakeEngine(TransferStatus.FAILED)
    both = PairedCopyEngine(ok, _FakeEngine(TransferStatus.DONE))
    h = both.start_backup(np.arange(4), np.arange(4))
    assert both.poll(h) is TransferStatus.PENDING
    assert both.poll(h, wait=True) is TransferStatus.DONE
    failing = PairedCopyEngine(ok, bad)
    h = failing.start_load(np.arange(4), np.arange(4))
    assert failing.poll(h, wait=True) is TransferStatus.FAILED and failing.poll(h) is TransferStatus.FAILED
    h = failing.start_backup(np.arange(4), np.arange(4))
    failing.cancel(h)
    assert (ok.cancelled, bad.cancelled) == (1, 1)


def test_build_refuses_a_standalone_draft_without_its_spec_and_an_swa_targets_draft():
    with pytest.raises(ConfigError, match="draft_spec"):
        build_kv_cache(
            dense(layers=1, head_dim=16), CacheConfig(max_total_tokens=64, speculative_algorithm="STANDALONE")
        )
    with pytest.raises(NotImplementedError, match="draft model's KV pools for a 'swa' target"):
        build_kv_cache(swa(), CacheConfig(memory_budget_bytes=2**26, speculative_algorithm="EAGLE"))


def test_host_pool_retraction_backup_restores_the_draft_pool_too():
    from kvjax.transfers.retraction_backup import RetractionBackup

    cache = eagle_cache(disaggregation_decode_retraction_backup="host_pool")
    assert cache.plan.draft_host_pools and cache.draft_host_pool.size == cache.host_pool.size
    ps = cache.plan.alloc_page_size
    rb = RetractionBackup("host_pool", ps, host=cache.tree_cache.host)
    _mark(cache, "kv", 7, slice(1, 3))
    _mark(cache, "kv_draft", 17, slice(1, 3))
    assert rb.backup("r", np.arange(ps, 3 * ps), 0, 2 * ps)
    assert rb.restore("r", np.arange(3 * ps, 5 * ps))  # pages 1, 2 -> 3, 4
    cache.apply_pending()  # the owner of the step applies the recorded loads
    rb.poll(wait=True)  # their held host slots are returned once they landed
    assert (np.asarray(cache.pools["kv_draft"].kv[0])[3:5] == 17).all()
    for i, layer in enumerate(cache.pools.kv.kv):
        assert (np.asarray(layer)[3:5] == 7 + i).all()
    assert cache.host_pool.allocator.available_size() == cache.host_pool.size  # held slots returned


def test_nextn_mla_draft_pool_round_trips_through_the_host_tier():
    import dataclasses

    from tests.specs import mla

    spec = dataclasses.replace(mla(layers=2), num_nextn_predict_layers=1)
    config = CacheConfig(
        max_total_tokens=256,
        max_running_requests=4,
        context_length=64,
        enable_hierarchical_cache=True,
        speculative_algorithm="NEXTN",
    )
    cache = build_kv_cache(spec, config)
    draft = cache.pools["kv_draft"]
    assert type(draft).__name__ == "MLAKVPool" and draft.kv[0].shape == cache.pools.kv.kv[0].shape
    assert cache.draft_host_pool.num_layers == 1 and cache.draft_host_pool.size == cache.host_pool.size
    pages, _ = _host_round_trip(cache)
    assert (np.asarray(cache.pools["kv_draft"].kv[0])[pages] == 17).all()
    for i, layer in enumerate(cache.pools.kv.kv):
        assert (np.asarray(layer)[pages] == 7 + i).all()


def test_a_failed_draft_copy_fails_the_paired_backup_and_the_tree_keeps_its_accounting():
    from kvjax.radix import HiRadixCache
    from kvjax.tiers import SimulatedCopyEngine

    target, draft = SimulatedCopyEngine(), SimulatedCopyEngine(fail_backups=1)
    tree = HiRadixCache(page_size=2, host_pool_tokens=8, copy_engine=PairedCopyEngine(target, draft))
    tree.insert([1, 2, 3, 4], np.array([2, 3, 4, 5], np.int32))
    tree.check_transfers(wait=True)
    tree.check_invariants()
    assert tree.evict(4) == 4  # the failed backup left no host copy: evicted outright
    assert tree.host_allocator.available_size() == 8
    assert tree.match_prefix([1, 2, 3, 4]).prefix_len == 0
    tree.insert([1, 2, 3, 4], np.array([6, 7, 8, 9], np.int32))  # both copies land this time
    tree.check_transfers(wait=True)
    assert tree.evict(4) == 4 and tree.host_allocator.available_size() == 4  # demoted to host
    tree.check_invariants()
