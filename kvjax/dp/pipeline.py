"""DP attention over pipeline stages: every DP rank's batch through every stage's layers.

SGLang 0.5.23 serves ``--enable-dp-attention`` with ``--pp-size``: each pipeline stage is a TP
group whose attention runs per DP rank. kvjax lays it out as the two parts it already has:

* **devices**: ``pp_size`` stages of ``tp_size`` devices (``pipeline_meshes(..., dp_size)``), each
  stage a ``("data", "tp")`` mesh of the ``dp_size`` ranks (``("data", "tp", "dcp")`` under DCP):
  rank ``r``'s attention runs on row ``r`` of every stage's mesh.
* **state**: stage 0 is a whole ``DPKVCache`` (``build_dp_kv_cache`` with ``pp_rank=0``: every
  rank's tree, allocator, request table and its slice of stage 0's pools); every later stage holds
  only its layers' pools, stacked per rank the same way (``build_dp_pools`` of its plan,
  ``pp_rank=s``). The planner sizes every stage alike (checked), so a rank's slot is the same
  token on every stage, as one rank's stages share stage 0's allocator.
* **the step** (`DPStages`, the lockstep front's DP step): stage 0's DP program
  (``make_dp_step(..., stage=...)``) takes every rank's tokens (and, with overlap scheduling, the
  future tokens) and returns every rank's hidden states ``[dp, T, hidden]``, moved to the next
  stage's devices; each later stage runs every rank's rows over its layers and the last samples.
  Every stage's pools are donated (each KV write in place on the stage's devices); the metadata is
  the same on every stage (the slots and page tables are the ranks').

One micro-batch per step: for one batch the stages run one after the other (JAX's asynchronous
dispatch lets the host form the next batch meanwhile); SGLang's pipeline overlaps micro-batches
across stages, which the one-rank pipeline does (``kvjax.serve.pipeline_stepping``) and this
does not yet.

Refused by name before anything is allocated (``check_dp_pipeline_config``): the host tier and
the retraction backups (their copies are recorded on a rank's queue of stage 0's pools, so later
stages' layers would be left out), recurrent layers (a rank's state copies write its slice of
stage 0's stacked pool only: ``kvjax.dp.rank_state``), and what stages refuse without DP
attention (speculative decoding: ``kvjax.pipeline_check``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.sharding import serving_mesh
from kvjax.build import with_extra_pools
from kvjax.config import CacheConfig
from kvjax.dp.cache import DPKVCache, build_dp_kv_cache, build_dp_pools, check_dp_mesh
from kvjax.dp.layout import DPLayout
from kvjax.dp.rank_mesh import host_sharding
from kvjax.dp.step import make_dp_step, place_params
from kvjax.errors import ConfigError
from kvjax.pipeline_check import check_pipeline_config
from kvjax.plan import plan_kv_cache
from kvjax.plan.kinds import planner_kinds_of
from kvjax.pools import CachePools
from kvjax.serve.causal_lm import PipelineStage
from kvjax.serve.model import as_model_config
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.pipeline_cache import pipeline_meshes, pipeline_stages, planned_slots
from kvjax.spec import ModelSpec

__all__ = ["DPStages", "build_dp_stages", "check_dp_pipeline_config", "dp_stage_meshes"]


def check_dp_pipeline_config(spec: ModelSpec, config: CacheConfig) -> None:
    """``ConfigError`` naming the option for what DP attention over stages does not serve (module
    docstring), before anything is planned or allocated; ``config`` has ``enable_dp_attention``
    and ``pp_size`` above 1."""
    check_pipeline_config(spec, config)
    refusals = (
        (config.enable_hierarchical_cache, "enable_hierarchical_cache", True),
        (
            config.disaggregation_decode_retraction_backup is not None,
            "disaggregation_decode_retraction_backup",
            config.disaggregation_decode_retraction_backup,
        ),
    )
    for refused, option, value in refusals:
        if refused:
            raise ConfigError(
                option,
                value,
                "DP attention over pipeline stages copies no stage's pages to the host in kvjax yet (a rank's "
                "copies would reach stage 0's layers only); leave it unset, or serve without --pp or --dp",
            )
    if spec.recurrent_layer_ids():
        raise ConfigError(
            "enable_dp_attention",
            True,
            f"{spec.name} has recurrent layers: DP attention over pipeline stages does not copy a rank's recurrent "
            "state on every stage in kvjax yet (its forks would reach stage 0's layers only); serve it without "
            "--dp or with {pp_size} 1",
        )


def dp_stage_meshes(config: CacheConfig, devices: Sequence[Any] | None = None) -> tuple[Mesh, ...]:
    """Every stage's ``("data", "tp"[, "dcp"])`` mesh over its row of ``tp_size`` of ``devices``
    (default: the local ones; ``pipeline_meshes``' ``ConfigError`` when there are too few)."""
    return pipeline_meshes(config.pp_size, config.tp_size, devices, config.dcp_size, config.dp_size)


@dataclasses.dataclass(eq=False)
class DPStages:
    """The DP step over pipeline stages (module docstring): called as ``make_dp_step``'s step is,
    ``(pools, params, tokens [dp, T], meta, *future) -> (pools, next_tokens [dp, S][, logits])``,
    with ``pools`` stage 0's (the DP cache's) and ``params`` :attr:`params`; the later stages'
    pools are kept here (``stage_pools``) and replaced by each step's.

    Attributes:
        cache: stage 0's DP cache (every rank's host state).
        stages: each stage's layers.
        layouts: each stage's ``DPLayout`` (its mesh and pool specs).
        stage_pools: each stage's current pools (index 0: None, the cache holds stage 0's).
        params: each stage's weights, placed over its mesh (``place_params(..., stage)``).
    """

    cache: DPKVCache
    stages: tuple[PipelineStage, ...]
    layouts: tuple[DPLayout, ...]
    stage_pools: list[CachePools | None]
    params: tuple[Any, ...]
    steps: tuple[Any, ...]

    def __call__(self, pools: CachePools, params: Any, tokens: Any, meta: AttentionMetadata, *future: Any) -> Any:
        if future:  # overlap: the last stage sampled the future tokens; stage 0 reads them
            prev_tokens, token_src = future
            future = (jax.device_put(prev_tokens, host_sharding(self.layouts[0].mesh)), token_src)
        out = self.steps[0](pools, params[0], tokens, meta, *future)
        first_pools, x = out[0], out[1]
        for s in range(1, len(self.stages)):
            x = jax.device_put(x, host_sharding(self.layouts[s].mesh))  # the hidden states to stage s's devices
            out = self.steps[s](self.stage_pools[s], params[s], x, meta)
            self.stage_pools[s] = out[0]
            x = out[1]
        if len(self.stages) == 1:
            return out
        return (first_pools, *out[1:])


def build_dp_stages(
    spec: ModelSpec,
    config: CacheConfig,
    params: Any,
    meshes: Sequence[Mesh],
    *,
    model_config: ModelConfig | None = None,
    with_logits: bool = False,
) -> DPStages:
    """Plan and build every stage (module docstring) over ``meshes`` (``dp_stage_meshes``), place
    each stage's weights of ``params`` (the whole model's) and make each stage's DP program.

    Raises ``ConfigError`` (``check_dp_pipeline_config``, a mesh per stage that does not match,
    the planner's refusals for every stage) before anything is allocated."""
    check_dp_pipeline_config(spec, config)
    if len(meshes) != config.pp_size:
        raise ConfigError("pp_size", config.pp_size, f"give one mesh per stage ({len(meshes)} given)")
    served = as_model_config(spec if model_config is None else model_config)
    configs = [config.replace(pp_rank=s) for s in range(config.pp_size)]
    for stage_config, mesh in zip(configs, meshes, strict=True):
        check_dp_mesh(mesh, stage_config)
    plans = [plan_kv_cache(spec, c) for c in configs]  # every stage's plan passes before any is allocated
    for s, plan in enumerate(plans[1:], start=1):
        if planned_slots(plan) != planned_slots(plans[0]):  # the planner sizes every stage alike
            raise AssertionError(f"stage {s} plans slots {planned_slots(plan)}, stage 0 {planned_slots(plans[0])}")
    stages = pipeline_stages(spec.num_hidden_layers, config.pp_size)
    cache = build_dp_kv_cache(spec, configs[0], meshes[0])
    layouts = [cache.layout]
    stage_pools: list[CachePools | None] = [None]
    for s in range(1, config.pp_size):
        plan = with_extra_pools(plans[s], planner_kinds_of(plans[s]))
        pools, layout = build_dp_pools(plan, configs[s], serving_mesh(meshes[s]))
        layouts.append(layout)
        stage_pools.append(pools)
    placed = tuple(place_params(served, params, layout, stage) for layout, stage in zip(layouts, stages, strict=True))
    steps = tuple(
        make_dp_step(served, layout, with_logits=with_logits, stage=stage)
        for layout, stage in zip(layouts, stages, strict=True)
    )
    return DPStages(cache, stages, tuple(layouts), stage_pools, placed, steps)
