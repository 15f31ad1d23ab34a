"""The ``cpu_tensor`` decode retraction backup in the serving loop: retracted requests are
restored from numpy copies of their pages (counted), not recomputed, with the same tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.errors import InvalidSlotError
from kvjax.serve.kinds import retraction_parts
from kvjax.serve.model import init_params
from kvjax.serve.retraction_extension import RetractionBackupExtension, cpu_tensor_backup
from kvjax.serve.scheduler import Scheduler, ServingReq


def _config(**kw):
    # The demo's cache settings (as tests/serve/test_host_tier_serving.py: compiled shapes are shared)
    return CacheConfig(
        page_size=4, max_total_tokens=96, max_running_requests=16, context_length=1024, chunked_prefill_size=64, **kw
    )


def _serve(spec, params, prompts, **kw):
    sched = Scheduler(spec, build_kv_cache(spec, _config(**kw)), params, max_batch_size=2)
    done = sched.run([ServingReq(i, p, max_new_tokens=40) for i, p in enumerate(prompts)])
    return sched, {r.rid: r.output_ids for r in done}


def test_decode_retraction_restores_cpu_tensor_copies_with_the_same_tokens():
    spec = ModelSpec.preset("tiny")
    params = init_params(spec)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, 12)] for _ in range(4)]
    plain, plain_out = _serve(spec, params, prompts)
    backed, backed_out = _serve(spec, params, prompts, disaggregation_decode_retraction_backup="cpu_tensor")
    assert backed_out == plain_out
    assert plain.extensions == () and plain.stats.retractions > 0  # resolved cpu_tensor, inactive: recompute
    [ext] = backed.extensions
    assert isinstance(ext, RetractionBackupExtension) and ext.retraction.mode == "cpu_tensor"
    assert backed.stats.retractions > 0
    assert ext.retraction.restored > 0 and ext.retraction.restored_tokens > 0
    assert backed.stats.prefill_tokens_computed < plain.stats.prefill_tokens_computed
    assert backed.leak_free() and plain.leak_free() and ext.retraction.held == 0
    backed.cache.tree_cache.sanity_check()


def test_cpu_tensor_extension_attaches_on_a_decode_server_or_when_set():
    spec = ModelSpec.preset("tiny")
    params = init_params(spec)
    assert Scheduler(spec, build_kv_cache(spec, _config()), params).extensions == ()
    # a decode server resolves cpu_tensor when a host_pool condition fails (here: priority preemption)
    decode = _config(disaggregation_mode="decode", enable_priority_scheduling=True)
    [ext] = Scheduler(spec, build_kv_cache(spec, decode), params).extensions
    assert isinstance(ext, RetractionBackupExtension) and ext.retraction.mode == "cpu_tensor"


def test_cpu_tensor_copies_round_trip_pages_in_place_and_refuse_bad_slots():
    spec = ModelSpec.preset("tiny")
    cache = build_kv_cache(spec, _config(disaggregation_decode_retraction_backup="cpu_tensor"))
    layers = cache.pools.kv.kv
    filled = tuple(np.arange(a.size, dtype=np.uint32).reshape(a.shape).astype(a.dtype) for a in layers)
    cache.set_pools(cache.pools.replace(kv=cache.pools.kv.replace(kv=tuple(jnp.asarray(a) for a in filled))))
    backup = cpu_tensor_backup(cache, retraction_parts(cache))
    assert backup.backup("r", np.arange(4, 14), 0, 10)  # pages 1, 2, 3 (a partial last page)
    before = cache.pools.kv.kv[0]
    assert backup.restore("r", np.arange(20, 28), from_token=4)  # pages 2, 3 -> 5, 6
    assert cache.pools.kv.kv[0] is before and not before.is_deleted(), "recorded, not applied behind the caller"
    cache.apply_pending()  # the owner of the step applies it
    assert before.is_deleted(), "the restore writes the pool in place"
    after = [np.asarray(a) for a in cache.pools.kv.kv]
    for layer, want in enumerate(filled):
        np.testing.assert_array_equal(after[layer][5:7], want[2:4])
        np.testing.assert_array_equal(after[layer][:5], want[:5])
    assert backup.restored == 1 and backup.restored_tokens == 6
    with pytest.raises(InvalidSlotError):
        backup.backup("bad", np.arange(0, 4), 0, 4)  # the trash page
    assert "bad" not in backup
