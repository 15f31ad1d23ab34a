"""`plan_kv_cache`: every decision and every size of the KV cache, before a byte is allocated.

The package is a short pipeline of pure decisions, one module each, over the small records of
``kvjax.plan.records``: ``model_kind`` -> ``target`` (layout, TP and page checks) -> ``sizing`` ->
``tree`` (retraction backup, radix on/off, tree kind, host tier) -> ``pool_plans`` (asked of the
pool kinds' layouts) -> ``CachePlan`` (``cache_plan``, which also prints it). No jax is imported.
What differs per kind of cached state is asked of the cache kinds the model needs (the planner
hooks of ``kvjax.plan.kinds.PlannerKind``); no module here names a kind.

The planner is a pure function of ``(ModelSpec, CacheConfig, device_memory_bytes)``: no globals,
no environment reads, no devices touched. Equal inputs give equal plans. It ports the decisions of
SGLang's ``kv_cache_builder.build_kv_cache`` and of the sizing it relies on
(``model_runner_kv_cache_mixin``): hybrid detection, token budgets, the SWA split, the SSM state
set-aside, radix on/off, which tree, the decode retraction backup, the host ratio, draft host pools
and the multimodal embedding cache.

Decisions, in the seed's order (each has a test named after it in ``tests/test_plan.py``):

1. model kind: ``is_hybrid_swa`` (some sliding layers, hybrid SWA memory not disabled),
   ``is_hybrid_ssm`` (recurrent layers), ``is_dsa`` (DeepSeek sparse attention indexer);
2. target: storage dtype, KV heads per rank (refusing TP sizes SGLang refuses), padding, TPU page
   size versus packing;
   sizes: bytes per token from the storage layout, tokens from the budget (after the SSM state
   set-aside and the trash page), capped by ``max_total_tokens``, page aligned, minimum across
   pipeline stages; the SWA split; request rows and the request-table width;
3. retraction backup and the ``hicache_ratio`` default;
4. radix cache disabled (asked, or multimodal on the Transformers backend, with a warning), and the
   effective chunked prefill size;
5. decode-side radix cache rejected for SWA and SSM models;
6. the tree cache kind (table below) and its page size;
7. draft host pools, host tier size, multimodal embedding cache; the speculative draft model's
   pool ``kv_draft`` (``draft``: described before sizing, since its bytes share the budget).

Tree-cache decision table (SGLang's newest registry; the first matching row wins)::

    row  condition                                                   tree_cache_kind
    0    radix disabled and retraction backup == "host_pool"         "unified" (disabled tree) + host tier
    1    chunked prefill on and radix disabled, not SWA              "chunk"
    1    ... SWA with no full-attention layers                        "pure_swa_chunk"
    1    ... other SWA                                                "swa_chunk"
    4    hybrid SWA with no full-attention layers                    "pure_swa_radix"
    7    everything else (plain, SWA, SSM, DSA, hierarchical or not) "unified"; components full (+swa) (+mamba)

Rows 2, 3, 5 and 6 of SGLang's chain (C++ tree, external linker, LMCache, FlexKV) select
integrations kvjax does not have and are omitted. A ``"unified"`` tree with ``disable_radix_cache``
is SGLang's "disabled tree": it never matches, like a chunk cache.
"""

from __future__ import annotations

from kvjax.layout.pool_plan import PoolPlan
from kvjax.plan.cache_plan import CachePlan, fmt_bytes
from kvjax.plan.pipeline import plan_kv_cache
from kvjax.plan.records import HostTier, ModelKind, Sizes, StageLayers, Target, TreeChoice
from kvjax.plan.sizing import DEFAULT_MEM_FRACTION_STATIC, REQ_TABLE_EXTRA_TOKENS

__all__ = [
    "DEFAULT_MEM_FRACTION_STATIC",
    "REQ_TABLE_EXTRA_TOKENS",
    "CachePlan",
    "HostTier",
    "ModelKind",
    "PoolPlan",
    "Sizes",
    "StageLayers",
    "Target",
    "TreeChoice",
    "fmt_bytes",
    "plan_kv_cache",
]
