"""Pairs (and triples) of the combination matrix (``tests/combinations.py``) served on one device
with Transformers' greedy tokens and logits (1e-4), each feature asserted in effect, for full
attention (the tiny parity Llama) and MLA (the tiny parity DeepSeek-V2's latent pool).

The storage tier (``hicache_storage_backend='memory'``, behind a host tier too small to keep the
prefixes), with the ``cpu_tensor`` retraction backup and overlap scheduling: the parity rounds
first, on the same small pool (requests retracted and restored from their copies), then system
prompts served one at a time, twice round, so that every second-round prefix was evicted from the
device and the host and comes back from storage.

STANDALONE speculative decoding with the storage tier, the target as its own draft: a stored page
holds the draft pool's page with the target's (``kvjax.transfers.storage_attach``), so the
second round's prefixes come back from storage into both pools and every proposal is accepted.
EAGLE with the storage tier: the tree's bigram keys hashed page by page over ``page_size + 1``
tokens, the MTP layer's latent stored with the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvjax.build import build_kv_cache
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.generate import scheduler_for
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative import DraftDecoding
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler
from kvjax.serve.speculative.nextn import load_nextn_draft, nextn_params
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import (
    CHUNK,
    VOCAB,
    assert_matches_transformers,
    build_scheduler,
    parity_cache_config,
    serve_two_rounds,
)
from tests.serve.test_speculative_eagle import checkpoints as checkpoints  # noqa: F401, PLC0414  (the fixtures)
from tests.serve.test_speculative_eagle import deepseek as deepseek  # noqa: F401, PLC0414

MAX_NEW = 4
ATOL = 1e-4
SYSTEMS = 6  # more system prompts than the host pool holds
PROMPT_SEED = 11


@pytest.fixture(scope="module", params=["llama", "deepseek_v2"])
def family(request, tmp_path_factory) -> tuple[Any, Any]:
    return family_checkpoint(request.param, tmp_path_factory)


def _storage(model: Any, **config: Any) -> dict[str, Any]:
    """A device pool of 48 tokens (pages of 4), a host pool of twice that, the storage tier."""
    return dict(
        page_size=4,
        max_total_tokens=48,
        max_running_requests=4,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_storage_backend="memory",
        hicache_storage_model_fingerprint=model.fingerprint,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=8,
        **config,
    )


def _twice_round(sched: Scheduler) -> dict[str, ServingReq]:
    """``SYSTEMS`` 24-token system prompts, each with 3 question tokens, twice round, one request at a
    time; returns them by name after checking every second-round prefix came back from storage."""
    rng = np.random.default_rng(PROMPT_SEED)
    systems = [[int(t) for t in rng.integers(0, VOCAB, 24)] for _ in range(SYSTEMS)]
    done: dict[str, ServingReq] = {}
    for rnd in range(2):
        for i, system in enumerate(systems):
            req = ServingReq(
                f"s{rnd}-{i}", system + [int(t) for t in rng.integers(0, VOCAB, 3)], max_new_tokens=MAX_NEW
            )
            sched.run([req])
            done[str(req.rid)] = req
    host = _host(sched)
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    # with bigram (EAGLE) keys a prompt's last token pairs with the next one: its system's whole
    # pages of pairs are those of its first 23 tokens
    shared = (24 - int(tree.is_eagle)) // sched.page_size * sched.page_size
    assert host.prefetched_tokens >= SYSTEMS * shared and host.loaded_tokens > 0, "prefixes should come from storage"
    assert all((done[f"s1-{i}"].first_cached_tokens or 0) >= shared for i in range(SYSTEMS))
    assert tree.storage.pending_prefetches == 0
    assert sched.leak_free() and host.host_balanced()
    tree.sanity_check()
    return done


def _host(sched: Scheduler) -> HostTierExtension:
    [host] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    return host


def test_storage_with_the_cpu_tensor_retraction_backup_under_overlap(family):
    hf, model = family
    sched = build_scheduler(model, **_storage(model, disaggregation_decode_retraction_backup="cpu_tensor"))
    [backup] = [e for e in sched.extensions if type(e) is RetractionBackupExtension]
    assert backup.retraction.mode == "cpu_tensor" and sched.overlap
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.stats.retractions > 0 and backup.retraction.restored > 0, "retracted requests should be restored"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
    done = _twice_round(sched)
    assert backup.retraction.held == 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_standalone_target_as_its_own_draft_accepts_everything_after_storage_hits(family):
    hf, model = family
    config = parity_cache_config(
        **_storage(model, speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_num_draft_tokens=4)
    )
    cache = build_kv_cache(model.spec, config, draft_spec=model.spec)
    sched = scheduler_for(
        model, cache, draft=model, num_steps=3, max_batch_size=2, chunked_prefill_size=CHUNK, record_logits=True
    )
    assert isinstance(sched.proposer, DraftDecoding) and cache.draft_host_pool is not None
    store = sched.cache.tree_cache.storage.storage  # an entry holds the target's layers, then the draft's
    assert store.page_shape[0] == 2 * model.spec.num_hidden_layers
    done = _twice_round(sched)
    stats = sched.proposer.stats
    # every proposal accepted: the draft's pages of each stored prefix came back with the target's
    assert stats.proposed_tokens > 0 and stats.acceptance_rate == 1.0, stats
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory) -> tuple[Any, Path, Path]:
    """(Transformers' Llama target, its checkpoint, an EAGLE head's checkpoint: ``test_eagle_head``'s)."""
    from tests.serve.test_eagle_head import _checkpoints

    return _checkpoints(str(tmp_path_factory.mktemp("eagle_head")))


@pytest.mark.parametrize("draft", ["mtp", "head"])
def test_eagle_with_the_storage_tier_hashes_bigram_pages(draft, request):
    """EAGLE with the storage tier (DeepSeek-V2's MTP layer over MLA; a Llama EAGLE head over full
    attention): the tree's keys are bigrams, so a stored page is hashed over its ``page_size + 1``
    tokens and a prefetched node's edge starts at its anchor's last token; a stored page holds the
    draft's layer after the target's. Every second-round prefix comes back from storage;
    Transformers' tokens and logits."""
    if draft == "mtp":
        hf, _, directory, _ = request.getfixturevalue("deepseek")
        model = load_checkpoint(directory)
        algorithm, params = "NEXTN", nextn_params(model.config, model.params, directory)
    else:
        hf, target_dir, head_dir = request.getfixturevalue("eagle_head")
        model = load_checkpoint(target_dir)
        algorithm, params = "EAGLE", load_nextn_draft(head_dir, model).params
    config = parity_cache_config(
        **_storage(model, speculative_algorithm=algorithm, speculative_num_steps=3, speculative_num_draft_tokens=4)
    )
    cache = build_kv_cache(model.spec, config)
    assert cache.tree_cache.is_eagle and cache.draft_host_pool is not None
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=params,
        num_steps=3,
        max_batch_size=2,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    store = sched.cache.tree_cache.storage.storage  # an entry holds the target's layers, then the draft's
    assert store.page_shape[0] == model.spec.num_hidden_layers + 1
    done = _twice_round(sched)
    assert isinstance(sched.proposer, EagleDecoding) and sched.proposer.stats.proposed_tokens > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
