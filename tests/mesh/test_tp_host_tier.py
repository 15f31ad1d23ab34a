"""The host tier (HiCache L2) and the storage tier (L3) over pools sharded over tensor-parallel ranks.

Each device's shard of the pool (its KV heads) is backed up into its heads of the host pages and
loaded back from them (``kvjax.tiers.head_shards``, ``kvjax.transfers.transfer``): the serving tests
run Transformers' tiny checkpoints (``tests/serve`` parity configs) at tp 2 and tp 4 (the tiny
models' 2 KV heads replicated over 4 ranks: the host keeps each head once) with device pools small
enough that prefixes are evicted to the host and loaded back, and retracted requests restored from
the host (``disaggregation_decode_retraction_backup='host_pool'``); tokens equal Transformers'
greedy ``generate`` and logits agree. The engine tests check a load writes each device's shard in
place (donated, no collective) and that the storage tier keeps one entry per rank, keyed with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.caches import host_tier_cache
from tests.mesh import sharded_host_tier
from tests.mesh.tp_serving import assert_sharded, family_checkpoint, mesh_of
from tests.serve import swa_parity
from tests.serve.parity_harness import (
    assert_matches_transformers,
    build_scheduler,
    host_tier_scheduler,
    prompts,
    serve_two_rounds,
)

MAX_NEW = 6
ATOL = 1e-4


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_host_tier_loads_back_per_shard_pages(tp, llama):
    hf, model = llama
    sched = host_tier_scheduler(model, mesh=mesh_of(tp), tp_size=tp, max_batch_size=2)
    host_pool = sched.cache.host_pool
    kv_heads = model.spec.num_kv_heads
    # Each distinct KV head once: K and V of every model head, whatever the replication over ranks.
    assert host_pool.page_row[1] == 2 * kv_heads and host_pool.kv_head_replicas == max(1, tp // kv_heads)
    planned = sched.cache.plan.pool("host_kv")  # the plan counts the host pool as it is built
    assert planned.shape[2] == host_pool.page_row[1] and planned.nbytes == host_pool.nbytes
    done = sharded_host_tier.serve_with_host_loads(sched, MAX_NEW)
    assert_sharded(sched, tp)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_llama_retraction_backups_into_the_host_pool_at_tp_2(llama):
    """Retracted requests' KV backed up per shard into held host slots (the request then finds its
    prefix in the tree, so nothing is left to restore: the restore is checked below)."""
    hf, model = llama
    sched = host_tier_scheduler(model, mesh=mesh_of(2), tp_size=2, disaggregation_decode_retraction_backup="host_pool")
    done = serve_two_rounds(sched, MAX_NEW)
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    assert host.retraction is not None
    assert sched.stats.retractions > 0 and host.retraction.backed_up > 0, "retracted requests should be backed up"
    sched.cache.tree_cache.check_transfers(wait=True)
    assert host.host_balanced()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_gemma3_sliding_window_host_pools_at_tp_2(tmp_path_factory):
    from kvjax.transfers.swa_transfer import SWAPageTransferEngine

    hf, model = family_checkpoint("gemma3", tmp_path_factory)
    sched = host_tier_scheduler(model, mesh=mesh_of(2), tp_size=2, max_batch_size=2)
    tree = sched.cache.tree_cache
    assert isinstance(tree.host.engine, SWAPageTransferEngine)
    done = sharded_host_tier.serve_with_host_loads(sched, swa_parity.MAX_NEW)
    assert_sharded(sched, 2)
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes() if n.value is not None)
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def _engine_cache(tp: int, name: str = "tiny") -> Any:
    return host_tier_cache(name, mesh=mesh_of(tp), tp_size=tp, page_size=4)


@pytest.mark.parametrize(("tp", "name"), [(2, "tiny"), (4, "tiny"), (2, "deepseek-tiny")])
def test_a_load_writes_each_shard_in_place(tp, name):
    """Backup of 2 pages, load into 2 others: the pages equal, every other page untouched, each
    device's layer buffer reused (donated), and the compiled scatter has no collective."""
    cache = _engine_cache(tp, name)
    before = sharded_host_tier.fill(cache, seed=tp)
    page = cache.plan.page_size
    host_slots = sharded_host_tier.back_up_pages_2_and_3(cache, page)
    sharded_host_tier.assert_a_load_writes_in_place(cache, host_slots, before, page)


def test_a_retraction_backup_restores_every_shard_at_tp_4():
    """The ``host_pool`` retraction backup over replicated heads: a request's pages go to held host
    slots and come back into fresh pages, every shard equal."""
    cache = _engine_cache(4)
    before = sharded_host_tier.fill(cache, seed=7)
    sharded_host_tier.assert_a_retraction_backup_restores(cache, before, cache.plan.page_size)


def _storage_scheduler(model: LoadedModel, directory: Any, tp: int) -> Scheduler:
    mesh = {"mesh": mesh_of(tp), "tp_size": tp} if tp > 1 else {}
    return build_scheduler(
        model,
        page_size=1,
        max_total_tokens=96,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_model_fingerprint=model.fingerprint,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=8,
        **mesh,
    )


