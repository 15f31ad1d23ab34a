"""Gemma 3 served through the hybrid-SWA cache with the host tier matches Hugging Face Transformers.

The tiny Gemma 3 of ``test_parity_gemma3.py`` (window 8, sliding/full layers) on pools small
enough to evict both device pools (page size 1, 64 full tokens), with the host tier on: evicted
prefixes are backed up into the two host pools (full layers, sliding layers; one host slot id for
both), loaded back on a hit with SWA restored for the last window only, and the tokens and logits
still equal Transformers'. Both device pools and the host pool balance afterwards.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="parity tests need the 'parity' extra (torch, transformers)")
pytest.importorskip("transformers", reason="parity tests need the 'parity' extra (torch, transformers)")

from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.radix import HiSWARadixCache  # noqa: E402
from kvjax.serve.host_tier import HostTierExtension  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.tiers.swa_transfer import SWAPageTransferEngine  # noqa: E402
from tests.serve.test_parity_gemma3 import (  # noqa: E402
    CHUNK,
    MAX_NEW,
    _assert_matches_transformers,
    _prompts,
    gemma3,  # noqa: F401  (the module-scoped checkpoint fixture)
)


def test_evicted_prefixes_come_back_from_the_host_with_the_last_window(gemma3):  # noqa: F811
    hf, model = gemma3
    cache = build_kv_cache(
        model.spec,
        CacheConfig(
            page_size=1,
            max_total_tokens=64,
            max_running_requests=8,
            context_length=124,
            chunked_prefill_size=CHUNK,
            enable_hierarchical_cache=True,
            hicache_ratio=8.0,
        ),
    )
    tree = cache.tree_cache
    assert isinstance(tree, HiSWARadixCache)
    assert isinstance(tree.host.engine, SWAPageTransferEngine)
    assert cache.swa_host_pool is not None and cache.swa_host_pool.size == cache.host_pool.size
    sched = Scheduler(
        model.config, cache, model.params, max_batch_size=2, chunked_prefill_size=CHUNK, record_logits=True
    )
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    p = _prompts()
    done: dict[str, ServingReq] = {}
    for names in (("a", "chat1"), ("b", "c"), ("d",)):
        batch = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in names]
        sched.run(batch)
        done.update((str(r.rid), r) for r in batch)
    chat2 = ServingReq("chat2", p["chat1"] + done["chat1"].output_ids + p["chat2_new"], max_new_tokens=MAX_NEW)
    sched.run([chat2])
    done["chat2"] = chat2
    tree.check_transfers(wait=True)
    assert host.loads > 0 and host.loaded_tokens > 0, "a prefix should come back from the host"
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes() if n.value is not None)
    assert sched.leak_free() and host.host_balanced()
    tree.sanity_check()
    cache.token_to_kv_pool_allocator.check_invariants()
    _assert_matches_transformers(hf, done)
