"""The host tier (HiCache L1 host pool, L2 load-back) over a pool striped over DCP ranks.

Under decode context parallelism the tree's page is ``page_size * dcp`` slots, logical token ``o``
of a page on DCP rank ``o % dcp`` at local row ``o // dcp`` (``kvjax.alloc.dcp``). The host page
keeps every rank's rows once, rank-major as the global page array (``kvjax.tiers.head_shards``):
each device gathers its own rows (and heads) of the moved pages inside ``shard_map`` and a load
scatters them back in place. The engine tests check that mapping slot by slot, that a load
reuses each device's buffers (donated) with no collective in the scatter, and that the
``host_pool`` retraction backup restores every rank's rows. The serving tests run the tiny Llama
at dcp 2 and tp 2 x dcp 2 with a device pool small enough that prefixes go to the host and come
back (loads asserted), Transformers' tokens and logits (1e-4), the host and device accounting
balanced and the cache leak free, and at tp 2 x dcp 2 retracted requests restored from the host
pool; the demo at dcp 2 with the host tier under memory pressure loads back and gives the cold
run's tokens.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import pytest

from kvjax.alloc.dcp import DCPStripe
from kvjax.cli import main
from kvjax.mesh_check import make_serving_mesh
from kvjax.serve.host_tier import HostTierExtension
from tests.mesh.test_tp_host_tier import _fill, load_buffer, serve_with_host_loads
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import assert_matches_transformers, build_scheduler, serve_two_rounds

MAX_NEW = 6
ATOL = 1e-4
PAGE = 2  # rows per rank and page in the engine tests (the striped page is PAGE * dcp slots)


def _engine_cache(dcp: int, tp: int, name: str) -> Any:
    from kvjax import CacheConfig, ModelSpec, build_kv_cache

    config = CacheConfig(
        tp_size=tp,
        dcp_size=dcp,
        page_size=PAGE,
        max_total_tokens=64,
        context_length=64,
        enable_hierarchical_cache=True,
    )
    return build_kv_cache(ModelSpec.preset(name), config, mesh=make_serving_mesh(tp, dcp_size=dcp))


def _rank_rows(layer: jax.Array, page: int) -> dict[int, np.ndarray]:
    """Each DCP rank's local rows of device page ``page`` (every head), read from its own shards."""
    out: dict[int, np.ndarray] = {}
    for shard in layer.addressable_shards:
        rank = (shard.index[1].start or 0) // PAGE
        rows = out.setdefault(rank, np.zeros((PAGE, *layer.shape[2:]), layer.dtype))
        rows[(slice(None), *shard.index[2:])] = np.asarray(shard.data)[page]
    return out


@pytest.mark.parametrize(
    ("dcp", "tp", "name"), [(2, 1, "tiny"), (4, 1, "tiny"), (2, 2, "tiny"), (2, 2, "deepseek-tiny")]
)
def test_a_backup_keeps_each_ranks_rows_where_the_stripe_puts_them_and_a_load_writes_them_in_place(dcp, tp, name):
    """Backup of 2 striped pages, load into 2 others: host row ``page_row(o)`` of a page holds
    logical token ``o``, read from rank ``o % dcp``'s local row ``o // dcp``; the loaded pages
    equal the backed-up ones, every other page is untouched, each device's layer buffer is reused
    (donated) and the compiled scatter has no collective."""
    from kvjax.tiers.copy_engine import TransferStatus
    from kvjax.transfers.device_pages import page_layers
    from kvjax.transfers.transfer import _scatter_per_shard

    cache = _engine_cache(dcp, tp, name)
    stripe = DCPStripe(PAGE, dcp)
    big = stripe.alloc_page_size
    host_pool = cache.host_pool
    assert host_pool.page_size == big == cache.plan.tree_page_size, "the host page is the striped page"
    engine = cache.tree_cache.host.engine
    before = _fill(cache, seed=dcp * 10 + tp)
    host_slots = host_pool.allocator.alloc(2 * big)
    backup = engine.start_backup(np.arange(2 * big, 4 * big), host_slots)
    assert engine.poll(backup, wait=True) is TransferStatus.DONE

    host = host_pool.read_pages(host_slots, np.float32)  # [layers, 2 pages, big, ...]
    for layer, array in enumerate(page_layers(cache.pools.kv)):
        for i, page in enumerate((2, 3)):
            local = _rank_rows(array, page)
            for offset in range(big):
                rank, row = int(stripe.owner(offset)), offset // dcp
                np.testing.assert_array_equal(host[layer, i, stripe.page_row(offset)], local[rank][row])

    pointers = [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in page_layers(cache.pools.kv)]
    load = engine.start_load(host_slots, np.arange(5 * big, 7 * big))
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


