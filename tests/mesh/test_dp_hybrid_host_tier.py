"""The host tier (HiCache) under lockstep DP attention for the sliding-window and recurrent-state kinds, dp 2 x tp 2.

Each DP rank has its own host pools, tree and engines, composed as a one-rank cache of its kinds
composes them but over the rank's slice of the stacked pools (``kvjax.dp.cache``): Gemma 3's
``HiSWARadixCache`` copies through a sliding-window pair whose halves (full layers, sliding
layers) are the rank's ``RankPageTransferEngine``; Qwen3-Next's ``HiMambaRadixCache`` copies its
KV pages through the rank's ``RankPageTransferEngine`` and its checkpoints through the rank's
``RankStateTransferEngine`` (``kvjax.dp.rank_state_transfer``). The engine test checks the state
engine on the built DP cache: a rank's checkpoints go to its host pool and come back into its
slice only, in place.

The serving tests run each tiny random-weight checkpoint with ``LockstepDPScheduler`` over a
``("data", "tp")`` mesh of 2 x 2 CPU devices, routed round robin so each rank serves three chats
whose first turns evict each other to the rank's host pool (a 48-token pool per rank); a chat's
second turn then loads its first turn back from the host on both ranks (each rank's load
counter > 0; for Qwen3-Next, each rank's checkpoints went to its host and came back). Every
request's greedy tokens equal Transformers' and its logits agree within 1e-4 (the DP parity
tests' tolerance); every rank ends leak free with its device, state-slot and host accounting balanced
(device balance checked after every round, ``tests.mesh.dp_balance``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from kvjax import CacheConfig
from kvjax.dp import LockstepDPScheduler, build_dp_kv_cache
from kvjax.dp.rank_state_transfer import RankStateTransferEngine
from kvjax.dp.rank_transfer import RankPageTransferEngine
from kvjax.radix import HiSWARadixCache
from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import ServingReq
from kvjax.tiers.copy_engine import TransferStatus
from kvjax.transfers.state_transfer import KVAndStateEngine
from kvjax.transfers.swa_transfer import SWAPageTransferEngine
from tests.mesh.dp_balance import BalancedFront
from tests.mesh.qwen3_next_tp import HEADS as QWEN3_NEXT_HEADS
from tests.mesh.qwen3_next_tp import LAYERS as QWEN3_NEXT_LAYERS
from tests.mesh.tp_serving import family_checkpoint
from tests.serve import random_workloads
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    TINY_CONFIG,
    VOCAB,
    assert_matches_transformers,
    tiny_checkpoint,
    transformers,
)
from tests.serve.test_parity_qwen3_next import MODEL_SEED as QWEN3_NEXT_SEED

pytestmark = pytest.mark.mesh

DP, TP = 2, 2
MAX_NEW = 6
POOL_TOKENS = 48  # per rank: a rank's second chat evicts its first to the host
ATOL = 1e-4  # the DP parity tests' logit tolerance (tests/mesh/test_dp_parity.py)


def _front(model: LoadedModel, **cache_config: Any) -> LockstepDPScheduler:
    settings: dict[str, Any] = dict(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    return LockstepDPScheduler.build_lockstep(
        model.spec,
        CacheConfig(**{**settings, **cache_config}),
        model.params,
        jax.make_mesh((DP, TP), ("data", "tp"), devices=jax.devices()[: DP * TP]),
        policy="round_robin",
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
    )


def _host_extensions(front: LockstepDPScheduler) -> list[HostTierExtension]:
    return [next(e for e in s.extensions if isinstance(e, HostTierExtension)) for s in front.schedulers]


def _serve_chats(front: LockstepDPScheduler) -> dict[str, ServingReq]:
    """Six 24-token chats without a common prefix, first turns in three rounds (``x0``, ``y0``,
    then ``x1``, ``y1``, then ``x2``, ``y2``: round robin puts the ``x`` chats on rank 0, the ``y``
    chats on rank 1), then the second turns of ``x0`` and ``y0`` (turn 1, its output and 5 new
    tokens), whose first turns the rank evicted to its host pool meanwhile."""
    rng = np.random.default_rng(11)
    names = [f"{chat}{i}" for i in range(3) for chat in "xy"]
    first = {name: [int(t) for t in rng.integers(0, VOCAB, 24)] for name in names}
    balanced = BalancedFront(front)
    done: dict[str, ServingReq] = {}
    for pair in zip(names[::2], names[1::2], strict=True):
        batch = [ServingReq(n, first[n], max_new_tokens=MAX_NEW) for n in pair]
        balanced.run(batch)
        done.update((str(r.rid), r) for r in batch)
    again = []
    for name in ("x0", "y0"):
        turn2 = first[name] + list(done[name].output_ids) + [int(t) for t in rng.integers(0, VOCAB, 5)]
        again.append(ServingReq(f"{name}+", turn2, max_new_tokens=MAX_NEW))
    balanced.run(again)
    done.update((str(r.rid), r) for r in again)
    assert [front.rank_of[n] for n in (*names, "x0+", "y0+")] == [0, 1] * 4
    return done


def _assert_loaded_back_on_both_ranks_leak_free(front: LockstepDPScheduler, done: dict[str, ServingReq]) -> None:
    hosts = _host_extensions(front)
    assert [h.loads > 0 and h.loaded_tokens > 0 for h in hosts] == [True] * DP, [h.loads for h in hosts]
    assert all(s.stats.evicted_tokens > 0 for s in front.schedulers)
    assert all(s.cache.pending.applied > 0 for s in front.schedulers), "each rank's loads go through its own queue"
    for name in ("x0+", "y0+"):  # the second turn resumes from the first turn (loaded back from the host)
        assert (done[name].first_cached_tokens or 0) >= 24, (name, done[name].first_cached_tokens)
    for scheduler, host in zip(front.schedulers, hosts, strict=True):
        scheduler.cache.tree_cache.check_transfers(wait=True)
        assert scheduler.leak_free(), f"rank {scheduler.cache.rank} leaked"
        assert host.host_balanced(), f"rank {scheduler.cache.rank}: the host accounting does not balance"
        scheduler.cache.tree_cache.sanity_check()
        scheduler.cache.token_to_kv_pool_allocator.check_invariants()


def test_gemma3_sliding_window_host_pools_per_rank(tmp_path_factory):
    """Each rank's sliding-window pair copies its full and sliding layers' pages through the
    rank's own page engines into the rank's two host pools, and loads them back into its slices."""
    hf, model = family_checkpoint("gemma3", tmp_path_factory)
    front = _front(model)
    for scheduler in front.schedulers:
        view = scheduler.cache
        tree = view.tree_cache
        assert isinstance(tree, HiSWARadixCache) and isinstance(tree.host.engine, SWAPageTransferEngine)
        halves = tree.host.engine.engines
        assert [type(e) for e in halves] == [RankPageTransferEngine] * 2 and {e.rank for e in halves} == {view.rank}
        assert [e.ref.target for e in halves] == ["swa.full", "swa.swa"]
        assert halves[0].host_pool is view.host_pool and halves[1].host_pool is not view.host_pool
    assert front.schedulers[0].cache.host_pool is not front.schedulers[1].cache.host_pool
    done = _serve_chats(front)
    _assert_loaded_back_on_both_ranks_leak_free(front, done)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _qwen3_next(tmp_path_factory: Any) -> tuple[Any, LoadedModel]:
    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **QWEN3_NEXT_LAYERS, **QWEN3_NEXT_HEADS[TP])
    return tiny_checkpoint(config, tmp_path_factory, "qwen3_next_dp_host", seed=QWEN3_NEXT_SEED)


def test_qwen3_next_checkpoints_through_each_ranks_host(tmp_path_factory):
    """Each rank's KV pages and recurrent-state checkpoints go to the rank's host pools and come
    back into its slices; the second turns continue from the loaded checkpoints."""
    hf, model = _qwen3_next(tmp_path_factory)
    front = _front(model, max_mamba_cache_size=12)
    for scheduler in front.schedulers:
        view = scheduler.cache
        tree = view.tree_cache
        assert isinstance(tree, HiMambaRadixCache) and isinstance(tree.host.engine, KVAndStateEngine)
        kv, state = tree.host.engine.engines
        assert isinstance(kv, RankPageTransferEngine) and isinstance(state, RankStateTransferEngine)
        assert kv.rank == state.rank == view.rank and state.host_pool is view.host_pools["host_state"]
    done = _serve_chats(front)
    _assert_loaded_back_on_both_ranks_leak_free(front, done)
    for scheduler in front.schedulers:
        tree = scheduler.cache.tree_cache
        assert tree.mamba.backups > 0 and tree.mamba.loads > 0, f"rank {scheduler.cache.rank}: no checkpoint came back"
        table = scheduler.cache.req_to_token_pool
        held = tree.mamba_evictable_size() + tree.mamba_protected_size()
        assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_rank_state_engine_moves_only_its_rank_slice():
    """Rank 1's engine backs up two of its state slots into its host pool and loads them into two
    other slots: those slots of rank 1 get the rows, in place (the arrays' buffers reused), every
    other slot of either rank is untouched; rank 0's engine is another object over rank 0's pool."""
    spec, _, _ = random_workloads.model("qwen3-next-tiny")
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        max_mamba_cache_size=12,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
        enable_hierarchical_cache=True,
    )
    cache = build_dp_kv_cache(spec, config, jax.make_mesh((DP, TP), ("data", "tp"), devices=jax.devices()[: DP * TP]))
    engines = [rank.tree_cache.host.engine.state for rank in cache.ranks]
    assert [e.rank for e in engines] == [0, 1] and engines[0].host_pool is not engines[1].host_pool
    assert engines[1].num_slots >= 5
    state = cache.pools.recurrent
    rng = np.random.default_rng(0)
    before = [rng.standard_normal(a.shape).astype(a.dtype) for a in state.arrays()]
    owned = jax.jit(lambda x: x + np.zeros((), x.dtype))  # buffers XLA allocated, which it donates in place
    new = tuple(owned(jax.device_put(v, a.sharding)) for v, a in zip(before, state.arrays(), strict=True))
    cache.set_pools(cache.pools.replace(recurrent=state.replace(conv=new[:-1], ssm=new[-1])))
    rank = cache.ranks[1]
    engine = engines[1]
    host_slots = engine.host_pool.allocator.alloc(2)
    backup = engine.start_backup(np.array([2, 5]), host_slots)
    cache.set_pools(rank.pending.apply(cache.pools))
    assert engine.poll(backup, wait=True) is TransferStatus.DONE
    for host, b in zip(engine.host_pool.arrays, before, strict=True):  # host [slot, layer, *row]
        np.testing.assert_array_equal(host[host_slots], np.swapaxes(b[1][:, [2, 5]], 0, 1))
    pointers = [[s.data.unsafe_buffer_pointer() for s in a.addressable_shards] for a in cache.pools.recurrent.arrays()]
    load = engine.start_load(host_slots, np.array([1, 3]))
    cache.set_pools(rank.pending.apply(cache.pools))
    assert engine.poll(load, wait=True) is TransferStatus.DONE
    after = cache.pools.recurrent.arrays()
    assert [[s.data.unsafe_buffer_pointer() for s in a.addressable_shards] for a in after] == pointers
    for a, b in zip(after, before, strict=True):
        want = b.copy()
        want[1][:, [1, 3]] = b[1][:, [2, 5]]
        np.testing.assert_array_equal(np.asarray(a), want)
