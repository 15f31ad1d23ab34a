"""Gemma 3's hybrid sliding-window pools striped over decode-context-parallel (DCP) ranks.

Under ``--tp T --dcp D`` both pools of the hybrid cache (``SWAKVPool``: the full layers' pool and
the sliding layers' smaller pool) are striped by token over the ``D`` ranks as the full kind's
pool is (``kvjax.alloc.dcp``): both allocators of ``SWATokenToKVPoolAllocator`` hand out striped
pages of ``page_size * D`` slots, and the full→SWA pairing keeps a slot's offset within its page,
so a token's sliding row lies on the same rank (``offset % D``) as its full row. Sliding layers
attend their rows with the window masked on global positions and merge the ranks' partials with
their log-sum-exp, as the full layers do.

The tiny random-weight Gemma 3 (window 8, three sliding layers and one full one) is served through
the parity harness's two rounds on pools small enough to reuse prefixes, prefill in chunks, evict
from both pools, free out-of-window sliding pages at decode and retract (each asserted), with
overlap scheduling: at tp 2 x dcp 2, and at tp 4 x dcp 2 (KV heads over 2 ``"tp"`` ranks) with
the ``cpu_tensor`` retraction backup restoring retracted requests from copies of both sides; with
pages of 2 rows per rank on roomy pools (prefixes reused across the window, tombstones); and
with the host tier at tp 2 x dcp 2, evicted prefixes going to the two host pools and coming back;
with DP attention (``--dp 2 --tp 8 --dcp 2``: each rank's pools striped over its own ``"dcp"``
pair); over 2 pipeline stages of tp 2 x dcp 2; with a STANDALONE draft whose pool is striped as
the target's, rejected proposals rolled back on both allocators. Tokens equal Transformers' greedy
``generate`` and logits agree within 1e-4; the cache ends leak free on both allocators, the
allocator's and the tree's invariants hold. ``generate --model DIR --tp 2 --dcp 2`` gives the
single-device tokens (Transformers'), and so does ``launch --processes 2 -- generate --tp 4 --dcp
2``. Slow: gpt-oss (attention sinks) and Mistral (every layer sliding: one striped SWA pool, the
pure SWA tree) at tp 2 x dcp 2.
"""

from __future__ import annotations

import jax
import pytest

from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.mesh_check import make_serving_mesh
from kvjax.pools import SWAKVPool
from tests.mesh.tp_serving import family_checkpoint
from tests.serve import swa_parity
from tests.serve.parity_harness import assert_matches_transformers
from tests.serve.test_speculative_swa import family as family  # noqa: F401, PLC0414  (the fixture)

PAGE = 1


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return family_checkpoint("gemma3", tmp_path_factory)


def _assert_both_pools_striped(sched, tp: int, dcp: int) -> None:
    """Both allocators hand out striped pages; both pools lie over the TP group, each device
    holding its rank's rows of every page."""
    alloc = sched.cache.token_to_kv_pool_allocator
    assert isinstance(alloc, SWATokenToKVPoolAllocator)
    assert alloc.page_size == PAGE * dcp and alloc.swa_attn_allocator.page_size == PAGE * dcp
    pool = sched.cache.pools.swa
    assert isinstance(pool, SWAKVPool) and pool.full is not None
    for side in (pool.full, pool.swa):
        assert side.context_axis == "dcp" and side.page_size == PAGE * dcp
        assert len(side.kv[0].sharding.device_set) == tp
        assert {shard.data.shape[1] for shard in side.kv[0].addressable_shards} == {PAGE}


