"""The recurrent-state kind (``kv_pool_kind="hybrid_linear"``, the plan's ``is_hybrid_ssm``):
hybrid SSM / linear-attention models.

* pool: every recurrent tensor of the plan, built together as one ``RecurrentStatePool`` under
  ``"recurrent"`` (one slot per live request, slot 0 padding);
* request table: ``HybridReqToTokenPool``, a state slot per request over the plan's
  ``max_mamba_cache_size`` slots;
* planner: applies to a model with recurrent state (SGLang's ``is_hybrid_ssm``), names the KV pool
  kind first of all kinds; plans the state pools (``max_mamba_cache_size`` slots, sized by
  ``kvjax.plan.sizing``); refuses the decode-side radix cache and the ``host_pool`` retraction
  backup;
* tree component ``"mamba"`` (unified tree only: ``MambaRadixCache``); serving:
  ``RecurrentStateExtension`` (state slots at admission, the step's slot inputs, checkpoints into
  the tree);
* not attention: ``attend`` refuses its layers (``recurrent_step`` runs them);
* the ``cpu_tensor`` retraction backup does not cover the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan import CachePlan
    from kvjax.plan.records import Sizes, Target
    from kvjax.plan.tree_options import TreeOptions
    from kvjax.radix import MambaRadixCache
    from kvjax.radix.tree_inputs import TreeInputs
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.serve.extension import ServingExtension
    from kvjax.spec import ModelSpec

POOL = PoolKind(
    "recurrent",
    "device",
    "the recurrent-state pool of hybrid SSM / linear-attention models (kv_pool_kind='hybrid_linear')",
    group_builder="kvjax.pools.recurrent:create_pool_group",
)


def applies(spec: ModelSpec, config: CacheConfig) -> bool:
    return spec.uses_ssm_state


def model_flags(spec: ModelSpec) -> dict[str, Any]:
    return {"is_hybrid_ssm": True}


def state_pools(target: Target, sizes: Sizes) -> tuple[PoolPlan, ...]:
    """The recurrent-state tensors of the stage's recurrent layers (``max_mamba_cache_size``
    slots and the padding slot); none on a stage without one."""
    if target.recurrent is None or not sizes.stage.recurrent:
        return ()
    return target.recurrent.pool_plans(
        num_slots=sizes.max_mamba_cache_size or 0, layer_ids=sizes.stage.recurrent, built=POOL.built
    )


def no_host_pool_backup(sizes: Sizes) -> bool:
    return False


def mamba_tree(o: TreeOptions, inputs: TreeInputs) -> MambaRadixCache:
    """The unified tree over ``"full"`` and ``"mamba"``: ``MambaRadixCache`` (no host tier yet:
    ``no_host_copy``, refused by the tree registry)."""
    from kvjax.radix import MambaRadixCache

    common = {k: v for k, v in inputs.common.items() if k != "is_eagle"}  # the Mamba tree takes no bigram keys
    return MambaRadixCache(
        page_size=inputs.page_size,
        token_to_kv_pool_allocator=inputs.token_to_kv_pool_allocator,
        enable_mamba_extra_buffer=bool(o.enable_mamba_extra_buffer),
        mamba_max_states_per_path=int(o.mamba_max_states_per_path),
        disable=bool(o.disable_radix_cache),
        **common,
    )


def uses(plan: CachePlan) -> bool:
    return bool(plan.is_hybrid_ssm)


def with_state_slots(table: ReqToTokenPool, plan: CachePlan) -> ReqToTokenPool:
    """The request table with a state slot per request (``HybridReqToTokenPool``) over the
    plan's ``max_mamba_cache_size`` slots."""
    from kvjax.hybrid_req_pool import HybridReqToTokenPool

    return HybridReqToTokenPool(
        table.size,
        table.max_context_len,
        mamba_size=int(plan.max_mamba_cache_size or 0),
        enable_mamba_extra_buffer=plan.enable_mamba_extra_buffer,
    )


def serving_extension(cache: KVCache) -> ServingExtension | None:
    """``RecurrentStateExtension`` when this rank holds recurrent state (a pipeline stage may not)."""
    if POOL.name not in cache.pools:
        return None
    from kvjax.serve.recurrent_extension import RecurrentStateExtension

    return RecurrentStateExtension(cache)


KIND = CacheKind(
    name="recurrent",
    pool_kinds=(POOL,),
    kv_pool_kind="hybrid_linear",
    tree_components=("mamba",),
    not_attention="layer_id={layer_id} is a recurrent layer (pools.recurrent): run it with recurrent_step, not attend",
    uses=uses,
    request_table=with_state_slots,
    serving_extension=serving_extension,
    page_backup=False,
    applies=applies,
    model_flags=model_flags,
    kv_pool_priority=3,
    state_pools=state_pools,
    supports_host_pool_backup=no_host_pool_backup,
    host_pool_backup_refusal="host_pool retraction does not support Mamba/SSM models; use 'cpu_tensor'",
    # SGLang 0.5.23 keeps host copies of the recurrent-state checkpoints (its Mamba host
    # component); kvjax has no host copy of them yet, so the build refuses before allocating.
    no_host_copy="recurrent-state checkpoints",
    dcp_refusal="recurrent state is per request, not per token, so it cannot be striped; use {dcp_size} 1",
    decode_radix_refusal=(
        "--disaggregation-decode-enable-radix-cache is incompatible with Mamba/SSM models; turn it off for this model"
    ),
    tree_builders={"full+mamba": mamba_tree},
    tree_label="Mamba",
)
