"""The sliding-window kind's planning (``kv_pool_kind="swa"``, the plan's ``is_hybrid_swa``).

Applies to a model with sliding layers unless ``disable_hybrid_swa_memory``; splits the token
budget so each sliding layer holds ``swa_full_tokens_ratio`` times a full layer's tokens (SGLang's
``set_num_tokens_hybrid_swa``); plans ``"kv_full"`` (full layers) and ``"kv_swa"`` (sliding
layers), built together as one pool under ``"swa"`` (pure SWA, every layer sliding: only
``"kv_swa"``), and one host pool per side; refuses the decode-side radix cache and (pure) the
``host_pool`` retraction default; names its own trees (the SWA chunk caches, and for pure SWA the
``pure_swa_radix`` tree; else the unified tree's ``"swa"`` component). A pure cache holds about
one window of KV per request; the ``cpu_tensor`` retraction backup does not cover the pair.

Speculative decoding (``speculative_rollback``): freeing a rejected draft token's slot frees its
SWA slot with it (the allocator's ``free`` unpairs the full→SWA mapping), so the kind serves it.
A STANDALONE draft's pool ``"kv_draft"`` is planned as for a full-attention target
(``kvjax.plan.draft``), indexed by the allocator's slots, its layers checked here
(``standalone_draft``: sliding layers allowed; a pure target's draft slides on every layer) and
counted in the split (``split_tokens``' ``draft_layers``); with the host tier its host pool
``"host_kv_draft"`` has the full side's host slots and its pages ride with the full side's
(``kvjax.transfers.swa_transfer``).

Decode context parallelism (``dcp_size`` D > 1) stripes both sides as it stripes the full kind's
pool (``kvjax.alloc.dcp``): the budget, the split and both pools count striped pages of
``alloc_page_size = page_size * D`` slots (each device holds ``page_size`` rows of every page of
both pools), and both allocators of ``SWATokenToKVPoolAllocator`` hand out such pages. Its pairing
maps a full page whole onto one SWA page, offset to the same offset, so a token's sliding slot has
the owner rank of its full slot (``offset % D``) and each rank writes its own tokens' rows on both
sides; a sliding layer attends its rank's rows with the window masked on global positions and the
ranks' partials merge by log-sum-exp (``kvjax.attention.dcp_attention``). Window freeing and
tombstones free whole striped SWA pages (every rank's rows of them). SGLang 0.5.23 does not widen
its SWA allocator under DCP (``kv_cache_configurator``: "SWA allocators never widen under DCP"), so
there the hybrid pools hold no more request tokens with DCP than without; kvjax widens both sides,
so each holds ``D`` times one device's rows, as the full kind's pool does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.names import SWA
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.kinds.choices import OwnTree, TokenSplit
    from kvjax.plan.records import Sizes, StageLayers, Target
    from kvjax.spec import ModelSpec

POOL = PoolKind(
    "swa",
    "device",
    "the hybrid sliding-window pools (kv_pool_kind='swa': full + SWA pools and the SWA allocator)",
)
SWA_HOST_POOL_NAME = "host_kv_swa"  # the host pool of the sliding side


def applies(spec: ModelSpec, config: CacheConfig) -> bool:
    return spec.has_sliding_layers and not config.disable_hybrid_swa_memory


def model_flags(spec: ModelSpec) -> dict[str, Any]:
    return {"is_hybrid_swa": True, "sliding_window_size": spec.sliding_window}


def split_tokens(
    spec: ModelSpec,
    config: CacheConfig,
    stage: StageLayers,
    max_total: int,
    budget: int | None,
    draft_layers: float = 0.0,
) -> TokenSplit:
    """SGLang's ``set_num_tokens_hybrid_swa``: the budget counted every KV layer at ``max_total``
    tokens; it is re-split so that each SWA layer holds ``swa_full_tokens_ratio`` times the tokens
    of a full layer (never more bytes than before). ``ConfigError`` when a pool is left without a
    page.

    ``draft_layers``: a speculative draft's pool (``"kv_draft"``, indexed by the full pool's slots,
    so as many tokens as a full layer), in units of one target layer's bytes per token; the budget
    counted it at ``max_total`` tokens too, and it is re-split with the full layers (SGLang sizes
    the draft's pool to the target's full token count after this split, ``draft_runner_cache_size``,
    from memory left over; kvjax keeps the draft inside the budget). A pure sliding-window cache
    is unchanged: its draft shares the SWA slots."""
    from kvjax.errors import ConfigError
    from kvjax.plan.kinds.choices import TokenSplit

    ps, ratio = config.alloc_page_size, config.swa_full_tokens_ratio
    if not stage.full:
        full, swa = 0, max_total // ps * ps
    else:
        total = max_total * (stage.kv_layers + draft_layers)
        full_raw = int(total / (ratio * len(stage.swa) + len(stage.full) + draft_layers))
        full, swa = full_raw // ps * ps, int(full_raw * ratio) // ps * ps
    if (stage.full and full <= 0) or (stage.swa and swa <= 0):
        raise ConfigError(
            "memory_budget_bytes",
            budget,
            f"after the sliding-window split (swa_full_tokens_ratio={ratio}) a pool holds no page of {ps} tokens; "
            "raise the budget",
        )
    return TokenSplit(
        full_tokens_per_layer=full,
        swa_tokens_per_layer=swa,
        max_total_tokens=full if stage.full else swa,
        request_window=None if stage.full else spec.sliding_window,
    )


def attention_pools(target: Target, sizes: Sizes) -> tuple[PoolPlan, ...] | None:
    """``"kv_full"`` (the full layers; none when pure) and ``"kv_swa"``, built together as one
    ``SWAKVPool``; None over a latent layout (the MLA kind plans every layer in one pool)."""
    from kvjax.layout.mha import MHALayout

    attention, stage, ps = target.attention, sizes.stage, sizes.alloc_page_size
    if not isinstance(attention, MHALayout):
        return None
    pools = []
    if stage.full:
        full_pages = (sizes.full_tokens_per_layer or 0) // ps
        pools.append(
            attention.pool_plan("kv_full", POOL.name, num_pages=full_pages, layer_ids=stage.full, built=POOL.built)
        )
    swa_pages = (sizes.swa_tokens_per_layer or 0) // ps
    pools.append(attention.pool_plan("kv_swa", POOL.name, num_pages=swa_pages, layer_ids=stage.swa, built=POOL.built))
    return tuple(pools)


def host_pools(target: Target, sizes: Sizes, host_tokens: int) -> tuple[PoolPlan, ...] | None:
    """One host pool per side (SGLang builds one per device pool; host slot ids are shared, one
    to one) when the stage has both sides; else None (the one default host pool)."""
    from kvjax.plan.kinds.host_tier import HOST_KV, host_kv_pool, host_pages

    stage = sizes.stage
    if not (stage.full and stage.swa):
        return None
    pages = host_pages(sizes, host_tokens)
    return tuple(
        host_kv_pool(target.attention, pages, name, ids)
        for name, ids in ((HOST_KV, stage.full), (SWA_HOST_POOL_NAME, stage.swa))
    )


def supports_host_pool_backup(sizes: Sizes) -> bool:
    """Only a hybrid pair (some full layers) can be backed up in the host pool by default."""
    return bool(sizes.full_tokens_per_layer)


def own_tree(sizes: Sizes, chunked: bool) -> OwnTree | None:
    """The SWA chunk caches (pure or not) for chunked prefill without the radix cache; the pure
    SWA radix tree for a pure cache; else None (the unified tree with the ``"swa"`` component)."""
    from kvjax.plan.kinds.choices import OwnTree

    pure = not sizes.full_tokens_per_layer
    if chunked:
        return OwnTree("pure_swa_chunk", ("swa",)) if pure else OwnTree("swa_chunk", ("full", "swa"))
    return OwnTree("pure_swa_radix", ("swa",)) if pure else None


def standalone_draft(target: ModelSpec, draft: ModelSpec) -> tuple[str, ...]:
    """A STANDALONE draft of a sliding-window target (``PlannerKind.standalone_draft``): its pool
    ``"kv_draft"`` is indexed by the allocator's slots, and its sliding layers mask it on global
    positions, so it may slide. A pure sliding-window target (every layer sliding) hands out SWA
    slots that window freeing returns and the allocator hands out again, so the draft's KV past the
    target's window is gone as the target's is: its draft must slide on every layer with a window
    of at most the target's (``ConfigError`` naming the draft otherwise)."""
    from kvjax.errors import ConfigError
    from kvjax.spec import LayerKind

    if all(k is LayerKind.SLIDING for k in target.layer_kinds):
        window = int(target.sliding_window or 0)
        full = [i for i, k in enumerate(draft.layer_kinds) if k is not LayerKind.SLIDING]
        if full or not draft.sliding_window or int(draft.sliding_window) > window:
            what = f"full-attention layers {full}" if full else f"a sliding window of {draft.sliding_window}"
            raise ConfigError(
                "draft_spec",
                draft.name,
                f"{target.name} slides on every layer (window {window}), so its pool keeps only the last window "
                f"of each request and the draft's pool shares those slots; this draft has {what}: give a draft "
                f"whose every layer slides with a window of at most {window}, or set disable_hybrid_swa_memory",
            )
    return (LayerKind.SLIDING.value,)


def is_pure_swa(plan: CachePlan) -> bool:
    """Every layer sliding: one SWA pool under a plain allocator (no full-attention tokens)."""
    return bool(plan.is_hybrid_swa and not plan.full_tokens_per_layer)


def uses(plan: CachePlan) -> bool:
    return bool(plan.is_hybrid_swa)


KIND = PlannerKind(
    name=SWA,
    pool_kinds=(POOL,),
    kv_pool_kind="swa",
    tree_components=("full", "swa"),
    uses=uses,
    windowed_request_kv=is_pure_swa,
    applies=applies,
    model_flags=model_flags,
    kv_pool_priority=2,
    plans_draft_pools=False,  # EAGLE-style drafts; a STANDALONE draft's pool is planned (standalone_draft)
    standalone_draft=standalone_draft,
    speculative_rollback=True,
    attention_pools=attention_pools,
    host_pools=host_pools,
    split_tokens=split_tokens,
    supports_host_pool_backup=supports_host_pool_backup,
    decode_radix_refusal=(
        "--disaggregation-decode-enable-radix-cache is incompatible with sliding window attention (SWA) models; "
        "turn it off for this model"
    ),
    own_tree=own_tree,
    tree_label="SWA",
)
