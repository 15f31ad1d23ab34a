"""Decode context parallelism inside pipeline stages over 8 CPU devices, against Transformers.

Each of 2 stages is a DCP TP group of its own (``pipeline_meshes(..., dcp_size)``: the stage's row
of devices laid out ``("tp", "dcp")``), holding its layers' pools striped by token over ``"dcp"``
(the allocator's page ``page_size * dcp_size``, stage 0's allocator and tree driving both stages,
so a striped slot means the same token on every stage) and its weights split over the whole group:

* the tiny Llama (4 layers, 2 KV heads) at tp 2 x dcp 2 per stage: one ``"tp"`` rank, so the KV
  heads TP would replicate are striped instead;
* the tiny DeepSeek-V2's MLA latent at tp 4 x dcp 2 per stage (latent striped over 2 ranks, query
  heads over 4).

Both through one cache small enough that the two rounds of ``parity_harness`` reuse prefixes,
prefill in chunks, evict and retract (each asserted), with two micro-batches and overlap
scheduling: Transformers' greedy tokens, logits within 1e-4 (float32), leak free, every stage's
arrays on its own group's devices, each device holding its rank's rows of every striped page.
"""

from __future__ import annotations

import jax
import pytest

from kvjax import CacheConfig
from kvjax.pools import MHAKVPool, MLAKVPool
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_stepping import pipeline_scheduler
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds

pytestmark = pytest.mark.mesh

PP, DCP, PAGE = 2, 2, 1
MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_checkpoint("llama", tmp_path_factory, label="llama4", num_hidden_layers=4)


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory):
    return family_checkpoint("deepseek_v2", tmp_path_factory)


@pytest.mark.parametrize(
    ("family", "tp", "pool_type"), [("llama", 2, MHAKVPool), ("deepseek_v2", 4, MLAKVPool)], ids=["llama", "mla"]
)
def test_striped_stages_reuse_chunk_evict_and_retract(family, tp, pool_type, request):
    hf, model = request.getfixturevalue(family)
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        pp_size=PP,
        tp_size=tp,
        dcp_size=DCP,
        page_size=PAGE,
        max_total_tokens=64,
        max_running_requests=8,
    )
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
    sched = pipeline_scheduler(
        model.config,
        pipeline,
        model.params,
        micro_batches=2,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    assert sched.alloc.page_size == PAGE * DCP, "the allocator's page is the striped page"
    seen: set = set()
    for s, mesh in enumerate(pipeline.meshes):
        assert dict(mesh.shape) == {"tp": tp // DCP, "dcp": DCP}, f"stage {s}: {dict(mesh.shape)}"
        devices = set(mesh.devices.flat)
        assert not devices & seen, "stages share devices"
        seen |= devices
        pool = pipeline.pools(s).kv
        assert isinstance(pool, pool_type) and pool.context_axis == "dcp"
        layer = pool.kv[0]
        assert layer.sharding.device_set == devices
        assert {shard.data.shape[1] for shard in layer.addressable_shards} == {PAGE}, "a device holds its rank's rows"
    done = serve_two_rounds(sched, MAX_NEW)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert st.prefill_steps > len(done), "prompts longer than a chunk prefill in chunks"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
