"""The ``cpu_tensor`` decode retraction backup over recurrent state: a retracted request's KV pages
and its state slot's rows are copied aside and restored on re-admission, not recomputed.

Qwen3-Next tiny (random weights, ``tests/serve/test_parity_qwen3_next.py``) at page size 1 on a
pool small enough that the running batch is retracted, with the radix cache (the tree may match a
checkpoint on re-admission; the restored state replaces the forked one) and without it (a decode
server's setting: the request's slot is freed at retraction, after its copy). Each request gives
Transformers' greedy tokens and logits (2e-4, the family's tolerance); the backup restored
requests (its counters); the KV, the state slots and the backup's copies balance afterwards. The
same with the host tier (KV and checkpoints evicted to the host and loaded back beside the
restores), Nemotron-H (Mamba-2 state) against Transformers' full forward, and a STANDALONE
draft (a one-layer Qwen3 beside the Qwen3-Next target: rejected rounds replayed, the draft's pages
restored with the target's) and Qwen3-Next's MTP layer (EAGLE).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.build import build_kv_cache
from kvjax.hybrid_req_pool import HybridReqToTokenPool
from kvjax.radix.mamba_radix_cache import MambaRadixCache
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.generate import scheduler_for
from kvjax.serve.kinds import retraction_parts
from kvjax.serve.retraction_extension import RetractionBackupExtension, cpu_tensor_backup
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.speculative import DraftDecoding
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler
from kvjax.serve.speculative.nextn import nextn_params
from kvjax.transfers.retraction_backup import RowPart
from tests.serve.parity_harness import (
    CHUNK,
    assert_matches_transformers,
    build_scheduler,
    parity_cache_config,
    serve_recurrent,
    serve_two_rounds,
)
from tests.serve.test_parity_nemotron_h import assert_matches_full_forward, nemotron_h_checkpoint
from tests.serve.test_parity_qwen3_next import _hf_model
from tests.serve.test_qwen3_next_mtp import checkpoints  # noqa: F401 (the module's fixture)
from tests.serve.test_recurrent_host_tier import assert_leak_free
from tests.serve.test_speculative_recurrent import K, _cache, models  # noqa: F401 (the module's fixture)

MAX_NEW = 6
#: A pool the two rounds of the parity prompts overflow (retractions), with few state slots.
SMALL: dict[str, Any] = dict(max_total_tokens=56, max_running_requests=4, max_mamba_cache_size=6)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return _hf_model(tmp_path_factory, "qwen3_next_retraction")


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    return nemotron_h_checkpoint(tmp_path_factory, "nemotron_h_retraction")


def _backup(sched: Scheduler) -> RetractionBackupExtension:
    [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
    return ext


def _assert_restored_and_leak_free(sched: Scheduler) -> None:
    ext = _backup(sched)
    assert ext.retraction.mode == "cpu_tensor" and "recurrent" in ext.retraction.pool_names
    assert sched.stats.retractions > 0
    assert ext.retraction.restored > 0 and ext.retraction.restored_tokens > 0, "no retracted request was restored"
    assert ext.retraction.held == 0, "a backup was kept after its request finished"
    assert sched.leak_free()
    table = sched.cache.req_to_token_pool
    assert isinstance(table, HybridReqToTokenPool)
    tree = sched.cache.tree_cache
    held = tree.mamba_evictable_size() + tree.mamba_protected_size() if isinstance(tree, MambaRadixCache) else 0
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no_radix"])
def test_qwen3_next_retracted_requests_are_restored_with_their_state(qwen3_next, radix):
    hf, loaded = qwen3_next
    sched, done = serve_recurrent(
        loaded,
        MAX_NEW,
        disaggregation_decode_retraction_backup="cpu_tensor",
        disable_radix_cache=not radix,
        **SMALL,
    )
    _assert_restored_and_leak_free(sched)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=2e-4)


def test_qwen3_next_restores_beside_the_host_tier(qwen3_next):
    """With the host tier: prefixes and checkpoints evicted to the host and loaded back at
    admission, and the retracted requests restored from their own copies past that prefix."""
    hf, loaded = qwen3_next
    sched, done = serve_recurrent(
        loaded,
        MAX_NEW,
        disaggregation_decode_retraction_backup="cpu_tensor",
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        **SMALL,
    )
    _assert_restored_and_leak_free(sched)
    assert sched.stats.evicted_tokens > 0
    assert_leak_free(sched)  # the host pools too
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=2e-4)


def test_nemotron_h_retracted_requests_are_restored_with_their_state(nemotron_h):
    hf, loaded = nemotron_h
    sched, done = serve_recurrent(loaded, MAX_NEW, disaggregation_decode_retraction_backup="cpu_tensor", **SMALL)
    _assert_restored_and_leak_free(sched)
    assert_matches_full_forward(hf, done, max_new=MAX_NEW)


def test_qwen3_next_with_a_standalone_draft_restores_the_state_and_the_drafts_pages(models):  # noqa: F811
    hf, target, draft = models
    cache = _cache(target, draft, max_total_tokens=64, disaggregation_decode_retraction_backup="cpu_tensor")
    sched = scheduler_for(
        target, cache, draft=draft, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    done = serve_two_rounds(sched, MAX_NEW)
    assert _backup(sched).retraction.pool_names == ("kv", "recurrent", "kv_draft")
    _assert_restored_and_leak_free(sched)
    assert isinstance(sched.proposer, DraftDecoding) and sched.proposer.stats.replayed_requests > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=2e-4)


def test_qwen3_next_mtp_layer_restores_the_state_and_the_drafts_pages(checkpoints):  # noqa: F811
    hf, _, directory = checkpoints
    model = load_checkpoint(directory)
    cache = build_kv_cache(
        model.spec,
        parity_cache_config(
            page_size=1,
            max_total_tokens=64,
            max_running_requests=8,
            speculative_algorithm="NEXTN",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
            disaggregation_decode_retraction_backup="cpu_tensor",
        ),
    )
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
    assert _backup(sched).retraction.pool_names == ("kv", "recurrent", "kv_draft")
    _assert_restored_and_leak_free(sched)
    assert isinstance(sched.proposer, EagleDecoding) and sched.proposer.stats.replayed_requests > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=2e-4)


def test_state_rows_round_trip_into_another_slot_in_place(qwen3_next):
    """The state part alone: slot 2's rows copied at the backup, written into slot 5 at the
    restore (recorded, applied by the owner, the pool's arrays donated); other slots unchanged."""
    _, loaded = qwen3_next
    cache = build_scheduler(loaded, page_size=1, disaggregation_decode_retraction_backup="cpu_tensor", **SMALL).cache
    pool = cache.pools.recurrent
    filled = tuple(np.random.default_rng(0).standard_normal(a.shape).astype(a.dtype) for a in pool.arrays())
    conv, ssm = tuple(jnp.asarray(a) for a in filled[:-1]), jnp.asarray(filled[-1])
    cache.set_pools(cache.pools.replace(recurrent=pool.replace(conv=conv, ssm=ssm)))
    backup = cpu_tensor_backup(cache, retraction_parts(cache))
    [state] = [p for p in backup.parts if isinstance(p, RowPart)]

    class Req:
        mamba_pool_idx: int | None = 2

    req = Req()
    assert backup.backup("r", np.arange(1, 5), 0, 4, request=req)
    req.mamba_pool_idx = 5
    before = cache.pools.recurrent.ssm
    assert backup.restore("r", np.arange(9, 13), request=req)
    assert not before.is_deleted(), "recorded, not applied behind the caller"
    cache.apply_pending()
    assert before.is_deleted(), "the restore writes the state pool in place"
    after = [np.asarray(a) for a in cache.pools.recurrent.arrays()]
    for got, want in zip(after, filled, strict=True):
        np.testing.assert_array_equal(got[:, 5], want[:, 2])
        np.testing.assert_array_equal(np.delete(got, 5, axis=1), np.delete(want, 5, axis=1))
    assert backup.restored == 1 and state.target == "recurrent"
    # A request holding no state slot: no backup taken, nothing kept.
    req.mamba_pool_idx = None
    assert not backup.backup("s", np.arange(1, 5), 0, 4, request=req) and "s" not in backup
