"""What decode context parallelism (``dcp_size > 1``) combines with: checked on the config and the
model's kind before anything is sized (``ConfigError``), and on a plan before anything is built
(``NotImplementedError`` for what kvjax plans but does not build under DCP).

DCP means what it means in SGLang: ``--dcp D`` divides ``--tp T`` and uses the TP group's own
``T`` chips. The weights (and the query heads) stay split over all ``T``; the KV heads are split
over ``T / D`` ranks (``CacheConfig.attn_tp_size``), and the KV that TP would replicate (MLA's
latent row, or KV heads fewer than the ranks) is striped by token over the ``D`` ranks instead
(``kvjax.alloc.dcp``): token ``i`` of a request on DCP rank ``i % D``. The mesh is ``("tp",
"dcp")`` = ``(T / D, D)`` (``kvjax.mesh_check``). Per chip, the weights are ``1 / T`` of the
checkpoint whatever ``D`` is, and the pool holds ``D`` times the tokens of one device's rows: for
DeepSeek-V3 at tp 8 the latent pool grows ``D``-fold on the same chips. For a model whose KV heads
already split over ``T`` ranks, DCP gives no more tokens (each device holds ``D`` times the heads
of ``1 / D`` of the tokens), as in SGLang.

Under DP attention (``--dp N --tp T --dcp D``, SGLang: ``attn_tp_size % dcp_size == 0``) DCP
divides each DP rank's attention TP group of ``T / N`` chips: the rank's KV heads over ``T / N /
D`` ranks, its tokens striped over ``D``, its weights and query heads over all ``T / N``; the mesh
is ``("data", "tp", "dcp")`` = ``(N, T / N / D, D)`` and each rank's plan is the one above for
its group (``kvjax.dp``).

The allocator's and the tree's page is ``page_size * dcp_size``, the pools hold ``page_size`` rows
of each striped page per device, and ``max_total_tokens`` counts the allocator's (striped) slots,
``dcp_size`` times one device's rows. Every ``page_size`` tiles the stripe (the striped page is
defined as ``page_size * dcp_size``); a pool that holds no striped page is refused by the sizing.

Refused, each by name, with what to do:

* a ``dcp_size`` that does not divide ``tp_size`` (``CacheConfig``), and query heads that do not
  split over the ``tp_size`` ranks;
* the storage tier (L3) with DCP for a kind whose KV heads TP splits (every kind but MLA's latent),
  as in SGLang (``hicache_hook.py``: ``resolve_hicache_dcp_compatibility`` refuses HiCache under DCP
  without ``use_mla_backend``; kvjax serves the host tier over DCP for every kind, the storage tier
  for MLA);
* a cache kind that says why it cannot be striped (``PlannerKind.dcp_refusal``), or what it needs
  beside DCP (``PlannerKind.dcp_config_refusal``): recurrent state without the extra buffer (its
  tree's page is the striped page, below).

Served for the hybrid sliding-window kind (Gemma 3, gpt-oss): both of its pools striped alike,
both allocators handing out striped pages, the full→SWA pairing keeping a slot's offset in its
page and so its owner rank; the sliding layers mask the window on global positions and merge over
the ranks as the full layers do (``kvjax.plan.kinds.swa``). SGLang 0.5.23 serves hybrid SWA under
DCP on its default pools without widening the SWA allocator's ids (the pools then hold no more
request tokens than without DCP); kvjax widens both, as for the full kind. A model with
``disable_hybrid_swa_memory`` is served on one striped full-size pool, the window a mask on global
positions.

Served for recurrent state (Qwen3-Next, Nemotron-H: ``kvjax.plan.kinds.recurrent``), as SGLang
serves its Mamba / linear-attention hybrids (``allocator/unified_mamba.py``: the full-attention
allocator widened by ``dcp_size``, the mamba state slot-granular beside it): the full-attention
layers' KV as for the full kind, and the state not striped, one slot per request and checkpoint,
split by heads over the whole TP group of ``T`` chips as at tp ``T`` (``("tp", "dcp")`` jointly,
tp-major, as the recurrent layers' weights: every device runs its heads' recurrence, nothing is
replicated over ``"dcp"`` and nothing more crosses it than at tp ``T``). The tree's page is the
striped page, so its checkpoints lie on that grid (SGLang's ``mamba_checkpoint_grid`` of the
widened page) and only the extra buffer's tracking slots hold a state there:
``enable_mamba_extra_buffer`` is required (SGLang's ``MambaComponent`` asserts a page of 1 without
it, on the widened page; ``generate`` sets it). Speculative decoding of it is served (a round's
rejected tokens rolled back by the state replay, the extra buffer recording a state tracked in a
round within its kept tokens only: ``kvjax.serve.speculative.draft_decoding``), and so is DP
attention with it: a rank's slice of the state split by heads over the rank's ``("tp", "dcp")``
group (``kvjax.dp.cache``).

Served: the host tier (L1 host pool, L2 load-back) and the ``host_pool`` retraction backup over
a striped pool: the host page is the striped page, every rank's rows once, rank-major, and each
device moves its own rows of the pages (``kvjax.tiers.head_shards``).
Served for MLA: the storage tier (L3) behind that host tier: a stored entry is the host page, one
striped page of every rank's rows, rank-major, under a key that says so
(``kvjax.transfers.storage_attach``); in one process only (across processes a process's host page
holds its own devices' rows: ``NotImplementedError`` at build).

Served with a speculative draft model (STANDALONE, EAGLE/NEXTN's MTP layer): the draft's pool
``kv_draft`` is planned and built as the target's (``kvjax.plan.draft``, ``build_kv_cache``), so it
is striped by token over the same ``D`` ranks at the same slots (``page_size * dcp_size`` allocator
pages), and the draft's layers attend it through the same DCP attention path (the pool's
``context_axis``); EAGLE's hidden-state store is indexed by those (global, striped) slots,
``[kv_draft slots, hidden]``, replicated over the mesh. Not built yet
(``NotImplementedError`` at build): the DSA indexer keys.
"""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.layout.pool_plan import PoolPlan
from kvjax.plan.kinds.planning import kinds_named
from kvjax.plan.records import ModelKind

