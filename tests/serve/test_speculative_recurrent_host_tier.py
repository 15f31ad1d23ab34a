"""Speculative decoding of a recurrent-state target with the host tier (HiCache).

The target is the tiny Qwen3-Next of ``test_speculative_recurrent`` (3 gated-delta-net layers and
one full-attention layer), drafted by

* STANDALONE: its one-layer Qwen3 (full attention, the target's vocabulary, embedding and head: it
  agrees now and then, so rounds mix accepted and rejected proposals);
* EAGLE (NEXTN): its own MTP layer (``test_qwen3_next_mtp``'s random ``mtp.*`` tensors: one
  full-attention layer, most proposals rejected).

With ``enable_hierarchical_cache`` over a pool small enough (page size 1, 64 tokens, 12 state
slots) that ``serve_batches_through_the_host`` evicts every batch's prefixes (KV pages and
checkpoints) to the host and the chat's second turn loads its first turn's back, the draft's pool
``"kv_draft"`` (indexed by the KV pool's slots, no state of its own) goes to its host pool
``"host_kv_draft"`` and comes back with the KV pages (``KVAndStateEngine.pair_token_pages``), never
with the checkpoints.

Asserted, for each draft: KV pages and checkpoints came back from the host, the draft's pool loaded
exactly the KV pool's slots, the draft's KV at the chat's prefix (loaded back here) is that of the
same batches served without the host tier (recomputed there: a draft page that did not come back
with the target's would be stale), Transformers' greedy tokens with logits within ``LOGIT_ATOL``
(the Qwen3-Next parity tests': Transformers' chunked delta rule against the recurrence), and leak
free (device KV, the state slots, both host pools). For the STANDALONE draft also every round's
proposals (by the sequence they continue) and the acceptance counts are those of the run without
the host tier. The MTP layer's KV is compared up to the loaded prefix's last position: EAGLE's
hidden-state store is not copied to the host (kvjax's choice, ``docs/architecture.md``), so the
draft's KV of that one position, recomputed from the store when the prefill resumes, and the
proposals attending to it may differ (the tokens do not).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.generate import scheduler_for
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative.draft_decoding import DraftDecoding
from kvjax.serve.speculative.eagle import eagle_scheduler
from kvjax.serve.speculative.nextn import nextn_params
from kvjax.transfers.draft_pools import PairedCopyEngine
from kvjax.transfers.state_transfer import KVAndStateEngine
from kvjax.transfers.transfer import PageTransferEngine
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    prompts,
    serve_batches_through_the_host,
)
from tests.serve.test_qwen3_next_mtp import _checkpoints as mtp_checkpoints
from tests.serve.test_recurrent_host_tier import assert_leak_free
from tests.serve.test_speculative_recurrent import LOGIT_ATOL, MAX_NEW, K, _cache
from tests.serve.test_speculative_recurrent import models as models  # noqa: F401, PLC0414  (the fixture)

HOST = {"enable_hierarchical_cache": True, "hicache_ratio": 8.0}
Proposals = dict[tuple[int, ...], list[int]]


@pytest.fixture(scope="module")
def mtp(tmp_path_factory) -> tuple[Any, Any]:
    """(Transformers' Qwen3-Next, its checkpoint directory with a random MTP layer)."""
    hf, _, directory = mtp_checkpoints(str(tmp_path_factory.mktemp("qwen3_next_mtp_host")))
    return hf, directory


def _recording(monkeypatch: Any) -> list[Proposals]:
    """Record every settled round's proposals, by the sequence each row continues, into a new dict
    per scheduler (the list's last)."""
    runs: list[Proposals] = []
    settle = DraftDecoding._settle_round

    def recording(self: Any, s: Any, running: list[ServingReq], kv_len: Any, proposals: Any, *rest: Any) -> Any:
        for row, r in enumerate(running):
            runs[-1][(*r.origin_input_ids, *r.output_ids)] = [int(t) for t in np.asarray(proposals)[row]]
        return settle(self, s, running, kv_len, proposals, *rest)

    monkeypatch.setattr(DraftDecoding, "_settle_round", recording)
    return runs


def _counting_loads(monkeypatch: Any) -> collections.Counter[str]:
    """Slots loaded back from the host, by device pool."""
    loaded: collections.Counter[str] = collections.Counter()
    start_load = PageTransferEngine.start_load

    def counting(engine: Any, host_slots: Any, device_slots: Any) -> Any:
        loaded[str(engine.pool_name)] += len(device_slots)
        return start_load(engine, host_slots, device_slots)

    monkeypatch.setattr(PageTransferEngine, "start_load", counting)
    return loaded


def _draft_kv(sched: Scheduler, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The draft's K and V (its one layer) at the slots the tree holds for ``tokens``' prefix."""
    cache = sched.cache
    assert cache.plan.draft is not None
    [layer] = cache.plan.draft.layer_ids
    pools = cache.apply_pending()
    slots = np.asarray(cache.tree_cache.match_prefix(tokens).indices)
    draft = pools["kv_draft"]
    return np.asarray(draft.get_key_buffer(layer))[slots], np.asarray(draft.get_value_buffer(layer))[slots]


def _check_against_the_run_without_the_host(
    hf: Any, serve: Callable[..., Scheduler], monkeypatch: Any, *, hidden_state_store: bool = False
) -> DraftDecoding:
    """Serve the host tier's batches with and without the host tier (``serve(**host settings)``
    returns a scheduler that has served them, ``sched.done`` the requests by name) and assert the
    module docstring's claims; return the host run's proposer. ``hidden_state_store``: an EAGLE
    draft, whose hidden-state store the host tier does not copy (kvjax's choice, documented): its
    KV at a loaded prefix's last position is recomputed from that position's store row when the
    prefill resumes, so that position and the proposals attending to it may differ; the rest of
    the prefix's draft KV must not."""
    loaded = _counting_loads(monkeypatch)
    proposals = _recording(monkeypatch)
    proposals.append({})
    sched = serve(**HOST)
    done: dict[str, ServingReq] = sched.done  # type: ignore[attr-defined]
    tree = sched.cache.tree_cache
    assert isinstance(tree, HiMambaRadixCache) and sched.cache.draft_host_pool is not None
    engine = tree.host.engine
    assert isinstance(engine, KVAndStateEngine) and isinstance(engine.kv, PairedCopyEngine)
    [ext] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    assert ext.loads > 0 and ext.loaded_tokens > 0, "no prefix came back from the host"
    assert tree.mamba.backups > 0 and tree.mamba.loads > 0, "no checkpoint went to the host and back"
    assert set(loaded) == {"kv", "kv_draft"} and loaded["kv"] == loaded["kv_draft"] > 0, loaded
    assert (done["chat2"].first_cached_tokens or 0) >= len(prompts()["chat1"]), "turn 2 resumes from the host"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    assert_leak_free(sched)

    proposals.append({})
    plain = serve()  # the same batches without the host tier: the chat's prefix recomputed
    assert not isinstance(plain.cache.tree_cache, HiMambaRadixCache)
    plain_done: dict[str, ServingReq] = plain.done  # type: ignore[attr-defined]
    assert {n: r.output_ids for n, r in done.items()} == {n: r.output_ids for n, r in plain_done.items()}
    if not hidden_state_store:
        ours, theirs = proposals
        assert ours == theirs, "a round's proposals differ from those without the host tier"
        sp, want = (s.proposer.stats for s in (sched, plain))  # type: ignore[union-attr]
        assert (sp.proposed_tokens, sp.accepted_tokens) == (want.proposed_tokens, want.accepted_tokens), (sp, want)
    # the draft's KV of the chat's prefix (loaded back from the host here, recomputed there) is the same
    chat2 = list(done["chat2"].origin_input_ids) + done["chat2"].output_ids[:-1]
    ours_kv, theirs_kv = (_draft_kv(s, chat2) for s in (sched, plain))
    n = min(len(ours_kv[0]), len(theirs_kv[0]))
    assert n >= len(prompts()["chat1"]), f"the chat's first turn should be cached in both runs: {n}"
    if hidden_state_store:  # up to the loaded prefix's last position (the docstring)
        n = min(n, (done["chat2"].first_cached_tokens or 0) - 1)
        assert n >= len(prompts()["chat1"]) - 1, n
    for a, b in zip(ours_kv, theirs_kv, strict=True):
        np.testing.assert_allclose(a[:n], b[:n], atol=1e-5, rtol=0)
    assert isinstance(sched.proposer, DraftDecoding)
    return sched.proposer


def test_the_drafts_pages_come_back_with_the_kv_and_acceptance_is_unchanged(models, monkeypatch):  # noqa: F811
    hf, target, draft = models

    def serve(**host: Any) -> Scheduler:
        cache = _cache(target, draft, max_total_tokens=64, max_mamba_cache_size=12, **host)
        sched = scheduler_for(
            target, cache, draft=draft, num_steps=K, max_batch_size=2, chunked_prefill_size=CHUNK, record_logits=True
        )
        sched.done = serve_batches_through_the_host(sched, MAX_NEW)  # type: ignore[attr-defined]
        return sched

    sp = _check_against_the_run_without_the_host(hf, serve, monkeypatch).stats
    assert 0 < sp.accepted_tokens < sp.proposed_tokens and sp.replayed_requests > 0, sp


def test_the_mtp_layers_pages_come_back_with_the_kv(mtp, monkeypatch):
    hf, directory = mtp
    model = load_checkpoint(directory)

    def serve(**host: Any) -> Scheduler:
        config = CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=1,
            max_total_tokens=64,
            max_running_requests=8,
            max_mamba_cache_size=12,
            speculative_algorithm="NEXTN",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
            **host,
        )
        cache = build_kv_cache(model.spec, config)
        sched = eagle_scheduler(
            model.config,
            cache,
            model.params,
            draft_params=nextn_params(model.config, model.params, directory),
            num_steps=K,
            max_batch_size=2,
            chunked_prefill_size=CHUNK,
            record_logits=True,
        )
        sched.done = serve_batches_through_the_host(sched, MAX_NEW)  # type: ignore[attr-defined]
        return sched

    sp = _check_against_the_run_without_the_host(hf, serve, monkeypatch, hidden_state_store=True).stats
    assert sp.proposed_tokens > 0 and sp.replayed_requests > 0, sp
