"""`build_kv_cache`: execute a plan — allocate the device pools and the host bookkeeping.

The build is the only place that touches devices. It plans first (every decision and error
happens in ``plan_kv_cache``), checks that every pool of the plan has a builder in the pool kind
registry (``kvjax.pools.registry``; a kind not built yet raises ``NotImplementedError`` naming its
capability, before anything is allocated), then loops over ``plan.pools`` and builds each through
its kind: device pools (zeros, created directly on their devices, sharded over the mesh when one is
given) and the request→token table; then the token allocator and the tree cache
(``kvjax.radix.create_tree_cache`` picks it from the plan). Whatever depends on the kind of
cached state (pools a kind adds, the request table's wrapper, the allocator, the host tier's
transfer engine) comes from the cache kinds the plan uses (``kvjax.plan.kinds.planner_kinds_of``),
in the kinds' order, through each kind's registration in its layer (``kvjax.radix.kinds``,
``kvjax.pools.registry``, ``kvjax.transfers.transfer_engines``); this module names no kind.

Ownership of device state: the owner of the step (the serving scheduler, or a user's own loop)
owns the current device state; a ``KVCache`` holds what the owner last handed in
(``cache.set_pools(new_pools)`` after every donated step) and changes it only in calls whose caller
receives the new pools (``cache.apply_pending``). Host-tier loads, retraction restores and
recurrent-state forks are recorded as pending device updates (``cache.pending``,
``kvjax.device_updates``) that the owner applies before its next step; they never swap
``cache.pools`` behind the owner's back. ``cache.with_pools(new_pools)`` is the functional
alternative to ``set_pools``: a new holder sharing the same host objects (allocator, request table,
tree, pending updates), after which the old holder's pools may be stale.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh

from kvjax.alloc import make_allocator
from kvjax.attention.sharding import serving_mesh
from kvjax.config import CacheConfig
from kvjax.device_state import DeviceState
from kvjax.device_updates import PendingDeviceUpdates, StaleDeviceStateError
from kvjax.errors import ConfigError
from kvjax.layout.pool_plan import PoolPlan
from kvjax.mesh_check import DCP_AXIS, KV_HEAD_AXIS, MeshFacts, check_mesh
from kvjax.plan import CachePlan, plan_kv_cache
from kvjax.plan.buildable import check_host_tier_buildable
from kvjax.plan.dcp import check_dcp_plan_buildable
from kvjax.plan.draft import DRAFT_HOST_POOL_NAME, check_draft_host_tier_buildable
from kvjax.plan.forwarded import Forwarded
from kvjax.plan.kinds import PlannerKind, planner_kinds_of
from kvjax.plan.kinds.host_tier import HOST_KV
from kvjax.plan.kinds.host_tier import POOL as HOST_TIER_POOL
from kvjax.pools.cache_pools import CachePools
from kvjax.pools.registry import (
    POOL_BUILDERS,
    BuildContext,
    create_pool,
    create_pool_group,
    is_grouped,
    require_builder,
)
from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol, TreeCacheProtocol
from kvjax.radix import create_tree_cache
from kvjax.radix.kinds import HOST_KINDS
from kvjax.req_pool import ReqToTokenPool
from kvjax.spec import ModelSpec
from kvjax.transfers.draft_pools import check_draft_buildable, with_draft_transfers

if TYPE_CHECKING:
    from kvjax.transfers.transfer_engines import TransferContext

KV_HEAD_MESH_AXIS = KV_HEAD_AXIS


class KVCache:
    """A built KV cache: its plan, its device pools and its host bookkeeping.

    SGLang's ``KVCacheBuildResult`` names read from the plan (``is_hybrid_swa``, ``is_hybrid_ssm``,
    ``sliding_window_size``, ``full_tokens_per_layer``, ``swa_tokens_per_layer``,
    ``disable_radix_cache``) or are the host objects (``req_to_token_pool``,
    ``token_to_kv_pool_allocator``, ``tree_cache``).

    Device state (``docs/architecture.md``, "Device state: who changes it"): ``pools`` changes
    only in calls whose caller receives the new pools. The owner of the step donates ``pools``
    into its step and hands the result back with :meth:`set_pools` (this mutates the holder:
    every reference to this ``KVCache`` sees the new state). Library calls that change device
    state without holding the pools (a host-tier load inside ``init_load_back``, a retraction
    restore, a recurrent-state fork) record it in :attr:`pending` instead; the owner applies it
    with ``pools = cache.apply_pending(pools)`` before launching the next step. Reads of device
    state (host-tier backups) read the pools last handed in. The allocator, request table and
    tree cache are host objects mutated in place.
    """

    __slots__ = (
        "_pending",
        "_state",
        "draft_host_pool",
        "host_pools",
        "host_pool",
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
        host_pools: Mapping[str, Any] | None = None,
        pending: PendingDeviceUpdates | None = None,
        state: DeviceState | None = None,
    ) -> None:
        self.plan = plan
        self.host_pool = host_pool  # the host tier's HostKVPool (None without a host tier)
        # The draft model's host pool, host slots one to one with host_pool's (None without one).
        self.draft_host_pool = draft_host_pool
        # Every host pool by its plan name (a kind's own beside ``host_pool``: the sliding layers'
        # of a hybrid-SWA cache, host slots one to one with host_pool's); empty without the tier.
        self.host_pools: Mapping[str, Any] = dict(host_pools or {})
        if not isinstance(pools, CachePools):
            raise TypeError(f"KVCache: expected CachePools, got {type(pools).__name__}")
        # The device state: this holder's own, or a group's shared with other views (a DP rank's).
        if state is None:
            state = DeviceState(pools)
        elif pools is not state.pools:
            raise ValueError("KVCache: pools must be the shared state's current pools")
        self._state = state
        # Device updates recorded by the host side (transfers, restores, forks), shared with the
        # transfer engines built over this cache; the owner of the step applies them.
        self._pending = PendingDeviceUpdates(pools) if pending is None else pending
        state.attach(self._pending)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache

    # --- device state ---------------------------------------------------------------------------

    @property
    def pools(self) -> CachePools:
        """The device state the owner last handed in (a pytree; apply :meth:`apply_pending` to
        it, donate it into a step, then :meth:`set_pools`). No other kvjax call replaces it.

        Raises ``StaleDeviceStateError`` when those pools were donated into a step whose result
        was not handed back (``cache.set_pools(new_pools)``): their arrays are deleted, and
        reading them would fail later with a message that does not say why.
        """
        pools = self._state.pools
        first = next(iter(jax.tree_util.tree_leaves(pools)), None)
        if first is not None and not isinstance(first, jax.core.Tracer) and first.is_deleted():
            raise StaleDeviceStateError(
                "cache.pools were donated into a step and not handed back: after `pools, out = step(pools, ...)` "
                "call cache.set_pools(pools) (or keep using the pools your step returned)"
            )
        return pools

    @property
    def state(self) -> DeviceState:
        """The holder of :attr:`pools` (``kvjax.device_state``), shared by every view of the group."""
        return self._state

    @property
    def pending(self) -> PendingDeviceUpdates:
        """Device updates recorded by transfers, restores and forks, not applied yet (the
        transfer engines and serving extensions record into it; the owner applies it)."""
        return self._pending

    def set_pools(self, pools: CachePools) -> None:
        """Hand in the device state a (donated) step returned: mutates this holder, and reads of
        device state (backups) see ``pools`` from now on.

        Raises ``TypeError`` (the cache unchanged) unless ``pools`` is a ``CachePools`` with the
        same pools and array structure as the current state.
        """
        self._state.store(pools, "set_pools")

    def apply_pending(self, pools: CachePools | None = None) -> CachePools:
        """Apply the pending device updates to ``pools`` (default :attr:`pools`), in the order
        they were recorded, and return the new pools, also handed in (:meth:`set_pools`).

        The owner of the step calls it right before launching its next step, so loaded prefixes,
        restored tokens and forked state slots are in place when the step reads them. The arrays
        replaced are donated (in place): use only the pools this returns. With nothing pending it
        returns ``pools`` itself. Raises ``TypeError`` (nothing applied) for pools of another
        structure.
        """
        if pools is None:
            pools = self._state.pools
        elif pools is not self._state.pools:
            self.set_pools(pools)
        if not self._pending.count:
            return pools
        new = self._pending.apply(pools)
        self.set_pools(new)
        return new

    def with_pools(self, pools: CachePools) -> KVCache:
        """A new holder of ``pools`` sharing this cache's plan and host objects (functional form
        of :meth:`set_pools`; this holder is left as it is)."""
        self._state.check_structure(pools, "with_pools")
        return KVCache(
            plan=self.plan,
            pools=pools,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            host_pool=self.host_pool,
            draft_host_pool=self.draft_host_pool,
            host_pools=self.host_pools,
            pending=self._pending,
        )

    # --- SGLang's KVCacheBuildResult names --------------------------------------------------------

    is_hybrid_swa = Forwarded[bool]("plan")
    is_hybrid_ssm = Forwarded[bool]("plan")
    sliding_window_size = Forwarded[int | None]("plan")
    full_tokens_per_layer = Forwarded[int | None]("plan")
    swa_tokens_per_layer = Forwarded[int | None]("plan")
    disable_radix_cache = Forwarded[bool]("plan")

    @property
    def allocator(self) -> AllocatorProtocol:
        """The token/page allocator (SGLang's ``token_to_kv_pool_allocator``)."""
        return self.token_to_kv_pool_allocator

    def __repr__(self) -> str:
        return (
            f"KVCache(model={self.plan.model!r}, pools={self.pools!r}, tokens={self.plan.max_total_tokens}, "
            f"tree={type(self.tree_cache).__name__})"
        )


def check_placement(config: CacheConfig, mesh: Mesh | None) -> None:
    """Refuse a ``mesh`` that does not fit ``config`` (``kvjax.mesh_check``), and the sharded
    configurations that need one but got none (DCP; KV heads over ``attn_tp_size > 1`` ranks,
    which without a mesh would build one rank's share of the heads on one device). Raises
    ``ConfigError`` naming the mesh to pass; changes nothing."""
    if mesh is not None:
        check_mesh(MeshFacts.of(mesh), config)
    elif config.dcp_enabled:
        raise ConfigError(
            "dcp_size",
            config.dcp_size,
            "striping each request's KV over DCP ranks needs a mesh with a 'dcp' axis: pass "
            f"mesh=kvjax.mesh_check.make_serving_mesh({config.tp_size}, dcp_size={config.dcp_size})",
        )
    elif config.attn_tp_size > 1:
        raise ConfigError(
            "tp_size",
            config.tp_size,
            f"sharding the KV heads over {config.attn_tp_size} ranks needs a mesh with a 'tp' axis of that many "
            f"devices: pass mesh=kvjax.mesh_check.make_serving_mesh({config.attn_tp_size}) (without one, only one "
            "rank's share of the heads would be built, on one device); or build with tp_size=1",
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

    ``mesh``: KV heads are sharded over its ``"tp"`` axis (``config.attn_tp_size`` devices; a
    ``"data"`` axis holds the DP-attention ranks; under DCP a ``"dcp"`` axis of
    ``config.dcp_size`` devices holds each page's striped rows, ``kvjax.alloc.dcp``; DCP needs a
    mesh); ``kvjax.mesh_check`` refuses any other mesh
    before anything is planned or allocated. Without a mesh the pools live on the default
    device. ``device_memory_bytes`` defaults to what
    the device reports, and is only needed when the budget is ``mem_fraction_static``.
    ``event_sink`` receives the tree's KV events when ``enable_kv_cache_events`` is set.
    ``draft_spec``: the speculative draft model (``kvjax.plan.draft``); its pool is built as
    ``cache.pools["kv_draft"]`` and, with the host tier, its host pool as ``cache.draft_host_pool``.

    Raises ``ConfigError`` for a bad configuration and ``NotImplementedError`` naming a pool kind
    whose capability is not built yet, before
    allocating anything.
    """
    check_placement(config, mesh)  # before anything is planned or allocated
    devices = mesh.devices.flatten().tolist() if mesh is not None else jax.devices()[:1]
    if config.platform is None:
        config = config.replace(platform=devices[0].platform)
    if device_memory_bytes is None and config.mem_fraction_static is not None and config.memory_budget_bytes is None:
        device_memory_bytes = device_memory_limit_bytes(devices[0])
    host_memory = (
        host_memory_bytes()
        if config.enable_hierarchical_cache or config.disaggregation_decode_retraction_backup == "host_pool"
        else None
    )
    plan = plan_kv_cache(
        spec, config, device_memory_bytes=device_memory_bytes, host_memory_bytes=host_memory, draft_spec=draft_spec
    )
    for pool in plan.pools:
        require_builder(pool.kind, plan.model)
    check_host_tier_buildable(plan)
    check_draft_host_tier_buildable(plan)
    check_dcp_plan_buildable(config, plan.pools)
    check_draft_buildable(plan, config)
    if config.hicache_storage_backend is not None:
        from kvjax.transfers.storage_attach import check_storage_buildable

        check_storage_buildable(plan, config)
    if mesh is not None:
        mesh = serving_mesh(mesh)  # Auto axes: XLA places what the pools' layout does not fix

    kinds = planner_kinds_of(plan)
    plan, device, req_to_token_pool, host_pools = _create_pools(plan, config, mesh, kinds, device_only=False)
    if req_to_token_pool is None or not device:
        raise AssertionError(f"plan {plan.model} lists no request table or no device pool: {plan.pools}")
    assert isinstance(req_to_token_pool, ReqToTokenPoolProtocol)
    host_pool = host_pools.get(HOST_KV)
    allocator = plan_allocator(plan, kinds)
    pools = CachePools(device)
    pending = PendingDeviceUpdates(pools)
    host_engine = None
    storage = None
    if host_pool is not None:
        host_engine = _host_transfer_engine(plan, pending, host_pools, allocator)
        if config.hicache_storage_backend is not None:
            from kvjax.transfers.storage_attach import open_storage_tier

            storage = open_storage_tier(
                plan, host_pool, pools, config, host_pools.get(DRAFT_HOST_POOL_NAME), host_pools=host_pools
            )
    tree_cache = create_tree_cache(
        plan.tree_options,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        event_sink=event_sink,
        host_allocator=None if host_pool is None else host_pool.allocator,
        host_engine=host_engine,
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
        host_pools=host_pools,
        pending=pending,
    )
    return cache


def build_stage_pools(
    spec: ModelSpec, config: CacheConfig, *, mesh: Mesh | None = None
) -> tuple[CachePlan, CachePools]:
    """The plan and the device pools of pipeline stage ``config.pp_rank`` only: its layers' pools
    (and, on the last stage, the draft's), with the checks of ``build_kv_cache`` first, and no host
    objects (request table, allocator, tree, host pools): under pipeline parallelism one stage's
    ``KVCache`` (``build_kv_cache``) holds those and drives every stage (``kvjax.serve.pipeline``).

    ``mesh``: the stage's own devices (KV heads over its ``"tp"`` axis), else the default device.
    Raises ``ConfigError`` / ``NotImplementedError`` as ``build_kv_cache`` does, before allocating.
    """
    check_placement(config, mesh)
    devices = mesh.devices.flatten().tolist() if mesh is not None else jax.devices()[:1]
    if config.platform is None:
        config = config.replace(platform=devices[0].platform)
    device_memory_bytes = None
    if config.mem_fraction_static is not None and config.memory_budget_bytes is None:
        device_memory_bytes = device_memory_limit_bytes(devices[0])
    plan = plan_kv_cache(spec, config, device_memory_bytes=device_memory_bytes)
    for pool in plan.pools:
        require_builder(pool.kind, plan.model)
    if mesh is not None:
        mesh = serving_mesh(mesh)
    plan, device, _, _ = _create_pools(plan, config, mesh, planner_kinds_of(plan), device_only=True)
    return plan, CachePools(device)


def build_stage_host_engine(
    plan: CachePlan,
    config: CacheConfig,
    pools: CachePools,
    host_allocator: Any,
    allocator: Any,
    *,
    mesh: Mesh | None = None,
) -> tuple[PendingDeviceUpdates, Any]:
    """Pipeline stage ``config.pp_rank``'s part of the host tier: host pools of its layers (as
    ``plan`` lists them) whose slot allocator is ``host_allocator`` (the tree's, stage 0's: one
    host slot id per token on every stage), a queue of pending device updates over ``pools``
    (the stage's device state) and the transfer engine recording into it, over ``allocator``
    (the device token allocator, stage 0's): ``(pending, engine)``. Raises ``AssertionError``
    when a host pool has another size than ``host_allocator``."""
    if mesh is not None:
        mesh = serving_mesh(mesh)
    context = BuildContext(
        platform=plan.platform,
        mesh=mesh,
        kv_head_axis=KV_HEAD_MESH_AXIS,
        tp_size=config.attn_tp_size,
        host_layout=plan.hicache_mem_layout,
        kv_head_replicas=plan.target.kv_head_replicas,
    )
    host_pools: dict[str, Any] = {}
    for pool in plan.pools:
        if pool.memory == "device" or pool.kind != HOST_TIER_POOL.name:
            continue
        built = create_pool(pool, context)
        if host_allocator.size != built.allocator.size:
            raise AssertionError(
                f"stage {config.pp_rank}'s host pool {pool.name} of {built.allocator.size} slots, stage 0's of "
                f"{host_allocator.size}"
            )
        built.allocator = host_allocator
        host_pools[pool.name] = built
    pending = PendingDeviceUpdates(pools)
    return pending, _host_transfer_engine(plan, pending, host_pools, allocator)


def _create_pools(
    plan: CachePlan, config: CacheConfig, mesh: Mesh | None, kinds: tuple[PlannerKind, ...], *, device_only: bool
) -> tuple[CachePlan, dict[str, Any], ReqToTokenPool | None, dict[str, Any]]:
    """Allocate the plan's pools (with those its kinds add): ``(plan with the added pools, device
    pools by name, the request table, host pools by name)``; ``device_only``: the device pools
    alone (the table None, no host pool)."""
    plan = with_extra_pools(plan, kinds)
    context = BuildContext(
        platform=plan.platform,
        mesh=mesh,
        kv_head_axis=KV_HEAD_MESH_AXIS,
        tp_size=config.attn_tp_size,
        host_layout=plan.hicache_mem_layout,
        context_axis=DCP_AXIS if config.dcp_enabled else None,
        dcp_size=config.dcp_size,
        kv_head_replicas=plan.target.kv_head_replicas,
    )
    device: dict[str, Any] = {}
    req_to_token_pool: ReqToTokenPool | None = None
    host_pools: dict[str, Any] = {}
    groups: dict[str, list[PoolPlan]] = {}
    for pool in plan.pools:
        if device_only and pool.memory != "device":
            continue
        if is_grouped(pool.kind):  # built together below, under the pool kind's name
            groups.setdefault(pool.kind, []).append(pool)
            continue
        built = create_pool(pool, _draft_context(plan, context) if pool.name == DRAFT_HOST_POOL_NAME else context)
        if pool.memory == "device":
            device[pool.name] = built
        elif isinstance(built, ReqToTokenPool):
            req_to_token_pool = built
        else:
            host_pools[pool.name] = built
    for name, members in groups.items():
        device[name] = create_pool_group(name, tuple(members), context)
    if not device_only and req_to_token_pool is not None:
        req_to_token_pool = plan_request_table(req_to_token_pool, plan, kinds)
    return plan, device, req_to_token_pool, host_pools


def with_extra_pools(plan: CachePlan, kinds: tuple[PlannerKind, ...]) -> CachePlan:
    """``plan`` with the pools its kinds add beyond the planner's (``PlannerKind.extra_pools``:
    small per-request state), each checked to be buildable first."""
    extra = tuple(pool for kind in kinds if kind.extra_pools is not None for pool in kind.extra_pools(plan))
    for pool in extra:
        require_builder(pool.kind, plan.model)
    return dataclasses.replace(plan, pools=plan.pools + extra) if extra else plan


def plan_request_table(table: ReqToTokenPool, plan: CachePlan, kinds: tuple[PlannerKind, ...]) -> ReqToTokenPool:
    """The request table with the per-request state the kinds keep around it
    (``HostKind.request_table``: recurrent state slots), in the kinds' order."""
    for kind in kinds:
        wrap = HOST_KINDS[kind.name].request_table
        if wrap is not None:
            table = wrap(table, plan)
    return table


def _host_transfer_engine(
    plan: CachePlan, pending: PendingDeviceUpdates, host_pools: dict[str, Any], allocator: AllocatorProtocol
) -> Any:
    """The host tier's page transfer engine over the cache's own pools (:func:`host_transfer_engine`)."""
    from kvjax.transfers.transfer_engines import TransferContext

    return host_transfer_engine(TransferContext(plan, pending, host_pools, allocator))


def host_transfer_engine(context: TransferContext) -> Any:
    """The host tier's page transfer engine, made before the tree (which takes it at construction):
    the first engine a kind of the plan offers (``PoolBuilders.transfer_engine``), else the default
    one, each page or state engine in it made by the context's factories (a DP rank's give the
    rank's engines: ``kvjax.dp.cache``).

    The engine holds no cache: it reads static facts (shapes, dtype, sharding) from
    ``pending.owner_pools``, reads device data for backups through ``pending.read`` (the pools the
    owner last handed in) and records its loads in ``pending`` for the owner to apply
    (``KVCache.apply_pending``). The draft pool's engine rides along when there is one."""
    from kvjax.transfers.transfer_engines import default_transfer_engine

    engine = None
    for kind in planner_kinds_of(context.plan):  # the first engine a kind of the plan offers, in the kinds' order
        offer = POOL_BUILDERS[kind.name].transfer_engine
        engine = offer(context) if offer is not None else None
        if engine is not None:
            break
    if engine is None:
        engine = default_transfer_engine(context)
    return with_draft_transfers(engine, context.host_pools.get(DRAFT_HOST_POOL_NAME), context.page_engine)


def plan_allocator(plan: CachePlan, kinds: tuple[PlannerKind, ...]) -> AllocatorProtocol:
    """The token allocator of the first kind of ``kinds`` that decides it (``HostKind.allocator``),
    else the plain one for the plan's ``max_total_tokens`` (``make_allocator``)."""
    for kind in kinds:
        decide = HOST_KINDS[kind.name].allocator
        allocator = decide(plan) if decide is not None else None
        if allocator is not None:
            return allocator
    return make_allocator(plan.max_total_tokens, plan.alloc_page_size, need_sort=plan.need_sort)


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


def _draft_context(plan: CachePlan, context: BuildContext) -> BuildContext:
    """The build context of the draft model's host pool: the draft's own KV-head replicas (its
    host pool holds each distinct head once, as the target's does)."""
    if plan.draft is None:
        return context
    return dataclasses.replace(context, kv_head_replicas=plan.draft.kv_head_replicas)


def device_memory_limit_bytes(device: jax.Device) -> int:
    """The memory ``device`` reports it can hold (``bytes_limit`` of its memory stats), in bytes;
    ``ConfigError`` naming ``mem_fraction_static`` where it reports none."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ConfigError(
            "mem_fraction_static",
            None,
            f"device {device} does not report its memory; pass device_memory_bytes or set memory_budget_bytes",
        )
    return int(limit)
