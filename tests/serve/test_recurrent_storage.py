"""The storage tier (L3) under the recurrent-state tree, served: Qwen3-Next (tiny) with the host
tier and ``hicache_storage_backend='memory'``.

A node's KV pages are the page store's entries and its checkpoint (the state after its last token)
an entry of the checkpoint store under its last page's hash (``kvjax.radix.storage_checkpoint``).
System prompts are served one at a time, twice round, on pools small enough that by the second
round every first-round prefix has left the device and the host (KV and checkpoint); the storage
tier brings back the longest stored run ending at a stored state, its KV pages and that state, and
the request is served from it with Transformers' greedy tokens and logits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.parity_harness import VOCAB, assert_matches_transformers, build_scheduler
from tests.serve.test_parity_qwen3_next import _hf_model
from tests.serve.test_recurrent_host_tier import assert_leak_free

MAX_NEW = 6
ATOL = 2e-4  # the recurrent parity tests' tolerance for Qwen3-Next
SYSTEMS = 5
SYSTEM_TOKENS = 24
PROMPT_SEED = 7


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> tuple[Any, Any]:
    return _hf_model(tmp_path_factory, "qwen3_next_storage")


def storage_scheduler(model: Any, **extra: Any) -> Scheduler:
    """A device pool of 64 tokens (pages of 1) and 12 state slots, a host pool of twice that, the
    storage tier in memory; ``extra``: more ``build_scheduler`` arguments (a mesh and its ``tp_size``)
    or other values of these."""
    settings: dict[str, Any] = dict(
        max_batch_size=2,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=2,
        max_mamba_cache_size=12,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_storage_backend="memory",
        hicache_storage_model_fingerprint=model.fingerprint,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=8,
    )
    return build_scheduler(model, **{**settings, **extra})


def _twice_round(sched: Scheduler) -> dict[str, ServingReq]:
    """``SYSTEMS`` system prompts with a question each, twice round, one request at a time."""
    rng = np.random.default_rng(PROMPT_SEED)
    systems = [[int(t) for t in rng.integers(0, VOCAB, SYSTEM_TOKENS)] for _ in range(SYSTEMS)]
    done: dict[str, ServingReq] = {}
    for rnd in range(2):
        for i, system in enumerate(systems):
            question = [int(t) for t in rng.integers(0, VOCAB, 3)]
            req = ServingReq(f"s{rnd}-{i}", system + question, max_new_tokens=MAX_NEW)
            sched.run([req])
            done[str(req.rid)] = req
    return done


def serve_from_storage(hf: Any, sched: Scheduler) -> None:
    """Serve ``_twice_round`` on ``storage_scheduler``'s ``sched`` and check what the module
    docstring says: the states stored, every second-round prefix served back from storage with its
    state, the accounting (device, state slots, both host pools), the tree, and Transformers'
    tokens and logits."""
    tree = sched.cache.tree_cache
    assert isinstance(tree, HiMambaRadixCache) and tree.storage is not None and tree.storage.checkpoints is not None
    done = _twice_round(sched)
    [host] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    tree.check_transfers(wait=True)
    states = tree.storage.checkpoints
    assert states.states_backed_up > 0 and tree.storage.pages_backed_up > states.states_backed_up
    # every second-round prefix came back from storage with the state after it
    assert states.states_taken == SYSTEMS and states.states_dropped == 0 and host.prefetched_tokens > 0
    assert all(done[f"s1-{i}"].first_cached_tokens == SYSTEM_TOKENS for i in range(SYSTEMS))
    assert tree.storage.pending_prefetches == 0
    assert_leak_free(sched)
    assert host.host_balanced()
    tree.sanity_check()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_prefixes_and_their_checkpoints_come_back_from_storage(qwen3_next):
    hf, model = qwen3_next
    sched = storage_scheduler(model)
    assert sched.overlap
    serve_from_storage(hf, sched)


def test_retracted_requests_restore_their_state_beside_the_storage_tier(qwen3_next):
    """With the ``cpu_tensor`` retraction backup too: the parity rounds (4 rows on a 56-token pool,
    6 state slots) retract requests and restore them (their KV pages and state rows) while the
    host tier writes pages and checkpoints through to storage."""
    from kvjax.serve.retraction_extension import RetractionBackupExtension
    from tests.serve.parity_harness import serve_two_rounds

    hf, model = qwen3_next
    sched = storage_scheduler(
        model,
        disaggregation_decode_retraction_backup="cpu_tensor",
        max_batch_size=4,
        max_total_tokens=56,
        max_running_requests=4,
        max_mamba_cache_size=6,
        hicache_ratio=8.0,
    )
    [backup] = [e.retraction for e in sched.extensions if type(e) is RetractionBackupExtension]
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.stats.retractions > 0 and backup.restored > 0, "retracted requests should be restored"
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    assert tree.storage.pages_backed_up > 0 and tree.storage.checkpoints.states_backed_up > 0
    assert backup.held == 0
    assert_leak_free(sched)
    tree.sanity_check()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
