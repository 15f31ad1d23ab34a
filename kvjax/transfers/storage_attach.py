"""The storage tier (L3) behind a cache's host tier, as ``CacheConfig.hicache_storage_*`` say: opened
before the tree is built and passed to its constructor (``create_tree_cache(..., storage=...)``).

With a speculative draft model's host pool (``kvjax.transfers.draft_pools``: the same host slots
as the target's, its pages copied with the target's on every backup and load), a stored page holds
the draft's layers after the target's (``kvjax.tiers.stacked_pages``, the seam pipeline stages use
for their layers), so a prefix that comes back from storage brings the draft's KV too and the
draft proposes from it as it would have before the page left the device. SGLang 0.5.23 stores the
draft pool as a pool of its own beside the target's (``PoolName.DRAFT``, keys with a ``draft``
suffix); kvjax keeps one entry per page, so a prefetch never lands the target's page without the
draft's. Its key is the target's and the draft's keys stacked (:func:`storage_key` of each), so a
store written without a draft is not read with one (nor the other way round); the draft's weights
are named by ``hicache_storage_model_fingerprint`` only if the caller folds them in (the demo does):
pages of another draft of the same shape would only lower the acceptance (the target verifies every
token), never change a token.

Under decode context parallelism (MLA only: ``kvjax.plan.dcp``) a stored page is the host page, the
striped page of ``page_size * dcp`` rows with every DCP rank's rows once, rank-major
(``kvjax.tiers.head_shards``), and the key's layout names the stripe, so it is read only at the
same ``dcp_size``. SGLang 0.5.23 writes each DCP rank's rows as an entry of its own
(``hicache_storage.py``: the ``_tp{T}_dcp{r}_{D}_page{P}`` suffix); kvjax's one process holds every
rank's rows in its host page and keeps the page whole. Across processes (a process holding its own
devices' rows only) it is not built yet (:func:`check_storage_buildable`).

Under the hybrid sliding-window tree (``HiSWARadixCache``: two host pools, the full layers' and
the sliding layers', with the same host slot ids) the full layers' pages are the page store (the
key of the full host pool, its layers) and the sliding layers' pages a second store beside it
(the key of the SWA host pool, its layers; ``kvjax.radix.storage_window``), each sharded over TP
ranks like its host page. SGLang 0.5.23 stores them the same way, the SWA pool as its own entries
(``PoolName.SWA``) next to the KV pool's. Under the recurrent-state tree (``HiMambaRadixCache``:
the KV host pool and the host state pool, slot ids of its own) the KV pages are the page store and
the checkpoints a second store beside it, one entry per state (every layer's rows of every state
array as bytes; the key names the recurrent layers, the arrays' dtypes and the TP size:
``kvjax.radix.storage_checkpoint``), as SGLang 0.5.23 stores its Mamba pool (``PoolName.MAMBA``).
Not built yet for either tree (:func:`check_storage_buildable`): under DP attention, over
pipeline stages, across processes, and with a draft model's host pool (refused earlier as well).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.layout.storage import is_fp8, logical_dtype_name
from kvjax.plan.draft import DRAFT_HOST_POOL_NAME, DRAFT_POOL_NAME
from kvjax.plan.kinds.recurrent import HOST_STATE_POOL
from kvjax.plan.kinds.swa import POOL as SWA_POOL
from kvjax.plan.kinds.swa import SWA_HOST_POOL_NAME
from kvjax.radix.storage_checkpoint import CheckpointStore, state_page_shape
from kvjax.radix.storage_link import StorageOptions
from kvjax.radix.storage_window import WindowStore
from kvjax.tiers.head_shards import HeadShards
from kvjax.tiers.stacked_pages import StackedHostPages, stacked_storage_key
from kvjax.tiers.storage import StorageTier
from kvjax.tiers.storage_key import StorageKey
from kvjax.transfers.device_pages import page_layers

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvjax.config import CacheConfig
    from kvjax.plan import CachePlan
    from kvjax.tiers.host_pool import HostKVPool
    from kvjax.tiers.host_state_pool import HostStatePool


def storage_key(
    plan: CachePlan,
    host_pool: HostKVPool,
    pools: Any,
    config: CacheConfig,
    *,
    host_pool_name: str = "host_kv",
    device_pool: str = "kv",
    device_kv: Any = None,
) -> StorageKey:
    """The key of the pages a cache of ``plan`` writes from ``host_pool`` (the plan's pool
    ``host_pool_name``, the host copy of device pool ``device_pool``):
    ``config.hicache_storage_model_fingerprint``, the host pool's page shape and stored dtype, the
    plan's KV dtype, the device pool's fp8 scales (``pools[device_pool]``; MHA: K then V per
    layer; MLA: the latent's per layer; as they are now, so set them before the store is opened),
    the pool kind (and, under DCP, the stripe: a page's rows rank-major over ``dcp_size`` ranks,
    ``kvjax.tiers.head_shards``), the TP size, this process's index as the rank (a pool sharded
    over TP ranks stores each rank's heads under its own rank's key instead: :func:`rank_shards`),
    the host pool's layer ids, and ``config.hicache_storage_namespace``. ``device_kv``: the device
    pool itself, when it is a part of a pool (the sliding-window pool's ``full`` or ``swa``).
    """
    import jax

    scales: tuple[float, ...] = ()
    if is_fp8(plan.kv_cache_dtype):
        device_kv = pools[device_pool] if device_kv is None else device_kv
        names = ("k_scale", "v_scale") if hasattr(device_kv, "k_scale") else ("scale",)  # MHA; MLA latent
        scales = tuple(s for name in names for s in np.asarray(getattr(device_kv, name), np.float32).tolist())
    host_plan = next(p for p in plan.pools if p.name == host_pool_name)
    return StorageKey(
        model=str(config.hicache_storage_model_fingerprint or ""),
        page_shape=(host_pool.num_layers, *host_pool.page_row),
        store_dtype=host_pool.store_dtype.name,
        kv_dtype=logical_dtype_name(plan.kv_cache_dtype),
        kv_scales=scales,
        layout=f"{plan.kind.kv_pool_kind}/page_first" + (f"/dcp{config.dcp_size}" if config.dcp_enabled else ""),
        tp_rank=jax.process_index(),
        tp_size=config.tp_size,
        layers=tuple(host_plan.layer_ids),
        namespace=config.hicache_storage_namespace,
    )


def check_storage_buildable(plan: CachePlan, config: CacheConfig) -> None:
    """Before anything is allocated: the storage tier can be built over ``plan``'s host pools.

    ``NotImplementedError`` naming what is not built: a draft model whose host page (tokens, KV
    heads, head dim) or KV-head replicas over the TP ranks differ from the target's (one stored
    entry stacks the two pools' layers, sharded over the ranks alike: module docstring); a pool
    striped over DCP ranks across several processes (a stored entry is the whole striped page,
    and a process's host page holds only its own devices' rows); the hybrid sliding-window and the
    recurrent-state trees' second stores under DP attention, over pipeline stages, across
    processes or with a draft's host pool."""
    if config.hicache_storage_backend is None:
        return
    import jax

    refused = {
        f"dp_size={config.dp_size} with enable_dp_attention": config.enable_dp_attention,
        f"pp_size={config.pp_size}": config.pp_size > 1,
        f"{jax.process_count()} processes": jax.process_count() > 1,
        "a speculative draft model's host pool": plan.draft is not None,
    }
    layout = next((name for name, on in refused.items() if on), None)
    tree = "the hybrid sliding-window tree" if plan.is_hybrid_swa else "the recurrent-state tree"
    second = "sliding layers' pages are" if plan.is_hybrid_swa else "checkpoints are"
    if (plan.is_hybrid_swa or plan.is_hybrid_ssm) and layout is not None:
        raise NotImplementedError(
            f"kvjax cannot build the storage tier under {tree} with {layout} yet (its {second} stored on one "
            f"device or a TP mesh only); drop hicache_storage_backend={config.hicache_storage_backend!r} or serve "
            "it without that"
        )

    if config.dcp_enabled and jax.process_count() > 1:
        raise NotImplementedError(
            f"kvjax cannot build the storage tier over dcp_size={config.dcp_size} across {jax.process_count()} "
            f"processes yet (each process's host page holds its own devices' rows); serve it in one process, or drop "
            f"hicache_storage_backend={config.hicache_storage_backend!r}"
        )
    shapes = {p.name: p.shape for p in plan.pools if p.name in ("host_kv", DRAFT_HOST_POOL_NAME)}
    if plan.draft is None or len(shapes) != 2:
        return
    target, draft = shapes["host_kv"], shapes[DRAFT_HOST_POOL_NAME]
    if target != draft or plan.target.kv_head_replicas != plan.draft.kv_head_replicas:
        raise NotImplementedError(
            f"kvjax cannot store the draft model's pages with the target's yet when its host pages differ "
            f"(draft {draft}, {plan.draft.kv_head_replicas} head replicas; target {target}, "
            f"{plan.target.kv_head_replicas}): use a draft of the target's KV heads and head dim, or drop "
            f"hicache_storage_backend={config.hicache_storage_backend!r}"
        )


def rank_shards(
    host_pool: HostKVPool, config: CacheConfig, local_heads: Sequence[slice] | None = None
) -> tuple[tuple[int, slice], ...]:
    """The per-rank entries of a page (``StorageTier(shards=)``) for a pool sharded over
    ``config.attn_tp_size`` ranks: one per distinct head shard of the host page, keyed with the
    first rank that holds it (replicated heads are stored once, like the host page); ``()`` for
    one rank or a page without a head axis (MLA's latent, the same on every rank: one entry).
    ``local_heads``: the host head blocks this process's devices hold (:func:`local_head_blocks`;
    None: every block): across processes each stores and reads only its own ranks' entries."""
    if config.attn_tp_size == 1 or len(host_pool.page_row) != 3:
        return ()
    replicas = host_pool.kv_head_replicas
    shards = max(1, config.attn_tp_size // replicas)  # distinct head shards, each once in the host page
    width = host_pool.page_row[1] // shards
    every = tuple((i * replicas, slice(i * width, (i + 1) * width)) for i in range(shards))
    if local_heads is None:
        return every
    held = {(h.start, h.stop) for h in local_heads}
    return tuple((rank, heads) for rank, heads in every if (heads.start, heads.stop) in held)


def local_head_blocks(pools: Any, host_pool: HostKVPool) -> tuple[slice, ...] | None:
    """The host head blocks of the device KV pool (``pools.kv``) that this process's devices
    hold, when the pool's heads are split over devices of several processes; None when this
    process holds every block (one process, a pool on one device, or a page without a head axis)."""
    import jax

    if jax.process_count() == 1 or len(host_pool.page_row) != 3:
        return None
    layer = page_layers(pools.kv)[0]
    if len(layer.sharding.device_set) == 1 or layer.ndim != 4:
        return None
    shards = HeadShards.of(layer.sharding, layer.shape, host_pool.page_row[1], host_pool.kv_head_replicas)
    local = shards.on_process(jax.process_index())
    if len(local.host_blocks) == len(shards.host_blocks):
        return None
    return tuple(heads for _, heads in local.host_blocks)


def open_storage_tier(
    plan: CachePlan,
    host_pool: HostKVPool,
    pools: Any,
    config: CacheConfig,
    draft_host_pool: HostKVPool | None = None,
    *,
    host_pools: Mapping[str, Any] | None = None,
) -> StorageOptions:
    """Open the store (``"memory"``, or the ``"file"`` backend in ``hicache_storage_dir``) over pages
    of ``host_pool``, under :func:`storage_key`, with the config's prefetch settings: what the
    tree's constructor links behind its host tier. ``draft_host_pool``: the draft model's host
    pool (the same slots), whose layers each page holds after the target's (module docstring).
    ``host_pools``: the plan's host pools by name; the sliding-window host pool or the host state
    pool among them gets a store of its own beside the page store (module docstring).
    """
    location = "memory" if config.hicache_storage_backend == "memory" else str(config.hicache_storage_dir)
    window_host_pool = None if host_pools is None else host_pools.get(SWA_HOST_POOL_NAME)
    if window_host_pool is not None:
        if draft_host_pool is not None:
            raise NotImplementedError("the storage tier of a draft model's host pool beside the sliding-window pools")
        return _open_window_storage(plan, host_pool, window_host_pool, pools, config, location)
    state_host_pool = None if host_pools is None else host_pools.get(HOST_STATE_POOL.name)
    if state_host_pool is not None:
        if draft_host_pool is not None:
            raise NotImplementedError("the storage tier of a draft model's host pool beside the host state pool")
        return _open_checkpoint_storage(plan, host_pool, state_host_pool, pools, config, location)
    key = storage_key(plan, host_pool, pools, config)
    pages: Any = host_pool
    if draft_host_pool is not None:
        if draft_host_pool.size != host_pool.size:
            raise AssertionError(f"draft host pool of {draft_host_pool.size} slots, target's {host_pool.size}")
        draft = storage_key(
            plan, draft_host_pool, pools, config, host_pool_name=DRAFT_HOST_POOL_NAME, device_pool=DRAFT_POOL_NAME
        )
        key = stacked_storage_key([key, draft])
        pages = StackedHostPages([host_pool, draft_host_pool])
    local = local_head_blocks(pools, host_pool)
    shards = rank_shards(host_pool, config, local)
    store = StorageTier(location, key=key, shards=shards, partial_shards=local is not None)
    return _storage_options(config, store, pages)


def _storage_options(config: CacheConfig, store: StorageTier, pages: Any, **stores: Any) -> StorageOptions:
    """The options linking ``store`` over host ``pages`` with the config's prefetch settings
    (policy, timeout, threshold); ``stores``: the side stores a hybrid tree links beside it
    (``window``, ``checkpoints``)."""
    return StorageOptions(
        store,
        pages,
        prefetch_policy=config.hicache_storage_prefetch_policy,
        prefetch_timeout_s=config.hicache_storage_prefetch_timeout_s,
        prefetch_threshold=config.hicache_storage_prefetch_threshold,
        **stores,
    )


def _open_window_storage(
    plan: CachePlan, host_pool: HostKVPool, window_host_pool: HostKVPool, pools: Any, config: CacheConfig, location: str
) -> StorageOptions:
    """The page store of the full layers' ``host_pool`` and, beside it, the store of the sliding
    layers' ``window_host_pool`` (the same host slots; module docstring), each under its own
    pool's key and sharded over TP ranks like its host page."""
    if window_host_pool.size != host_pool.size:
        raise AssertionError(f"SWA host pool of {window_host_pool.size} slots, full host pool's {host_pool.size}")
    device = pools[SWA_POOL.name]
    stores = []
    for name, pool, part in ((None, host_pool, device.full), (SWA_HOST_POOL_NAME, window_host_pool, device.swa)):
        names = {} if name is None else {"host_pool_name": name}
        key = storage_key(plan, pool, pools, config, device_kv=part, **names)
        stores.append(StorageTier(location, key=key, shards=rank_shards(pool, config, None)))
    full, window = stores
    return _storage_options(config, full, host_pool, window=WindowStore(window, window_host_pool))


def checkpoint_storage_key(plan: CachePlan, state_pool: HostStatePool, config: CacheConfig) -> StorageKey:
    """The key of the checkpoints a cache of ``plan`` writes from ``state_pool`` (the plan's host
    state pool): ``config.hicache_storage_model_fingerprint``, one state's stored page
    (``state_page_shape``, bytes), the state arrays' storage dtypes, the layout
    (``recurrent-state/slot``), the TP size, this process's index as the rank, the recurrent layer
    ids, and ``config.hicache_storage_namespace``."""
    import jax

    host_plan = next(p for p in plan.pools if p.name == HOST_STATE_POOL.name)
    return StorageKey(
        model=str(config.hicache_storage_model_fingerprint or ""),
        page_shape=state_page_shape(state_pool),
        store_dtype="uint8",
        kv_dtype="+".join(dtype for _, dtype in state_pool.rows),
        layout="recurrent-state/slot",
        tp_rank=jax.process_index(),
        tp_size=config.tp_size,
        layers=tuple(host_plan.layer_ids),
        namespace=config.hicache_storage_namespace,
    )


def _open_checkpoint_storage(
    plan: CachePlan, host_pool: HostKVPool, state_pool: HostStatePool, pools: Any, config: CacheConfig, location: str
) -> StorageOptions:
    """The page store of the KV ``host_pool`` and, beside it, the store of the checkpoints in
    ``state_pool`` (module docstring; one entry per state, the host pool's rows of every rank)."""
    full = StorageTier(location, key=storage_key(plan, host_pool, pools, config), shards=rank_shards(host_pool, config))
    states = StorageTier(location, key=checkpoint_storage_key(plan, state_pool, config))
    return _storage_options(config, full, host_pool, checkpoints=CheckpointStore(states, state_pool))
