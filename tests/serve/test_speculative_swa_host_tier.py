"""Speculative decoding (STANDALONE) over sliding-window caches with the host tier (HiCache).

The targets are the tiny random-weight gpt-oss and Gemma 3 of ``test_speculative_swa``, each
served as its own STANDALONE draft, with ``enable_hierarchical_cache`` over pools small enough
(page size 1, 64 tokens) that ``serve_batches_through_the_host`` evicts every batch's prefixes to
the host and the chat's second turn loads its first turn's prefix back. The draft's pool
``"kv_draft"`` is indexed by the full slots (``kvjax.plan.draft``): its pages ride with the full
side's on every backup and load (``kvjax.transfers.swa_transfer``, ``kvjax.transfers.draft_pools``),
into its own host pool ``"host_kv_draft"`` at the full side's host slots.

Each run asserts: prefixes came back from the host (the host tier's loads), the draft's pool loaded
exactly the slots the full side loaded (counted per pool), every proposal accepted (a draft page that
did not follow the target's would be stale, and its proposal rejected), the draft's KV at a loaded
prefix's slots equal to the target's full layer's (the same weights wrote both), Transformers' greedy
tokens with logits within ``LOGIT_ATOL``, both sides' accounting after every step, and leak free
(device pools, both sides' accounting, the host pools).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

from kvjax.radix import HiSWARadixCache
from kvjax.serve.host_tier import HostTierExtension
from kvjax.transfers.draft_pools import PairedCopyEngine
from kvjax.transfers.swa_transfer import SWAPageTransferEngine
from kvjax.transfers.transfer import PageTransferEngine
from tests.serve.parity_harness import assert_matches_transformers, serve_batches_through_the_host
from tests.serve.test_speculative_swa import FAMILIES, _checkpoints, _draft, check_accounting, spec_scheduler

LOGIT_ATOL = 1e-4
MAX_NEW = 12


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> dict[str, Any]:
    class_name, config = FAMILIES[request.param]
    return _checkpoints(class_name, config, tmp_path_factory, f"{request.param}-host")


def test_the_target_as_its_own_draft_accepts_everything_after_load_backs(family, monkeypatch):
    loaded: collections.Counter[str] = collections.Counter()  # slots loaded back, by pool (and part)
    start_load = PageTransferEngine.start_load

    def counting(engine: Any, host_slots: Any, device_slots: Any) -> Any:
        loaded[engine.ref.target] += len(device_slots)
        return start_load(engine, host_slots, device_slots)

    monkeypatch.setattr(PageTransferEngine, "start_load", counting)
    target = family["target"]
    sched = spec_scheduler(
        target, target, page_size=1, max_total_tokens=64, enable_hierarchical_cache=True, hicache_ratio=8.0
    )
    cache = sched.cache
    tree = cache.tree_cache
    assert isinstance(tree, HiSWARadixCache) and cache.draft_host_pool is not None
    engine = tree.host.engine
    assert isinstance(engine, SWAPageTransferEngine) and isinstance(engine.full, PairedCopyEngine)
    assert cache.draft_host_pool.size == cache.host_pool.size
    [ext] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]

    done = serve_batches_through_the_host(sched, MAX_NEW)

    assert ext.loads > 0 and ext.loaded_tokens > 0, "a prefix should have been loaded back from the host"
    assert loaded["kv_draft"] > 0, f"the draft's pool should load with the full side: {loaded}"
    assert loaded["kv_draft"] == loaded["swa.full"], f"the draft's pool loads the full side's slots: {loaded}"
    assert 0 < loaded["swa.swa"] <= loaded["swa.full"], f"the window's sliding side comes back too: {loaded}"
    sp = _draft(sched).stats
    assert sp.proposed_tokens > 0 and sp.acceptance_rate == 1.0, f"a draft page did not follow the target's: {sp}"
    assert_matches_transformers(family["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)

    tree.check_transfers(wait=True)
    check_accounting(sched)
    assert sched.leak_free() and ext.host_balanced()
    # the same weights wrote both pools: the draft's KV is the target's full layers' wherever the tree serves it
    req = done["chat2"]
    slots = np.asarray(tree.match_prefix(list(req.origin_input_ids) + req.output_ids[:-1]).indices)
    assert slots.size > 0
    pools = cache.apply_pending()
    swa = pools["swa"]
    for index, layer in enumerate(swa.full_layer_ids):  # the full pool numbers its layers 0..
        ours = np.asarray(swa.full.get_key_buffer(index))[slots]
        draft = np.asarray(pools["kv_draft"].get_key_buffer(layer))[slots]
        np.testing.assert_allclose(draft, ours, atol=1e-5, rtol=0)
