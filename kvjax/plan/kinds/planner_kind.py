"""`PlannerKind`: what a cache kind tells the planner, and `PoolKind`, one kind of pool it plans
(jax-free; the plan layer's record of a kind, ``kvjax.kinds.registry``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.kinds.choices import AttentionChoice, OwnTree, TokenSplit
    from kvjax.plan.records import HostTier, Sizes, StageLayers, Target
    from kvjax.spec import ModelSpec

__all__ = ["PlannerKind", "PoolKind"]


@dataclass(frozen=True)
class PoolKind:
    """One kind of pool: the key ``PoolPlan.kind`` uses.

    Attributes:
        name: the key ``PoolPlan.kind`` uses (unique over every kind's pool kinds).
        memory: ``"device"`` or ``"host"``.
        capability: what this kind is, in words (error messages name it).
        built: whether kvjax builds it today (the pools layer registers its builder,
            ``kvjax.pools.registry``); a plan of a kind not built yet is planned, not built.
    """

    name: str
    memory: str
    capability: str
    built: bool = True

    def require_built(self, model: str) -> None:
        """Raise ``NotImplementedError`` naming the capability when this kind cannot be built yet."""
        if not self.built:
            raise NotImplementedError(
                f"kvjax cannot build {self.capability} (pool kind {self.name!r}) yet for {model}; "
                "the plan is available from plan_kv_cache"
            )


@dataclass(frozen=True)
class PlannerKind:
    """A cache kind as the planner and the plan's readers see it. Every hook is optional: a kind
    sets only what it decides. Hooks are pure and jax-free; each is asked only of the kinds the
    model needs (``ModelKind.cache_kinds``) or the plan uses (``uses``).

    Attributes:
        name: the kind's name (``kvjax.kinds``; the key its other layers register under).
        pool_kinds: the pool kinds it plans (``PoolPlan.kind`` keys; each owned by one kind).
        kv_pool_kind: the plan's ``kv_pool_kind`` this kind serves (``"mha"``, ``"mla"``,
            ``"swa"``, ``"hybrid_linear"``), or None when it is not a KV pool kind.
        tree_components: the components it adds to the unified tree (``"full"``, ``"swa"``,
            ``"mamba"``); the planner lists those of the kinds a model needs, in kind order, each once.
        tree_label: how messages name a tree over its component (``"SWA"``, ``"Mamba"``).
        uses: ``(plan) -> bool``, whether a plan uses this kind; default: a pool of
            ``plan.pools`` is of one of ``pool_kinds``.
        extra_pools: ``(plan) -> tuple[PoolPlan, ...]``, pools the kind adds to those the planner
            lists (built like them, appended to ``plan.pools``; not in the planner's memory
            budget: for small per-request state).
        windowed_request_kv: ``(plan) -> bool``, True when a request holds about one window of KV
            whatever its length (pure sliding window): the scheduler then does not refuse long
            requests for the pool's size.
        page_backup: whether the decode retraction backup (``cpu_tensor``, page copies of the
            pools the serving layer's ``ServingKind.retraction_parts`` name) covers this kind's
            device state (the sliding-window pair: its full side and its window; recurrent state:
            the request's state slot with its KV pages).
        speculative_rollback: whether freeing the rejected draft tokens' slots rolls this kind's
            state back, so speculative decoding serves it (full attention, the request table, the
            host tier: True; False by default, so a new kind is refused until it says so).
        speculative_replay: whether this kind's state is rolled back by restoring its state from
            before the round and replaying the kept tokens (``kvjax.serve.speculative.state_replay``:
            the recurrent state, one slot per request that a round advances over every token).
        applies: ``(spec, config) -> bool``, planner step 1: whether the model needs this kind
            (None: never by the model; such a kind is found by ``uses`` on the plan).
        model_flags: ``(spec) -> {field: value}``, the ``ModelKind`` fields (SGLang's flags:
            ``is_hybrid_swa``, ``sliding_window_size``, ...) it sets when it applies.
        kv_pool_priority: among the kinds that apply and have a ``kv_pool_kind``, the one of the
            highest priority names the plan's ``kv_pool_kind`` (full 0, MLA 1, SWA 2, recurrent 3).
        attention_layout: ``(spec, config, platform, kv_dtype) -> AttentionChoice``, the layout of
            the per-token attention cache; the applying kind of the highest ``kv_pool_priority``
            that has one decides (full: MHA/GQA heads; MLA: the latent row), for the draft too.
        splits_kv_heads: whether tensor parallelism splits the model's KV heads over the ranks
            (SGLang's KV-head checks apply), for a kind with an ``attention_layout``.
        layer_kind: the ``LayerKind`` value of the layers its layout caches (a draft model of a
            target laid out by this kind has only such layers).
        layout_pool: ``(layout, name, num_pages, layer_ids) -> PoolPlan``, one device pool of its
            layout (the draft model's ``"kv_draft"``).
        plans_draft_pools: whether a draft model's pools are planned for a target whose
            ``kv_pool_kind`` this kind names.
        standalone_draft: ``(target, draft) -> tuple[str, ...]``, for a target whose
            ``kv_pool_kind`` this kind names: a STANDALONE draft's pool is planned (even where
            ``plans_draft_pools`` is False) once this refuses (``ConfigError``) a draft the kind's
            slots cannot serve; returns the ``LayerKind`` values the draft may have beyond its
            layout's (``kvjax.plan.draft``). None: only ``plans_draft_pools`` decides.
        draft_host_refusal: why the build refuses a host tier over this kind's pools with a draft
            model's pool (its host pool is not built beside the kind's); None: it is built.
        attention_pools: ``(target, sizes) -> tuple[PoolPlan, ...] | None``, the device pools of
            the attention layers; asked in descending ``kv_pool_priority``, the first answer that
            is not None is the plan's.
        host_pools: ``(target, sizes, host_tokens) -> tuple[PoolPlan, ...] | None``, the host
            tier's pools when the kind plans its own (no answer: one host pool ``"host_kv"``).
        host_state_pools: ``(target, sizes, host) -> tuple[PoolPlan, ...]``, host pools of the
            kind's per-request state beside the KV's, when the host tier is attached (the
            recurrent-state checkpoints' host copies), sized from the ``HostTier``.
        state_pools: ``(target, sizes) -> tuple[PoolPlan, ...]``, further planned pools (request
            table, recurrent state), in kind order after the attention pools; in the budget.
        split_tokens: ``(spec, config, stage, max_total, budget) -> TokenSplit``, the per-layer
            token counts when the kind splits the token budget between its pools (SWA).
        supports_host_pool_backup: ``(sizes) -> bool``, whether the ``host_pool`` decode
            retraction backup can be the default for this kind's state (None: it can).
        host_pool_backup_refusal: the message refusing an explicit ``host_pool`` backup.
        no_host_copy: what of the kind's state the host tier keeps no copy of yet; the build
            (``kvjax.plan.buildable``) and the tree registry refuse a host tier over it, naming it.
        write_back_refusal: why the build refuses the host tier's ``write_back`` policy over this
            kind's state (``kvjax.plan.buildable``); None: every write policy is built.
        dcp_refusal: why the kind's state is not striped over decode-context-parallel ranks and
            what to do (options as ``{option}``); None: the kind serves DCP.
        dcp_config_refusal: ``(config) -> str | None``, why the kind does not serve DCP under
            this config (a setting DCP needs beside it) and what to do (options as ``{option}``);
            None: it does (asked only under DCP, after ``dcp_refusal``).
        decode_radix_refusal: the message refusing ``disaggregation_decode_enable_radix_cache``.
        own_tree: ``(sizes, chunked) -> OwnTree | None``, a tree of the kind's own instead of the
            default (the chunk cache of chunked prefill with the radix cache off, or the unified
            tree); its builder is the kind's host-layer registration's.
    """

    name: str
    pool_kinds: tuple[PoolKind, ...] = ()
    kv_pool_kind: str | None = None
    tree_components: tuple[str, ...] = ()
    tree_label: str | None = None
    uses: Callable[[CachePlan], bool] | None = None
    extra_pools: Callable[[CachePlan], tuple[PoolPlan, ...]] | None = None
    windowed_request_kv: Callable[[CachePlan], bool] | None = None
    page_backup: bool = True
    speculative_rollback: bool = False
    speculative_replay: bool = False
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
    host_state_pools: Callable[[Target, Sizes, HostTier], tuple[PoolPlan, ...]] | None = None
    state_pools: Callable[[Target, Sizes], tuple[PoolPlan, ...]] | None = None
    split_tokens: Callable[[ModelSpec, CacheConfig, StageLayers, int, int | None], TokenSplit] | None = None
    supports_host_pool_backup: Callable[[Sizes], bool] | None = None
    host_pool_backup_refusal: str | None = None
    no_host_copy: str | None = None
    write_back_refusal: str | None = None
    standalone_draft: Callable[[ModelSpec, ModelSpec], tuple[str, ...]] | None = None
    draft_host_refusal: str | None = None
    dcp_refusal: str | None = None
    dcp_config_refusal: Callable[[CacheConfig], str | None] | None = None
    decode_radix_refusal: str | None = None
    own_tree: Callable[[Sizes, bool], OwnTree | None] | None = None

    def used_by(self, plan: CachePlan) -> bool:
        """Whether ``plan`` uses this kind (``uses``, else: a pool of the plan is of its kinds)."""
        if self.uses is not None:
            return bool(self.uses(plan))
        names = {k.name for k in self.pool_kinds}
        return any(pool.kind in names for pool in plan.pools)
