"""`build_dp_kv_cache`: the KV cache of DP attention, pools built once over a ``("data", "tp")`` mesh.

Under DP attention (``CacheConfig(tp_size=N, dp_size=M, enable_dp_attention=True)``) each of
the ``M`` DP ranks is an attention group of ``attn_tp_size = N / M`` devices with its own plan
(the planner's per-device plan: ``attn_tp_size`` shares of the KV heads, the per-device memory
budget), its own prefix tree, allocator and request table, and its own slice of every pool.
SGLang builds one scheduler per rank; kvjax builds:

* **one set of device pools for all ranks** (``DPKVCache.pools``): every pool array gets a
  leading rank axis of size ``M`` sharded over the mesh's ``"data"`` axis, and the axis a pool
  shards over KV heads under tensor parallelism sharded over ``"tp"`` (other axes replicated;
  so is the KV-head axis where the plan replicates heads, and an MLA latent). Each device
  builds its own slice with the pool kinds' own builders (``kvjax.pools.registry``), so the
  content (zeros, unit fp8 scales, ...) is what ``build_kv_cache`` would build per device. The
  pytree's static fields are those of **one device's** pool (``num_kv_heads`` per device, no
  mesh): inside ``jax.shard_map`` over ``("data", "tp")`` each device sees exactly such a pool
  with a leading axis of 1 (``kvjax.dp.attention`` strips it and runs the unsharded kernels).
* **host state per rank** (``DPKVCache.ranks[r]``, a ``DPRank``): request table, allocator and
  tree built from the rank's plan as ``build_kv_cache`` builds them, and the rank's queue of
  pending device updates. Their slot and page ids are the rank's own (local: page ``p`` of rank
  ``r`` is ``pools...[r, p]``); ids of two ranks never meet.
* **the host tier per rank** (``enable_hierarchical_cache``, or the ``host_pool`` retraction
  backup), as SGLang gives each DP rank its own host pool and cache controller: the rank's host
  pool is built from its plan over the rank's ``("tp",)`` devices as ``build_kv_cache`` builds it
  (every distinct KV head of the rank once), its tree is a ``HiRadixCache`` and its transfers go
  through the engines a one-rank cache of the plan's kinds composes (``host_transfer_engine``),
  each made by the rank's factories: a ``kvjax.dp.rank_transfer.RankPageTransferEngine`` per
  page pool (the KV's; each half of the sliding-window pair, beside the rank's SWA host pool; the
  draft's) and a ``kvjax.dp.rank_state_transfer.RankStateTransferEngine`` for recurrent-state
  checkpoints (beside the rank's ``HostStatePool``; one process only). Each reads and writes only
  the rank's slice of the stacked pools (in place, O(pages or slots moved)) and records its loads
  on the rank's queue. Every rank's host pools together must fit the host's memory. With a
  storage tier (``hicache_storage_backend``) each rank opens its own store behind its host pool
  (``kvjax.transfers.storage_attach.open_storage_tier``), under the key a one-rank cache of the
  rank's plan uses: the pages are content addressed and the rank's host page is what that cache
  holds, so ranks (and a one-rank cache of the same attention TP) read each other's pages; one
  process only, not with an fp8 KV cache (the key carries the pool's scales, one set per rank).

Under decode context parallelism (``dcp_size > 1``, DCP dividing each rank's attention TP group:
``kvjax.plan.dcp``) the mesh is ``("data", "tp", "dcp")`` and each rank's slice is the pool
``build_kv_cache`` builds over the rank's ``("tp", "dcp")`` group: page rows striped over
``"dcp"`` (``kvjax.alloc.dcp``), KV heads over ``"tp"``; each rank's allocator and tree use the
striped page (``page_size * dcp_size``). A rank's host pool (the host tier, or the ``host_pool``
retraction backup) is the one ``build_kv_cache`` builds over the rank's group: the host page is the
striped page, every ``"dcp"`` rank's rows once, rank-major (``kvjax.tiers.head_shards``), and the
rank's ``RankPageTransferEngine`` moves each device's rows of the rank's slice in place. Recurrent
state is not striped: a rank's slice of it is split by heads over the rank's whole ``("tp",
"dcp")`` group (``P("data", None, None, ("tp", "dcp"))``, ``kvjax.plan.kinds.recurrent``), as
``build_kv_cache`` builds it over that group.

Invariants: ``pools`` leaves have shape ``(dp_size, *rank_shape)`` where ``rank_shape`` is the
shape ``build_kv_cache`` gives that array over the rank's ``("tp",)`` (or ``("tp", "dcp")``) mesh;
``layout.pool_specs`` is the matching pytree of ``PartitionSpec`` (first entry ``"data"``).
Not built yet under DP attention (refused before anything is allocated): the storage tier over
several processes or an fp8 KV cache, and the host copies of recurrent-state checkpoints over
several processes.

Speculative decoding (``speculative_algorithm``; STANDALONE with ``draft_spec``): the draft's pool
``"kv_draft"`` is one more device pool of the plan, stacked per rank and laid out as the target's
(its KV heads over ``"tp"``, an MLA latent whole); with the host tier each rank's draft host pool
is built beside its target host pool (host slots one to one) and the rank's engine copies both
(``PairedCopyEngine`` of two ``RankPageTransferEngine``: ``kvjax.transfers.draft_pools``,
``with_draft_transfers`` given the rank's page engine factory).
EAGLE's hidden-state store is built with the DP programs (``kvjax.dp.speculative``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.attention.sharding import serving_mesh
from kvjax.build import (
    KV_HEAD_MESH_AXIS,
    device_memory_limit_bytes,
    host_memory_bytes,
    host_transfer_engine,
    plan_allocator,
    plan_request_table,
    with_extra_pools,
)
from kvjax.config import CacheConfig
from kvjax.device_state import DeviceState
from kvjax.device_updates import PendingDeviceUpdates
from kvjax.dp.layout import DPLayout
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, rank_devices, rank_mesh
from kvjax.errors import ConfigError
from kvjax.layout.pool_plan import PoolPlan
from kvjax.mesh_check import DCP_AXIS
from kvjax.plan import CachePlan, plan_kv_cache
from kvjax.plan.buildable import check_host_tier_buildable
from kvjax.plan.draft import DRAFT_HOST_POOL_NAME, check_draft_host_tier_buildable
from kvjax.plan.host_sizing import check_host_memory
from kvjax.plan.kinds import PlannerKind, planner_kinds_of
from kvjax.plan.kinds.host_tier import HOST_KV
from kvjax.plan.kinds.host_tier import POOL as HOST_TIER_POOL
from kvjax.pools.cache_pools import CachePools
from kvjax.pools.registry import (
    BuildContext,
    create_pool,
    create_pool_group,
    is_grouped,
    require_builder,
)
from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol, TreeCacheProtocol
from kvjax.radix import create_tree_cache
from kvjax.req_pool import ReqToTokenPool
from kvjax.spec import ModelSpec
from kvjax.transfers.draft_pools import check_draft_buildable
from kvjax.transfers.transfer_engines import TransferContext

__all__ = ["DATA_MESH_AXIS", "DPKVCache", "DPLayout", "DPRank", "build_dp_kv_cache", "build_dp_pools", "rank_devices"]


@dataclasses.dataclass(frozen=True, eq=False)
class DPRank:
    """One DP rank's host state (SGLang's per-rank scheduler objects), over the rank's own
    slot and page ids.

    Attributes:
        rank: the rank's index along ``"data"``.
        plan: the rank's plan (every rank's is the same).
        req_to_token_pool: its request table.
        token_to_kv_pool_allocator: its slot allocator.
        tree_cache: its prefix tree (a ``HiRadixCache`` over the rank's host pool with the host tier).
        pending: the rank's queue of pending device updates over the stacked pools (its tree's
            host loads and its extensions' copies record there; the rank's ``RankKVCache`` holds it).
        host_pool: the rank's host pool (``HostKVPool``) with the host tier, else None.
        host_pools: every host pool of the rank by its plan name (empty without the host tier).
        draft_host_pool: the speculative draft's host pool with the host tier (host slots one to
            one with ``host_pool``'s, copied with it: ``kvjax.transfers.draft_pools``), else None.
    """

    rank: int
    plan: CachePlan
    req_to_token_pool: ReqToTokenPoolProtocol
    token_to_kv_pool_allocator: AllocatorProtocol
    tree_cache: TreeCacheProtocol
    pending: PendingDeviceUpdates | None = None
    host_pool: Any = None
    host_pools: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    draft_host_pool: Any = None

    @property
    def allocator(self) -> AllocatorProtocol:
        """The slot allocator (SGLang's ``token_to_kv_pool_allocator``)."""
        return self.token_to_kv_pool_allocator


class DPKVCache:
    """The DP-attention KV cache: one set of device pools over all ranks, host state per rank.

    Device state follows ``KVCache``'s rule: the owner of the step donates :attr:`pools` into
    its step and hands the result back (:meth:`set_pools` in a loop of the caller's own; the
    serving loop's ``Scheduler.store_pools``). The pools live in one ``DeviceState``
    (:attr:`state`), which the ranks' views (``kvjax.dp.rank_cache``) share.
    """

    __slots__ = ("layout", "plan", "ranks", "state")

    def __init__(self, *, plan: CachePlan, pools: CachePools, layout: DPLayout, ranks: tuple[DPRank, ...]) -> None:
        self.plan = plan
        self.state = DeviceState(pools)
        self.layout = layout
        self.ranks = ranks

    @property
    def pools(self) -> CachePools:
        """The pools of every rank (leading rank axis; module docstring)."""
        return self.state.pools

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def set_pools(self, pools: CachePools) -> None:
        """Hand in the pools a (donated) step returned (every rank's view reads them from now on).
        Raises ``TypeError`` (nothing changed) for pools of another structure."""
        self.state.store(pools, "set_pools")

    def __repr__(self) -> str:
        return (
            f"DPKVCache(model={self.plan.model!r}, dp={self.dp_size}, attn_tp={self.layout.attn_tp_size}, "
            f"pools={self.pools!r})"
        )


def build_dp_kv_cache(
    spec: ModelSpec,
    config: CacheConfig,
    mesh: Mesh,
    *,
    device_memory_bytes: int | None = None,
    draft_spec: ModelSpec | None = None,
) -> DPKVCache:
    """Plan one DP rank, then build every rank's pools (once, over ``mesh``) and host state.

    Args:
        spec: the model.
        config: with ``enable_dp_attention`` set; ``dp_size`` ranks of ``attn_tp_size`` devices.
        mesh: axes ``("data", "tp")`` of sizes ``(dp_size, attn_tp_size)``; under decode context
            parallelism ``("data", "tp", "dcp")``, the last of ``dcp_size`` (each rank's pools
            striped over its ``"dcp"`` devices, as ``build_kv_cache`` stripes one rank's).
        device_memory_bytes: per-device memory, only needed with ``mem_fraction_static`` (default:
            what the device reports).
        draft_spec: a STANDALONE speculative draft model (``kvjax.plan.draft``), as
            ``build_kv_cache`` takes it: its pool ``"kv_draft"`` is stacked per rank like the
            target's (with NEXTN the draft pool holds the target's MTP layer, no spec needed).

    Raises:
        ConfigError: DP attention off, a mesh whose axes or sizes do not match the config, or
            devices of two platforms; any planning error. Nothing is allocated.
        NotImplementedError: a pool kind or a tier not built under DP attention yet.
    """
    check_dp_mesh(mesh, config)
    mesh = serving_mesh(mesh)
    devices = mesh.devices.flatten().tolist()
    if config.platform is None:
        config = config.replace(platform=devices[0].platform)
    if device_memory_bytes is None and config.mem_fraction_static is not None and config.memory_budget_bytes is None:
        device_memory_bytes = device_memory_limit_bytes(devices[0])
    _refuse_unbuilt_tiers(config)
    plan = plan_kv_cache(spec, config, device_memory_bytes=device_memory_bytes, draft_spec=draft_spec)
    kinds = planner_kinds_of(plan)
    plan = with_extra_pools(plan, kinds)
    for pool in plan.pools:
        require_builder(pool.kind, plan.model)
    check_draft_buildable(plan, config)
    _check_rank_host_tiers(plan, kinds, config)
    pools, layout = build_dp_pools(plan, config, mesh)
    ranks = tuple(_rank_host_state(r, plan, kinds, pools, layout, config) for r in range(config.dp_size))
    return DPKVCache(plan=plan, pools=pools, layout=layout, ranks=ranks)


def build_dp_pools(plan: CachePlan, config: CacheConfig, mesh: Mesh) -> tuple[CachePools, DPLayout]:
    """The device pools of ``plan`` for every DP rank, stacked over ``mesh``'s ``"data"`` axis, and
    their layout (each rank's pools as one rank's build lays them out over its ``("tp",)``
    devices, striped over ``"dcp"`` under DCP): what ``build_dp_kv_cache`` builds before the
    ranks' host state, and all a pipeline stage after the first holds (``kvjax.dp.pipeline``).
    ``mesh``: checked by the caller (``check_dp_mesh``), with ``Auto`` axes."""
    device_plans = tuple(pool for pool in plan.pools if pool.memory == "device")
    one_device = BuildContext(platform=plan.platform, host_layout=plan.hicache_mem_layout)
    one_rank = _rank_context(one_device, rank_mesh(mesh, 0), config)
    # the rank's pools over its "tp" devices alone (not striped): which axes "tp" splits; under DCP
    # over its ("tp", "dcp") group, not striped: recurrent state splits its heads over both
    heads_mesh = rank_mesh(mesh, 0) if config.dcp_enabled else Mesh(rank_devices(mesh, 0), (KV_HEAD_MESH_AXIS,))
    headed = dataclasses.replace(one_device, mesh=heads_mesh, tp_size=config.attn_tp_size)
    local = jax.eval_shape(lambda: _device_pools(device_plans, one_device))
    over_heads = jax.tree_util.tree_leaves(jax.eval_shape(lambda: _device_pools(device_plans, headed)))
    ranked = jax.eval_shape(lambda: _device_pools(device_plans, one_rank))
    local_leaves, structure = jax.tree_util.tree_flatten(local)
    rank_leaves = jax.tree_util.tree_leaves(ranked)  # same arrays, other static fields (heads, mesh)
    if not len(rank_leaves) == len(over_heads) == len(local_leaves):
        raise AssertionError(f"one rank's pools have {len(rank_leaves)} arrays; one device's {len(local_leaves)}")
    specs = jax.tree_util.tree_unflatten(
        structure,
        [
            _rank_spec(a.shape, h.shape, b.shape, config.attn_tp_size, config.dcp_size)
            for a, h, b in zip(local_leaves, over_heads, rank_leaves, strict=True)
        ],
    )
    pools = _build_over_mesh(lambda: _device_pools(device_plans, one_device), mesh, specs)
    return pools, DPLayout(mesh, specs, jax.tree_util.tree_structure(ranked))


def check_dp_mesh(mesh: Mesh, config: CacheConfig) -> None:
    """``ConfigError`` unless DP attention is on and ``mesh`` is ``("data", "tp")`` of sizes
    ``(dp_size, attn_tp_size)`` (under decode context parallelism ``("data", "tp", "dcp")``, the
    last of ``dcp_size``) over devices of one platform."""
    if not config.enable_dp_attention:
        raise ConfigError(
            "enable_dp_attention", False, "set it: a DP cache builds one tree, allocator and pool slice per DP rank"
        )
    names = tuple(mesh.axis_names)
    expected = (DATA_MESH_AXIS, KV_HEAD_MESH_AXIS, *((DCP_AXIS,) if config.dcp_enabled else ()))
    if sorted(names) != sorted(expected):
        striped = f", each rank's tokens striped over {DCP_AXIS!r}" if config.dcp_enabled else ""
        raise ConfigError(
            "mesh",
            names,
            f"name the axes {expected}: DP ranks over {DATA_MESH_AXIS!r}, KV heads over {KV_HEAD_MESH_AXIS!r}{striped}",
        )
    if config.dcp_enabled and mesh.shape[DCP_AXIS] != config.dcp_size:
        raise ConfigError(
            "dcp_size",
            config.dcp_size,
            f"the mesh's {DCP_AXIS!r} axis has {mesh.shape[DCP_AXIS]} devices; make them equal",
        )
    if mesh.shape[DATA_MESH_AXIS] != config.dp_size:
        raise ConfigError(
            "dp_size",
            config.dp_size,
            f"the mesh's {DATA_MESH_AXIS!r} axis has {mesh.shape[DATA_MESH_AXIS]} devices; make them equal",
        )
    if mesh.shape[KV_HEAD_MESH_AXIS] != config.attn_tp_size:
        raise ConfigError(
            "tp_size",
            config.tp_size,
            f"each DP rank attends over tp_size / dp_size = {config.attn_tp_size} devices but the mesh's "
            f"{KV_HEAD_MESH_AXIS!r} axis has {mesh.shape[KV_HEAD_MESH_AXIS]}; make them equal",
        )
    platforms = sorted({d.platform for d in mesh.devices.flat})
    if len(platforms) != 1:
        raise ConfigError("mesh", platforms, "use devices of one platform")


def _refuse_unbuilt_tiers(config: CacheConfig) -> None:
    storage = config.hicache_storage_backend is not None
    unbuilt = {
        "hicache_storage_backend over several processes": storage and jax.process_count() > 1,
        "hicache_storage_backend with an fp8 KV cache": storage and config.kv_cache_dtype.startswith("fp8"),
    }
    for option, on in unbuilt.items():
        if on:
            raise NotImplementedError(
                f"kvjax cannot build {option} under DP attention yet; build without it or with "
                "build_kv_cache (one rank)"
            )


def _device_pools(plans: tuple[PoolPlan, ...], context: BuildContext) -> CachePools:
    """The device pools of ``plans`` built by their kinds (grouped kinds together), as
    ``build_kv_cache`` builds them."""
    device: dict[str, Any] = {}
    groups: dict[str, list[PoolPlan]] = {}
    for pool in plans:
        if is_grouped(pool.kind):
            groups.setdefault(pool.kind, []).append(pool)
        else:
            device[pool.name] = create_pool(pool, context)
    for name, members in groups.items():
        device[name] = create_pool_group(name, tuple(members), context)
    return CachePools(device)


def _rank_spec(local: tuple[int, ...], headed: tuple[int, ...], ranked: tuple[int, ...], attn_tp: int, dcp: int) -> P:
    """The spec of one array: rank axis over ``"data"``; over ``"tp"`` the axis where the rank's
    array over its ``"tp"`` devices alone (``headed``: under decode context parallelism over its
    ``("tp", "dcp")`` group, not striped) is ``attn_tp`` times one device's (``local``); over
    ``("tp", "dcp")`` jointly the axis where ``headed`` is ``attn_tp * dcp`` times ``local``
    (recurrent state's heads, over the whole group); over ``"dcp"`` the axis where the rank's
    striped array (``ranked``) is ``dcp`` times ``headed`` (its page rows)."""
    if not len(local) == len(headed) == len(ranked):
        raise AssertionError(f"a pool array of shape {ranked} over a rank has shape {local} on one device")
    axes: list[str | tuple[str, str] | None] = []
    for a, h, b in zip(local, headed, ranked, strict=True):
        if a == h == b:
            axes.append(None)
        elif h == a * attn_tp and b == h and KV_HEAD_MESH_AXIS not in axes:
            axes.append(KV_HEAD_MESH_AXIS)
        elif dcp > 1 and h == a * attn_tp * dcp and b == h and not {KV_HEAD_MESH_AXIS, DCP_AXIS} & set(axes):
            axes.append((KV_HEAD_MESH_AXIS, DCP_AXIS))  # recurrent state: heads over the whole group
        elif a == h and b == h * dcp and DCP_AXIS not in axes:
            axes.append(DCP_AXIS)
        else:
            raise AssertionError(
                f"a pool array of shape {ranked} over {attn_tp} x {dcp} devices has shape {local} on one"
            )
    return P(DATA_MESH_AXIS, *axes)


def _rank_context(context: BuildContext, mesh: Mesh, config: CacheConfig) -> BuildContext:
    """``context`` over one rank's ``mesh`` (``rank_mesh``): the rank's KV heads over its
    ``attn_tp_size`` ``"tp"`` devices, its pages striped over ``"dcp"`` under decode context
    parallelism (as ``build_kv_cache`` builds a one-rank cache over that mesh)."""
    return dataclasses.replace(
        context,
        mesh=mesh,
        kv_head_axis=KV_HEAD_MESH_AXIS,
        tp_size=config.attn_tp_size,
        context_axis=DCP_AXIS if config.dcp_enabled else None,
        dcp_size=config.dcp_size,
    )


def _build_over_mesh(make: Callable[[], CachePools], mesh: Mesh, specs: Any) -> CachePools:
    """Every device runs ``make`` (one device's pools) for its own slice; the slices form the
    stacked pools laid out as ``specs``."""

    def per_device() -> CachePools:
        return jax.tree.map(lambda x: x[None], make())

    build = jax.shard_map(per_device, mesh=mesh, in_specs=(), out_specs=specs, check_vma=False)
    pools: CachePools = jax.jit(build)()
    return pools


def _check_rank_host_tiers(plan: CachePlan, kinds: tuple[PlannerKind, ...], config: CacheConfig) -> None:
    """Before anything is allocated: the host tier (or the ``host_pool`` retraction backup) is
    buildable as on one rank, the host copies of per-request state (recurrent-state checkpoints)
    are in one process (their engine reads the rank's state whole), and every rank's host pools
    together (the KV's, and a kind's state pool) must fit the host's memory (SGLang's check, on
    ``dp_size`` sets of host pools)."""
    state_kinds = {k.name for kind in kinds if kind.host_state_pools is not None for k in kind.pool_kinds}
    host_bytes = sum(
        p.nbytes for p in plan.pools if p.memory == "host" and p.kind in {HOST_TIER_POOL.name, *state_kinds}
    )
    if not host_bytes:
        return
    check_host_tier_buildable(plan)
    check_draft_host_tier_buildable(plan)
    if config.hicache_storage_backend is not None:
        from kvjax.transfers.storage_attach import check_storage_buildable

        check_storage_buildable(plan, config)
    states = [p.name for p in plan.pools if p.memory == "host" and p.kind in state_kinds]
    if states and jax.process_count() > 1:
        raise NotImplementedError(
            f"kvjax cannot build the host tier's state pools {states} under DP attention over several processes "
            "yet (each process would copy its own devices' shards of a rank's state); serve it in one process"
        )
    available = host_memory_bytes()
    if available is not None:
        check_host_memory(config.dp_size * host_bytes, available)


def _draft_context(plan: CachePlan, context: BuildContext) -> BuildContext:
    """The build context of the draft's host pool: the draft's own KV-head replicas (its host
    pool holds each distinct head once, as the target's does), as ``build_kv_cache`` builds it."""
    if plan.draft is None:
        return context
    return dataclasses.replace(context, kv_head_replicas=plan.draft.kv_head_replicas)


def _rank_host_state(
    rank: int, plan: CachePlan, kinds: tuple[PlannerKind, ...], pools: CachePools, layout: DPLayout, config: CacheConfig
) -> DPRank:
    """Rank ``rank``'s request table, allocator, host pools and tree, as ``build_kv_cache`` builds
    them (the host pools for the rank's ``("tp",)`` devices), and its queue of pending device
    updates over ``pools`` (laid out as ``layout``); with a host pool, its tree's transfers go
    through the engines a one-rank cache of the plan's kinds composes, each over the rank's slice
    of ``pools``: ``RankPageTransferEngine`` for pages (the KV's, each half of the sliding-window
    pair, the draft's), ``RankStateTransferEngine`` for recurrent-state checkpoints."""
    mesh = layout.mesh
    context = _rank_context(
        BuildContext(
            platform=plan.platform,
            host_layout=plan.hicache_mem_layout,
            kv_head_replicas=plan.target.kv_head_replicas,
        ),
        rank_mesh(mesh, rank),
        config,
    )
    table: Any = None
    host_pools: dict[str, Any] = {}
    for pool in plan.pools:
        if pool.memory == "device":
            continue
        built = create_pool(pool, _draft_context(plan, context) if pool.name == DRAFT_HOST_POOL_NAME else context)
        if isinstance(built, ReqToTokenPool):
            table = built
        else:
            host_pools[pool.name] = built
    if table is not None:
        table = plan_request_table(table, plan, kinds)
    if not isinstance(table, ReqToTokenPoolProtocol):
        raise AssertionError(f"plan {plan.model} lists no request table: {plan.pools}")
    allocator = plan_allocator(plan, kinds)
    pending = PendingDeviceUpdates(pools)
    host_pool = host_pools.get(HOST_KV)
    engine: Any = None
    storage = None
    if host_pool is not None:
        from kvjax.dp.rank_state_transfer import rank_state_engine
        from kvjax.dp.rank_transfer import rank_page_engine

        # The engines a one-rank cache of the plan's kinds composes (the draft's pages riding with
        # the target's, the sliding-window pair, the checkpoints' state engine), each the rank's own.
        transfers = TransferContext(
            plan,
            pending,
            host_pools,
            allocator,
            page_engine=rank_page_engine(rank),
            state_engine=rank_state_engine(rank, layout),
        )
        engine = host_transfer_engine(transfers)
        draft_host = host_pools.get(DRAFT_HOST_POOL_NAME)
        if config.hicache_storage_backend is not None:
            from kvjax.transfers.storage_attach import open_storage_tier

            # The key reads the device pool only for fp8 scales and other processes' heads (both refused).
            storage = open_storage_tier(plan, host_pool, pools, config, draft_host)
    tree = create_tree_cache(
        plan.tree_options,
        req_to_token_pool=table,
        token_to_kv_pool_allocator=allocator,
        host_allocator=None if host_pool is None else host_pool.allocator,
        host_engine=engine,
        storage=storage,
    )
    return DPRank(
        rank, plan, table, allocator, tree, pending, host_pool, host_pools, host_pools.get(DRAFT_HOST_POOL_NAME)
    )
