"""`build_kv_cache`: execute a plan — allocate the device pools and the host bookkeeping.

The build is the only place that touches devices. It plans first (every decision and error
happens in ``plan_kv_cache``), then allocates what the plan lists: the device pools (zeros, created
directly on their devices, sharded over the mesh when one is given), the request→token table, the
token allocator and the tree cache (``kvjax.radix.create_tree_cache`` picks it from the plan).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from kvjax.alloc import make_allocator
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan import CachePlan, plan_kv_cache
from kvjax.pools import CachePools, MHAKVPool
from kvjax.radix import create_tree_cache
from kvjax.req_pool import ReqToTokenPool
from kvjax.spec import ModelSpec

KV_HEAD_MESH_AXIS = "tp"


@dataclass(frozen=True, kw_only=True)
class KVCache:
    """A built KV cache: the fields of SGLang's ``KVCacheBuildResult`` plus ``plan`` and ``pools``.

    ``pools`` is device state (a pytree, replaced by every update); the allocator, request table
    and tree cache are host objects mutated in place.
    """

    is_hybrid_swa: bool
    is_hybrid_ssm: bool
    sliding_window_size: int | None
    full_tokens_per_layer: int | None
    swa_tokens_per_layer: int | None
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: Any
    disable_radix_cache: bool
    tree_cache: Any
    plan: CachePlan
    pools: CachePools

    @property
    def allocator(self) -> Any:
        """The token/page allocator (SGLang's ``token_to_kv_pool_allocator``)."""
        return self.token_to_kv_pool_allocator

    def with_pools(self, pools: CachePools) -> KVCache:
        """The same cache holding the device state returned by a step."""
        return dataclasses.replace(self, pools=pools)


def build_kv_cache(
    spec: ModelSpec,
    config: CacheConfig,
    *,
    mesh: Mesh | None = None,
    device_memory_bytes: int | None = None,
    event_sink: Any = None,
) -> KVCache:
    """Plan and build the KV cache of ``spec`` under ``config``.

    ``mesh``: KV heads are sharded over its ``"tp"`` axis (whose size must equal ``config.tp_size``);
    without a mesh the pools live on the default device. ``device_memory_bytes`` defaults to what
    the device reports, and is only needed when the budget is ``mem_fraction_static``.
    ``event_sink`` receives the tree's KV events when ``enable_kv_cache_events`` is set.

    Raises ``ConfigError`` for a bad configuration and ``NotImplementedError`` naming a pool kind
    whose capability is not built yet (MLA, hybrid SWA, recurrent state, host tier).
    """
    devices = mesh.devices.flatten().tolist() if mesh is not None else jax.devices()[:1]
    if config.platform is None:
        config = config.replace(platform=devices[0].platform)
    if device_memory_bytes is None and config.mem_fraction_static is not None and config.memory_budget_bytes is None:
        device_memory_bytes = _device_memory_bytes(devices[0])
    plan = plan_kv_cache(spec, config, device_memory_bytes=device_memory_bytes)
    _require_built_capabilities(plan)

    if mesh is not None:
        _check_mesh(mesh, config)
    kv = MHAKVPool.create(
        num_pages=plan.num_pages,
        page_size=plan.alloc_page_size,
        num_layers=plan.num_kv_layers,
        num_kv_heads=plan.num_kv_heads_per_rank * (config.attn_tp_size if mesh is not None else 1),
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
        dtype=plan.kv_cache_dtype,
        platform=plan.platform,
        head_dim_alignment=128 if plan.platform == "tpu" else 1,
        start_layer=plan.start_layer,
        mesh=mesh,
        kv_head_axis=KV_HEAD_MESH_AXIS,
    )
    allocator = make_allocator(plan.max_total_tokens, plan.alloc_page_size, need_sort=plan.need_sort)
    req_to_token_pool = ReqToTokenPool(plan.max_running_requests, plan.req_to_token_width)
    tree_cache = create_tree_cache(
        plan, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, event_sink=event_sink
    )
    return KVCache(
        is_hybrid_swa=plan.is_hybrid_swa,
        is_hybrid_ssm=plan.is_hybrid_ssm,
        sliding_window_size=plan.sliding_window_size,
        full_tokens_per_layer=plan.full_tokens_per_layer,
        swa_tokens_per_layer=plan.swa_tokens_per_layer,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        disable_radix_cache=plan.disable_radix_cache,
        tree_cache=tree_cache,
        plan=plan,
        pools=CachePools(kv=kv),
    )


def _require_built_capabilities(plan: CachePlan) -> None:
    """Raise ``NotImplementedError`` for any pool of the plan that kvjax cannot build yet."""
    missing = {
        "mla": "the MLA latent KV pool (kv_pool_kind='mla')",
        "swa": "the hybrid sliding-window pools (kv_pool_kind='swa': full + SWA pools and the SWA allocator)",
        "hybrid_linear": "the recurrent-state pool of hybrid SSM / linear-attention models (kv_pool_kind='hybrid_linear')",
    }.get(plan.kv_pool_kind)
    if missing:
        raise NotImplementedError(
            f"kvjax cannot build {missing} yet for {plan.model}; the plan is available from plan_kv_cache"
        )
    if plan.attach_host_tier:
        raise NotImplementedError(
            "kvjax cannot build the host-memory tier yet (enable_hierarchical_cache or retraction backup "
            f"'host_pool' on {plan.model}); plan without them, or use plan_kv_cache to size it"
        )


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
