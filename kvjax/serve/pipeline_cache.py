"""Pipeline parallelism's cache: the layers split into stages, each stage's pools on its own devices.

``build_pipeline_cache(spec, config)`` serves ``config.pp_size`` stages of ``config.tp_size``
devices each: the first ``pp_size * tp_size`` devices form a ``("pp", "tp")`` grid and stage ``s``
owns row ``s`` as a ``("tp",)`` sub-mesh of its own (``pipeline_meshes``). Stage ``s`` holds the
pools of its layers only, ``kvjax.plan.sizing.stage_bounds(num_layers, pp_size, s)``, planned with
``pp_rank=s`` and allocated on its sub-mesh (KV heads over its ``"tp"`` axis, as without
pipelining); a hybrid model's stages keep their per-layer kind mapping (each pool lists the global
layers it serves). The token budget is every stage's minimum (the planner takes it, as SGLang
all-reduces MIN), so every stage has the same slots.

One request table, one allocator and one tree drive every stage: those of stage 0's ``KVCache``
(``cache``), built by ``build_kv_cache``; the other stages are device pools only
(``kvjax.build.build_stage_pools``). A slot id means the same token on every stage; only the
layers behind it differ. So does a recurrent-state slot id (every stage plans the same state
slots, checked with the token slots: ``planned_slots``), each stage holding its own recurrent
layers' state (``kvjax.serve.pipeline_state``).

Refused by name before anything is allocated: what ``kvjax.pipeline_check.check_pipeline_config``
refuses (more stages than layers, and what pipelining does not serve), then more
``pp_size * tp_size`` devices than there are (``pipeline_meshes``).

The host tier (HiCache) covers every stage's layers, as SGLang's per-stage cache controllers do:
each stage has host pools of its own layers, whose slot allocators are stage 0's (one host slot
id per token on every stage), and a transfer engine recording its loads in a queue of pending
device updates of its own (``pending[s]``, reading stage ``s``'s state); the tree drives one
engine, which starts every stage's copy of the same slots and reports a transfer done once every
stage's landed (``kvjax.transfers.draft_pools.PairedCopyEngine``). The owner of the step applies
each stage's queue before that stage's step. Sized in bytes (``hicache_size``), every stage's host
pool gets the slots of the stage with the most bytes per token (the planner's
``Sizes.host_bytes_per_token``). With a storage tier (L3), stage 0's cache is built without it and
the store is linked behind the tree once every stage's host pools exist, a stored page holding
every stage's layers (``kvjax.serve.pipeline_storage``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from kvjax.attention.sharding import serving_mesh
from kvjax.build import (
    KVCache,
    build_kv_cache,
    build_stage_host_engine,
    build_stage_pools,
    device_memory_limit_bytes,
)
from kvjax.config import CacheConfig
from kvjax.device_state import DeviceState
from kvjax.device_updates import PendingDeviceUpdates
from kvjax.errors import ConfigError
from kvjax.mesh_check import KV_HEAD_AXIS, make_serving_mesh
from kvjax.pipeline_check import check_pipeline_config
from kvjax.plan import CachePlan, plan_kv_cache
from kvjax.plan.sizing import stage_bounds
from kvjax.pools import CachePools
from kvjax.serve.causal_lm import PipelineStage
from kvjax.serve.pipeline_storage import link_staged_storage
from kvjax.spec import ModelSpec
from kvjax.transfers.draft_pools import PairedCopyEngine
from kvjax.transfers.storage_attach import check_storage_buildable

__all__ = ["PipelineCache", "build_pipeline_cache", "pipeline_meshes", "pipeline_stages", "planned_slots"]


def pipeline_stages(num_layers: int, pp_size: int) -> tuple[PipelineStage, ...]:
    """The layers of each of ``pp_size`` stages (``stage_bounds``: an even split, earlier stages
    one larger)."""
    return tuple(PipelineStage(*stage_bounds(num_layers, pp_size, s), num_layers) for s in range(pp_size))


def pipeline_meshes(
    pp_size: int, tp_size: int, devices: Sequence[Any] | None = None, dcp_size: int = 1, dp_size: int = 1
) -> tuple[Mesh, ...]:
    """The stage sub-meshes: the first ``pp_size * tp_size`` of ``devices`` (default: the local
    ones) as a ``("pp", "tp")`` grid, row ``s`` stage ``s``'s ``("tp",)`` mesh (``Auto`` axes);
    with ``dcp_size`` above 1 each row laid out ``("tp", "dcp")`` as one stage's TP group under
    decode context parallelism, with ``dp_size`` above 1 ``("data", "tp"[, "dcp"])`` as one
    stage's DP attention ranks (``make_serving_mesh``).

    Raises ``ConfigError`` naming ``pp_size`` when there are fewer devices than
    ``pp_size * tp_size`` (saying how to get more on a CPU host); creates nothing then.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    need = pp_size * tp_size
    if need > len(devices):
        platform = devices[0].platform if devices else "no"
        more = (
            "; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax starts) gives N devices"
            if platform == "cpu"
            else ""
        )
        raise ConfigError(
            "pp_size",
            pp_size,
            f"{pp_size} pipeline stages of tp_size={tp_size} devices need {need} devices, but only {len(devices)} "
            f"{platform} device(s) are visible; use {{pp_size}} {max(1, len(devices) // tp_size)} or fewer{more}",
        )
    grid = np.array(devices[:need], dtype=object).reshape(pp_size, tp_size)
    if dcp_size > 1 or dp_size > 1:
        return tuple(
            serving_mesh(make_serving_mesh(tp_size, dp_size, dp_size > 1, devices=list(grid[s]), dcp_size=dcp_size))
            for s in range(pp_size)
        )
    return tuple(serving_mesh(Mesh(grid[s], (KV_HEAD_AXIS,))) for s in range(pp_size))


