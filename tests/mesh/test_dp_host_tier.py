"""The host tier (HiCache), its storage tier and the retraction backups under lockstep DP attention, dp 2 x tp 2.

Each DP rank has its own host pool, ``HiRadixCache`` and ``RankPageTransferEngine``
(``kvjax.dp.rank_transfer``): a backup gathers the rank's pages of its slice of the stacked pools
(each of its ``"tp"`` devices its own KV heads) into its host pool, and a load scatters them back
into that slice only, in place. The engine tests check it on the built DP cache (dp 2 x tp 2,
dp 2 x tp 4 with each KV head replicated over two devices, and DeepSeek-V2's MLA latent): the
rank's pages come back, every other page of either rank is untouched, the layers' buffers are
reused (donated), and the scatter has no collective; the ``host_pool`` and ``cpu_tensor``
retraction copies restore a rank's pages the same way.

The serving tests run Transformers' tiny Llama (random weights) with ``LockstepDPScheduler`` over
a ``("data", "tp")`` mesh of 2 x 2 CPU devices through a pool small enough (48 tokens per rank)
that prefixes are evicted to each rank's host pool and loaded back on both ranks (each rank's
load counter > 0); every request's greedy tokens equal Transformers' and its logits agree
within 1e-4; every rank ends leak free with its device and host accounting balanced (device
balance checked after every round, ``tests.mesh.dp_balance``). The retraction backups
(``host_pool`` with the host tier, ``cpu_tensor`` without it) back up retracted requests and
restore them when they are admitted again, with the same tokens. The storage tier: each rank
writes its pages behind its host pool, and a cold server's ranks prefetch the pages the other
rank wrote, with the same tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec
from kvjax.dp import LockstepDPScheduler, build_dp_kv_cache
from kvjax.dp.rank_cache import rank_caches
from kvjax.dp.rank_transfer import RankPageTransferEngine, rank_page_copy, rank_page_load
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import ServingReq
from kvjax.tiers.copy_engine import TransferStatus
from kvjax.transfers.device_pages import page_layers, with_page_layers
from kvjax.transfers.retraction_backup import RetractionBackup
from tests.mesh.dp_balance import BalancedFront
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, VOCAB, assert_matches_transformers, serve_two_rounds

pytestmark = pytest.mark.mesh

DP, TP = 2, 2
MAX_NEW = 6
ATOL = 1e-4
POOL_TOKENS = 48  # per rank: a second prompt evicts the first to the host
PAGE = 4  # the engine tests' page size


def _mesh(tp: int) -> Any:
    return jax.make_mesh((DP, tp), ("data", "tp"), devices=jax.devices()[: DP * tp])


def _front(model: LoadedModel, policy: str, **cache_config: Any) -> LockstepDPScheduler:
    settings: dict[str, Any] = dict(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
    )
    return LockstepDPScheduler.build_lockstep(
        model.spec,
        CacheConfig(**{**settings, **cache_config}),
        model.params,
        _mesh(TP),
        policy=policy,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
    )


def _host_extensions(front: LockstepDPScheduler) -> list[HostTierExtension]:
    return [next(e for e in s.extensions if isinstance(e, HostTierExtension)) for s in front.schedulers]


def _assert_leak_free_and_balanced(front: LockstepDPScheduler) -> None:
    for scheduler in front.schedulers:
        scheduler.cache.tree_cache.check_transfers(wait=True)
    assert [s.leak_free() for s in front.schedulers] == [True] * DP
    for scheduler, host in zip(front.schedulers, _host_extensions(front), strict=True):
        assert host.host_balanced(), f"rank {scheduler.cache.rank}: the host accounting does not balance"
        scheduler.cache.tree_cache.sanity_check()
        scheduler.cache.token_to_kv_pool_allocator.check_invariants()


def _rank_prompts() -> dict[str, list[int]]:
    """Four prompts without a common prefix, 30 tokens each (with ``MAX_NEW`` tokens of output two
    do not fit a rank's pool together), and their follow-ups (the prompt plus 5 tokens)."""
    rng = np.random.default_rng(11)
    first = {name: [int(t) for t in rng.integers(0, VOCAB, 30)] for name in ("x0", "y0", "x1", "y1")}
    again = {f"{name}+": tokens + [int(t) for t in rng.integers(0, VOCAB, 5)] for name, tokens in first.items()}
    return {**first, **again}


def test_llama_host_tier_loads_prefixes_back_on_both_ranks(llama):
    """Round robin over two ranks: ``x0`` and ``x1`` go to rank 0, ``y0`` and ``y1`` to rank 1, so
    each rank's second prompt evicts its first to the rank's host pool; the follow-ups of the first
    prompts then load their prefixes back from the host on both ranks."""
    hf, model = llama
    front = _front(model, "round_robin", enable_hierarchical_cache=True, hicache_ratio=8.0)
    for scheduler in front.schedulers:
        view = scheduler.cache
        engine = view.tree_cache.host.engine
        assert isinstance(engine, RankPageTransferEngine) and engine.rank == view.rank
        assert view.host_pool is not None and view.host_pool is engine.host_pool
    assert front.schedulers[0].cache.host_pool is not front.schedulers[1].cache.host_pool
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


@pytest.mark.parametrize("backup", ["host_pool", "cpu_tensor"])
def test_llama_retraction_backups_per_rank(backup, llama):
    """The parity rounds over 48-token pools retract on the ranks: the retracted requests' KV is
    backed up per rank (into the rank's host pool, or to numpy through the rank's copies), the
    tokens are Transformers' and every rank ends leak free."""
    hf, model = llama
    tier = {"enable_hierarchical_cache": True, "hicache_ratio": 8.0} if backup == "host_pool" else {}
    front = _front(model, "cache_aware", disaggregation_decode_retraction_backup=backup, **tier)
    done = serve_two_rounds(BalancedFront(front), MAX_NEW)  # type: ignore[arg-type]
    if backup == "host_pool":
        backups = [h.retraction for h in _host_extensions(front)]
        _assert_leak_free_and_balanced(front)
    else:
        backups = [
            next(e for e in s.extensions if isinstance(e, RetractionBackupExtension)).retraction
            for s in front.schedulers
        ]
        assert [s.leak_free() for s in front.schedulers] == [True] * DP
    assert all(b is not None and b.mode == backup for b in backups)
    assert sum(s.stats.retractions for s in front.schedulers) > 0
    assert sum(b.backed_up for b in backups if b is not None) > 0, "retracted requests should be backed up"
    assert sum(b.restored for b in backups if b is not None) > 0, "a re-admitted request should be restored"
    assert all(b is not None and b.held == 0 for b in backups)
    assert sorted(set(front.rank_of.values())) == [0, 1]
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _engine_cache(tp: int, name: str, **changes: Any) -> Any:
    settings: dict[str, Any] = dict(
        max_total_tokens=128,
        page_size=PAGE,
        tp_size=DP * tp,
        dp_size=DP,
        enable_dp_attention=True,
        context_length=32,
        max_running_requests=4,
        enable_hierarchical_cache=True,
    )
    return build_dp_kv_cache(ModelSpec.preset(name), CacheConfig(**{**settings, **changes}), _mesh(tp))


def _fill(cache: Any, seed: int) -> list[np.ndarray]:
    """Random pages in every layer of every rank (equal copies of each replicated head); the new
    pools handed in."""
    pool = cache.pools.kv
    layers = page_layers(pool)
    replicas = cache.ranks[0].host_pool.kv_head_replicas
    rng = np.random.default_rng(seed)
    values = []
    for x in layers:
        v = rng.standard_normal(x.shape).astype(np.float32)
        if x.ndim == 5 and replicas > 1:  # [rank, pages, page, 2 * heads, D]: the group's first head
            heads = v.reshape(*x.shape[:3], x.shape[3] // 2, 2, x.shape[4])
            v = heads[:, :, :, (np.arange(heads.shape[3]) // replicas) * replicas].reshape(x.shape)
        values.append(v)
    # Written by a compiled program: buffers XLA allocated (and aligned), which it donates in place.
    owned = jax.jit(lambda x: x + np.float32(0))
    new = tuple(owned(jax.device_put(v, x.sharding)) for v, x in zip(values, layers, strict=True))
    cache.set_pools(cache.pools.replace(kv=with_page_layers(pool, new)))
    return values


def _pointers(layers: Any) -> list[list[int]]:
    return [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in layers]


def _expect(before: list[np.ndarray], rank: int, dst: slice, src: slice) -> list[np.ndarray]:
    out = []
    for old in before:
        new = old.copy()
        new[rank, dst] = old[rank, src]
        out.append(new)
    return out


@pytest.mark.parametrize(("tp", "name"), [(2, "tiny"), (4, "tiny"), (2, "deepseek-tiny")])
def test_a_rank_load_writes_only_its_slice_in_place(tp, name):
    """Rank 1 backs up its pages 2 and 3 and loads them into its pages 5 and 6: they equal, every
    other page of both ranks is untouched, each device's buffer is reused, and the compiled
    scatter has no collective. Each rank has its own host pool (replicated heads kept once)."""
    cache = _engine_cache(tp, name)
    views = rank_caches(cache)
    assert len({id(r.host_pool) for r in cache.ranks}) == DP
    if name == "tiny":
        assert cache.ranks[0].host_pool.page_row[1] == 2 * ModelSpec.preset(name).num_kv_heads
        assert cache.ranks[0].host_pool.kv_head_replicas == max(1, tp // ModelSpec.preset(name).num_kv_heads)
    before = _fill(cache, seed=tp)
    rank = 1
    view = views[rank]
    engine = view.tree_cache.host.engine
    host_slots = view.host_pool.allocator.alloc(2 * PAGE)
    backup = engine.start_backup(np.arange(2 * PAGE, 4 * PAGE), host_slots)
    assert engine.poll(backup, wait=True) is TransferStatus.DONE
    pointers = _pointers(page_layers(cache.pools.kv))
    load = engine.start_load(host_slots, np.arange(5 * PAGE, 7 * PAGE))
    assert views[0].pending.count == 0 and view.pending.count == 1, "the load is on the rank's own queue"
    pools = view.apply_pending(view.pools)
    assert engine.poll(load, wait=True) is TransferStatus.DONE
    after = page_layers(pools.kv)
    assert _pointers(after) == pointers
    for new, expected in zip(after, _expect(before, rank, slice(5, 7), slice(2, 4)), strict=True):
        np.testing.assert_array_equal(np.asarray(new), expected)
    from kvjax.dp.rank_transfer import _buffer_spec, _scatter_program

    buffer = jax.ShapeDtypeStruct(
        (DP, len(after), 2, *after[0].shape[2:]),
        after[0].dtype,
        sharding=jax.sharding.NamedSharding(engine._mesh, _buffer_spec(engine._specs[0])),
    )
    text = _scatter_program(engine._mesh, engine._specs).lower(after, buffer, np.zeros((DP, 2), np.int32)).compile()
    assert not any(op in text.as_text() for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all"))


def test_retraction_copies_of_a_rank_restore_only_its_slice():
    """Rank 0: the ``host_pool`` backup of pages 1 and 2 restored into pages 8 and 9 (held host
    slots freed), then the ``cpu_tensor`` copies of pages 3 and 4 restored into pages 10 and 11;
    rank 1's slice and every other page untouched."""
    cache = _engine_cache(4, "tiny")
    views = rank_caches(cache)
    before = _fill(cache, seed=5)
    rank = 0
    view = views[rank]
    retraction = RetractionBackup("host_pool", PAGE, host=view.tree_cache.host)
    assert retraction.backup("q", np.arange(PAGE, 3 * PAGE), 0, 2 * PAGE)
    assert retraction.restore("q", np.arange(8 * PAGE, 10 * PAGE))
    view.apply_pending(view.pools)
    retraction.poll(wait=True)
    assert retraction.restored == 1 and retraction.held == 0
    copies = RetractionBackup(
        "cpu_tensor", PAGE, pending=view.pending, get_copy=rank_page_copy(rank), load_copy=rank_page_load(rank)
    )
    assert copies.backup("r", np.arange(3 * PAGE, 5 * PAGE), 0, 2 * PAGE)
    assert copies.restore("r", np.arange(10 * PAGE, 12 * PAGE))
    pools = view.apply_pending(view.pools)
    expected = _expect(_expect(before, rank, slice(8, 10), slice(1, 3)), rank, slice(10, 12), slice(3, 5))
    for new, want in zip(page_layers(pools.kv), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(new), want)


def _storage_front(model: LoadedModel, directory: Any) -> LockstepDPScheduler:
    return _front(
        model,
        "round_robin",
        max_total_tokens=96,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_model_fingerprint=model.fingerprint,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=8,
    )


def test_llama_storage_tier_per_rank_read_back_by_a_cold_dp_server(llama, tmp_path):
    """Each rank writes its pages to the storage tier behind its host pool (``x0`` from rank 0,
    ``y0`` from rank 1); a cold server of the same layout routes the follow-ups the other way
    round (``y0+`` to rank 0, ``x0+`` to rank 1), and each rank prefetches the pages the other
    rank wrote (one key for every rank: the pages are content addressed), with Transformers'
    tokens, leak free."""
    hf, model = llama
    p = _rank_prompts()
    first = _storage_front(model, tmp_path)
    written = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in ("x0", "y0")]
    first.run(written)
    for scheduler in first.schedulers:
        tree = scheduler.cache.tree_cache
        tree.check_transfers(wait=True)
        tree.storage.check_writes(wait=True)
        tree.storage.storage.flush()
    assert [first.rank_of[n] for n in ("x0", "y0")] == [0, 1]
    assert any(tmp_path.glob("*/key.json")), "the ranks should write pages to storage"

    cold = _storage_front(model, tmp_path)
    again = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in ("y0+", "x0+")]
    cold.run(again)
    assert [cold.rank_of[n] for n in ("y0+", "x0+")] == [0, 1]
    hosts = _host_extensions(cold)
    assert [h.prefetched_tokens > 0 for h in hosts] == [True, True], [h.prefetched_tokens for h in hosts]
    assert all(s.stats.cached_tokens > 0 for s in cold.schedulers)
    _assert_leak_free_and_balanced(cold)
    assert_matches_transformers(hf, {str(r.rid): r for r in [*written, *again]}, max_new=MAX_NEW, atol=ATOL)