__all__ = ["check_dcp_config", "check_dcp_plan_buildable"]


def check_dcp_config(config: CacheConfig, kind: ModelKind, model: str, num_attention_heads: int = 0) -> None:
    """Refuse a combination DCP does not serve (module docstring), before anything is sized;
    ``num_attention_heads``: the model's query heads (0: not checked), split over all
    ``tp_size`` ranks under DCP."""
    if not config.dcp_enabled:
        return
    dcp = config.dcp_size
    tp = config.tp_size // config.dp_size if config.enable_dp_attention else config.tp_size  # a DP rank's group
    refusals: tuple[tuple[bool, str, object, str], ...] = (
        (
            num_attention_heads > 0 and num_attention_heads % tp != 0,
            "tp_size",
            tp,
            f"{model}: under {{dcp_size}} {dcp} the query heads stay split over all {tp} (attention) TP ranks, and "
            f"its {num_attention_heads} attention heads do not split over {tp}; use a {{tp_size}} that divides "
            f"{num_attention_heads}" + (" per DP rank" if config.enable_dp_attention else ""),
        ),
        (
            config.hicache_storage_backend is not None
            and all(k.splits_kv_heads for k in kinds_named(kind.cache_kinds)),
            "hicache_storage_backend",
            config.hicache_storage_backend,
            f"{model}: the storage tier (L3) with {{dcp_size}} {dcp} is served for an MLA latent only, as in SGLang "
            "(hicache_hook: resolve_hicache_dcp_compatibility refuses HiCache under DCP without MLA); drop "
            "{hicache_storage_backend}",
        ),
    )
    for refused, option, value, why in refusals:
        if refused:
            raise ConfigError(option, value, why)
    for cache_kind in kinds_named(kind.cache_kinds):
        if cache_kind.dcp_refusal is not None:
            raise ConfigError("dcp_size", dcp, f"{model}: {cache_kind.dcp_refusal}")
        needs = None if cache_kind.dcp_config_refusal is None else cache_kind.dcp_config_refusal(config)
        if needs is not None:
            raise ConfigError("dcp_size", dcp, f"{model}: {needs}")


def check_dcp_plan_buildable(config: CacheConfig, pools: tuple[PoolPlan, ...]) -> None:
    """``NotImplementedError`` for what a DCP plan holds that kvjax does not build striped: the DSA
    indexer keys."""
    if not config.dcp_enabled:
        return
    if any(pool.name == "index_k" for pool in pools):
        raise NotImplementedError(
            f"the DSA indexer keys (pool 'index_k') striped over dcp_size={config.dcp_size} ranks are not built "
            "yet; serve the model with dcp_size=1"
        )