def test_storage_entries_per_rank_read_back_by_a_cold_server_of_the_same_tp(llama, tmp_path):
    """A server at tp 2 writes each page as one entry per rank (its key carries the rank); a cold
    server at tp 2 serves the prompts again from storage, with Transformers' tokens; a server of
    another TP size has another key and reads nothing."""
    import json

    hf, model = llama
    p = prompts()
    first = _storage_scheduler(model, tmp_path, 2)
    reqs = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in ("a", "chat1")]
    first.run(reqs)
    tree = first.cache.tree_cache
    tree.check_transfers(wait=True)
    tree.storage.check_writes(wait=True)
    tree.storage.storage.flush()
    records = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("*/key.json"))]
    assert sorted((r["tp_rank"], r["tp_size"]) for r in records) == [(0, 2), (1, 2)]
    heads = {r["page_shape"][2] for r in records}
    assert heads == {first.cache.host_pool.page_row[1] // 2}, "each entry holds one rank's heads"
    folders = {f.parent for f in tmp_path.glob("*/key.json")}
    pages = [{e.name for e in folder.iterdir() if e.name != "key.json"} for folder in folders]
    assert pages[0] == pages[1] and len(pages[0]) > 0, "every page stored once per rank"

    cold = _storage_scheduler(model, tmp_path, 2)
    again = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in ("a", "chat1")]
    cold.run(again)
    ext = next(e for e in cold.extensions if isinstance(e, HostTierExtension))
    assert ext.prefetched_tokens > 0 and cold.stats.cached_tokens > 0, "the cold server should hit storage"
    cold.cache.tree_cache.check_transfers(wait=True)
    assert cold.leak_free() and ext.host_balanced()
    assert_matches_transformers(hf, {str(r.rid): r for r in again}, max_new=MAX_NEW, atol=ATOL)

    other = _storage_scheduler(model, tmp_path, 1)
    other.run([ServingReq("a", p["a"], max_new_tokens=MAX_NEW)])
    other_ext = next(e for e in other.extensions if isinstance(e, HostTierExtension))
    assert other_ext.prefetched_tokens == 0 and other.stats.cached_tokens == 0


def test_a_draft_models_host_pool_over_sharded_heads_holds_every_distinct_head_once():
    """The draft's host pool over a TP mesh: every distinct head shard of the draft once (its own
    replicas), one host slot per target host slot (serving: ``test_tp_speculative.py``)."""
    from kvjax import CacheConfig, ModelSpec, build_kv_cache

    config = CacheConfig(
        speculative_algorithm="STANDALONE",
        speculative_num_steps=2,
        speculative_num_draft_tokens=3,
        tp_size=2,
        max_total_tokens=256,
        context_length=64,
        enable_hierarchical_cache=True,
    )
    spec = ModelSpec.preset("tiny")
    cache = build_kv_cache(spec, config, mesh=mesh_of(2), draft_spec=ModelSpec.preset("tiny", num_key_value_heads=1))
    draft_host, target_host = cache.draft_host_pool, cache.host_pool
    assert draft_host is not None and draft_host.size == target_host.size
    # the draft's 1 KV head is held by both ranks: its host page holds it once (K and V)
    assert draft_host.kv_head_replicas == 2 and draft_host.page_row[-2] == 2
    assert target_host.kv_head_replicas == 1 and target_host.page_row[-2] == 2 * spec.num_kv_heads


class _BalancedEachStep:
    """A serving front over ``sched`` that checks the device memory balance after every step:
    ``available + evictable + protected + held by live requests == capacity``, where a live
    request holds its own pages ``[cache_protected_len, kv_len)``, page-rounded."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.finished = sched.finished
        self.steps = 0

    @property
    def idle(self) -> bool:
        return self.sched.idle

    def submit(self, reqs: Any) -> None:
        self.sched.submit(reqs)

    def step(self) -> list[ServingReq]:
        sched = self.sched
        done = sched.step()
        self.steps += 1
        ps = sched.page_size
        live = [r for r in sched.live_requests() if r.req_pool_idx is not None]
        held = sum(-(-r.kv_len() // ps) * ps - r.cache_protected_len for r in live)
        tree = sched.tree
        cached = tree.evictable_size() + tree.protected_size()
        assert sched.alloc.available_size() + cached + held == sched.alloc.size, (
            f"step {self.steps}: {sched.alloc.available_size()} free + {cached} in the tree + {held} held by "
            f"{[r.rid for r in live]} != {sched.alloc.size} slots"
        )
        return done


def test_every_running_request_retracted_while_backups_are_pending_at_tp_2(llama):
    """Over a sharded pool a backup is asynchronous and locks its node until it lands, so a decode
    step short of pages can retract every running request; the one re-admitted first then decodes
    from its new length (not the length it had before the retraction) and no page is lost: the
    balance holds after every step, the cache ends leak free, and the tokens equal tp 1's."""
    from kvjax.demo import MAX_BATCH, demo_cache
    from kvjax.serve.workload import Workload, run_workload

    _, model = llama
    workload = Workload(groups=2, prompts_per_group=3, chats=1, turns=3, system_tokens=48, output_tokens=3)
    workload = dataclasses.replace(workload, vocab_size=model.config.vocab_size)
    outputs = {}
    for tp in (1, 2):
        cache = demo_cache(spec=model.spec, tp_size=tp, enable_hierarchical_cache=True, max_total_tokens=160)
        sched = Scheduler(model.config, cache, model.params, max_batch_size=MAX_BATCH, overlap=False)
        front = _BalancedEachStep(sched)
        outputs[tp] = run_workload(front, workload)
        sched.cache.tree_cache.check_transfers(wait=True)
        host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
        assert sched.leak_free() and host.host_balanced()
        sched.tree.sanity_check()
    assert sched.stats.retractions > 0 and host.loads > 0, "the workload should retract and load back at tp 2"
    assert outputs[2] == outputs[1]
