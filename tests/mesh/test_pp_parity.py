"""Pipeline parallelism over 8 CPU devices gives Transformers' tokens and logits.

The tiny random-weight Llama (the parity tests' own config, ``tests/serve``; with 4 layers for 4
stages) is served over 2 and 4 pipeline stages of one device and over 2 stages of 2 TP devices,
and the tiny Gemma 3 (4 layers, sliding and full) over 2 and 4 stages, through one cache small
enough that the two rounds of ``parity_harness`` reuse prefixes, prefill in chunks, evict and
retract (each asserted), with one micro-batch and with two, with overlap scheduling and without.
Tokens must equal Transformers' greedy ``generate`` and logits agree within 1e-4 (float32), with
the radix cache (warm) and without it (cold); the cache ends leak free; each stage's devices hold
only its own layers' pools and weights.
"""

from __future__ import annotations

import jax
import pytest

from kvjax import CacheConfig
from kvjax.plan.sizing import stage_bounds
from kvjax.pools import SWAKVPool
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_retraction import StagedRetractionBackup
from kvjax.serve.pipeline_stepping import PipelineStages, pipeline_scheduler
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds

MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_checkpoint("llama", tmp_path_factory, label="llama4", num_hidden_layers=4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return family_checkpoint("gemma3", tmp_path_factory)


def stage_scheduler(model, pp: int, tp: int = 1, micro_batches: int = 1, overlap: bool = True, **cache_config):
    """A logits-recording scheduler over ``pp`` stages of ``tp`` devices (small cache: the rounds
    reuse, chunk, evict and retract; ``overlap``: overlap scheduling)."""
    cache_config = {"max_total_tokens": 64, "max_running_requests": 8, **cache_config}
    config = CacheConfig(
        context_length=CONTEXT_LENGTH, chunked_prefill_size=CHUNK, pp_size=pp, tp_size=tp, **cache_config
    )
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
    return pipeline_scheduler(
        model.config,
        pipeline,
        model.params,
        micro_batches=micro_batches,
        overlap=overlap,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )


def assert_stages_hold_their_own(sched: Scheduler, num_layers: int) -> None:
    """Each stage's pool arrays and weights lie on its devices only, and its pools serve its layers."""
    stepping = sched.stepping
    assert isinstance(stepping, PipelineStages)
    pipe = stepping.pipeline
    seen: set = set()
    for s, mesh in enumerate(pipe.meshes):
        devices = set(mesh.devices.flat)
        assert not devices & seen, "stages share devices"
        seen |= devices
        for leaf in jax.tree.leaves(pipe.pools(s)) + jax.tree.leaves(stepping.stage_params[s]):
            assert leaf.sharding.device_set == devices, f"stage {s}: an array off its devices"
        start, end = stage_bounds(num_layers, pipe.pp_size, s)
        pools = pipe.pools(s)
        served = sorted(i for name in pools.names for i in _layer_ids(pools[name]))
        assert served == list(range(start, end)), f"stage {s} pools serve layers {served}, not [{start}, {end})"
        layers = {k for k in stepping.stage_params[s]["model"] if k.startswith("layers_")}
        assert layers == {f"layers_{i}" for i in range(start, end)}, f"stage {s} holds weights {sorted(layers)}"


def _layer_ids(pool) -> list[int]:
    """The global layers a pool serves (a hybrid SWA pool: both its sub-pools')."""
    if isinstance(pool, SWAKVPool):  # its sub-pools index their layers locally: the layer counts
        assert pool.swa.num_layers == len(pool.swa_layer_ids)
        assert (pool.full.num_layers if pool.full is not None else 0) == len(pool.full_layer_ids)
        return [*pool.full_layer_ids, *pool.swa_layer_ids]
    ids = getattr(pool, "layer_ids", None)
    if ids:
        return list(ids)
    return list(range(pool.start_layer, pool.start_layer + pool.num_layers))


@pytest.mark.parametrize(("pp", "tp", "micro", "overlap"), [(2, 1, 2, True), (4, 1, 2, True), (2, 2, 1, False)])
def test_llama_reuse_chunked_prefill_eviction_and_retraction(pp, tp, micro, overlap, llama):
    hf, model = llama
    sched = stage_scheduler(model, pp, tp, micro, overlap)
    done = serve_two_rounds(sched, MAX_NEW)  # asserts leak free
    assert_stages_hold_their_own(sched, 4)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_cold_equals_warm(llama):
    """Without the radix cache (cold: every prompt computed) the stages serve Transformers' tokens
    too, so cold == warm (the warm runs above share prefixes)."""
    hf, model = llama
    sched = stage_scheduler(model, 2, disable_radix_cache=True)
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.stats.cached_tokens == 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


@pytest.mark.parametrize("pp", [2, 4])
def test_gemma3_hybrid_sliding_window_over_stages(pp, gemma3):
    """At pp 4 (one layer a stage) and pages of 4 tokens (room to restore in the small pool),
    retracted requests are restored from the ``cpu_tensor`` backup of every stage: the sliding
    stages' pages of the window, the full layer's stage's pages of every token."""
    hf, model = gemma3
    backup = {"disaggregation_decode_retraction_backup": "cpu_tensor", "page_size": 4} if pp == 4 else {}
    sched = stage_scheduler(model, pp, micro_batches=2, **backup)
    done = serve_two_rounds(sched, MAX_NEW)
    assert_stages_hold_their_own(sched, 4)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    if backup:
        [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
        staged = ext.retraction
        assert isinstance(staged, StagedRetractionBackup)
        copied = [[p.target for p in b.parts] for b in staged.stages]
        assert copied == [["swa.swa"], ["swa.swa"], ["swa.full"], ["swa.swa"]], "each stage copies its own side"
        assert staged.restored > 0 and all(b.restored == staged.restored for b in staged.stages), st
        assert staged.held == 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
