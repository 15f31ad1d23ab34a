"""The storage tier (L3) under the hybrid sliding-window tree, served: Gemma 3 (text, tiny: layers
sliding, sliding, full, sliding; window 8) with the host tier and ``hicache_storage_backend='memory'``.

A stored page is two entries under one chained page hash (``kvjax.radix.storage_window``): the full
layer's page (every backed-up page) and the sliding layers' page (the pages whose host copy carried
SWA). System prompts are served one at a time, twice round, on a device pool of 48 tokens and a host
pool of twice that: by the second round every first-round prefix has left both, and the storage tier
brings it back, its full pages and the sliding pages of its last window (the node above them an SWA
tombstone, the window's node SWA-live once loaded), and the request is served from it with
Transformers' greedy tokens and logits (1e-4).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvjax.radix import HiSWARadixCache
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.tiers.storage import page_hashes
from tests.serve import test_parity_gemma3, test_parity_gpt_oss
from tests.serve.parity_harness import (
    VOCAB,
    assert_matches_transformers,
    build_scheduler,
    tiny_checkpoint,
    transformers,
)

PAGE = 4
MAX_NEW = 12  # every request decodes past its window (8): its tail's middle pages become SWA tombstones
ATOL = 1e-4
SYSTEMS = 5  # more 24-token system prompts than the host pool (96 tokens) keeps
SYSTEM_TOKENS = 24
PROMPT_SEED = 5


def swa_checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """``(hf, model)`` of the tiny parity checkpoint of ``family`` (``gemma3`` or ``gpt_oss``)."""
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(**test_parity_gemma3.CONFIG)
    else:
        config = transformers.GptOssConfig(**test_parity_gpt_oss.CONFIG)
    return tiny_checkpoint(config, tmp_path_factory, f"{family}_storage")


@pytest.fixture(scope="module", params=["gemma3", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def swa_model(request, tmp_path_factory) -> tuple[Any, Any]:
    return swa_checkpoint(request.param, tmp_path_factory)


def storage_scheduler(model: Any, **extra: Any) -> Scheduler:
    """A device pool of 64 full tokens (pages of 4), a host pool of twice that, the storage tier
    in memory; ``extra``: more ``build_scheduler`` arguments (a mesh and its ``tp_size``) or other
    values of these."""
    settings: dict[str, Any] = dict(
        max_batch_size=2,
        page_size=PAGE,
        max_total_tokens=64,
        max_running_requests=2,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_storage_backend="memory",
        hicache_storage_model_fingerprint=model.fingerprint,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=8,
    )
    return build_scheduler(model, **{**settings, **extra})


def _twice_round(sched: Scheduler) -> dict[str, ServingReq]:
    """A chat's first turn (decoding past its window), then ``SYSTEMS`` system prompts with a
    question each, twice round, one request at a time, then the chat's second turn; returns the
    requests by name."""
    rng = np.random.default_rng(PROMPT_SEED)
    systems = [[int(t) for t in rng.integers(0, VOCAB, SYSTEM_TOKENS)] for _ in range(SYSTEMS)]
    chat = [int(t) for t in rng.integers(0, VOCAB, SYSTEM_TOKENS + 3)]
    done: dict[str, ServingReq] = {}

    def serve(name: str, prompt: list[int]) -> None:
        req = ServingReq(name, prompt, max_new_tokens=MAX_NEW)
        sched.run([req])
        done[name] = req

    serve("chat1", chat)
    for rnd in range(2):
        for i, system in enumerate(systems):
            serve(f"s{rnd}-{i}", system + [int(t) for t in rng.integers(0, VOCAB, 3)])
    serve("chat2", chat + done["chat1"].output_ids + [int(t) for t in rng.integers(0, VOCAB, 3)])
    return done


def serve_from_storage(hf: Any, sched: Scheduler) -> None:
    """Serve ``_twice_round`` on ``storage_scheduler``'s ``sched`` and check what the module
    docstring says: the stored pages, the prefixes served back from storage with their window,
    the accounting, the tree, and Transformers' tokens and logits."""
    tree = sched.cache.tree_cache
    assert isinstance(tree, HiSWARadixCache) and tree.storage is not None and tree.storage.window is not None
    done = _twice_round(sched)
    [host] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    tree.check_transfers(wait=True)
    storage, window = tree.storage, tree.storage.window
    # Every page's full layers are stored; the sliding layers only of the pages whose host copy
    # carried them: the chat's first turn has a stored page without them (an SWA tombstone at its
    # backup) below its prompt and the sliding pages of its last window.
    chat = list(done["chat1"].origin_input_ids) + done["chat1"].output_ids[:-1]
    hashes = page_hashes(chat, PAGE, seed=tree.hash_seed)
    assert storage.storage.present(hashes) == [True] * len(hashes)
    sliding = window.store.present(hashes)
    assert not all(sliding) and sliding[-window.window_pages :] == [True] * window.window_pages, sliding
    # The second round's prefixes (each system prompt; the chat's whole first turn, hole included)
    # came back from storage with their last window, and were served from it.
    assert host.prefetched_tokens == SYSTEMS * SYSTEM_TOKENS + len(hashes) * PAGE
    assert host.loaded_tokens >= host.prefetched_tokens
    assert window.windows_taken == SYSTEMS + 1 and window.windows_dropped == 0
    assert all(done[f"s1-{i}"].first_cached_tokens == SYSTEM_TOKENS for i in range(SYSTEMS))
    assert done["chat2"].first_cached_tokens == len(hashes) * PAGE
    assert storage.pending_prefetches == 0
    assert sched.leak_free() and host.host_balanced()
    tree.sanity_check()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_prefixes_come_back_from_storage_with_their_last_window_and_transformers_tokens(swa_model):
    hf, model = swa_model
    sched = storage_scheduler(model)
    assert sched.overlap
    serve_from_storage(hf, sched)


