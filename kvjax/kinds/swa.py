"""The sliding-window kind (``kv_pool_kind="swa"``, the plan's ``is_hybrid_swa``).

* planner: applies to a model with sliding layers unless ``disable_hybrid_swa_memory``; splits the
  token budget so each sliding layer holds ``swa_full_tokens_ratio`` times a full layer's tokens
  (SGLang's ``set_num_tokens_hybrid_swa``); refuses the decode-side radix cache and (pure) the
  ``host_pool`` retraction default; its own trees: the SWA chunk caches, and for pure SWA the
  ``pure_swa_radix`` tree;
* pools: ``"kv_full"`` (full layers) and ``"kv_swa"`` (sliding layers), built together as one
  ``SWAKVPool`` under ``"swa"``; pure SWA (every layer sliding) has only ``"kv_swa"``;
* allocator: hybrid, ``SWATokenToKVPoolAllocator`` (each full slot paired with an SWA slot);
  pure, the plain allocator handing out SWA slots;
* tree components ``"full"`` and ``"swa"`` (pure: ``"swa"``); the trees over them
  (``SWARadixCache``, ``HiSWARadixCache``, the chunk caches, ``PureSWARadixCache``);
* serving: ``SWAServing`` (the SWA page table and slots of each step, window freeing); a pure
  cache holds about one window of KV per request, so long requests are not refused for the
  pool's size; ``attend`` runs ``hybrid_swa_attention`` for a layer of the pair;
* host tier: one host pool per side (``"host_kv"``, ``"host_kv_swa"``) and
  ``SWAPageTransferEngine`` moving both;
* the ``cpu_tensor`` retraction backup does not cover the pair.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.config import CacheConfig
    from kvjax.kinds.host_tier import TransferContext
    from kvjax.kinds.planning import OwnTree, TokenSplit
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan import CachePlan
    from kvjax.plan.records import Sizes, StageLayers, Target
    from kvjax.plan.tree_options import TreeOptions
    from kvjax.radix import PureSWAChunkCache, PureSWARadixCache, SWAChunkCache, SWARadixCache
    from kvjax.radix.tree_inputs import TreeInputs
    from kvjax.serve.extension import ServingExtension
    from kvjax.spec import ModelSpec

POOL = PoolKind(
    "swa",
    "device",
    "the hybrid sliding-window pools (kv_pool_kind='swa': full + SWA pools and the SWA allocator)",
    group_builder="kvjax.pools.swa:create_pool_group",
)
SWA_HOST_POOL_NAME = "host_kv_swa"  # the host pool of the sliding side


# --- planner ---------------------------------------------------------------------------------


def applies(spec: ModelSpec, config: CacheConfig) -> bool:
    return spec.has_sliding_layers and not config.disable_hybrid_swa_memory


def model_flags(spec: ModelSpec) -> dict[str, Any]:
    return {"is_hybrid_swa": True, "sliding_window_size": spec.sliding_window}


def split_tokens(
    spec: ModelSpec, config: CacheConfig, stage: StageLayers, max_total: int, budget: int | None
) -> TokenSplit:
    """SGLang's ``set_num_tokens_hybrid_swa``: the budget counted every KV layer at ``max_total``
    tokens; it is re-split so that each SWA layer holds ``swa_full_tokens_ratio`` times the tokens
    of a full layer (never more bytes than before). ``ConfigError`` when a pool is left without a
    page."""
    from kvjax.errors import ConfigError
    from kvjax.kinds.planning import TokenSplit

    ps, ratio = config.alloc_page_size, config.swa_full_tokens_ratio
    if not stage.full:
        full, swa = 0, max_total // ps * ps
    else:
        total = max_total * stage.kv_layers
        full_raw = int(total / (ratio * len(stage.swa) + len(stage.full)))
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
    from kvjax.kinds.host_tier import HOST_KV, host_kv_pool, host_pages

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
    from kvjax.kinds.planning import OwnTree

    pure = not sizes.full_tokens_per_layer
    if chunked:
        return OwnTree("pure_swa_chunk", ("swa",)) if pure else OwnTree("swa_chunk", ("full", "swa"))
    return OwnTree("pure_swa_radix", ("swa",)) if pure else None


def swa_tree(o: TreeOptions, inputs: TreeInputs) -> SWARadixCache | SWAChunkCache:
    """The unified tree over ``"full"`` and ``"swa"``: ``SWARadixCache`` (the SWA allocator);
    radix disabled, ``SWAChunkCache`` (SGLang's disabled tree); with the host tier
    ``HiSWARadixCache``."""
    from kvjax.radix import HiSWARadixCache, SWARadixCache

    window = o.sliding_window_size
    allocator: Any = inputs.token_to_kv_pool_allocator  # checked by the tree: an SWA allocator
    if o.attach_host_tier:
        if o.disable_radix_cache:
            raise NotImplementedError(
                "the host tier over a disabled hybrid sliding-window tree (the host_pool retraction backup with "
                "disable_radix_cache) is not built; use decode_retraction_backup='cpu_tensor' for this model"
            )
        return HiSWARadixCache(
            page_size=inputs.page_size,
            sliding_window_size=window,
            allocator=allocator,
            storage=inputs.storage,
            **inputs.host_tier,
            **inputs.common,
        )
    if o.disable_radix_cache:
        return swa_chunk_cache(o, inputs)
    return SWARadixCache(page_size=inputs.page_size, sliding_window_size=window, allocator=allocator, **inputs.common)


def swa_chunk_cache(o: TreeOptions, inputs: TreeInputs) -> SWAChunkCache:
    """``tree_cache_kind="swa_chunk"`` (needs the SWA allocator)."""
    from kvjax.radix import SWAChunkCache

    return SWAChunkCache(**inputs.chunk, sliding_window_size=o.sliding_window_size)


def pure_swa_chunk_cache(o: TreeOptions, inputs: TreeInputs) -> PureSWAChunkCache:
    """``tree_cache_kind="pure_swa_chunk"``: every layer sliding, chunked prefill, radix off."""
    from kvjax.radix import PureSWAChunkCache

    return PureSWAChunkCache(**inputs.chunk, sliding_window_size=o.sliding_window_size)


def pure_swa_tree(o: TreeOptions, inputs: TreeInputs) -> PureSWARadixCache:
    """``tree_cache_kind="pure_swa_radix"``: the pure-SWA tree over the SWA pool's plain allocator."""
    from kvjax.radix import PureSWARadixCache

    if o.attach_host_tier:
        # SGLang 0.5.23 builds its pure-SWA tree without the host tier (and refuses the
        # host_pool retraction backup for it); kvjax says so rather than drop the flag.
        raise NotImplementedError(
            "tree_cache_kind='pure_swa_radix' (every layer sliding) with the host tier: SGLang's pure-SWA "
            "tree has no host tier; turn off enable_hierarchical_cache for this model"
        )
    allocator: Any = inputs.token_to_kv_pool_allocator  # a plain allocator (checked by the tree)
    return PureSWARadixCache(
        page_size=inputs.page_size, sliding_window_size=o.sliding_window_size, allocator=allocator, **inputs.common
    )


# --- serving ---------------------------------------------------------------------------------


def is_pure_swa(plan: CachePlan) -> bool:
    """Every layer sliding: one SWA pool under a plain allocator (no full-attention tokens)."""
    return bool(plan.is_hybrid_swa and not plan.full_tokens_per_layer)


def uses(plan: CachePlan) -> bool:
    return bool(plan.is_hybrid_swa)


def allocator(plan: CachePlan) -> Any:
    """Hybrid: the paired ``SWATokenToKVPoolAllocator``; pure: None (the plain allocator)."""
    if is_pure_swa(plan):
        return None
    from kvjax.alloc import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(
        int(plan.full_tokens_per_layer or 0),
        plan.swa_tokens_per_layer or 0,
        plan.alloc_page_size,
        need_sort=plan.need_sort,
    )


def serving_extension(cache: KVCache) -> ServingExtension:
    from kvjax.serve.swa_extension import SWAServing

    return SWAServing(cache)


def pool_layers(pool: Any) -> tuple[int, ...]:
    """The global layer ids of both sides of an ``SWAKVPool``."""
    return tuple(sorted((*pool.full_layer_ids, *pool.swa_layer_ids)))


def transfer_engine(context: TransferContext) -> Any:
    """The engine moving both sides' pages, when the host tier has the SWA side's pool."""
    swa_host_pool = context.host_pools.get(SWA_HOST_POOL_NAME)
    if swa_host_pool is None:
        return None
    from kvjax.tiers.swa_transfer import SWAPageTransferEngine

    return SWAPageTransferEngine(
        context.pending, context.host_pool, swa_host_pool, context.allocator, pool_name=POOL.name
    )


KIND = CacheKind(
    name="swa",
    pool_kinds=(POOL,),
    kv_pool_kind="swa",
    tree_components=("full", "swa"),
    attention="kvjax.attention.hybrid_swa_attention:hybrid_swa_attention",
    pool_type="kvjax.pools.swa:SWAKVPool",
    attention_layers=pool_layers,
    uses=uses,
    allocator=allocator,
    serving_extension=serving_extension,
    transfer_engine=transfer_engine,
    windowed_request_kv=is_pure_swa,
    page_backup=False,
    applies=applies,
    model_flags=model_flags,
    kv_pool_priority=2,
    plans_draft_pools=False,
    attention_pools=attention_pools,
    host_pools=host_pools,
    split_tokens=split_tokens,
    supports_host_pool_backup=supports_host_pool_backup,
    dcp_refusal=(
        "the sliding layers' pool has its own allocator, not striped over DCP ranks; set "
        "{disable_hybrid_swa_memory} (one full-size pool, the window a mask on global positions) or {dcp_size} 1"
    ),
    decode_radix_refusal=(
        "--disaggregation-decode-enable-radix-cache is incompatible with sliding window attention (SWA) models; "
        "turn it off for this model"
    ),
    own_tree=own_tree,
    tree_builders={
        "full+swa": swa_tree,
        "swa_chunk": swa_chunk_cache,
        "pure_swa_chunk": pure_swa_chunk_cache,
        "pure_swa_radix": pure_swa_tree,
    },
    tree_label="SWA",
)
