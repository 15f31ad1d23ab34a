"""The parity scenarios of the sliding-window families (``test_parity_gemma3.py``,
``test_parity_gpt_oss.py``) on the hybrid-SWA cache, over ``parity_harness``'s rounds.

With ``MAX_NEW = 12`` decoded tokens per request every window moves past its prompt, so the
scheduler frees out-of-window SWA slots and the tree stores tombstones. Scenarios (each takes the
Transformers model and kvjax's load of its checkpoint):

* ``page_4_prefix_reuse``: page size 4, a roomy pool: prefix reuse across the window, SWA slots
  freed at decode, tombstones in the tree;
* ``page_1_evict_and_retract``: page size 1, pools small enough to evict from both and to retract;
* ``page_1_retract_and_restore``: the same with the ``cpu_tensor`` retraction backup: retracted
  requests restored from copies of their full side and their window's sliding side;
* ``full_size_pools``: ``disable_hybrid_swa_memory`` (one full-size pool, windowed attention);
* ``through_generate``: the command's entry point;
* ``host_tier_load_back``: page size 1, pools small enough to evict from both, with the host tier:
  evicted prefixes are backed up into the two host pools (full layers, sliding layers; one host
  slot id for both) and loaded back on a hit with SWA restored for the last window only.

Every request's greedy tokens equal Transformers' ``generate`` and its logits agree within
``LOGIT_ATOL``; after both rounds the full and SWA accounting is leak free.

``HybridSWAParityTests`` runs the first four scenarios as pytest tests: a family's test module
subclasses it and defines the ``swa_model`` fixture.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.plan.kinds.swa import SWA_HOST_POOL_NAME
from kvjax.radix import SWARadixCache
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.swa_extension import SWAServing
from tests.serve.parity_harness import (
    CHUNK,
    assert_matches_transformers,
    build_scheduler,
    hf_greedy,
    host_tier_scheduler,
    prompts,
    serve_batches_through_the_host,
    serve_two_rounds,
)

LOGIT_ATOL = 1e-4
MAX_NEW = 12


def serve(
    model: LoadedModel, *, page_size: int, max_total_tokens: int, hybrid: bool = True, **extra: Any
) -> tuple[Scheduler, dict[str, ServingReq]]:
    """The harness's two rounds on a hybrid-SWA cache, counting evictions per pool
    (``sched.evicted_per_pool``); without ``hybrid``, prompts ``a``, ``b`` and ``chat1`` on one
    full-size pool. ``extra``: more ``build_scheduler`` arguments (a mesh and its ``tp_size``)."""
    sched = build_scheduler(
        model,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=8,
        disable_hybrid_swa_memory=not hybrid,
        **extra,
    )
    cache = sched.cache
    if not hybrid:
        assert not cache.is_hybrid_swa and not sched.extensions
        p = prompts()
        reqs = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in ("a", "b", "chat1")]
        sched.run(reqs)
        assert sched.leak_free()
        return sched, {str(r.rid): r for r in reqs}
    assert isinstance(cache.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    assert isinstance(cache.tree_cache, SWARadixCache)
    assert isinstance(sched.extensions[0], SWAServing)
    tree = cache.tree_cache
    evict = tree.evict
    evicted: dict[str, int] = {"full": 0, "swa": 0}

    def recording_evict(*args, **kwargs):  # the per-pool counts of every eviction the loop asks for
        out = evict(*args, **kwargs)
        if isinstance(out, dict):
            for k in evicted:
                evicted[k] += out.get(k, 0)
        return out

    tree.evict = recording_evict  # type: ignore[method-assign]
    sched.evicted_per_pool = evicted  # type: ignore[attr-defined]
    done = serve_two_rounds(sched, MAX_NEW)
    cache.tree_cache.sanity_check()
    cache.token_to_kv_pool_allocator.check_invariants()
    return sched, done


def _assert_matches_transformers(hf: Any, done: dict[str, ServingReq]) -> None:
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def page_4_prefix_reuse(hf: Any, model: LoadedModel) -> None:
    sched, done = serve(model, page_size=4, max_total_tokens=1024)
    assert sched.stats.cached_tokens > 0
    assert (done["chat2"].first_cached_tokens or 0) >= 16 and (done["d"].first_cached_tokens or 0) >= 16
    swa = sched.extensions[0]
    assert isinstance(swa, SWAServing) and swa.freed_swa_tokens > 0, "decode should free out-of-window SWA slots"
    tree = sched.cache.tree_cache
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes()), "the tree should hold SWA tombstones"
    _assert_matches_transformers(hf, done)


def page_1_evict_and_retract(hf: Any, model: LoadedModel) -> None:
    sched, done = serve(model, page_size=1, max_total_tokens=64)
    assert sched.stats.cached_tokens > 0
    evicted = sched.evicted_per_pool  # type: ignore[attr-defined]
    assert evicted["full"] > 0 and evicted["swa"] > 0, f"both pools should be evicted from, got {evicted}"
    assert sched.stats.retractions > 0, "the pools should be small enough to force retraction"
    _assert_matches_transformers(hf, done)


def page_1_retract_and_restore(hf: Any, model: LoadedModel) -> None:
    """``page_1_evict_and_retract`` with the ``cpu_tensor`` retraction backup: retracted requests
    are restored (counted: not recomputed) from copies of their full side and of their window's
    sliding side, with Transformers' tokens and logits."""
    from kvjax.serve.retraction_extension import RetractionBackupExtension

    sched, done = serve(model, page_size=1, max_total_tokens=64, disaggregation_decode_retraction_backup="cpu_tensor")
    [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
    backup = ext.retraction
    assert backup.mode == "cpu_tensor" and backup.pool_names == ("swa.full", "swa.swa")
    assert sched.stats.retractions > 0 and backup.restored > 0 and backup.restored_tokens > 0, "not recomputed"
    assert backup.held == 0
    _assert_matches_transformers(hf, done)


def full_size_pools(hf: Any, model: LoadedModel) -> None:
    _, done = serve(model, page_size=4, max_total_tokens=1024, hybrid=False)
    _assert_matches_transformers(hf, done)


def through_generate(hf: Any, model: LoadedModel) -> None:
    from kvjax.serve.generate import generate

    p = prompts()
    chosen = [p["a"], p["b"]]
    result, sched = generate(model, chosen, max_new_tokens=MAX_NEW, page_size=4, chunked_prefill_size=CHUNK)
    assert sched.leak_free()
    for prompt, out in zip(chosen, result.outputs, strict=True):
        assert out == hf_greedy(hf, prompt, MAX_NEW)[0]


def host_tier_load_back(hf: Any, model: LoadedModel) -> None:
    from kvjax.radix import HiSWARadixCache
    from kvjax.serve.host_tier import HostTierExtension
    from kvjax.transfers.swa_transfer import SWAPageTransferEngine

    sched = host_tier_scheduler(model, max_batch_size=2)
    cache = sched.cache
    tree = cache.tree_cache
    assert isinstance(tree, HiSWARadixCache) and isinstance(tree.host.engine, SWAPageTransferEngine)
    swa_host_pool = cache.host_pools.get(SWA_HOST_POOL_NAME)
    assert swa_host_pool is not None and swa_host_pool.size == cache.host_pool.size
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    done = serve_batches_through_the_host(sched, MAX_NEW)
    tree.check_transfers(wait=True)
    assert host.loads > 0 and host.loaded_tokens > 0, "a prefix should come back from the host"
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes() if n.value is not None)
    assert sched.leak_free() and host.host_balanced()
    tree.sanity_check()
    cache.token_to_kv_pool_allocator.check_invariants()
    _assert_matches_transformers(hf, done)


class HybridSWAParityTests:
    """The scenarios above as tests of one family: subclass it as ``Test<Family>`` in the family's
    test module and define a module-scoped fixture ``swa_model`` returning ``(Transformers model,
    kvjax's LoadedModel)``. Only the page-4 run is in the default suite (the others are slow)."""

    def test_page_4_with_prefix_reuse_across_the_window_multi_turn_and_chunked_prefill(self, swa_model):
        page_4_prefix_reuse(*swa_model)

    @pytest.mark.slow  # ~20 s: the default suite keeps the page-4 run above
    def test_page_1_with_pools_small_enough_to_evict_and_retract(self, swa_model):
        page_1_evict_and_retract(*swa_model)

    @pytest.mark.slow  # one full-size pool, windowed attention (SGLang's way to serve Gemma 3)
    def test_full_size_pools_without_hybrid_swa(self, swa_model):
        full_size_pools(*swa_model)

    @pytest.mark.slow  # the same scheduler as above, through the command's entry point
    def test_served_through_generate(self, swa_model):
        through_generate(*swa_model)
