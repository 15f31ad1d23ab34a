"""The retraction backup, the storage tier and a host tier sized in bytes over pipeline stages.

The tiny random-weight Llama (4 layers), Gemma 3 (4 layers, sliding and full) and DeepSeek-V2
(MLA's latent; the host tier, the storage tier and the ``cpu_tensor`` backup at once) are served at
pp 2 through caches small enough (page size 1, 64 tokens) that the parity rounds reuse prefixes,
prefill in chunks, evict and retract (each asserted):

* the ``cpu_tensor`` retraction backup: every stage's pages copied aside and written back into the
  same fresh slots (``kvjax.serve.pipeline_retraction``), restored requests counted;
* the ``host_pool`` retraction backup with the host tier: every stage's pages backed up into the
  same held host slots and loaded back (the stages' paired copy engine); both backups' restores
  also checked page by page on every stage's pool;
* the storage tier: a server at pp 2 stores pages of every stage's layers (its key lists layers
  0-3), and cold servers at pp 2 and at pp 1 serve the prompts again from storage (storage ->
  host -> every stage's devices);
* a host tier sized in bytes (``hicache_size``): every stage's host pool gets the slots of the
  largest stage's bytes per token (checked over 3 uneven stages; Gemma 3 served over 2).

Tokens equal Transformers' greedy ``generate``, logits agree within 1e-4 (float32), and the device
and host accounting balance afterwards (leak free).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from kvjax import CacheConfig
from kvjax.plan import plan_kv_cache
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_retraction import StagedRetractionBackup, staged_cpu_tensor_backup
from kvjax.serve.pipeline_stepping import pipeline_scheduler
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.transfers.retraction_backup import RetractionBackup
from tests.mesh import sharded_host_tier
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    build_scheduler,
    prompts,
    serve_two_rounds,
)

pytestmark = pytest.mark.mesh

MAX_NEW = 6
ATOL = 1e-4
#: What every cache here shares (so the stages' compiled steps are shared across the tests).
SMALL = dict(page_size=1, max_total_tokens=64, max_running_requests=8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_checkpoint("llama", tmp_path_factory, label="llama_pp_tiers", num_hidden_layers=4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return family_checkpoint("gemma3", tmp_path_factory, label="gemma3_pp_tiers")


def stages(model, **cache_config) -> Scheduler:
    """A logits-recording scheduler over 2 stages of one device each (``SMALL`` cache, then
    ``cache_config``), 4 rows in 2 micro-batches."""
    config = CacheConfig(context_length=CONTEXT_LENGTH, chunked_prefill_size=CHUNK, pp_size=2, **SMALL, **cache_config)
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
    return pipeline_scheduler(
        model.config,
        pipeline,
        model.params,
        micro_batches=2,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )


def host_extension(sched: Scheduler) -> HostTierExtension:
    return next(e for e in sched.extensions if isinstance(e, HostTierExtension))


def assert_retracted_and_evicted(sched: Scheduler) -> None:
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st


def _fill_every_stage(pipeline, seed: int) -> list[list[np.ndarray]]:
    """Random values in every layer of every stage's KV pool (handed in as its state); per stage,
    the layers' values."""
    from kvjax.transfers.device_pages import page_layers, with_page_layers

    rng = np.random.default_rng(seed)
    values = []
    for s in range(pipeline.pp_size):
        pools = pipeline.pools(s)
        layers = page_layers(pools.kv)
        new = [rng.standard_normal(x.shape).astype(np.float32) for x in layers]
        placed = tuple(jax.device_put(v, x.sharding) for v, x in zip(new, layers, strict=True))
        pipeline.states[s].store(pools.replace(kv=with_page_layers(pools.kv, placed)))
        values.append(new)
    return values


