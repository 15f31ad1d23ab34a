"""EAGLE (DeepSeek's MTP layer, NEXTN) with the host tier (issue 35, a pair of the combination
matrix, and a part of DeepSeek-V3's production configuration).

The tiny DeepSeek-V2 target of ``tests/serve/test_speculative_eagle.py`` with a random MTP layer,
served over a device pool small enough (page 1, 64 tokens) that the two rounds' prefixes are
evicted to a host tier 8 times the pool and loaded back: the target's latent pool (``kv``) and the
MTP layer's (``kv_draft``) go to the host and come back together, slot for slot, and the tokens
are Transformers' greedy tokens (logits within 1e-4), through eviction, retraction and rollback of
the mostly rejected proposals; the host's accounting balances after the run.
"""

from __future__ import annotations

import collections
from typing import Any

from kvjax import build_kv_cache
from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler
from kvjax.serve.speculative.nextn import nextn_params
from kvjax.transfers.transfer import PageTransferEngine
from tests.serve.parity_harness import CHUNK, assert_matches_transformers, serve_two_rounds
from tests.serve.test_speculative_eagle import LOGIT_ATOL, MAX_NEW, K, nextn_config
from tests.serve.test_speculative_eagle import checkpoints as checkpoints  # noqa: F401, PLC0414  (the fixture)
from tests.serve.test_speculative_eagle import deepseek as deepseek  # noqa: F401, PLC0414


def test_the_mtp_layers_pool_goes_to_the_host_and_back_with_the_targets(deepseek, monkeypatch):  # noqa: F811
    hf, _, directory, _ = deepseek
    loaded: collections.Counter[str] = collections.Counter()  # slots loaded back, by pool
    start_load = PageTransferEngine.start_load

    def counting(engine: Any, host_slots: Any, device_slots: Any) -> Any:
        loaded[str(engine.pool_name)] += len(device_slots)
        return start_load(engine, host_slots, device_slots)

    monkeypatch.setattr(PageTransferEngine, "start_load", counting)
    model = load_checkpoint(directory)
    config = nextn_config(page_size=1, max_total_tokens=64, enable_hierarchical_cache=True, hicache_ratio=8.0)
    cache = build_kv_cache(model.spec, config)
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=nextn_params(model.config, model.params, directory),
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    done = serve_two_rounds(sched, MAX_NEW)
    tree = sched.cache.tree_cache
    assert isinstance(tree, HiRadixCache) and sched.cache.draft_host_pool is not None
    [ext] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    assert ext.loaded_tokens > 0, "a prefix should have been loaded back from the host"
    assert set(loaded) == {"kv", "kv_draft"} and loaded["kv"] == loaded["kv_draft"] > 0, loaded
    assert sched.stats.evicted_tokens > 0
    proposer = sched.proposer
    assert isinstance(proposer, EagleDecoding) and proposer.stats.rolled_back_slots > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    tree.check_transfers(wait=True)
    assert ext.host_balanced() and sched.leak_free()
