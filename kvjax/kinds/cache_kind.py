"""`CacheKind`: everything one kind of cached state registers, in one record (jax-free).

A cache kind (full attention, MLA, sliding window, recurrent state, the host tier, ...) is one
module of ``kvjax.kinds`` holding one ``CacheKind``. ``build_kv_cache`` and the serving
scheduler loop over the kinds a plan uses (``kvjax.kinds.cache_kinds_of``) and call these hooks;
neither names a kind. Every hook is optional: a kind sets only what it owns.

Hooks are plain functions of the kind's own module that import heavy code (jax, the pools, the
serving loop) inside their body, so importing a kind stays jax-free (the planner imports the
registry). The attention function is a ``"module:function"`` string, resolved by ``attend``
(``kvjax.attention``) for the pool that holds a layer.

The planner (``kvjax.plan``) decides through the planner hooks (``applies`` ... ``tree_builders``)
of the kinds a model needs (``ModelKind.cache_kinds``) and names no kind itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.config import CacheConfig
    from kvjax.kinds.host_tier import TransferContext
    from kvjax.kinds.planning import AttentionChoice, OwnTree, TokenSplit
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan import CachePlan
    from kvjax.plan.records import Sizes, StageLayers, Target
    from kvjax.plan.tree_options import TreeOptions
    from kvjax.protocols import AllocatorProtocol
    from kvjax.radix.tree_inputs import TreeInputs
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.serve.extension import ServingExtension
    from kvjax.spec import ModelSpec

__all__ = ["CacheKind"]


@dataclass(frozen=True)
class CacheKind:
    """One kind of cached state: its pools, allocator, tree component, serving hooks, attention.

    Attributes:
        name: the registry key (unique).
        pool_kinds: the pool kinds it builds (``PoolPlan.kind`` keys; each owned by one kind).
        kv_pool_kind: the plan's ``kv_pool_kind`` this kind serves (``"mha"``, ``"mla"``,
            ``"swa"``, ``"hybrid_linear"``), or None when it is not a KV pool kind.
        tree_components: the components it adds to the unified tree (names of
            ``plan.tree_components``: ``"full"``, ``"swa"``, ``"mamba"``); the planner lists those
            of the kinds a model needs, in registry order, each once.
        attention: ``"module:function"`` of the function ``attend`` runs for a layer held by one
            of its pools, with the uniform signature ``(pool, layer_id, q, k, v, meta, *,
            sm_scale, soft_cap, sinks, sliding_window, mesh) -> (out, pool)`` (a kind adapts its
            own function in its module), or None (no attention: ``attend`` refuses its layers).
        attention_pool: the ``CachePools`` entry (``pools[name]``) ``attend`` looks for its layers
            in (default: the name of its first pool kind).
        pool_type: ``"module:Class"`` the entry must be an instance of to be this kind's (two
            kinds share the entry ``"kv"``: MHA and MLA pools), or None (any).
        attention_layers: ``(pool) -> tuple[int, ...]``, the global layer ids the pool holds
            (default: ``kvjax.attention.pool_layers``).
        not_attention: the message ``attend`` raises (``InvalidSlotError``) for a layer of its pool
            when the kind has no attention function (``{layer_id}`` is filled in).
        uses: ``(plan) -> bool``, whether a plan uses this kind; default: a pool of
            ``plan.pools`` is of one of ``pool_kinds``.
        extra_pools: ``(plan) -> tuple[PoolPlan, ...]``, pools the kind adds to those the planner
            lists (built like them, appended to ``plan.pools``; not counted in the planner's
            memory budget: for small per-request state).
        allocator: ``(plan) -> allocator | None``, the token allocator when this kind decides it
            (the first kind of the plan that returns one wins; none: ``make_allocator``).
        request_table: ``(table, plan) -> table``, the request table this kind needs around the
            plain one (recurrent state: a state slot per request).
        serving_extension: ``(cache) -> ServingExtension | None``, the kind's serving hooks
            (``kvjax.serve.extension``); the scheduler's default extensions are these, in
            registry order.
        transfer_engine: ``(TransferContext) -> engine``, the host tier's page transfer engine
            over this kind's pools when the plain one (``PageTransferEngine``) does not fit them
            (made before the tree, which takes it at construction: ``kinds.host_tier``).
        windowed_request_kv: ``(plan) -> bool``, True when a request holds about one window of KV
            whatever its length (pure sliding window): the scheduler then does not refuse long
            requests for the pool's size.
        page_backup: whether the decode retraction backup (``cpu_tensor``, page copies of the
            ``"kv"`` pool) covers this kind's device state; a kind with state the copies miss
            (recurrent state, the sliding-window pair) sets False.

    Planner hooks (pure, jax-free; each asked only of the kinds the model needs):

        applies: ``(spec, config) -> bool``, planner step 1: whether the model needs this kind
            (None: never by the model; such a kind is found by ``uses`` on the plan).
        model_flags: ``(spec) -> {field: value}``, the ``ModelKind`` fields (SGLang's flags:
            ``is_hybrid_swa``, ``sliding_window_size``, ...) it sets when it applies.
        kv_pool_priority: among the kinds that apply and have a ``kv_pool_kind``, the one of the
            highest priority names the plan's ``kv_pool_kind`` (full 0, MLA 1, SWA 2, recurrent 3).
        attention_layout: ``(spec, config, platform, kv_dtype) -> AttentionChoice``, the layout of
            the per-token attention cache; the applying kind of the highest ``kv_pool_priority``
            that has one decides (full: MHA/GQA heads; MLA: the latent row), for the draft model
            too.
        splits_kv_heads: whether tensor parallelism splits the model's KV heads over the ranks
            (SGLang's KV-head checks apply), for a kind with an ``attention_layout`` (MLA: False,
            its latent row is replicated).
        layer_kind: the ``LayerKind`` value of the layers its layout caches (a draft model of a
            target laid out by this kind has only such layers).
        layout_pool: ``(layout, name, num_pages, layer_ids) -> PoolPlan``, one device pool of its
            layout (the draft model's ``"kv_draft"``).
        plans_draft_pools: whether a draft model's pools are planned for a target whose
            ``kv_pool_kind`` this kind names (SWA: not yet).
        attention_pools: ``(target, sizes) -> tuple[PoolPlan, ...] | None``, the device pools of
            the attention layers; asked in descending ``kv_pool_priority``, the first answer that
            is not None is the plan's (SWA answers None over a layout not its own).
        host_pools: ``(target, sizes, host_tokens) -> tuple[PoolPlan, ...] | None``, the host
            tier's pools when the kind plans its own; asked in descending ``kv_pool_priority``
            (no answer: one host pool of the attention layout over every KV layer, ``"host_kv"``).
        state_pools: ``(target, sizes) -> tuple[PoolPlan, ...]``, further planned pools (request
            table, recurrent state), in registry order after the attention pools; in the budget.
        split_tokens: ``(spec, config, stage, max_total, budget) -> TokenSplit``, the per-layer
            token counts when the kind splits the token budget between its pools (SWA).
        supports_host_pool_backup: ``(sizes) -> bool``, whether the ``host_pool`` decode
            retraction backup can be the default for this kind's state (None: it can).
        host_pool_backup_refusal: the message refusing an explicit ``host_pool`` backup for this
            kind (None: not refused by the kind).
        no_host_copy: what of the kind's state the host tier keeps no copy of yet (recurrent-state
            checkpoints): the build (``kvjax.plan.buildable``) and the tree registry refuse a host
            tier over it, naming it (None: the host tier covers the kind).
        dcp_refusal: why the kind's state is not striped over decode-context-parallel ranks
            and what to do (``kvjax.plan.dcp`` refuses ``dcp_size > 1`` with it; options as
            ``{option}``); None: the kind serves DCP (a kind registered outside kvjax that keeps
            per-token state of its own should set it).
        decode_radix_refusal: the message refusing ``disaggregation_decode_enable_radix_cache``
            on a decode server for this kind (None: allowed).
        own_tree: ``(sizes, chunked) -> OwnTree | None``, a tree of the kind's own instead of
            the default (``chunked``: the chunk cache of chunked prefill with the radix cache
            off; else the radix tree); None: the default (``"chunk"`` over ``"full"``, or the
            unified tree).
        tree_builders: ``{key: builder}``, the trees the kind builds
            (``kvjax.radix.create_tree_cache``): keyed by a ``tree_cache_kind`` of its own tree,
            or by the unified tree's components joined with ``"+"`` (``"full+swa"``); a builder
            takes ``(TreeOptions, TreeInputs)`` and imports the tree classes in its body.
        tree_label: how messages name a tree over its component (``"SWA"``, ``"Mamba"``).
    """

    name: str
    pool_kinds: tuple[PoolKind, ...] = ()
    kv_pool_kind: str | None = None
    tree_components: tuple[str, ...] = ()
    attention: str | None = None
    attention_pool: str | None = None
    pool_type: str | None = None
    attention_layers: Callable[[Any], tuple[int, ...]] | None = None
    not_attention: str | None = None
    uses: Callable[[CachePlan], bool] | None = None
    extra_pools: Callable[[CachePlan], tuple[PoolPlan, ...]] | None = None
    allocator: Callable[[CachePlan], AllocatorProtocol | None] | None = None
    request_table: Callable[[ReqToTokenPool, CachePlan], ReqToTokenPool] | None = None
    serving_extension: Callable[[KVCache], ServingExtension | None] | None = None
    transfer_engine: Callable[[TransferContext], Any] | None = None
    windowed_request_kv: Callable[[CachePlan], bool] | None = None
    page_backup: bool = True
    # --- planner hooks ---
    applies: Callable[[ModelSpec, CacheConfig], bool] | None = None
    model_flags: Callable[[ModelSpec], Mapping[str, Any]] | None = None
    kv_pool_priority: int = 0
    attention_layout: Callable[[ModelSpec, CacheConfig, str, str], AttentionChoice] | None = None
    splits_kv_heads: bool = True
    layer_kind: str | None = None
    layout_pool: Callable[[Any, str, int, tuple[int, ...]], PoolPlan] | None = None
    plans_draft_pools: bool = True
    attention_pools: Callable[[Target, Sizes], tuple[PoolPlan, ...] | None] | None = None
    host_pools: Callable[[Target, Sizes, int], tuple[PoolPlan, ...] | None] | None = None
    state_pools: Callable[[Target, Sizes], tuple[PoolPlan, ...]] | None = None
    split_tokens: Callable[[ModelSpec, CacheConfig, StageLayers, int, int | None], TokenSplit] | None = None
    supports_host_pool_backup: Callable[[Sizes], bool] | None = None
    host_pool_backup_refusal: str | None = None
    no_host_copy: str | None = None
    dcp_refusal: str | None = None
    decode_radix_refusal: str | None = None
    own_tree: Callable[[Sizes, bool], OwnTree | None] | None = None
    tree_builders: Mapping[str, Callable[[TreeOptions, TreeInputs], Any]] = dataclasses.field(default_factory=dict)
    tree_label: str | None = None

    def used_by(self, plan: CachePlan) -> bool:
        """Whether ``plan`` uses this kind (``uses``, else: a pool of the plan is of its kinds)."""
        if self.uses is not None:
            return bool(self.uses(plan))
        names = {k.name for k in self.pool_kinds}
        return any(pool.kind in names for pool in plan.pools)

    @property
    def attention_pool_name(self) -> str | None:
        """The ``CachePools`` entry ``attend`` looks for this kind's layers in."""
        if self.attention_pool is not None:
            return self.attention_pool
        return self.pool_kinds[0].name if self.pool_kinds else None