class PipelineCache:
    """A cache served over pipeline stages (module docstring).

    ``cache``: stage 0's ``KVCache``, whose request table, allocator and tree drive every stage
    (its ``pools`` are stage 0's). ``stages[s]``: the layers of stage ``s``; ``meshes[s]`` its
    devices; ``plans[s]`` its plan (the same token slots on every stage); ``states[s]`` its device
    state (``kvjax.device_state``; stage 0's is ``cache.state``); ``pending[s]`` its queue of
    pending device updates (stage 0's is ``cache.pending``; the others' record the host tier's
    loads into their layers and the recurrent-state copies of the tree, ``pipeline_state``, and
    are empty without either). The owner of the step (the
    scheduler, stepped by ``kvjax.serve.pipeline_stepping``) applies each stage's queue before its
    step (:meth:`apply_pending`) and stores each stage's new pools
    (``Scheduler.store_pools(pools, stage)``).
    """

    def __init__(
        self,
        cache: KVCache,
        stage_pools: Sequence[CachePools],
        plans: Sequence[CachePlan],
        stages: Sequence[PipelineStage],
        meshes: Sequence[Mesh],
        pending: Sequence[PendingDeviceUpdates] | None = None,
    ) -> None:
        if not len(stage_pools) == len(plans) == len(stages) == len(meshes):
            raise ValueError("PipelineCache: one pool set, plan, stage and mesh per stage")
        self.cache = cache
        self.states: tuple[DeviceState, ...] = (cache.state, *(DeviceState(p) for p in stage_pools[1:]))
        if pending is None:
            pending = [PendingDeviceUpdates(p) for p in stage_pools[1:]]
        if len(pending) != len(stage_pools) - 1:
            raise ValueError("PipelineCache: one queue of pending device updates per stage after the first")
        self.pending: tuple[PendingDeviceUpdates, ...] = (cache.pending, *pending)
        for state, queue in zip(self.states[1:], self.pending[1:], strict=True):
            state.attach(queue)
        self.plans = tuple(plans)
        self.stages = tuple(stages)
        self.meshes = tuple(meshes)

    @property
    def pp_size(self) -> int:
        return len(self.stages)

    def pools(self, stage: int) -> CachePools:
        """Stage ``stage``'s current device state (stage 0's is ``cache.pools``)."""
        return self.states[stage].pools

    def apply_pending(self, stage: int, pools: CachePools) -> CachePools:
        """Stage ``stage``'s pending device updates applied to ``pools`` (its current state), in
        the order recorded; ``pools`` itself when none is pending (the arrays replaced are
        donated: use only what this returns)."""
        if stage == 0:
            return self.cache.apply_pending(pools)
        queue = self.pending[stage]
        return queue.apply(pools) if queue.count else pools

    def device_bytes(self, stage: int) -> int:
        """Bytes of stage ``stage``'s device pools (over all its devices)."""
        return self.states[stage].nbytes()