@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_a_retraction_backup_restores_every_stages_pages(mode, llama):
    """A request's device pages 1 and 2 backed up (every stage's layers) and restored into pages 8
    and 9: on every stage, pages 8 and 9 then hold what pages 1 and 2 held, nothing is held."""
    from kvjax.transfers.device_pages import page_layers

    _, model = llama
    config = CacheConfig(context_length=CONTEXT_LENGTH, pp_size=2, enable_hierarchical_cache=True, **SMALL)
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
    before = _fill_every_stage(pipeline, seed=5)
    if mode == "host_pool":
        backup = RetractionBackup("host_pool", 1, host=pipeline.cache.tree_cache.host)
    else:
        backup = staged_cpu_tensor_backup(pipeline)
    assert backup.backup("q", np.arange(1, 3), 0, 2)
    assert backup.restore("q", np.arange(8, 10))
    after = [pipeline.apply_pending(s, pipeline.pools(s)) for s in range(2)]
    backup.poll(wait=True)
    assert backup.restored == 1 and backup.held == 0
    for s, pools in enumerate(after):
        for old, new in zip(before[s], page_layers(pools.kv), strict=True):
            np.testing.assert_array_equal(np.asarray(new)[8:10], old[1:3], err_msg=f"stage {s}")


def test_llama_cpu_tensor_retraction_backup_restores_every_stage(llama):
    hf, model = llama
    sched = stages(model, disaggregation_decode_retraction_backup="cpu_tensor")
    [ext] = sched.extensions
    assert isinstance(ext, RetractionBackupExtension) and isinstance(ext.retraction, StagedRetractionBackup)
    done = serve_two_rounds(sched, MAX_NEW)  # asserts leak free
    assert_retracted_and_evicted(sched)
    backup = ext.retraction
    assert backup.restored > 0 and backup.restored_tokens > 0, "retracted requests should be restored"
    assert all(b.restored == backup.restored for b in backup.stages), "every stage restores the same requests"
    assert backup.held == 0 and all(b.held == 0 for b in backup.stages)
    pipe = sched.stepping.pipeline
    assert pipe.pending[1].applied > 0 and all(q.count == 0 for q in pipe.pending)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_llama_host_pool_retraction_backup_over_stages(llama):
    hf, model = llama
    sched = stages(
        model, enable_hierarchical_cache=True, hicache_ratio=8.0, disaggregation_decode_retraction_backup="host_pool"
    )
    done = serve_two_rounds(sched, MAX_NEW)
    assert_retracted_and_evicted(sched)
    host = host_extension(sched)
    assert host.retraction is not None and host.retraction.backed_up > 0, "retracted requests should be backed up"
    sched.cache.tree_cache.check_transfers(wait=True)
    host.retraction.poll(wait=True)
    assert host.retraction.held == 0 and host.host_balanced()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _storage(directory) -> dict:
    return dict(
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=8,
    )


def _serve_again_from_storage(sched: Scheduler, hf, names: tuple[str, ...]) -> None:
    """A cold server serves ``names`` from the store: prefetched, loaded, Transformers' tokens."""
    p = prompts()
    reqs = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in names]
    sched.run(reqs)
    ext = host_extension(sched)
    assert ext.prefetched_tokens > 0 and sched.stats.cached_tokens > 0, "the cold server should hit storage"
    sched.cache.tree_cache.check_transfers(wait=True)
    assert sched.leak_free() and ext.host_balanced()
    assert_matches_transformers(hf, {str(r.rid): r for r in reqs}, max_new=MAX_NEW, atol=ATOL)


def test_llama_storage_tier_stores_every_stages_layers(llama, tmp_path):
    hf, model = llama
    storage = _storage(tmp_path)
    fingerprint = {"hicache_storage_model_fingerprint": model.fingerprint}
    first = stages(model, **storage, **fingerprint)
    done = sharded_host_tier.serve_with_host_loads(first, MAX_NEW)  # evicted to the host and back
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
    tree = first.cache.tree_cache
    tree.storage.check_writes(wait=True)
    tree.storage.storage.flush()
    assert tree.storage.pages_backed_up > 0
    [record] = [json.loads(f.read_text()) for f in tmp_path.glob("*/key.json")]
    assert record["layers"] == [0, 1, 2, 3] and record["page_shape"][0] == 4, record

    names = ("a", "chat1")
    _serve_again_from_storage(stages(model, **storage, **fingerprint), hf, names)
    # One stage reads the same pages: the key names the model's layers, not the stages.
    one = build_scheduler(model, max_batch_size=4, **SMALL, **storage, **fingerprint)
    _serve_again_from_storage(one, hf, names)


