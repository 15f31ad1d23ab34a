"""Speculative decoding (STANDALONE) of a recurrent-state target with the host tier (HiCache).

The target is the tiny Qwen3-Next of ``test_speculative_recurrent`` (3 gated-delta-net layers and
one full-attention layer), the draft its one-layer Qwen3 (full attention, the target's vocabulary,
embedding and head: it agrees now and then, so rounds mix accepted and rejected proposals). With
``enable_hierarchical_cache`` over a pool small enough (page size 1, 64 tokens, 12 state slots)
that ``serve_batches_through_the_host`` evicts every batch's prefixes (KV pages and checkpoints) to
the host and the chat's second turn loads its first turn's back, the draft's pool ``"kv_draft"``
(indexed by the KV pool's slots, no state of its own) goes to its host pool ``"host_kv_draft"`` and
comes back with the KV pages (``KVAndStateEngine.pair_token_pages``), never with the checkpoints.

Asserted: KV pages and checkpoints came back from the host, the draft's pool loaded exactly the KV
pool's slots, the draft's proposals and acceptances are those of the same run without the host
tier and its KV at the chat's prefix (loaded back here) equal to that run's (recomputed there: a
draft page that did not come back with the target's would be stale), Transformers' greedy tokens
with logits within ``LOGIT_ATOL`` (the Qwen3-Next parity tests': Transformers' chunked delta rule
against the recurrence), and leak free (device KV, the state slots, both host pools).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.serve.generate import scheduler_for
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.transfers.draft_pools import PairedCopyEngine
from kvjax.transfers.state_transfer import KVAndStateEngine
from kvjax.transfers.transfer import PageTransferEngine
from tests.serve.parity_harness import CHUNK, assert_matches_transformers, prompts, serve_batches_through_the_host
from tests.serve.test_recurrent_host_tier import assert_leak_free
from tests.serve.test_speculative_recurrent import LOGIT_ATOL, MAX_NEW, K, _cache, _draft
from tests.serve.test_speculative_recurrent import models as models  # noqa: F401, PLC0414  (the fixture)


def _serve(models: Any, **host: Any) -> tuple[Scheduler, dict[str, ServingReq]]:  # noqa: F811
    """The host tier's batches on a 64-token pool with 12 state slots; ``host``: the host tier's settings."""
    _, target, draft = models
    cache = _cache(target, draft, max_total_tokens=64, max_mamba_cache_size=12, **host)
    sched = scheduler_for(
        target, cache, draft=draft, num_steps=K, max_batch_size=2, chunked_prefill_size=CHUNK, record_logits=True
    )
    return sched, serve_batches_through_the_host(sched, MAX_NEW)


def test_the_drafts_pages_come_back_with_the_kv_and_acceptance_is_unchanged(models, monkeypatch):  # noqa: F811
    hf = models[0]
    loaded: collections.Counter[str] = collections.Counter()  # slots loaded back, by pool
    start_load = PageTransferEngine.start_load

    def counting(engine: Any, host_slots: Any, device_slots: Any) -> Any:
        loaded[str(engine.pool_name)] += len(device_slots)
        return start_load(engine, host_slots, device_slots)

    monkeypatch.setattr(PageTransferEngine, "start_load", counting)
    sched, done = _serve(models, enable_hierarchical_cache=True, hicache_ratio=8.0)
    cache = sched.cache
    tree = cache.tree_cache
    assert isinstance(tree, HiMambaRadixCache) and cache.draft_host_pool is not None
    engine = tree.host.engine
    assert isinstance(engine, KVAndStateEngine) and isinstance(engine.kv, PairedCopyEngine)
    [ext] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    assert ext.loads > 0 and ext.loaded_tokens > 0, "no prefix came back from the host"
    assert tree.mamba.backups > 0 and tree.mamba.loads > 0, "no checkpoint went to the host and back"
    assert set(loaded) == {"kv", "kv_draft"} and loaded["kv"] == loaded["kv_draft"] > 0, loaded
    sp = _draft(sched).stats
    assert 0 < sp.accepted_tokens < sp.proposed_tokens and sp.replayed_requests > 0, sp
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    assert_leak_free(sched)

    plain, plain_done = _serve(models)  # the same batches without the host tier: prefixes recomputed
    assert not isinstance(plain.cache.tree_cache, HiMambaRadixCache)
    want = _draft(plain).stats
    assert (sp.proposed_tokens, sp.accepted_tokens) == (want.proposed_tokens, want.accepted_tokens), (sp, want)
    assert {n: r.output_ids for n, r in done.items()} == {n: r.output_ids for n, r in plain_done.items()}
    # the draft's KV of the chat's prefix (loaded back from the host here, recomputed there) is the same
    chat2 = list(done["chat2"].origin_input_ids) + done["chat2"].output_ids[:-1]
    ours, theirs = (_draft_kv(s, chat2) for s in (sched, plain))
    n = min(len(ours[0]), len(theirs[0]))
    assert n >= len(prompts()["chat1"]), f"the chat's first turn should be cached in both runs: {n}"
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a[:n], b[:n], atol=1e-5, rtol=0)


def _draft_kv(sched: Scheduler, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The draft's K and V (its one layer) at the slots the tree holds for ``tokens``' prefix."""
    pools = sched.cache.apply_pending()
    slots = np.asarray(sched.cache.tree_cache.match_prefix(tokens).indices)
    draft = pools["kv_draft"]
    return np.asarray(draft.get_key_buffer(0))[slots], np.asarray(draft.get_value_buffer(0))[slots]
