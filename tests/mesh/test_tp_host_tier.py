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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve import swa_parity
from tests.serve.parity_harness import (
    assert_matches_transformers,
    build_scheduler,
    prompts,
    serve_two_rounds,
    tiny_checkpoint,
    transformers,
)
from tests.serve.test_parity_gemma3 import CONFIG as GEMMA3
from tests.serve.test_parity_transformers import COMMON, FAMILIES

MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Any, LoadedModel]:
    cls, extra = FAMILIES["llama"]
    return tiny_checkpoint(getattr(transformers, cls)(**COMMON, **extra), tmp_path_factory, "llama")


def serve_with_host_loads(sched: Scheduler, max_new: int) -> dict[str, ServingReq]:
    """Serve the parity prompts in three batches (each evicting the one before to the host), then
    the chat's second turn (its first turn comes back from the host); assert loads happened,
    the host and device accounting balance, and return the requests by name."""
    tree = sched.cache.tree_cache
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    p = prompts()
    done: dict[str, ServingReq] = {}
    for names in (("a", "chat1"), ("b", "c"), ("d",)):
        batch = [ServingReq(n, p[n], max_new_tokens=max_new) for n in names]
        sched.run(batch)
        done.update((str(r.rid), r) for r in batch)
    chat2 = ServingReq("chat2", p["chat1"] + done["chat1"].output_ids + p["chat2_new"], max_new_tokens=max_new)
    sched.run([chat2])
    done["chat2"] = chat2
    tree.check_transfers(wait=True)
    assert host.loads > 0 and host.loaded_tokens > 0, "a prefix should come back from the host"
    assert sched.stats.evicted_tokens > 0
    assert sched.leak_free() and host.host_balanced()
    tree.sanity_check()
    sched.cache.token_to_kv_pool_allocator.check_invariants()
    return done


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_host_tier_loads_back_per_shard_pages(tp, llama):
    hf, model = llama
    sched = build_scheduler(
        model,
        mesh=mesh_of(tp),
        tp_size=tp,
        max_batch_size=2,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    host_pool = sched.cache.host_pool
    kv_heads = model.spec.num_kv_heads
    # Each distinct KV head once: K and V of every model head, whatever the replication over ranks.
    assert host_pool.page_row[1] == 2 * kv_heads and host_pool.kv_head_replicas == max(1, tp // kv_heads)
    planned = sched.cache.plan.pool("host_kv")  # the plan counts the host pool as it is built
    assert planned.shape[2] == host_pool.page_row[1] and planned.nbytes == host_pool.nbytes
    done = serve_with_host_loads(sched, MAX_NEW)
    assert_sharded(sched, tp)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_llama_retraction_backups_into_the_host_pool_at_tp_2(llama):
    """Retracted requests' KV backed up per shard into held host slots (the request then finds its
    prefix in the tree, so nothing is left to restore: the restore is checked below)."""
    hf, model = llama
    sched = build_scheduler(
        model,
        mesh=mesh_of(2),
        tp_size=2,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        disaggregation_decode_retraction_backup="host_pool",
    )
    done = serve_two_rounds(sched, MAX_NEW)
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    assert host.retraction is not None
    assert sched.stats.retractions > 0 and host.retraction.backed_up > 0, "retracted requests should be backed up"
    sched.cache.tree_cache.check_transfers(wait=True)
    assert host.host_balanced()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_gemma3_sliding_window_host_pools_at_tp_2(tmp_path_factory):
    from kvjax.transfers.swa_transfer import SWAPageTransferEngine

    hf, model = tiny_checkpoint(transformers.Gemma3TextConfig(**GEMMA3), tmp_path_factory, "gemma3")
    sched = build_scheduler(
        model,
        mesh=mesh_of(2),
        tp_size=2,
        max_batch_size=2,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    tree = sched.cache.tree_cache
    assert isinstance(tree.host.engine, SWAPageTransferEngine)
    done = serve_with_host_loads(sched, swa_parity.MAX_NEW)
    assert_sharded(sched, 2)
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes() if n.value is not None)
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def _engine_cache(tp: int, name: str = "tiny") -> Any:
    from kvjax import CacheConfig, ModelSpec, build_kv_cache

    config = CacheConfig(
        tp_size=tp, page_size=4, max_total_tokens=64, context_length=64, enable_hierarchical_cache=True
    )
    return build_kv_cache(ModelSpec.preset(name), config, mesh=mesh_of(tp))


def _fill(cache: Any, seed: int) -> list[np.ndarray]:
    """Random pages in every layer (equal copies of each replicated head); the new pools handed in."""
    from kvjax.transfers.device_pages import page_layers, with_page_layers

    pool = cache.pools.kv
    layers = page_layers(pool)
    rng = np.random.default_rng(seed)
    replicas = cache.host_pool.kv_head_replicas
    values = []
    for x in layers:
        v = rng.standard_normal(x.shape).astype(np.float32)
        if x.ndim == 4 and replicas > 1:  # [pages, page, 2 * heads, D]: copies of the group's first head
            heads = v.reshape(*x.shape[:2], x.shape[2] // 2, 2, x.shape[3])
            v = heads[:, :, (np.arange(heads.shape[2]) // replicas) * replicas].reshape(x.shape)
        values.append(v)
    # Written by a compiled program, so each buffer is one XLA allocated (and aligned) as it does a
    # pool's: a buffer put from numpy may be aligned too little for XLA's CPU backend to donate in
    # place, and the in-place checks below compare buffer addresses.
    new = tuple(_owned(jax.device_put(v, x.sharding)) for v, x in zip(values, layers, strict=True))
    cache.set_pools(cache.pools.replace(kv=with_page_layers(pool, new)))
    return values


@jax.jit
def _owned(x: jax.Array) -> jax.Array:
    return x + jnp.zeros((), x.dtype)


@pytest.mark.parametrize(("tp", "name"), [(2, "tiny"), (4, "tiny"), (2, "deepseek-tiny")])
def test_a_load_writes_each_shard_in_place(tp, name):
    """Backup of 2 pages, load into 2 others: the pages equal, every other page untouched, each
    device's layer buffer reused (donated), and the compiled scatter has no collective."""
    from kvjax.tiers.copy_engine import TransferStatus
    from kvjax.transfers.device_pages import page_layers
    from kvjax.transfers.transfer import _scatter_per_shard

    cache = _engine_cache(tp, name)
    engine = cache.tree_cache.host.engine
    before = _fill(cache, seed=tp)
    page = cache.plan.page_size
    host_slots = cache.host_pool.allocator.alloc(2 * page)
    backup = engine.start_backup(np.arange(2 * page, 4 * page), host_slots)
    assert engine.poll(backup, wait=True) is TransferStatus.DONE
    pointers = [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in page_layers(cache.pools.kv)]
    load = engine.start_load(host_slots, np.arange(5 * page, 7 * page))
    pools = cache.apply_pending(cache.pools)
    assert engine.poll(load, wait=True) is TransferStatus.DONE
    after = page_layers(pools.kv)
    assert [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in after] == pointers
    for old, new in zip(before, after, strict=True):
        new = np.asarray(new)
        np.testing.assert_array_equal(new[5:7], old[2:4])
        np.testing.assert_array_equal(np.delete(new, [5, 6], axis=0), np.delete(old, [5, 6], axis=0))
    text = (
        _scatter_per_shard(engine._mesh, engine._specs)
        .lower(after, load_buffer(after, engine), np.zeros(2, np.int32))
        .compile()
        .as_text()
    )
    assert not any(op in text for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all"))


def load_buffer(layers: Any, engine: Any) -> jax.ShapeDtypeStruct:
    from jax.sharding import NamedSharding

    from kvjax.transfers.transfer import _buffer_spec

    x = layers[0]
    shape = (len(layers), 2, *x.shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(engine._mesh, _buffer_spec(engine._specs[0])))


def test_a_retraction_backup_restores_every_shard_at_tp_4():
    """The ``host_pool`` retraction backup over replicated heads: a request's pages go to held host
    slots and come back into fresh pages, every shard equal."""
    from kvjax.transfers.device_pages import page_layers
    from kvjax.transfers.retraction_backup import RetractionBackup

    cache = _engine_cache(4)
    before = _fill(cache, seed=7)
    page = cache.plan.page_size
    retraction = RetractionBackup("host_pool", page, host=cache.tree_cache.host)
    assert retraction.backup("q", np.arange(page, 3 * page), 0, 2 * page)
    assert retraction.restore("q", np.arange(8 * page, 10 * page))
    pools = cache.apply_pending(cache.pools)
    retraction.poll(wait=True)
    assert retraction.restored == 1 and retraction.held == 0
    for old, new in zip(before, page_layers(pools.kv), strict=True):
        np.testing.assert_array_equal(np.asarray(new)[8:10], old[1:3])


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


def test_a_draft_models_host_pool_over_sharded_heads_is_refused_before_anything_is_built():
    from kvjax import CacheConfig, ModelSpec, build_kv_cache

    config = CacheConfig(
        speculative_algorithm="EAGLE",
        tp_size=2,
        max_total_tokens=256,
        context_length=64,
        enable_hierarchical_cache=True,
    )
    with pytest.raises(NotImplementedError, match="draft model's host pool .* tp_size=2"):
        build_kv_cache(ModelSpec.preset("tiny"), config, mesh=mesh_of(2))


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