def test_deepseek_v2_cpu_tensor_backup_host_tier_and_storage_over_stages(tmp_path_factory, tmp_path):
    """MLA's latent over 2 stages: retracted requests restored from every stage's ``cpu_tensor``
    backup; then with the host tier and the storage tier, prefixes evicted to the host and loaded
    back, pages of every stage's layers stored, and a cold server at pp 2 serving the prompts
    again from storage."""
    hf, model = family_checkpoint("deepseek_v2", tmp_path_factory, label="deepseek_v2_pp_tiers")
    sched = stages(model, disaggregation_decode_retraction_backup="cpu_tensor")
    done = serve_two_rounds(sched, MAX_NEW)  # asserts leak free
    assert_retracted_and_evicted(sched)
    [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
    backup = ext.retraction
    assert isinstance(backup, StagedRetractionBackup) and backup.restored > 0
    assert all(b.restored == backup.restored and b.held == 0 for b in backup.stages)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)

    storage = {**_storage(tmp_path), "hicache_storage_model_fingerprint": model.fingerprint}
    first = stages(model, **storage)
    done = sharded_host_tier.serve_with_host_loads(first, MAX_NEW)  # evicted to the host and back
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
    tree = first.cache.tree_cache
    tree.storage.check_writes(wait=True)
    tree.storage.storage.flush()
    assert tree.storage.pages_backed_up > 0
    _serve_again_from_storage(stages(model, **storage), hf, ("a", "chat1"))


def _host_pools(pipeline) -> list:
    """Every stage's host pool (stage 0's, then the paired engine's followers'; of a sliding-window
    engine its sliding part's, whose slots are its full part's)."""
    followers = pipeline.cache.tree_cache.host.engine.followers
    return [pipeline.cache.host_pool, *(getattr(e, "swa", e).host_pool for e in followers)]


def _gb_for(tokens: float, bytes_per_token: int) -> float:
    return tokens * bytes_per_token / 1e9


def test_a_host_tier_sized_in_bytes_gives_every_stage_the_largest_stages_slots(llama):
    """4 layers over 3 stages (2, 1 and 1 layers): every stage's host pool has the slots the bytes
    give the first (largest) stage, the stages' minimum, as SGLang's ``sync_fixed_hicache_size``."""
    _, model = llama
    config = CacheConfig(context_length=CONTEXT_LENGTH, pp_size=3, platform="cpu", **SMALL)
    per_token = [plan_kv_cache(model.spec, config.replace(pp_rank=s)).bytes_per_token for s in range(3)]
    assert per_token[0] == 2 * per_token[1] == 2 * per_token[2], per_token
    size_gb = _gb_for(300.5, per_token[0])  # 300 tokens of stage 0, 601 of the others
    pipeline = build_pipeline_cache(
        model.spec, config.replace(enable_hierarchical_cache=True, hicache_size=size_gb), devices=jax.devices()
    )
    assert [p.size for p in _host_pools(pipeline)] == [301] * 3


def test_gemma3_host_tier_sized_in_bytes_over_stages(gemma3):
    hf, model = gemma3
    config = CacheConfig(context_length=CONTEXT_LENGTH, pp_size=2, platform="cpu", **SMALL)
    per_token = max(plan_kv_cache(model.spec, config.replace(pp_rank=s)).bytes_per_token for s in range(2))
    sched = stages(model, enable_hierarchical_cache=True, hicache_size=_gb_for(512.5, per_token))
    assert [p.size for p in _host_pools(sched.stepping.pipeline)] == [513] * 2
    done = sharded_host_tier.serve_with_host_loads(sched, MAX_NEW)  # asserts loads, leak free, host balanced
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