def test_retracted_requests_restore_their_window_beside_the_storage_tier(tmp_path_factory):
    """Gemma 3 with the ``cpu_tensor`` retraction backup too: the parity rounds (4 rows) retract
    requests and restore them (their full pages and their window's sliding pages) while the host
    tier writes both sides through to storage."""
    from kvjax.serve.retraction_extension import RetractionBackupExtension
    from tests.serve.parity_harness import serve_two_rounds

    hf, model = swa_checkpoint("gemma3", tmp_path_factory)
    sched = storage_scheduler(
        model, disaggregation_decode_retraction_backup="cpu_tensor", max_batch_size=4, max_running_requests=4
    )
    [backup] = [e.retraction for e in sched.extensions if type(e) is RetractionBackupExtension]
    done = serve_two_rounds(sched, MAX_NEW)
    print("RETRACT", sched.stats.retractions, backup.backed_up, backup.restored, backup.fallbacks)
    assert sched.stats.retractions > 0 and backup.restored > 0, "retracted requests should be restored"
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    assert tree.storage.pages_backed_up > 0 and backup.held == 0
    assert sched.leak_free()
    tree.sanity_check()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_what_is_not_built_is_refused_before_allocating():
    from kvjax import CacheConfig, ModelSpec, plan_kv_cache
    from kvjax.radix import HiSWARadixCache
    from kvjax.radix.storage_link import StorageOptions
    from kvjax.tiers.storage import StorageTier
    from kvjax.tiers.storage_key import StorageKey
    from kvjax.transfers.storage_attach import check_storage_buildable

    spec = ModelSpec.preset("gemma3-tiny")
    dp = CacheConfig(
        page_size=4,
        max_total_tokens=256,
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        enable_hierarchical_cache=True,
        hicache_storage_backend="memory",
        hicache_storage_model_fingerprint="m",
    )
    with pytest.raises(NotImplementedError, match="hybrid sliding-window tree with dp_size=2 with enable_dp_attention"):
        check_storage_buildable(plan_kv_cache(spec, dp), dp)
    # the tree refuses a storage tier without the sliding layers' store (its prefixes could never be served)
    key = StorageKey(model="m", page_shape=(1, 4, 2, 8), store_dtype="float32", kv_dtype="float32")
    storage = StorageOptions(StorageTier("memory", key=key), object())  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="needs its sliding-window pages stored beside"):
        HiSWARadixCache(page_size=4, sliding_window_size=8, host_pool_tokens=64, storage=storage)