def test_a_retraction_backup_restores_every_ranks_rows_at_dcp_2_tp_2():
    """The ``host_pool`` retraction backup over striped pages: a request's pages go to held host
    slots and come back into fresh pages, every rank's rows equal."""
    from kvjax.transfers.device_pages import page_layers
    from kvjax.transfers.retraction_backup import RetractionBackup

    cache = _engine_cache(2, 2, "tiny")
    before = _fill(cache, seed=3)
    big = cache.plan.tree_page_size
    retraction = RetractionBackup("host_pool", big, host=cache.tree_cache.host)
    assert retraction.backup("q", np.arange(big, 3 * big), 0, 2 * big)
    assert retraction.restore("q", np.arange(8 * big, 10 * big))
    pools = cache.apply_pending(cache.pools)
    retraction.poll(wait=True)
    assert retraction.restored == 1 and retraction.held == 0
    for old, new in zip(before, page_layers(pools.kv), strict=True):
        np.testing.assert_array_equal(np.asarray(new)[8:10], old[1:3])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_checkpoint("llama", tmp_path_factory)


@pytest.mark.parametrize(("dcp", "tp"), [(2, 1), (2, 2)])
def test_llama_loads_back_striped_pages_from_the_host_with_transformers_tokens(dcp, tp, llama):
    hf, model = llama
    sched = build_scheduler(
        model,
        mesh=make_serving_mesh(tp, dcp_size=dcp, devices=jax.devices()),
        tp_size=tp,
        dcp_size=dcp,
        max_batch_size=2,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    assert sched.cache.pools.kv.context_axis == "dcp" and sched.cache.host_pool.page_size == dcp
    done = serve_with_host_loads(sched, MAX_NEW)  # loads > 0, leak free, host and device balanced
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_llama_retracted_requests_restored_from_the_host_pool_at_tp_2_dcp_2(llama):
    """``disaggregation_decode_retraction_backup='host_pool'`` over striped pages: the two rounds
    retract requests, back them up into held host slots and restore them (not recompute), a
    prefix also comes back from the host, and the tokens are Transformers'."""
    hf, model = llama
    sched = build_scheduler(
        model,
        mesh=make_serving_mesh(2, dcp_size=2, devices=jax.devices()),
        tp_size=2,
        dcp_size=2,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        disaggregation_decode_retraction_backup="host_pool",
    )
    done = serve_two_rounds(sched, MAX_NEW)  # asserts leak free
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    assert host.retraction is not None and sched.stats.retractions > 0
    assert host.retraction.backed_up > 0 and host.retraction.restored > 0 and host.loads > 0
    sched.cache.tree_cache.check_transfers(wait=True)
    host.retraction.poll(wait=True)
    assert host.retraction.held == 0 and host.host_balanced()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_demo_at_dcp_2_with_the_host_tier_under_memory_pressure_is_leak_free_and_cold_equals_warm(capsys):
    """The command line end to end: a pool of 128 striped slots evicts prefixes to the host and
    loads them back; the warm run's tokens equal the cold run's (radix cache off)."""
    argv = ["demo", "--dcp", "2", "--enable-hierarchical-cache", "--page-size", "2", "--max-total-tokens", "128"]
    argv += ["--groups", "2", "--prompts-per-group", "2", "--chats", "1", "--turns", "2", "--system-tokens", "32"]
    assert main([*argv, "--output-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["host_loaded_tokens"] > 0 and report["evicted_tokens"] > 0, report
    assert report["leak_free"] and report["cold_equals_warm"] and report["host_balanced"], report
