"""Pairs (and triples) of the combination matrix (``tests/combinations.py``) served over a tp 2 mesh
of CPU devices with Transformers' greedy tokens and logits (1e-4), each feature asserted in effect.

* The ``cpu_tensor`` retraction backup with the host tier at tp 2, for full attention (Llama),
  MLA (DeepSeek-V2's latent pool, replicated over the ranks, the query heads split) and Gemma 3's
  sliding-window pools (the full side and the window's sliding side copied): the parity
  rounds on a device pool small enough to retract (the retracted requests restored from their
  copies, not recomputed) and then served in batches that evict prefixes to the host and load them
  back (each shard's pages).
  Overlap scheduling is on (the scheduler's default) throughout.
* The same over DCP (the pages striped over the DCP ranks): Llama at tp 2 x dcp 2, DeepSeek-V2's
  latent pool at tp 4 x dcp 2.
* The storage tier at tp 2 on MLA (``tests/serve/test_matrix_pairs.py``'s workload: every
  second-round prefix evicted from the device and the host comes back from storage).
* Qwen3-Next's gated delta net at tp 2 (head parallel, ``tests/mesh/qwen3_next_tp.py``) with the
  host tier: KV and state checkpoints evicted to the host and loaded back, requests retracted.
* EAGLE at tp 2: Qwen3-Next's MTP layer (``tests/serve/test_qwen3_next_mtp.py``'s checkpoint) on a
  pool small enough to evict and retract (the recurrent state replayed); Llama's EAGLE head
  (``tests/serve/test_eagle_head.py``'s) with the host tier, the head's pool loaded back from the
  host with the target's, slot for slot.
* STANDALONE at tp 2: on the recurrent kind, ``tests/serve/test_speculative_recurrent.py``'s Qwen3-Next
  target and one-layer Qwen3 draft on a pool small enough to evict and retract (the rejected
  drafts' state replayed); on MLA with the host tier, DeepSeek-V2 as its own draft accepting every
  proposal, also on the prefixes loaded back from the host (the draft's latent pages with the
  target's).
* DP attention on MLA (dp 2 x tp 2): the ``cpu_tensor`` retraction backup per rank (each rank's
  slice of the latent pool copied and restored; the same for Gemma 3's sliding-window pools); the
  storage tier per rank
  (``tests/mesh/test_dp_host_tier.py``'s storage case: each rank writes its pages behind its host
  pool, a cold server routes the follow-ups the other way round and each rank prefetches the pages
  the other rank wrote).
* Across processes: DeepSeek-V2 (MLA) at tp 2 over 2
  processes x 1 CPU device, overlap on, through reuse, chunked prefill, eviction and retraction,
  both processes' digests compared at every step (run as a program, ``python -m
  tests.mesh.test_matrix_pairs DIR CONFIG RUN``, it is one process of the group; ``CONFIG``: JSON
  of more ``CacheConfig`` fields, ``RUN``: JSON of the workload and its tokens per request).
  Gemma 3's sliding-window pools with the host tier the same way, the parity prompts in batches
  that evict prefixes to every process's host pool and load them back. The ``cpu_tensor``
  retraction backup across processes, the same with Llama and Gemma 3: each process copies and
  restores the blocks of the pages its own device holds (``kvjax.transfers.page_copy``).
* Over pipeline stages at pp 2 x tp 2 with overlap scheduling: DeepSeek-V2 (MLA) and Gemma 3 (sliding
  window interleaved with full attention)
  (``tests/mesh/test_pp_parity.py``'s stages), through reuse, chunked prefill, eviction and
  retraction, each stage holding only its layers' pools and weights.

Qwen3-Next's logits are compared within 2e-4 with a draft (its MTP and STANDALONE tests' tolerance:
Transformers' chunked delta rule against the recurrence).
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any

import jax
import pytest

from kvjax import build_kv_cache
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler
from kvjax.serve.speculative.nextn import load_nextn_draft
from kvjax.transfers.transfer import PageTransferEngine
from tests.mesh.qwen3_next_tp import qwen3_next_checkpoint
from tests.mesh.tp_serving import assert_sharded, family_checkpoint, mesh_of
from tests.serve.parity_harness import (
    CHUNK,
    assert_matches_transformers,
    build_scheduler,
    parity_cache_config,
    serve_batches_through_the_host,
    serve_recurrent,
    serve_two_rounds,
)

TP = 2
MAX_NEW = 6
ATOL = 1e-4


def _extension(sched: Scheduler, cls: type) -> object:
    [ext] = [e for e in sched.extensions if type(e) is cls]
    return ext


def _retraction_backup_with_the_host_tier(family: str, tmp_path_factory: Any, **mesh: Any) -> None:
    """The parity rounds on a 48-token pool (retracted requests restored from their cpu_tensor
    copies), then the rounds through the host tier, over ``mesh`` (a mesh and its sizes)."""
    hf, model = family_checkpoint(family, tmp_path_factory)
    sched = build_scheduler(
        model,
        page_size=1,
        max_total_tokens=48,  # small enough that retracted requests come back before their prefix is in the tree
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        disaggregation_decode_retraction_backup="cpu_tensor",
        **mesh,
    )
    retraction = _extension(sched, RetractionBackupExtension).retraction  # type: ignore[attr-defined]
    host = _extension(sched, HostTierExtension)
    assert retraction.mode == "cpu_tensor" and sched.overlap
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.stats.retractions > 0 and retraction.restored > 0, "retracted requests should be restored"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
    done = serve_batches_through_the_host(sched, MAX_NEW)
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    assert host.loads > 0 and host.loaded_tokens > 0, "a prefix should come back from the host"  # type: ignore[attr-defined]
    assert sched.stats.evicted_tokens > 0
    assert sched.leak_free() and host.host_balanced() and retraction.held == 0  # type: ignore[attr-defined]
    tree.sanity_check()
    tp, dcp = mesh["tp_size"], mesh.get("dcp_size", 1)
    if dcp == 1:
        assert_sharded(sched, tp)
    else:  # the pages striped over the DCP ranks of the ("tp", "dcp") mesh
        assert dict(sched.mesh.shape) == {"tp": tp // dcp, "dcp": dcp}
        assert sched.cache.pools.kv.context_axis == "dcp"
        assert all(len(a.sharding.device_set) == tp for a in jax.tree.leaves(sched.cache.pools))
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


@pytest.mark.parametrize("family", ["llama", "deepseek_v2", "gemma3"])
def test_tp2_cpu_tensor_retraction_backup_with_the_host_tier(family, tmp_path_factory):
    _retraction_backup_with_the_host_tier(family, tmp_path_factory, mesh=mesh_of(TP), tp_size=TP)


@pytest.mark.parametrize(("family", "tp"), [("llama", 2), ("deepseek_v2", 4)])
def test_dcp2_cpu_tensor_retraction_backup_with_the_host_tier(family, tp, tmp_path_factory):
    from kvjax.mesh_check import make_serving_mesh

    mesh = make_serving_mesh(tp, dcp_size=2, devices=jax.devices())
    _retraction_backup_with_the_host_tier(family, tmp_path_factory, mesh=mesh, tp_size=tp, dcp_size=2)


def test_deepseek_v2_storage_tier_at_tp2_dcp2_stores_striped_pages(tmp_path_factory):
    from kvjax.mesh_check import make_serving_mesh
    from tests.serve.test_matrix_pairs import MAX_NEW as STORAGE_MAX_NEW
    from tests.serve.test_matrix_pairs import _storage, _twice_round

    hf, model = family_checkpoint("deepseek_v2", tmp_path_factory)
    mesh = make_serving_mesh(TP, dcp_size=2, devices=jax.devices())
    sched = build_scheduler(model, mesh=mesh, tp_size=TP, dcp_size=2, **_storage(model))
    store = sched.cache.tree_cache.storage.storage
    # an entry is the striped page: every DCP rank's rows of the tree's page (page_size * dcp)
    assert store.page_shape[1] == sched.cache.tree_cache.page_size == 2 * 4
    assert store.storage_key.layout.endswith("/dcp2")
    done = _twice_round(sched)  # every second-round prefix back from storage, leak free, balanced
    assert dict(sched.mesh.shape) == {"tp": 1, "dcp": 2} and sched.cache.pools.kv.context_axis == "dcp"
    assert_matches_transformers(hf, done, max_new=STORAGE_MAX_NEW, atol=ATOL)


@pytest.mark.parametrize("family", ["deepseek_v2", "gemma3"])
def test_over_two_pipeline_stages_at_tp2(family, tmp_path_factory):
    from tests.mesh.test_pp_parity import assert_stages_hold_their_own, stage_scheduler

    hf, model = family_checkpoint(family, tmp_path_factory)
    sched = stage_scheduler(model, 2, TP, 1, True)
    assert sched.overlap
    done = serve_two_rounds(sched, MAX_NEW)  # asserts leak free
    assert_stages_hold_their_own(sched, model.spec.num_hidden_layers)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_deepseek_v2_storage_tier_at_tp2(tmp_path_factory):
    from tests.serve.test_matrix_pairs import MAX_NEW as STORAGE_MAX_NEW
    from tests.serve.test_matrix_pairs import _storage, _twice_round

    hf, model = family_checkpoint("deepseek_v2", tmp_path_factory)
    sched = build_scheduler(model, mesh=mesh_of(TP), tp_size=TP, **_storage(model))
    done = _twice_round(sched)  # every second-round prefix back from storage, leak free, balanced
    assert_sharded(sched, TP)
    assert_matches_transformers(hf, done, max_new=STORAGE_MAX_NEW, atol=ATOL)


def test_qwen3_next_tp2_with_the_host_tier(tmp_path_factory):
    hf, model = qwen3_next_checkpoint(TP, tmp_path_factory)
    sched, done = serve_recurrent(
        model,
        MAX_NEW,
        mesh=mesh_of(TP),
        tp_size=TP,
        max_total_tokens=56,
        max_running_requests=4,
        max_mamba_cache_size=6,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    host = _extension(sched, HostTierExtension)
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    assert sched.stats.retractions > 0 and sched.stats.evicted_tokens > 0
    assert host.loads > 0 and tree.mamba.loads > 0, "KV and a state checkpoint should come back from the host"  # type: ignore[attr-defined]
    assert sched.leak_free() and host.host_balanced()  # type: ignore[attr-defined]
    assert_sharded(sched, TP)
    assert all(a.sharding.spec[2] == "tp" for a in (*sched.cache.pools.recurrent.conv, sched.cache.pools.recurrent.ssm))
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _eagle(model: Any, draft_params: Any, **config: Any) -> Scheduler:
    """An EAGLE scheduler over a tp 2 mesh (``config``: the other ``CacheConfig`` fields), its
    weights and the draft's split over the ranks."""
    from tests.serve.test_eagle_head import K

    cache = build_kv_cache(
        model.spec,
        parity_cache_config(
            page_size=1,
            max_running_requests=8,
            tp_size=TP,
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
            **config,
        ),
        mesh=mesh_of(TP),
    )
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=draft_params,
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    assert isinstance(sched.proposer, EagleDecoding)
    assert_sharded(sched, TP)
    draft_weights = jax.tree.leaves(sched.proposer.draft_params)
    assert any(not a.sharding.is_fully_replicated for a in draft_weights), "the draft's heads should be split"
    return sched


