"""The recurrent-state kind's planning (``kv_pool_kind="hybrid_linear"``, the plan's
``is_hybrid_ssm``): hybrid SSM / linear-attention models.

Applies to a model with recurrent state (SGLang's ``is_hybrid_ssm``), names the KV pool kind
first of all kinds; plans the state pools (``max_mamba_cache_size`` slots, sized by
``kvjax.plan.sizing``), built together as one pool under ``"recurrent"``; adds the unified tree's
``"mamba"`` component; refuses the decode-side radix cache, the ``host_pool`` retraction backup,
a host tier over its checkpoints and DCP. The ``cpu_tensor`` retraction backup does not cover
the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.names import RECURRENT
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.records import Sizes, Target
    from kvjax.spec import ModelSpec

POOL = PoolKind(
    "recurrent",
    "device",
    "the recurrent-state pool of hybrid SSM / linear-attention models (kv_pool_kind='hybrid_linear')",
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


def uses(plan: CachePlan) -> bool:
    return bool(plan.is_hybrid_ssm)


KIND = PlannerKind(
    name=RECURRENT,
    pool_kinds=(POOL,),
    kv_pool_kind="hybrid_linear",
    tree_components=("mamba",),
    uses=uses,
    page_backup=False,
    speculative_replay=True,
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
    tree_label="Mamba",
)