@pytest.mark.parametrize(("tp", "dcp", "backup"), [(2, 2, None), (4, 2, "cpu_tensor")])
def test_gemma3_hybrid_pools_striped_reuse_chunk_evict_window_free_and_retract(tp, dcp, backup, gemma3):
    hf, model = gemma3
    mesh = make_serving_mesh(tp, dcp_size=dcp, devices=jax.devices())
    extra = {} if backup is None else {"disaggregation_decode_retraction_backup": backup}
    sched, done = swa_parity.serve(
        model, page_size=PAGE, max_total_tokens=64, mesh=mesh, tp_size=tp, dcp_size=dcp, **extra
    )  # leak free on both allocators, the tree's and the allocator's invariants checked
    _assert_both_pools_striped(sched, tp, dcp)
    evicted = sched.evicted_per_pool  # type: ignore[attr-defined]
    st = sched.stats
    assert st.cached_tokens > 0 and evicted["full"] > 0 and evicted["swa"] > 0 and st.retractions > 0, (st, evicted)
    assert sched.extensions[0].freed_swa_tokens > 0, "decode should free out-of-window sliding pages"
    assert max(len(r.origin_input_ids) for r in done.values()) > hf.config.sliding_window, "prompts pass the window"
    if backup is not None:
        from kvjax.serve.retraction_extension import RetractionBackupExtension

        [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
        assert ext.retraction.restored > 0 and ext.retraction.held == 0, "retracted requests restored, not recomputed"
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def test_gemma3_two_rows_per_rank_reuse_across_the_window_with_tombstones(gemma3):
    """Pages of 2 rows per rank (striped pages of 4 slots) on roomy pools: prefixes reused across
    the window, out-of-window sliding pages freed at decode and left as tombstones in the tree."""
    hf, model = gemma3
    mesh = make_serving_mesh(2, dcp_size=2, devices=jax.devices())
    sched, done = swa_parity.serve(model, page_size=2, max_total_tokens=1024, mesh=mesh, tp_size=2, dcp_size=2)
    assert sched.alloc.page_size == 4 and sched.cache.pools.swa.swa.page_size == 4
    assert (done["chat2"].first_cached_tokens or 0) >= 16 and (done["d"].first_cached_tokens or 0) >= 16
    assert sched.extensions[0].freed_swa_tokens > 0, "decode should free out-of-window sliding pages"
    tree = sched.cache.tree_cache
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes()), "the tree should hold SWA tombstones"
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def test_gemma3_host_tier_loads_striped_pages_of_both_pools_back(gemma3):
    """Prefixes evicted from both striped pools go to the two host pools (one host slot id for
    both sides, every rank's rows of a page once) and come back on a hit, the sliding side for the
    last window only; the host and device accounting balance."""
    from kvjax.radix import HiSWARadixCache
    from kvjax.serve.host_tier import HostTierExtension
    from tests.serve.parity_harness import host_tier_scheduler, serve_batches_through_the_host

    hf, model = gemma3
    mesh = make_serving_mesh(2, dcp_size=2, devices=jax.devices())
    sched = host_tier_scheduler(model, mesh=mesh, tp_size=2, dcp_size=2, max_batch_size=2)
    _assert_both_pools_striped(sched, 2, 2)
    tree = sched.cache.tree_cache
    assert isinstance(tree, HiSWARadixCache)
    assert sched.cache.host_pools[swa_parity.SWA_HOST_POOL_NAME].size == sched.cache.host_pool.size
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    done = serve_batches_through_the_host(sched, swa_parity.MAX_NEW)
    tree.check_transfers(wait=True)
    assert host.loads > 0 and host.loaded_tokens > 0, "a prefix should come back from the host"
    assert sched.leak_free() and host.host_balanced()
    tree.sanity_check()
    sched.cache.token_to_kv_pool_allocator.check_invariants()
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def test_gemma3_dp_attention_ranks_each_stripe_both_pools(gemma3):
    """``--dp 2 --tp 8 --dcp 2``: each DP rank's hybrid pools striped over its 2 ``"dcp"``
    devices, its own allocators and tree; both ranks serve, reuse, evict and retract."""
    from kvjax import CacheConfig
    from kvjax.dp import LockstepDPScheduler
    from tests.mesh.dp_balance import BalancedFront
    from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, serve_two_rounds

    hf, model = gemma3
    dp, tp, dcp = 2, 8, 2
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=PAGE,
        max_total_tokens=64,
        max_running_requests=8,
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=True,
        dcp_size=dcp,
    )
    mesh = make_serving_mesh(tp, dp, True, devices=jax.devices(), dcp_size=dcp)
    front = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
    )
    done = serve_two_rounds(BalancedFront(front), swa_parity.MAX_NEW)  # type: ignore[arg-type]
    rank_view = jax.tree_util.tree_unflatten(front.cache.layout.rank_pools, jax.tree.leaves(front.cache.pools))
    assert rank_view.swa.full.context_axis == "dcp" and rank_view.swa.swa.context_axis == "dcp"
    for s in front.schedulers:
        alloc = s.cache.token_to_kv_pool_allocator
        assert isinstance(alloc, SWATokenToKVPoolAllocator) and alloc.page_size == PAGE * dcp
        alloc.check_invariants()
    assert sorted(set(front.rank_of.values())) == [0, 1], front.rank_of
    assert [s.leak_free() for s in front.schedulers] == [True, True]
    stats = [s.stats for s in front.schedulers]
    assert sum(st.cached_tokens for st in stats) > 0 and sum(st.evicted_tokens for st in stats) > 0, stats
    assert sum(st.retractions for st in stats) > 0, stats
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def test_gemma3_pipeline_stages_each_stripe_their_pools(gemma3):
    """``--pp 2 --tp 2 --dcp 2``: each stage's hybrid pools (its layers' sides) striped over its
    own ``("tp", "dcp")`` group, stage 0's allocators and tree driving both stages, two
    micro-batches and overlap scheduling."""
    from kvjax import CacheConfig
    from kvjax.serve.pipeline_cache import build_pipeline_cache
    from kvjax.serve.pipeline_stepping import pipeline_scheduler
    from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, serve_two_rounds

    hf, model = gemma3
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        pp_size=2,
        tp_size=2,
        dcp_size=2,
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
    assert sched.alloc.page_size == PAGE * 2
    for s in range(2):
        pool = pipeline.pools(s).swa
        assert all(side.context_axis == "dcp" for side in (pool.full, pool.swa) if side is not None)
    done = serve_two_rounds(sched, swa_parity.MAX_NEW)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_gemma3_standalone_draft_rolls_back_on_striped_pools(family):
    """A STANDALONE draft (the target's first layer) at tp 2 x dcp 2: its pool ``kv_draft``
    striped as the target's, rejected proposals rolled back on both allocators (the accounting
    checked after every step), through eviction and retraction."""
    from tests.serve.test_speculative_swa import LOGIT_ATOL, MAX_NEW
    from tests.serve.test_speculative_swa import serve as serve_speculative

    mesh = make_serving_mesh(2, dcp_size=2, devices=jax.devices())
    sched, done, evicted = serve_speculative(
        family, "first-layer", page_size=PAGE, max_total_tokens=64, mesh=mesh, tp_size=2, dcp_size=2
    )
    _assert_both_pools_striped(sched, 2, 2)
    assert sched.cache.pools.kv_draft.context_axis == "dcp"
    stats = sched.proposer.stats
    assert 0 < stats.accepted_tokens < stats.proposed_tokens and stats.rolled_back_slots > 0, f"{stats}"
    assert evicted["full"] > 0 and evicted["swa"] > 0 and sched.stats.retractions > 0
    assert_matches_transformers(family["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_generate_at_tp_2_dcp_2_and_over_two_processes_gives_the_single_device_tokens(tmp_path_factory, capsys):
    """``generate --model DIR --tp 2 --dcp 2`` on a Gemma 3 checkpoint serves the hybrid pools
    striped (the second prompt reusing the first one's pages) with the single-device tokens, which
    are Transformers'; ``launch --processes 2 -- generate --tp 4 --dcp 2`` (the mesh across both
    processes, their state digests compared every step) prints the same."""
    import json

    from kvjax.cli import main
    from tests.mesh.test_multihost_generate import _lines
    from tests.mesh.test_multihost_serving import launch
    from tests.mesh.tp_serving import family_config
    from tests.serve.parity_harness import hf_greedy, saved_transformers_model

    hf, directory = saved_transformers_model(family_config("gemma3"), tmp_path_factory, "gemma3")
    shared = list(range(10, 30))  # 20 tokens, past the window of 8: 5 pages of 4
    prompts = [[*shared, 31, 32], [*shared, 33], [7, 8, 9]]
    argv = [
        "generate",
        "--model",
        str(directory),
        *[a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))],
    ]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--page-size", "4", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["outputs"] == [hf_greedy(hf, p, 6)[0] for p in prompts]
    assert main([*argv, "--tp", "2", "--dcp", "2"]) == 0
    striped = json.loads(capsys.readouterr().out)
    assert striped["outputs"] == single["outputs"] and striped["cached_tokens"] > 0, striped

    out = launch(["--processes", "2", "--cpu-devices-per-process", "2", "--", *argv, "--tp", "4", "--dcp", "2"])
    assert out.returncode == 0, out.stderr[-4000:]
    printed = _lines(out.stdout, 0)
    assert len(printed) == 1 and json.loads(printed[0])["outputs"] == single["outputs"], out.stdout[-2000:]
    assert "error" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow  # the other sliding-window shapes: Gemma 3's runs above prove the kind
