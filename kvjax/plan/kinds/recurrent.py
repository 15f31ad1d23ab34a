"""The recurrent-state kind's planning (``kv_pool_kind="hybrid_linear"``, the plan's
``is_hybrid_ssm``): hybrid SSM / linear-attention models.

Applies to a model with recurrent state (SGLang's ``is_hybrid_ssm``), names the KV pool kind
first of all kinds; plans the state pools (``max_mamba_cache_size`` slots, sized by
``kvjax.plan.sizing``), built together as one pool under ``"recurrent"``; adds the unified tree's
``"mamba"`` component; refuses the decode-side radix cache and the ``host_pool`` retraction
backup. The ``cpu_tensor`` retraction backup covers the state: the request's state slot is
copied with its KV pages (``kvjax.serve.recurrent_retraction``).

Under decode context parallelism (``dcp_size`` D dividing ``tp_size`` T, ``kvjax.plan.dcp``) the
full-attention layers' KV is striped over the D ranks as for the full kind, and the state is not:
it is per request, one slot per request and checkpoint, split by heads over the whole TP group
of T chips as at tp T (``kvjax.plan.target.state_tp_size``; the pool over ``("tp", "dcp")``
jointly, ``kvjax.pools.recurrent``), as SGLang keeps its mamba pool slot-granular beside the
widened full-attention allocator (``allocator/unified_mamba.py``). The tree's page is the striped
page, ``page_size * D`` tokens, so a checkpoint depth lands on that grid (SGLang's
``mamba_checkpoint_grid`` of the widened page) and its state exists only in the extra buffer's
tracking slots: DCP needs ``enable_mamba_extra_buffer`` (:func:`dcp_config_refusal`; SGLang's
``MambaComponent`` asserts a page of 1 without it on the widened page), unless the radix cache
is off.

With the host tier (``enable_hierarchical_cache``) it plans the host copies of the checkpoints
beside the KV's host pool (SGLang's ``MambaPoolHost``): ``"host_state"``, one slot per state
(every TP rank's share, as the host KV pool holds every head), sized as SGLang sizes it
(:func:`host_state_slots`): ``int(max_mamba_cache_size * hicache_ratio) + 1``,
or with ``hicache_size`` the state pool's byte share of it (its device bytes over the KV's and its
own, SGLang's ``_split_hicache_size``; the KV host pool gets the rest: ``plan.host_sizing.kv_host_share``)
over one state's bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.names import RECURRENT
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.records import HostTier, Sizes, Target
    from kvjax.spec import ModelSpec

POOL = PoolKind(
    "recurrent",
    "device",
    "the recurrent-state pool of hybrid SSM / linear-attention models (kv_pool_kind='hybrid_linear')",
)
HOST_STATE_POOL = PoolKind("host_state", "host", "the host copies of recurrent-state checkpoints (HiCache)")


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


def host_state_slots(
    device_slots: int,
    *,
    hicache_ratio: float,
    hicache_size_gb: float = 0,
    state_share: float = 1.0,
    bytes_per_state: int = 0,
) -> int:
    """Host state slots for a device pool of ``device_slots`` checkpoint slots (SGLang's
    ``MambaPoolHost.__init__``): with ``hicache_size`` (GB) the state pool's share of it
    (``state_share``: its device bytes over every device pool's, SGLang's ``_split_hicache_size``)
    over one state's bytes, else ``int(device_slots * hicache_ratio)``; then one more slot
    (``size // 1 + 1``: page size 1, no reserved slot).

    Raises ConfigError for a negative device size or a ``hicache_size`` without ``bytes_per_state``.
    """
    from kvjax.errors import ConfigError

    if device_slots < 0:
        raise ConfigError("max_mamba_cache_size", device_slots, "use a size >= 0")
    if hicache_size_gb > 0:
        if bytes_per_state <= 0:
            raise ConfigError("bytes_per_state", bytes_per_state, "hicache_size needs the bytes one state costs")
        slots = int(hicache_size_gb * state_share * 1e9 // bytes_per_state)
    else:
        slots = int(device_slots * hicache_ratio)
    return slots + 1


def host_state_pools(target: Target, sizes: Sizes, host: HostTier) -> tuple[PoolPlan, ...]:
    """The host state pool ``"host_state"`` (module docstring): ``shape[0]`` host state slots over
    the stage's recurrent layers, its ``layout`` the device pool's; none on a stage without one."""
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.host_sizing import kv_host_share

    layout = target.recurrent
    if layout is None or not sizes.stage.recurrent:
        return ()
    layers = sizes.stage.recurrent
    device_slots = int(sizes.max_mamba_cache_size or 0)
    per_rank = len(layers) * layout.bytes_per_slot_per_layer
    slots = host_state_slots(
        device_slots,
        hicache_ratio=host.hicache_ratio,
        hicache_size_gb=host.hicache_size_gb,
        state_share=1.0 - kv_host_share(sizes),
        bytes_per_state=per_rank * layout.tp_size,
    )
    bytes_per_state = per_rank * layout.tp_size
    return (
        PoolPlan(
            "host_state",
            HOST_STATE_POOL.name,
            (slots, bytes_per_state),
            "uint8",
            1,
            slots * bytes_per_state,
            memory="host",
            built=HOST_STATE_POOL.built,
            layer_ids=layers,
            layout=layout,
        ),
    )


def dcp_config_refusal(config: CacheConfig) -> str | None:
    """The extra buffer DCP needs beside recurrent state: the tree's page is ``page_size *
    dcp_size`` tokens (more than one), so its checkpoints need the extra buffer (module
    docstring), unless the radix cache keeps none."""
    if config.enable_mamba_extra_buffer or config.disable_radix_cache:
        return None
    page = config.page_size * config.dcp_size
    return (
        f"under {{dcp_size}} {config.dcp_size} the radix tree's page is the striped page of {{page_size}} "
        f"{config.page_size} x {config.dcp_size} = {page} tokens, and a recurrent-state checkpoint at a page "
        "boundary exists only in the extra buffer's tracking slots (SGLang's MambaComponent asserts a page of 1 "
        "without it, on the page DCP widens); set {enable_mamba_extra_buffer} True (or {disable_radix_cache} True)"
    )


def no_host_pool_backup(sizes: Sizes) -> bool:
    return False


def uses(plan: CachePlan) -> bool:
    return bool(plan.is_hybrid_ssm)


KIND = PlannerKind(
    name=RECURRENT,
    pool_kinds=(POOL, HOST_STATE_POOL),
    kv_pool_kind="hybrid_linear",
    tree_components=("mamba",),
    uses=uses,
    speculative_replay=True,
    applies=applies,
    model_flags=model_flags,
    kv_pool_priority=3,
    state_pools=state_pools,
    host_state_pools=host_state_pools,
    supports_host_pool_backup=no_host_pool_backup,
    host_pool_backup_refusal="host_pool retraction does not support Mamba/SSM models; use 'cpu_tensor'",
    write_back_refusal=(
        "a recurrent-state checkpoint's host copy would have to land before its eviction; use write_through or "
        "write_through_selective"
    ),
    dcp_config_refusal=dcp_config_refusal,
    decode_radix_refusal=(
        "--disaggregation-decode-enable-radix-cache is incompatible with Mamba/SSM models; turn it off for this model"
    ),
    tree_label="Mamba",
)
