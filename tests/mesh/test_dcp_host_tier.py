"""The host tier (HiCache L1 host pool, L2 load-back) over a pool striped over DCP ranks.

Under decode context parallelism the tree's page is ``page_size * dcp`` slots, logical token ``o``
of a page on DCP rank ``o % dcp`` at local row ``o // dcp`` (``kvjax.alloc.dcp``). The host page
keeps every rank's rows once, rank-major as the global page array (``kvjax.tiers.head_shards``):
each device gathers its own rows (and heads) of the moved pages inside ``shard_map`` and a load
scatters them back in place. The engine tests check that mapping slot by slot, that a load
reuses each device's buffers (donated) with no collective in the scatter, and that the
``host_pool`` retraction backup restores every rank's rows. DCP divides the TP group (``tp 4 x dcp
2``: a ``("tp", "dcp")`` mesh of 4 devices, KV heads over 2 ``"tp"`` ranks, tokens over 2). The
serving tests run the tiny Llama at tp 2 x dcp 2 and tp 4 x dcp 2 with a device pool small enough
that prefixes go to the host and come back (loads asserted), Transformers' tokens and logits
(1e-4), the host and device accounting balanced and the cache leak free, and at tp 4 x dcp 2
retracted requests restored from the host pool; the demo at tp 2 x dcp 2 with the host tier under
memory pressure loads back and gives the cold run's tokens.
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
from tests.caches import host_tier_cache
from tests.mesh import sharded_host_tier
from tests.serve.parity_harness import assert_matches_transformers, host_tier_scheduler, serve_two_rounds

MAX_NEW = 6
ATOL = 1e-4
PAGE = 2  # rows per rank and page in the engine tests (the striped page is PAGE * dcp slots)


def _engine_cache(tp: int, dcp: int, name: str) -> Any:
    return host_tier_cache(name, mesh=make_serving_mesh(tp, dcp_size=dcp), tp_size=tp, dcp_size=dcp, page_size=PAGE)


def _rank_rows(layer: jax.Array, page: int) -> dict[int, np.ndarray]:
    """Each DCP rank's local rows of device page ``page`` (every head), read from its own shards."""
    out: dict[int, np.ndarray] = {}
    for shard in layer.addressable_shards:
        rank = (shard.index[1].start or 0) // PAGE
        rows = out.setdefault(rank, np.zeros((PAGE, *layer.shape[2:]), layer.dtype))
        rows[(slice(None), *shard.index[2:])] = np.asarray(shard.data)[page]
    return out


@pytest.mark.parametrize(
    ("tp", "dcp", "name"), [(2, 2, "tiny"), (4, 4, "tiny"), (4, 2, "tiny"), (4, 2, "deepseek-tiny")]
)
def test_a_backup_keeps_each_ranks_rows_where_the_stripe_puts_them_and_a_load_writes_them_in_place(tp, dcp, name):
    """Backup of 2 striped pages, load into 2 others: host row ``page_row(o)`` of a page holds
    logical token ``o``, read from rank ``o % dcp``'s local row ``o // dcp``; the loaded pages
    equal the backed-up ones, every other page is untouched, each device's layer buffer is reused
    (donated) and the compiled scatter has no collective."""
    from kvjax.transfers.device_pages import page_layers

    cache = _engine_cache(tp, dcp, name)
    stripe = DCPStripe(PAGE, dcp)
    big = stripe.alloc_page_size
    host_pool = cache.host_pool
    assert host_pool.page_size == big == cache.plan.tree_page_size, "the host page is the striped page"
    before = sharded_host_tier.fill(cache, seed=dcp * 10 + tp)
    host_slots = sharded_host_tier.back_up_pages_2_and_3(cache, big)

    host = host_pool.read_pages(host_slots, np.float32)  # [layers, 2 pages, big, ...]
    for layer, array in enumerate(page_layers(cache.pools.kv)):
        for i, page in enumerate((2, 3)):
            local = _rank_rows(array, page)
            for offset in range(big):
                rank, row = int(stripe.owner(offset)), offset // dcp
                np.testing.assert_array_equal(host[layer, i, stripe.page_row(offset)], local[rank][row])

    sharded_host_tier.assert_a_load_writes_in_place(cache, host_slots, before, big)


def test_a_retraction_backup_restores_every_ranks_rows_at_tp_4_dcp_2():
    """The ``host_pool`` retraction backup over striped pages: a request's pages go to held host
    slots and come back into fresh pages, every rank's rows equal."""
    cache = _engine_cache(4, 2, "tiny")
    before = sharded_host_tier.fill(cache, seed=3)
    sharded_host_tier.assert_a_retraction_backup_restores(cache, before, cache.plan.tree_page_size)


@pytest.mark.parametrize(("tp", "dcp"), [(2, 2), (4, 2)])
def test_llama_loads_back_striped_pages_from_the_host_with_transformers_tokens(tp, dcp, llama):
    hf, model = llama
    mesh = make_serving_mesh(tp, dcp_size=dcp, devices=jax.devices())
    sched = host_tier_scheduler(model, mesh=mesh, tp_size=tp, dcp_size=dcp, max_batch_size=2)
    assert sched.cache.pools.kv.context_axis == "dcp" and sched.cache.host_pool.page_size == dcp
    done = sharded_host_tier.serve_with_host_loads(sched, MAX_NEW)  # loads > 0, leak free, host and device balanced
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_llama_retracted_requests_restored_from_the_host_pool_at_tp_4_dcp_2(llama):
    """``disaggregation_decode_retraction_backup='host_pool'`` over striped pages: the two rounds
    retract requests, back them up into held host slots and restore them (not recompute), a
    prefix also comes back from the host, and the tokens are Transformers'."""
    hf, model = llama
    mesh = make_serving_mesh(4, dcp_size=2, devices=jax.devices())
    sched = host_tier_scheduler(
        model, mesh=mesh, tp_size=4, dcp_size=2, disaggregation_decode_retraction_backup="host_pool"
    )
    done = serve_two_rounds(sched, MAX_NEW)  # asserts leak free
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    assert host.retraction is not None and sched.stats.retractions > 0
    assert host.retraction.backed_up > 0 and host.retraction.restored > 0 and host.loads > 0
    sched.cache.tree_cache.check_transfers(wait=True)
    host.retraction.poll(wait=True)
    assert host.retraction.held == 0 and host.host_balanced()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_demo_at_tp_2_dcp_2_with_the_host_tier_under_memory_pressure_is_leak_free_and_cold_equals_warm(capsys):
    """The command line end to end: a pool of 128 striped slots evicts prefixes to the host and
    loads them back; the warm run's tokens equal the cold run's (radix cache off)."""
    argv = [
        "demo",
        "--tp",
        "2",
        "--dcp",
        "2",
        "--enable-hierarchical-cache",
        "--page-size",
        "2",
        "--max-total-tokens",
        "128",
    ]
    argv += ["--groups", "2", "--prompts-per-group", "2", "--chats", "1", "--turns", "2", "--system-tokens", "32"]
    assert main([*argv, "--output-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["host_loaded_tokens"] > 0 and report["evicted_tokens"] > 0, report
    assert report["leak_free"] and report["cold_equals_warm"] and report["host_balanced"], report
