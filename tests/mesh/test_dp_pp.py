"""DP attention over pipeline stages on 8 CPU devices, against Transformers (``kvjax.dp.pipeline``).

Two stages of 4 devices, each stage a ``("data", "tp")`` mesh of 2 DP ranks (``dp_stage_meshes``):
stage 0 holds every rank's tree, allocator, request table and its slice of the first layers'
pools; stage 1 only its layers' pools, stacked per rank the same way. Every rank's batch runs
through stage 0's DP program, its hidden states move to stage 1's devices, and stage 1 samples.

* the tiny Llama (4 layers) at tp 4 per stage (each rank's attention over 2 devices), with overlap
  scheduling (the future tokens stage 1 sampled read by stage 0), a pool small enough per rank that
  the two rounds of ``parity_harness`` reuse prefixes, prefill in chunks, evict and retract;
* the tiny Gemma 3's hybrid sliding-window pools and DeepSeek-V2's MLA latent at tp 2 per stage
  (one device per rank), without overlap.

Each: Transformers' greedy tokens, logits within 1e-4 (float32), both ranks serving, every rank's
memory balance after every round (``tests.mesh.dp_balance``) and leak free, every stage's pools and
weights on its own devices only. Refused by name before anything is allocated: the host tier (a
rank's copies would reach stage 0's layers only), and DP attention through ``build_pipeline_cache``
(one rank's stages).
"""

from __future__ import annotations

import jax
import pytest

from kvjax import CacheConfig
from kvjax.dp import LockstepDPScheduler
from kvjax.dp.pipeline import DPStages, dp_stage_meshes
from kvjax.errors import ConfigError
from kvjax.serve.pipeline_cache import build_pipeline_cache
from tests.mesh.dp_balance import BalancedFront
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds

pytestmark = pytest.mark.mesh

PP, DP = 2, 2
MAX_NEW = 6
ATOL = 1e-4


def _config(tp: int, **fields) -> CacheConfig:
    return CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        pp_size=PP,
        dp_size=DP,
        tp_size=tp,
        enable_dp_attention=True,
        page_size=1,
        max_total_tokens=48,
        max_running_requests=8,
        **fields,
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_checkpoint("llama", tmp_path_factory, label="llama4", num_hidden_layers=4)


@pytest.mark.parametrize(
    ("family", "tp", "overlap"),
    [("llama", 4, True), ("gemma3", 2, False), ("deepseek_v2", 2, False)],
    ids=["llama-overlap", "gemma3", "deepseek_v2"],
)
def test_every_ranks_batch_through_both_stages(family, tp, overlap, request, tmp_path_factory):
    hf, model = request.getfixturevalue("llama") if family == "llama" else family_checkpoint(family, tmp_path_factory)
    config = _config(tp)
    meshes = dp_stage_meshes(config, jax.devices())
    front = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        meshes,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
        overlap=overlap,
    )
    stages = front._dp_step
    assert isinstance(stages, DPStages)
    seen: set = set()
    for s, mesh in enumerate(meshes):
        assert dict(mesh.shape) == {"data": DP, "tp": tp // DP}
        devices = set(mesh.devices.flat)
        assert not devices & seen, "stages share devices"
        seen |= devices
        pools = front.cache.pools if s == 0 else stages.stage_pools[s]
        for leaf in jax.tree.leaves(pools) + jax.tree.leaves(stages.params[s]):
            assert leaf.sharding.device_set <= devices, f"stage {s}: an array off its devices"
    done = serve_two_rounds(BalancedFront(front), MAX_NEW)  # type: ignore[arg-type]
    assert sorted(set(front.rank_of.values())) == [0, 1], front.rank_of
    stats = [s.stats for s in front.schedulers]
    assert sum(st.cached_tokens for st in stats) > 0 and sum(st.evicted_tokens for st in stats) > 0
    assert sum(st.prefill_steps for st in stats) > len(done), "prompts longer than a chunk prefill in chunks"
    if family == "llama":
        assert sum(st.retractions for st in stats) > 0, "the pool should be small enough to retract"
    for scheduler in front.schedulers:
        scheduler.cache.tree_cache.sanity_check()
        assert scheduler.leak_free()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_the_host_tier_and_one_ranks_pipeline_are_refused_before_anything_is_allocated(llama):
    _, model = llama
    config = _config(4, enable_hierarchical_cache=True)
    before = len(jax.live_arrays())
    with pytest.raises(ConfigError, match="enable_hierarchical_cache"):
        LockstepDPScheduler.build_lockstep(
            model.spec, config, model.params, dp_stage_meshes(config, jax.devices()), model_config=model.config
        )
    with pytest.raises(ConfigError, match="enable_dp_attention"):
        build_pipeline_cache(model.spec, _config(4), devices=jax.devices())
    assert len(jax.live_arrays()) == before, "arrays were allocated before the refusal"