def build_pipeline_cache(
    spec: ModelSpec, config: CacheConfig, *, devices: Sequence[Any] | None = None, event_sink: Any = None
) -> PipelineCache:
    """Plan and build ``spec``'s cache over ``config.pp_size`` stages of ``config.tp_size`` devices
    (module docstring); ``devices``: default the local ones. ``event_sink``: the tree's KV events.

    Raises ``ConfigError`` (``check_pipeline_config``, ``pipeline_meshes``, then the planner's own
    refusals for every stage) before anything is allocated."""
    check_pipeline_config(spec, config)
    if config.enable_dp_attention:
        raise ConfigError(
            "enable_dp_attention",
            True,
            "DP attention over pipeline stages is built by kvjax.dp.LockstepDPScheduler.build_lockstep (its "
            "stages: kvjax.dp.pipeline); build_pipeline_cache serves one rank's stages",
        )
    meshes = pipeline_meshes(config.pp_size, config.tp_size, devices, config.dcp_size)
    stages = pipeline_stages(spec.num_hidden_layers, config.pp_size)
    first_device = meshes[0].devices.flat[0]
    config = config.replace(platform=config.platform or first_device.platform)
    memory = None
    if config.mem_fraction_static is not None and config.memory_budget_bytes is None:
        memory = device_memory_limit_bytes(first_device)
    for s in range(config.pp_size):  # every stage's plan passes before any is allocated
        stage_plan = plan_kv_cache(spec, config.replace(pp_rank=s), device_memory_bytes=memory)
        if config.enable_hierarchical_cache and config.hicache_storage_backend is not None:
            check_storage_buildable(stage_plan, config)
    # The storage tier is linked once every stage's host pools exist (kvjax.serve.pipeline_storage).
    storage = config.enable_hierarchical_cache and config.hicache_storage_backend is not None
    stage0 = config.replace(hicache_storage_backend=None) if storage else config
    cache = build_kv_cache(spec, stage0, mesh=meshes[0], event_sink=event_sink)
    plans: list[CachePlan] = [cache.plan]
    pools: list[CachePools] = [cache.pools]
    for s in range(1, config.pp_size):
        plan, stage_pools = build_stage_pools(spec, config.replace(pp_rank=s), mesh=meshes[s])
        if planned_slots(plan) != planned_slots(cache.plan):  # the planner sizes every stage alike
            raise AssertionError(f"stage {s} plans slots {planned_slots(plan)}, stage 0 {planned_slots(cache.plan)}")
        plans.append(plan)
        pools.append(stage_pools)
    pending: list[PendingDeviceUpdates] = []
    if cache.host_pool is not None:  # every stage's layers backed up and loaded with the same slots
        engines = []
        host_pools: list[Any] = [cache.host_pool]
        for s in range(1, config.pp_size):
            queue, engine = build_stage_host_engine(
                plans[s],
                config.replace(pp_rank=s),
                pools[s],
                cache.host_pool.allocator,
                cache.token_to_kv_pool_allocator,
                mesh=meshes[s],
            )
            pending.append(queue)
            engines.append(engine)
            if storage:  # a kind the storage tier serves (its page engine: the host pool of its layers)
                host_pools.append(engine.host_pool)
        host = cache.tree_cache.host  # type: ignore[attr-defined]
        host.engine = PairedCopyEngine(host.engine, *engines)
        if storage:
            link_staged_storage(cache.tree_cache, config, plans, pools, host_pools)
    return PipelineCache(cache, pools, plans, stages, meshes, pending or None)


def planned_slots(plan: CachePlan) -> tuple[int, int | None, int | None, int, int | None]:
    """What every stage must agree on: the allocator's tokens, the sliding-window split, the rows,
    the recurrent-state slots (one state allocator, stage 0's, drives every stage)."""
    return (
        plan.max_total_tokens,
        plan.full_tokens_per_layer,
        plan.swa_tokens_per_layer,
        plan.max_running_requests,
        plan.max_mamba_cache_size,
    )
