"""The recurrent-state kind's host-side state: the request table with a state slot per request
(``HybridReqToTokenPool``) and the unified tree over ``"full"`` and ``"mamba"``
(``MambaRadixCache``; with the host tier ``HiMambaRadixCache``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.names import RECURRENT
from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.radix.kinds.host_kind import HostKind
from kvjax.radix.mamba_radix_cache import MambaRadixCache

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.tree_options import TreeOptions
    from kvjax.radix.tree_inputs import TreeInputs
    from kvjax.req_pool import ReqToTokenPool


def mamba_tree(o: TreeOptions, inputs: TreeInputs) -> MambaRadixCache:
    """The unified tree over ``"full"`` and ``"mamba"``: ``MambaRadixCache``; with the host tier
    ``HiMambaRadixCache``, its state copies through the state engine the build gives beside the
    KV's (``KVAndStateEngine.state``; none: simulated, host state slots sized by the tree)."""
    common = {k: v for k, v in inputs.common.items() if k != "is_eagle"}  # the Mamba tree takes no bigram keys
    if o.attach_host_tier:
        if o.disable_radix_cache:
            raise NotImplementedError(
                "the host tier over a disabled recurrent-state tree is not built; turn on the radix cache or turn "
                "off enable_hierarchical_cache for this model"
            )
        state = getattr(inputs.host_engine, "state", None)
        if inputs.host_engine is not None and state is None:
            raise NotImplementedError(
                "the host tier of a recurrent-state tree needs the state engine beside the KV's (KVAndStateEngine); "
                f"got {type(inputs.host_engine).__name__}"
            )
        return HiMambaRadixCache(
            page_size=inputs.page_size,
            token_to_kv_pool_allocator=inputs.token_to_kv_pool_allocator,
            enable_mamba_extra_buffer=bool(o.enable_mamba_extra_buffer),
            mamba_max_states_per_path=int(o.mamba_max_states_per_path),
            host_state_slots=None if state is None else state.host_pool.allocator,
            state_engine=state,
            storage=inputs.storage,
            **inputs.host_tier,
            **common,
        )
    return MambaRadixCache(
        page_size=inputs.page_size,
        token_to_kv_pool_allocator=inputs.token_to_kv_pool_allocator,
        enable_mamba_extra_buffer=bool(o.enable_mamba_extra_buffer),
        mamba_max_states_per_path=int(o.mamba_max_states_per_path),
        disable=bool(o.disable_radix_cache),
        **common,
    )


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


KIND = HostKind(name=RECURRENT, tree_builders={"full+mamba": mamba_tree}, request_table=with_state_slots)