def test_qwen3_next_mtp_layer_at_tp2_evicts_retracts_and_replays(tmp_path_factory):
    from kvjax.serve.speculative.nextn import nextn_params
    from tests.serve.test_qwen3_next_mtp import LOGIT_ATOL, _checkpoints

    hf, _, directory = _checkpoints(str(tmp_path_factory.mktemp("qwen3_next_mtp")))
    model = load_checkpoint(directory)
    draft = nextn_params(model.config, model.params, directory)
    sched = _eagle(model, draft, max_total_tokens=64, speculative_algorithm="NEXTN")
    done = serve_two_rounds(sched, MAX_NEW)
    tree = sched.cache.tree_cache
    tree.sanity_check()
    table = sched.cache.req_to_token_pool
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()  # type: ignore[attr-defined]
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    stats = sched.proposer.stats  # type: ignore[union-attr]
    assert stats.proposed_tokens > 0 and stats.replayed_requests > 0, stats
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0 and sched.stats.cached_tokens > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_llama_eagle_head_at_tp2_with_the_host_tier(tmp_path_factory, monkeypatch):
    from tests.serve.test_eagle_head import LOGIT_ATOL, _checkpoints

    loaded: collections.Counter[str] = collections.Counter()  # slots loaded back, by pool
    start_load = PageTransferEngine.start_load

    def counting(engine: Any, host_slots: Any, device_slots: Any) -> Any:
        loaded[str(engine.pool_name)] += len(device_slots)
        return start_load(engine, host_slots, device_slots)

    monkeypatch.setattr(PageTransferEngine, "start_load", counting)
    hf, target_dir, head_dir = _checkpoints(str(tmp_path_factory.mktemp("eagle_head")))
    model = load_checkpoint(target_dir)
    draft = load_nextn_draft(head_dir, model)
    sched = _eagle(
        model,
        draft.params,
        max_total_tokens=64,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        speculative_algorithm="EAGLE",
    )
    assert sched.cache.draft_host_pool is not None
    done = serve_batches_through_the_host(sched, MAX_NEW)
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    host = _extension(sched, HostTierExtension)
    assert host.loaded_tokens > 0, "a prefix should come back from the host"  # type: ignore[attr-defined]
    assert loaded["kv_draft"] > 0 and len(loaded) == 2 and len(set(loaded.values())) == 1, loaded
    assert sched.proposer.stats.proposed_tokens > 0  # type: ignore[union-attr]
    assert sched.leak_free() and host.host_balanced()  # type: ignore[attr-defined]
    tree.sanity_check()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_qwen3_next_standalone_at_tp2_evicts_retracts_and_replays(tmp_path_factory):
    from kvjax.serve.generate import scheduler_for
    from kvjax.serve.speculative import DraftDecoding
    from tests.serve.test_speculative_recurrent import LOGIT_ATOL, K
    from tests.serve.test_speculative_recurrent import models as recurrent_models

    hf, target, draft = recurrent_models.__wrapped__(tmp_path_factory)  # type: ignore[attr-defined]
    cache = build_kv_cache(
        target.spec,
        parity_cache_config(
            page_size=1,
            max_total_tokens=64,
            max_running_requests=8,
            tp_size=TP,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
        ),
        draft_spec=draft.spec,
        mesh=mesh_of(TP),
    )
    sched = scheduler_for(
        target, cache, draft=draft, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    assert isinstance(sched.proposer, DraftDecoding)
    assert_sharded(sched, TP)
    done = serve_two_rounds(sched, MAX_NEW)
    tree, table = sched.cache.tree_cache, sched.cache.req_to_token_pool
    tree.sanity_check()
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()  # type: ignore[attr-defined]
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    stats = sched.proposer.stats
    assert stats.replayed_requests > 0 and stats.accepted_tokens < stats.proposed_tokens, stats
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0 and sched.stats.cached_tokens > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_deepseek_v2_standalone_at_tp2_with_the_host_tier(tmp_path_factory, monkeypatch):
    from kvjax.serve.generate import scheduler_for
    from kvjax.serve.speculative import DraftDecoding
    from tests.serve.test_eagle_head import K

    loaded: collections.Counter[str] = collections.Counter()  # slots loaded back, by pool
    start_load = PageTransferEngine.start_load

    def counting(engine: Any, host_slots: Any, device_slots: Any) -> Any:
        loaded[str(engine.pool_name)] += len(device_slots)
        return start_load(engine, host_slots, device_slots)

    monkeypatch.setattr(PageTransferEngine, "start_load", counting)
    hf, model = family_checkpoint("deepseek_v2", tmp_path_factory)
    cache = build_kv_cache(
        model.spec,
        parity_cache_config(
            page_size=1,
            max_total_tokens=64,
            max_running_requests=8,
            tp_size=TP,
            enable_hierarchical_cache=True,
            hicache_ratio=8.0,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
        ),
        draft_spec=model.spec,
        mesh=mesh_of(TP),
    )
    sched = scheduler_for(
        model, cache, draft=model, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    assert isinstance(sched.proposer, DraftDecoding) and sched.cache.draft_host_pool is not None
    assert_sharded(sched, TP)
    done = serve_batches_through_the_host(sched, MAX_NEW)
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    host = _extension(sched, HostTierExtension)
    assert host.loaded_tokens > 0, "a prefix should come back from the host"  # type: ignore[attr-defined]
    assert loaded["kv_draft"] > 0 and len(loaded) == 2 and len(set(loaded.values())) == 1, loaded
    stats = sched.proposer.stats
    assert stats.proposed_tokens > 0 and stats.acceptance_rate == 1.0, "a draft page did not follow the target's"
    assert sched.leak_free() and host.host_balanced()  # type: ignore[attr-defined]
    tree.sanity_check()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_deepseek_v2_cpu_tensor_retraction_backup_per_dp_rank(tmp_path_factory):
    from tests.mesh.dp_balance import BalancedFront
    from tests.mesh.test_dp_parity import DP, _front

    hf, model = family_checkpoint("deepseek_v2", tmp_path_factory)
    front = _front(model, "cache_aware", disaggregation_decode_retraction_backup="cpu_tensor")
    done = serve_two_rounds(BalancedFront(front), MAX_NEW)  # type: ignore[arg-type]
    backups = [_extension(s, RetractionBackupExtension).retraction for s in front.schedulers]  # type: ignore[attr-defined]
    assert all(b.mode == "cpu_tensor" for b in backups)
    assert sum(s.stats.retractions for s in front.schedulers) > 0
    assert sum(b.restored for b in backups) > 0, "a re-admitted request should be restored"
    assert all(b.held == 0 for b in backups)
    assert [s.leak_free() for s in front.schedulers] == [True] * DP
    assert sorted(set(front.rank_of.values())) == [0, 1]
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_gemma3_cpu_tensor_retraction_backup_per_dp_rank(tmp_path_factory):
    from tests.mesh.dp_balance import BalancedFront
    from tests.mesh.test_dp_parity import DP, _front
    from tests.serve import swa_parity

    hf, model = family_checkpoint("gemma3", tmp_path_factory)
    front = _front(model, "cache_aware", disaggregation_decode_retraction_backup="cpu_tensor")
    done = serve_two_rounds(BalancedFront(front), swa_parity.MAX_NEW)  # type: ignore[arg-type]
    backups = [_extension(s, RetractionBackupExtension).retraction for s in front.schedulers]  # type: ignore[attr-defined]
    assert all(b.pool_names == ("swa.full", "swa.swa") for b in backups)
    assert sum(s.stats.retractions for s in front.schedulers) > 0
    assert sum(b.restored for b in backups) > 0, "a re-admitted request should be restored"
    assert all(b.held == 0 for b in backups)
    assert [s.leak_free() for s in front.schedulers] == [True] * DP
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def test_deepseek_v2_storage_tier_per_dp_rank_read_back_by_a_cold_server(tmp_path_factory, tmp_path):
    from kvjax.serve.scheduler import ServingReq
    from tests.mesh import test_dp_host_tier as dp

    hf, model = family_checkpoint("deepseek_v2", tmp_path_factory)
    p = dp._rank_prompts()
    first = dp._storage_front(model, tmp_path)
    written = [ServingReq(n, p[n], max_new_tokens=dp.MAX_NEW) for n in ("x0", "y0")]
    first.run(written)
    for scheduler in first.schedulers:
        tree = scheduler.cache.tree_cache
        tree.check_transfers(wait=True)
        tree.storage.check_writes(wait=True)
        tree.storage.storage.flush()
    assert [first.rank_of[n] for n in ("x0", "y0")] == [0, 1]
    assert any(tmp_path.glob("*/key.json")), "the ranks should write pages to storage"
    cold = dp._storage_front(model, tmp_path)
    again = [ServingReq(n, p[n], max_new_tokens=dp.MAX_NEW) for n in ("y0+", "x0+")]
    cold.run(again)
    assert [cold.rank_of[n] for n in ("y0+", "x0+")] == [0, 1]
    hosts = dp._host_extensions(cold)
    assert [h.prefetched_tokens > 0 for h in hosts] == [True, True], [h.prefetched_tokens for h in hosts]
    assert all(s.stats.cached_tokens > 0 for s in cold.schedulers)
    dp._assert_leak_free_and_balanced(cold)
    done = {str(r.rid): r for r in [*written, *again]}
    assert_matches_transformers(hf, done, max_new=dp.MAX_NEW, atol=ATOL)


@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek_v2"])
def test_cpu_tensor_retraction_backup_over_two_processes(family, tmp_path_factory):
    from tests.mesh.multihost_group import finished_requests
    from tests.mesh.tp_serving import family_config
    from tests.serve import swa_parity
    from tests.serve.parity_harness import saved_transformers_model

    hf, directory = saved_transformers_model(family_config(family), tmp_path_factory, family)
    max_new = swa_parity.MAX_NEW if family == "gemma3" else MAX_NEW
    reports = _over_two_processes(str(directory), max_new=max_new, disaggregation_decode_retraction_backup="cpu_tensor")
    for r in reports:
        assert r["restored"] > 0 and r["held"] == 0, r
    assert_matches_transformers(hf, finished_requests(reports[0], max_new), max_new=max_new, atol=ATOL)


def test_deepseek_v2_at_tp2_over_two_processes(tmp_path_factory):
    from tests.mesh.multihost_group import finished_requests
    from tests.mesh.tp_serving import family_config
    from tests.serve.parity_harness import saved_transformers_model

    hf, directory = saved_transformers_model(family_config("deepseek_v2"), tmp_path_factory, "deepseek_v2")
    reports = _over_two_processes(str(directory))
    assert_matches_transformers(hf, finished_requests(reports[0], MAX_NEW), max_new=MAX_NEW, atol=ATOL)


def test_gemma3_host_tier_at_tp2_over_two_processes(tmp_path_factory):
    from tests.mesh.multihost_group import finished_requests
    from tests.mesh.tp_serving import family_config
    from tests.serve import swa_parity
    from tests.serve.parity_harness import saved_transformers_model

    hf, directory = saved_transformers_model(family_config("gemma3"), tmp_path_factory, "gemma3")
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=8.0, max_total_tokens=64)
    reports = _over_two_processes(str(directory), through_the_host=True, max_new=swa_parity.MAX_NEW, **tier)
    for r in reports:
        assert r["host_loaded_tokens"] > 0 and r["host_balanced"] and r["tree"] == "HiSWARadixCache", r
    done = finished_requests(reports[0], swa_parity.MAX_NEW)
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def _over_two_processes(
    directory: str, *, through_the_host: bool = False, max_new: int = MAX_NEW, **config: Any
) -> list[dict[str, Any]]:
    """The parity rounds at tp 2 over 2 processes of 1 device; the reports, each checked: equal
    outputs, digests compared, leak free, overlap on, reuse, evictions and retractions."""
    from tests.mesh.multihost_group import assert_all_ok, run_group

    run = dict(through_the_host=through_the_host, max_new=max_new)
    args = ["-m", "tests.mesh.test_matrix_pairs", directory, json.dumps(config), json.dumps(run)]
    reports = assert_all_ok(run_group(args, devices=1, timeout=300))
    assert reports[0]["outputs"] == reports[1]["outputs"]
    for r in reports:
        assert r["leak_free"] and r["digest_checks"] > 0 and r["overlap"], r
        assert r["cached_tokens"] > 0 and r["evicted_tokens"] > 0, r
        assert through_the_host or r["retractions"] > 0, r
    return reports


def _serve_over_processes(directory: str, config: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    from tests.mesh.multihost_group import join_and_load, request_records

    group, model = join_and_load(directory)
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_tp_mesh

    settings: dict[str, Any] = dict(tp_size=TP, page_size=1, max_total_tokens=48, max_running_requests=8)
    cache = build_kv_cache(model.spec, parity_cache_config(**{**settings, **config}), mesh=group_tp_mesh(TP))
    sched = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        agreement=group.agreement(),
    )
    front = MultiProcessFront(sched, group.channel, check_agreement=True)
    if run["through_the_host"]:
        serve_batches_through_the_host(front, run["max_new"])  # type: ignore[arg-type]
    else:
        serve_two_rounds(front, run["max_new"])  # type: ignore[arg-type]  # a front serves like a scheduler
    hosts = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    if hosts:
        cache.tree_cache.check_transfers(wait=True)
    backups = [e.retraction for e in sched.extensions if type(e) is RetractionBackupExtension]  # type: ignore[attr-defined]
    return {
        "outputs": {str(r.rid): list(r.output_ids) for r in front.finished},
        "requests": request_records(front.finished),
        "leak_free": front.leak_free(),
        "digest_checks": front.digest_checks,
        "overlap": sched.overlap,
        "cached_tokens": sched.stats.cached_tokens,
        "evicted_tokens": sched.stats.evicted_tokens,
        "retractions": sched.stats.retractions,
        "restored": sum(b.restored for b in backups),
        "held": sum(b.held for b in backups),
        "tree": type(cache.tree_cache).__name__,
        "host_loaded_tokens": sum(h.loaded_tokens for h in hosts),
        "host_balanced": all(h.host_balanced() for h in hosts),
    }


if __name__ == "__main__":
    print(json.dumps(_serve_over_processes(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
