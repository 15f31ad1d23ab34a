"""The host tier (HiCache) over pipeline stages: every stage's layers backed up and loaded back.

The tiny random-weight Llama (4 layers) and Gemma 3 (4 layers, sliding and full) are served at
pp 2 with the host tier over a device pool small enough that prefixes are evicted to the host and
loaded back (``serve_with_host_loads`` asserts a load). Each stage has host pools of its own layers
on stage 0's host slot allocators, and the tree's engine copies every stage's pages; the loads are
applied by each stage before its step. Tokens equal Transformers' greedy ``generate``, logits
agree within 1e-4 (float32), and the device and host accounting balance (leak free).
"""

from __future__ import annotations

import jax
import pytest

from kvjax import CacheConfig
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_stepping import pipeline_scheduler
from kvjax.transfers.draft_pools import PairedCopyEngine
from tests.mesh import sharded_host_tier
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers

pytestmark = pytest.mark.mesh

MAX_NEW = 6
ATOL = 1e-4


def host_tier_stages(model, pp: int):
    """A logits-recording scheduler over ``pp`` stages with the host tier (8x a 64-token pool)."""
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        pp_size=pp,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
    sched = pipeline_scheduler(
        model.config,
        pipeline,
        model.params,
        micro_batches=2,
        max_batch_size=2,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    return pipeline, sched


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_host_tier_loads_back_every_stage(family, tmp_path_factory):
    extra = {"num_hidden_layers": 4} if family == "llama" else {}
    hf, model = family_checkpoint(family, tmp_path_factory, label=f"{family}_pp_host", **extra)
    pipeline, sched = host_tier_stages(model, 2)
    engine = sched.cache.tree_cache.host.engine
    assert isinstance(engine, PairedCopyEngine) and len(engine.followers) == 1
    done = sharded_host_tier.serve_with_host_loads(sched, MAX_NEW)  # asserts loads, leak free, host balanced
    # Stage 1's loads were recorded on its own queue and applied before its step.
    assert pipeline.pending[1].applied > 0 and pipeline.pending[1].count == 0
    assert all(p.count == 0 for p in pipeline.pending)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