@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])
def test_attention_sinks_and_a_pure_sliding_window_cache_striped(family, tmp_path_factory):
    """gpt-oss (hybrid pools, attention sinks joined to the merge once) and Mistral (every layer
    sliding: one striped SWA pool under a plain allocator, the pure SWA tree) at tp 2 x dcp 2,
    through reuse, eviction and retraction."""
    from tests.serve.parity_harness import tiny_checkpoint, transformers

    mesh = make_serving_mesh(2, dcp_size=2, devices=jax.devices())
    if family == "gpt_oss":
        from tests.serve.test_parity_gpt_oss import CONFIG

        hf, model = tiny_checkpoint(transformers.GptOssConfig(**CONFIG), tmp_path_factory, "gpt_oss")
        sched, done = swa_parity.serve(model, page_size=PAGE, max_total_tokens=64, mesh=mesh, tp_size=2, dcp_size=2)
        _assert_both_pools_striped(sched, 2, 2)
    else:
        from tests.serve.test_parity_mistral_swa import CONFIG, _serve

        hf, model = tiny_checkpoint(transformers.MistralConfig(**CONFIG), tmp_path_factory, "mistral")
        sched, done = _serve(model, page_size=PAGE, max_total_tokens=48, mesh=mesh, tp_size=2, dcp_size=2)
        assert sched.alloc.page_size == PAGE * 2 and sched.cache.pools.swa.swa.context_axis == "dcp"
        assert sched.extensions[0].freed_swa_tokens > 0
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)
