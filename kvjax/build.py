"""`build_kv_cache`: execute a plan — allocate the device pools and the host bookkeeping.

The build is the only place that touches devices. It plans first (every decision and error
happens in ``plan_kv_cache``), checks that every pool of the plan has a builder in the pool kind
registry (``kvjax.pools.registry``; a kind not built yet raises ``NotImplementedError`` naming its
capability, before anything is allocated), then loops over ``plan.pools`` and builds each through
its kind: device pools (zeros, created directly on their devices, sharded over the mesh when one is
given) and the request→token table; then the token allocator and the tree cache
(``kvjax.radix.create_tree_cache`` picks it from the plan).

Ownership of device state: a ``KVCache`` owns the *current* device state of its pools.
``cache.pools`` always reads live arrays as long as whoever runs a donated step stores its result
back with ``cache.set_pools(new_pools)`` (the serving scheduler does, after every step).
``cache.with_pools(new_pools)`` is the functional alternative: a new holder sharing the same host
objects (allocator, request table, tree), after which the old holder's pools may be stale.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from jax.sharding import Mesh

from kvjax.alloc import SWATokenToKVPoolAllocator, make_allocator
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan import CachePlan, plan_kv_cache
from kvjax.plan.buildable import check_host_tier_buildable
from kvjax.plan.draft import DRAFT_HOST_POOL_NAME
from kvjax.plan.pool_plans import SWA_HOST_POOL_NAME
from kvjax.pools.cache_pools import CachePools
from kvjax.pools.pool_plan import PoolPlan
from kvjax.pools.registry import BuildContext, pool_kind
from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol, TreeCacheProtocol
from kvjax.radix import create_tree_cache
from kvjax.req_pool import ReqToTokenPool
from kvjax.spec import ModelSpec
from kvjax.tiers.draft_pools import check_draft_buildable, with_draft_transfers

KV_HEAD_MESH_AXIS = "tp"
# Structures remembered by ``KVCache`` (one per compiled step shape; more only clears the memo).
_MAX_CHECKED_ORIGINS = 64


class KVCache:
    """A built KV cache: its plan, its device pools and its host bookkeeping.

    SGLang's ``KVCacheBuildResult`` names read from the plan (``is_hybrid_swa``, ``is_hybrid_ssm``,
    ``sliding_window_size``, ``full_tokens_per_layer``, ``swa_tokens_per_layer``,
    ``disable_radix_cache``) or are the host objects (``req_to_token_pool``,
    ``token_to_kv_pool_allocator``, ``tree_cache``).

    Ownership rule: the cache owns the current device state. ``pools`` is replaced, never mutated:
    a donated step consumes the arrays it is given, so store what it returns with
    :meth:`set_pools` (this mutates the holder: every reference to this ``KVCache`` sees the new
    state). The allocator, request table and tree cache are host objects mutated in place.
    """

    __slots__ = (
        "_pools",
        "_pools_structure",
        "_checked_origins",
        "draft_host_pool",
        "host_pool",
        "swa_host_pool",
        "plan",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "tree_cache",
    )

    def __init__(
        self,
        *,
        plan: CachePlan,
        pools: CachePools,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: AllocatorProtocol,
        tree_cache: TreeCacheProtocol,
        host_pool: Any = None,
        draft_host_pool: Any = None,
        swa_host_pool: Any = None,
    ) -> None:
        self.plan = plan
        self.host_pool = host_pool  # the host tier's HostKVPool (None without a host tier)
        # The draft model's host pool, host slots one to one with host_pool's (None without one).
        self.draft_host_pool = draft_host_pool
        # A hybrid-SWA cache's second host pool (the sliding layers), host slots one to one with
        # host_pool's (the full layers); None otherwise.
        self.swa_host_pool = swa_host_pool
        if not isinstance(pools, CachePools):
            raise TypeError(f"KVCache: expected CachePools, got {type(pools).__name__}")
        self._pools = pools
        # Fixed for the holder's life (set_pools only accepts the same structure): computed once,
        # so the check on every serving step flattens only the new pools.
        self._pools_structure: Any = jax.tree_util.tree_structure(pools)
        # Origins (``CachePools.origin``) of pools that passed the structure check, by identity;
        # the values keep the tuples alive so that an id is never reused while it is a key.
        self._checked_origins: dict[int, tuple[str, ...]] = {}
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache

    # --- device state ---------------------------------------------------------------------------

    @property
    def pools(self) -> CachePools:
        """The current device state (a pytree; donate it into a step, then :meth:`set_pools`)."""
        return self._pools

    def set_pools(self, pools: CachePools) -> None:
        """Store the device state a (donated) step returned: mutates this holder.

        Raises ``TypeError`` (the cache unchanged) unless ``pools`` is a ``CachePools`` with the
        same pools and array structure as the current state.
        """
        self._check_same_structure(pools, "set_pools")
        self._pools = pools

    def with_pools(self, pools: CachePools) -> KVCache:
        """A new holder of ``pools`` sharing this cache's plan and host objects (functional form
        of :meth:`set_pools`; this holder is left as it is)."""
        self._check_same_structure(pools, "with_pools")
        return KVCache(
            plan=self.plan,
            pools=pools,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            host_pool=self.host_pool,
            draft_host_pool=self.draft_host_pool,
            swa_host_pool=self.swa_host_pool,
        )

    def _check_same_structure(self, pools: Any, what: str) -> None:
        """Raise ``TypeError`` unless ``pools`` has the cache's tree structure.

        Run once per structure, not once per step: pools JAX rebuilt from a treedef (a compiled
        step's outputs) carry that treedef's names tuple as their ``origin``, and every object
        rebuilt from it has its structure. An origin whose pools passed the full check once is
        accepted by identity afterwards (an attribute read and a dict lookup); anything else
        (pools built by hand, the first output of each compiled step) is flattened and compared.
        """
        if not isinstance(pools, CachePools):
            raise TypeError(f"{what}: expected CachePools, got {type(pools).__name__}")
        origin = pools.origin
        if origin is not None and self._checked_origins.get(id(origin)) is origin:
            return
        # PyTreeDefs are equal iff same structure and static metadata (names, page size, dtype, ...).
        if jax.tree_util.tree_structure(pools) != self._pools_structure:
            raise TypeError(
                f"{what}: the new pools {pools.names} do not have the structure of the cache's {self._pools.names} "
                "(pass what the step returned for cache.pools)"
            )
        if origin is not None:
            if len(self._checked_origins) >= _MAX_CHECKED_ORIGINS:
                self._checked_origins.clear()  # bounded: one entry per compiled step shape
            self._checked_origins[id(origin)] = origin

    # --- SGLang's KVCacheBuildResult names --------------------------------------------------------

    @property
    def is_hybrid_swa(self) -> bool:
        return self.plan.is_hybrid_swa

    @property
    def is_hybrid_ssm(self) -> bool:
        return self.plan.is_hybrid_ssm

    @property
    def sliding_window_size(self) -> int | None:
        return self.plan.sliding_window_size

    @property
    def full_tokens_per_layer(self) -> int | None:
        return self.plan.full_tokens_per_layer

    @property
    def swa_tokens_per_layer(self) -> int | None:
        return self.plan.swa_tokens_per_layer

    @property
    def disable_radix_cache(self) -> bool:
        return self.plan.disable_radix_cache

    @property
    def allocator(self) -> AllocatorProtocol:
        """The token/page allocator (SGLang's ``token_to_kv_pool_allocator``)."""
        return self.token_to_kv_pool_allocator

    def __repr__(self) -> str:
        return (
            f"KVCache(model={self.plan.model!r}, pools={self._pools!r}, tokens={self.plan.max_total_tokens}, "
            f"tree={type(self.tree_cache).__name__})"
        )


def build_kv_cache(
    spec: ModelSpec,
    config: CacheConfig,
    *,
    mesh: Mesh | None = None,
    device_memory_bytes: int | None = None,
    event_sink: Any = None,
    draft_spec: ModelSpec | None = None,
) -> KVCache:
    """Plan and build the KV cache of ``spec`` under ``config``.

    ``mesh``: KV heads are sharded over its ``"tp"`` axis (whose size must equal ``config.tp_size``);
    without a mesh the pools live on the default device. ``device_memory_bytes`` defaults to what
    the device reports, and is only needed when the budget is ``mem_fraction_static``.
    ``event_sink`` receives the tree's KV events when ``enable_kv_cache_events`` is set.
    ``draft_spec``: the speculative draft model (``kvjax.plan.draft``); its pool is built as
    ``cache.pools["kv_draft"]`` and, with the host tier, its host pool as ``cache.draft_host_pool``.

    Raises ``ConfigError`` for a bad configuration and ``NotImplementedError`` naming a pool kind
    whose capability is not built yet, before
    allocating anything.
    """
    devices = mesh.devices.flatten().tolist() if mesh is not None else jax.devices()[:1]
    if config.platform is None:
        config = config.replace(platform=devices[0].platform)
    if device_memory_bytes is None and config.mem_fraction_static is not None and config.memory_budget_bytes is None:
        device_memory_bytes = _device_memory_bytes(devices[0])
    host_memory = (
        host_memory_bytes()
        if config.enable_hierarchical_cache or config.disaggregation_decode_retraction_backup == "host_pool"
        else None
    )
    plan = plan_kv_cache(
        spec, config, device_memory_bytes=device_memory_bytes, host_memory_bytes=host_memory, draft_spec=draft_spec
    )
    for pool in plan.pools:
        pool_kind(pool.kind).require_built(plan.model)
    check_host_tier_buildable(plan)
    check_draft_buildable(plan, config)
    if mesh is not None:
        _check_mesh(mesh, config)

    context = BuildContext(
        platform=plan.platform,
        mesh=mesh,
        kv_head_axis=KV_HEAD_MESH_AXIS,
        tp_size=config.attn_tp_size,
        host_layout=plan.hicache_mem_layout,
    )
    device: dict[str, Any] = {}
    req_to_token_pool: ReqToTokenPool | None = None
    host_pools: dict[str, Any] = {}
    groups: dict[str, list[PoolPlan]] = {}
    for pool in plan.pools:
        kind = pool_kind(pool.kind)
        if kind.group_builder is not None:  # built together below, under the kind's name
            groups.setdefault(kind.name, []).append(pool)
            continue
        built = kind.create(pool, context)
        if pool.memory == "device":
            device[pool.name] = built
        elif isinstance(built, ReqToTokenPool):
            req_to_token_pool = built
        elif pool.kind == "host_tier":
            host_pools[pool.name] = built
    for name, members in groups.items():
        device[name] = pool_kind(name).create_group(tuple(members), context)
    if req_to_token_pool is not None and plan.is_hybrid_ssm:
        req_to_token_pool = _with_state_slots(req_to_token_pool, plan)
    if req_to_token_pool is None or not device:
        raise AssertionError(f"plan {plan.model} lists no request table or no device pool: {plan.pools}")
    assert isinstance(req_to_token_pool, ReqToTokenPoolProtocol)
    host_pool = host_pools.get("host_kv")
    allocator: AllocatorProtocol
    if plan.is_hybrid_swa and plan.full_tokens_per_layer:
        # Full layers' slots, each paired with a sliding layers' slot (pure SWA: one plain allocator).
        allocator = SWATokenToKVPoolAllocator(
            plan.full_tokens_per_layer, plan.swa_tokens_per_layer or 0, plan.alloc_page_size, need_sort=plan.need_sort
        )
    else:
        allocator = make_allocator(plan.max_total_tokens, plan.alloc_page_size, need_sort=plan.need_sort)
    pools = CachePools(device)
    storage = None
    if host_pool is not None and config.hicache_storage_backend is not None:
        from kvjax.tiers.storage_attach import open_storage_tier

        storage = open_storage_tier(plan, host_pool, pools, config)
    tree_cache = create_tree_cache(
        plan.tree_options,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        event_sink=event_sink,
        host_allocator=None if host_pool is None else host_pool.allocator,
        storage=storage,
    )
    cache = KVCache(
        plan=plan,
        pools=pools,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree_cache,
        host_pool=host_pool,
        draft_host_pool=host_pools.get(DRAFT_HOST_POOL_NAME),
        swa_host_pool=host_pools.get(SWA_HOST_POOL_NAME),
    )
    if host_pool is not None:
        attach_host_transfers(cache)
    return cache


def attach_host_transfers(cache: KVCache) -> None:
    """Give the cache's host tier the page transfer engine over ``cache`` (the holder whose
    ``set_pools`` a load updates) and its host pool.

    The engine holds the cache, which holds the tree, so it is made after the tree and given to
    it through the host tier's one construction-time hook (``HostTierComponent.connect_engine``),
    before the cache is returned. Everything else the tree holds (allocators, the storage tier)
    is passed to its constructor."""
    from kvjax.radix import HiRadixCache
    from kvjax.tiers.transfer import PageTransferEngine

    tree = cache.tree_cache
    if isinstance(tree, HiRadixCache):
        engine: Any
        if cache.swa_host_pool is not None:
            from kvjax.tiers.swa_transfer import SWAPageTransferEngine

            engine = SWAPageTransferEngine(
                cache, cache.host_pool, cache.swa_host_pool, cache.token_to_kv_pool_allocator, pool_name="swa"
            )
        else:
            device_pool = next(p.name for p in cache.plan.pools if p.memory == "device")
            engine = PageTransferEngine(cache, cache.host_pool, pool_name=device_pool)
        tree.host.connect_engine(with_draft_transfers(engine, cache, cache.draft_host_pool))


def _with_state_slots(table: ReqToTokenPool, plan: CachePlan) -> ReqToTokenPool:
    """Hybrid SSM: the request table with a state slot per request (``HybridReqToTokenPool``)
    over the plan's ``max_mamba_cache_size`` slots."""
    from kvjax.hybrid_req_pool import HybridReqToTokenPool

    return HybridReqToTokenPool(
        table.size,
        table.max_context_len,
        mamba_size=int(plan.max_mamba_cache_size or 0),
        enable_mamba_extra_buffer=plan.enable_mamba_extra_buffer,
    )


def host_memory_bytes() -> int | None:
    """The host memory available now (``MemAvailable`` of ``/proc/meminfo``, else the physical
    memory), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _check_mesh(mesh: Mesh, config: CacheConfig) -> None:
    """KV heads (the combined K/V head axis) go over the mesh's ``"tp"`` axis, of ``attn_tp_size`` devices."""
    if KV_HEAD_MESH_AXIS not in mesh.axis_names:
        raise ConfigError("mesh", tuple(mesh.axis_names), f"name the KV-head axis {KV_HEAD_MESH_AXIS!r}")
    if mesh.shape[KV_HEAD_MESH_AXIS] != config.attn_tp_size:
        raise ConfigError(
            "tp_size",
            config.tp_size,
            f"the mesh's {KV_HEAD_MESH_AXIS!r} axis has {mesh.shape[KV_HEAD_MESH_AXIS]} devices; make them equal",
        )


def _device_memory_bytes(device: jax.Device) -> int:
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ConfigError(
            "mem_fraction_static",
            None,
            f"device {device} does not report its memory; pass device_memory_bytes or set memory_budget_bytes",
        )
    return int(limit)
