"""Decode context parallelism over 8 CPU devices gives Transformers' tokens and logits.

DCP divides the TP group (``--tp T --dcp D``: a ``("tp", "dcp")`` mesh of ``T`` devices, ``T / D``
x ``D``; weights and query heads split over all ``T``). The tiny random-weight Llama (the parity
tests' own config, ``tests/serve``: 4 query heads, 2 KV heads) is served at tp 4 x dcp 2 (its
KV heads over the 2 ``"tp"`` ranks, its tokens striped over 2) and tp 2 x dcp 2 (one ``"tp"``
rank: the KV heads TP would replicate striped instead); the tiny DeepSeek-V2 with its MLA latent
(which TP replicates) striped over 4 ranks at tp 4 x dcp 4 and over 2 at tp 4 x dcp 2; the
tiny Gemma 3's sliding window over one striped full-size pool at tp 2 x dcp 2. Llama and
DeepSeek run through one cache small enough that the two rounds of ``parity_harness`` reuse
prefixes, prefill in chunks, evict and retract (each asserted). Tokens must equal Transformers'
greedy ``generate`` and logits agree within 1e-4 (float32); the cache ends leak free, every pool
array lies on the TP group's devices, each device holds its rank's rows of every page only, and
the weights are split over the whole group.
"""

from __future__ import annotations

import jax
import pytest

from kvjax.mesh_check import make_serving_mesh
from kvjax.pools import MHAKVPool, MLAKVPool
from tests.mesh.tp_serving import family_checkpoint
from tests.serve import swa_parity
from tests.serve.parity_harness import assert_matches_transformers, build_scheduler, serve_two_rounds

MAX_NEW = 6
ATOL = 1e-4
PAGE = 1


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory):
    return family_checkpoint("deepseek_v2", tmp_path_factory)


def _scheduler(model, dcp: int, tp: int):
    """``build_scheduler`` over the ``("tp", "dcp")`` mesh of ``tp`` devices, on a pool small enough (64 tokens of pages
    of ``PAGE`` rows per rank, 8 running requests) that the two rounds evict and retract."""
    mesh = make_serving_mesh(tp, dcp_size=dcp, devices=jax.devices())
    return build_scheduler(
        model, mesh=mesh, tp_size=tp, dcp_size=dcp, page_size=PAGE, max_total_tokens=64, max_running_requests=8
    )


def _assert_reused_evicted_retracted_as_transformers(hf, sched, done) -> None:
    """The rounds reused prefixes, evicted and retracted; the tokens and logits are Transformers'."""
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _assert_weights_over_the_tp_group(sched, tp: int) -> None:
    """The query projection is split over all ``tp`` devices (``("tp", "dcp")`` jointly)."""
    q_proj = next(
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(sched.params)
        if "q_proj" in jax.tree_util.keystr(path) or "q_b_proj" in jax.tree_util.keystr(path)
    )
    assert len(q_proj.sharding.device_set) == tp
    assert {shard.data.shape[0] for shard in q_proj.addressable_shards} == {q_proj.shape[0] // tp}


@pytest.mark.parametrize(("tp", "dcp"), [(4, 2), (2, 2)])
def test_llama_reuse_chunked_prefill_eviction_and_retraction(tp, dcp, llama):
    hf, model = llama
    sched = _scheduler(model, dcp, tp)
    pool = sched.cache.pools.kv
    assert isinstance(pool, MHAKVPool) and pool.context_axis == "dcp"
    assert sched.alloc.page_size == PAGE * dcp and sched.cache.plan.tree_page_size == PAGE * dcp
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.mesh is not None and dict(sched.mesh.shape) == {"tp": tp // dcp, "dcp": dcp}
    layer = sched.cache.pools.kv.kv[0]
    assert len(layer.sharding.device_set) == tp
    _assert_weights_over_the_tp_group(sched, tp)
    assert {shard.data.shape[1] for shard in layer.addressable_shards} == {PAGE}, "a device holds its rank's rows"
    _assert_reused_evicted_retracted_as_transformers(hf, sched, done)


@pytest.mark.parametrize(("tp", "dcp"), [(4, 4), (4, 2)])
def test_deepseek_v2_latent_striped_over_dcp_heads_over_tp(tp, dcp, deepseek_v2):
    hf, model = deepseek_v2
    sched = _scheduler(model, dcp, tp)
    done = serve_two_rounds(sched, MAX_NEW)
    pool = sched.cache.pools.kv
    assert isinstance(pool, MLAKVPool) and pool.context_axis == "dcp"
    assert len(pool.kv[0].sharding.device_set) == tp
    assert {shard.data.shape[1] for shard in pool.kv[0].addressable_shards} == {PAGE}
    _assert_weights_over_the_tp_group(sched, tp)
    _assert_reused_evicted_retracted_as_transformers(hf, sched, done)


def test_gemma3_sliding_window_on_a_full_size_pool_masks_global_positions(tmp_path_factory):
    """The window is a mask on global positions over the striped full-size pool
    (``disable_hybrid_swa_memory``; the hybrid SWA pools striped: ``tests/mesh/test_dcp_swa.py``)."""
    hf, model = family_checkpoint("gemma3", tmp_path_factory)
    mesh = make_serving_mesh(2, dcp_size=2, devices=jax.devices())
    sched, done = swa_parity.serve(
        model, page_size=PAGE, max_total_tokens=256, hybrid=False, mesh=mesh, tp_size=2, dcp_size=2
    )
    assert sched.cache.pools.kv.context_axis == "dcp"
    assert max(len(r.origin_input_ids) for r in done.values()) > hf.config.sliding_window, "prompts pass the window"
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)
