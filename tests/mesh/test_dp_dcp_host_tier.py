"""The host tier per DP rank under decode context parallelism: ``--dp 2 --tp 8 --dcp 2`` with
``enable_hierarchical_cache`` on 8 CPU devices gives Transformers' tokens.

The mesh is ``("data", "tp", "dcp")`` = 2 x 2 x 2: each DP rank a group of 4 devices, its pools'
KV heads over its 2 ``"tp"`` devices and its tokens striped over its 2 ``"dcp"`` devices (the
allocator's and the tree's page ``page_size * 2``). Each rank has its own host pool, built from its
plan as ``build_kv_cache`` builds it over the rank's ``("tp", "dcp")`` group (the host page the
striped page, every rank's rows once, rank-major: ``kvjax.tiers.head_shards``), its own
``HiRadixCache`` and ``RankPageTransferEngine``, which moves each device's rows of the rank's
slice in place. The tiny Llama is served round robin so that each rank's second prompt evicts its
first to the rank's host pool and the follow-ups load their prefixes back on both ranks (loads
counted); tokens equal Transformers' greedy ``generate`` and logits agree within 1e-4; every rank
ends leak free with its device and host accounting balanced.
"""

from __future__ import annotations

import jax
import pytest

from kvjax import CacheConfig
from kvjax.dp import LockstepDPScheduler
from kvjax.dp.rank_transfer import RankPageTransferEngine
from kvjax.mesh_check import make_serving_mesh
from kvjax.serve.scheduler import ServingReq
from tests.mesh.dp_balance import BalancedFront
from tests.mesh.test_dp_host_tier import _assert_leak_free_and_balanced, _host_extensions, _rank_prompts
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers

pytestmark = pytest.mark.mesh

DP, TP, DCP = 2, 8, 2
MAX_NEW = 6
ATOL = 1e-4
POOL_TOKENS = 48  # per rank, striped slots: a second prompt evicts the first to the host


def test_llama_host_tier_per_rank_loads_striped_prefixes_back_on_both_ranks(llama):
    hf, model = llama
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        tp_size=TP,
        dp_size=DP,
        enable_dp_attention=True,
        dcp_size=DCP,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    mesh = make_serving_mesh(TP, DP, True, devices=jax.devices(), dcp_size=DCP)
    front = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        policy="round_robin",
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
    )
    for scheduler in front.schedulers:
        view = scheduler.cache
        engine = view.tree_cache.host.engine
        assert isinstance(engine, RankPageTransferEngine) and engine.rank == view.rank
        assert view.host_pool is not None and view.host_pool.page_size == DCP, "the host page is the striped page"
        assert scheduler.page_size == DCP
    p = _rank_prompts()
    balanced = BalancedFront(front)
    done: dict[str, ServingReq] = {}
    for names in (("x0", "y0"), ("x1", "y1"), ("x0+", "y0+")):
        batch = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in names]
        balanced.run(batch)
        done.update((str(r.rid), r) for r in batch)
    assert [front.rank_of[n] for n in ("x0", "y0", "x1", "y1", "x0+", "y0+")] == [0, 1, 0, 1, 0, 1]
    hosts = _host_extensions(front)
    assert [h.loads > 0 and h.loaded_tokens > 0 for h in hosts] == [True, True], [h.loads for h in hosts]
    assert all(s.stats.evicted_tokens > 0 for s in front.schedulers)
    assert all(s.cache.pending.applied > 0 for s in front.schedulers), "each rank's loads go through its own queue"
    _assert_leak_free_and_balanced(front)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
