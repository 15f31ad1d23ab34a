"""The small records the planner's decisions produce, one per stage of the pipeline.

Each is frozen and plain (no jax): ``ModelKind`` (what the model needs cached), ``Target`` (the
layout on the platform: dtype, heads per rank, padding), ``StageLayers`` (the layers of this
pipeline stage, by kind), ``Sizes`` (tokens, pages, rows, state slots), ``TreeChoice`` (the prefix
cache) and ``HostTier`` (retraction backup, host tier, drafts, multimodal cache). ``CachePlan``
holds them and shows their fields under the flat names SGLang users know.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvjax.kinds.names import FULL
from kvjax.layout.mha import MHALayout
from kvjax.layout.mla import MLALayout
from kvjax.layout.recurrent import RecurrentLayout


@dataclass(frozen=True)
class ModelKind:
    """Step 1: the model's kind (SGLang's ``is_hybrid_swa`` / ``is_hybrid_ssm`` / ``is_dsa``).

    ``kv_pool_kind``: ``"mha"``, ``"mla"``, ``"swa"`` (full + sliding pools) or ``"hybrid_linear"``
    (KV + recurrent state), named by the cache kind that applies with the highest priority.
    ``cache_kinds``: the registered cache kinds the model needs (``PlannerKind.applies``), in
    registry order; the later steps ask their planner hooks. The flags are set by those kinds
    (``PlannerKind.model_flags``).
    """

    kv_pool_kind: str
    is_hybrid_swa: bool = False
    is_hybrid_ssm: bool = False
    is_dsa: bool = False
    is_mla: bool = False
    sliding_window_size: int | None = None
    cache_kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """Step 2: how the cache is laid out on the platform it is planned for.

    ``num_kv_heads_per_rank`` is ``max(1, heads // attn_tp)``; ``kv_head_replicas`` is how many
    ranks hold a copy of each KV head (> 1 when the TP size exceeds the KV heads). ``padding``
    lists what the layout pads, in words. ``attention_bytes_per_token_per_layer`` covers every
    per-token array of one attention layer (K/V or latent, plus DSA indexer keys), per rank.
    """

    platform: str
    kv_cache_dtype: str
    storage_dtype: str
    num_kv_heads_per_rank: int
    kv_head_replicas: int
    head_dim_padded: int
    attention: MHALayout | MLALayout
    recurrent: RecurrentLayout | None
    attention_bytes_per_token_per_layer: int
    padding: tuple[str, ...]
    # The parallel layout the sizes are per device of: ``tp_size`` chips in all, ``dp_size``
    # DP-attention ranks (1 without DP attention), each of ``attn_tp_size`` attention-TP ranks.
    tp_size: int = 1
    attn_tp_size: int = 1
    dp_size: int = 1


@dataclass(frozen=True)
class StageLayers:
    """The layers ``[start, end)`` of one pipeline stage, by what they cache (global ids).

    ``full``: full-attention and MLA layers (and sliding layers when hybrid SWA memory is off);
    ``swa``: sliding layers in their own pool; ``recurrent``: layers with a recurrent state.
    """

    start: int
    end: int
    full: tuple[int, ...]
    swa: tuple[int, ...]
    recurrent: tuple[int, ...]

    @property
    def kv_layers(self) -> int:
        return len(self.full) + len(self.swa)


@dataclass(frozen=True)
class Sizes:
    """Step 3: every size, per rank. Tokens are per layer; bytes per device.

    ``max_total_tokens`` is the allocator's size (for hybrid SWA the full pool's, or the SWA pool's
    when no layer is full); ``num_pages = max_total_tokens // alloc_page_size``. Each device pool
    also holds one trash page (one padding slot for recurrent state): the budget pays for it.
    """

    page_size: int
    alloc_page_size: int
    stage: StageLayers
    bytes_per_token: int
    kv_budget_bytes: int | None
    max_total_tokens: int
    num_pages: int
    full_tokens_per_layer: int | None
    swa_tokens_per_layer: int | None
    max_mamba_cache_size: int | None
    mamba_state_bytes_per_req: int
    max_running_requests: int
    context_length: int
    req_to_token_width: int
    need_sort: bool
    warnings: tuple[str, ...] = ()
    draft_bytes_per_token: int = 0  # the draft model's pool, counted in the budget (kvjax.plan.draft)
    # The largest bytes_per_token of the pipeline stages (bytes_per_token with one stage): a host
    # tier sized in bytes (hicache_size) gives every stage the slots of the largest, as SGLang's
    # sync_fixed_hicache_size takes the stages' minimum token capacity.
    host_bytes_per_token: int = 0


@dataclass(frozen=True)
class TreeChoice:
    """Steps 4-6: the prefix cache (see the decision table in ``kvjax.plan``)."""

    disable_radix_cache: bool
    chunked_prefill_size: int | None
    tree_cache_kind: str
    tree_components: tuple[str, ...]
    tree_page_size: int
    radix_eviction_policy: str
    is_eagle: bool
    enable_kv_cache_events: bool
    enable_metrics: bool
    enable_session_radix_cache: bool
    warnings: tuple[str, ...] = ()
    enable_mamba_extra_buffer: bool = False
    mamba_max_states_per_path: int = -1


@dataclass(frozen=True)
class HostTier:
    """Steps 3 and 7: the decode retraction backup, the host tier, draft host pools, the
    multimodal embedding cache."""

    decode_retraction_backup: str
    hicache_ratio: float
    attach_host_tier: bool
    host_pool_tokens: int
    draft_host_pools: bool
    mm_embedding_cache_bytes: int
    hicache_write_policy: str = "write_through"
    hicache_mem_layout: str = "layer_first"
    hicache_size_gb: float = 0.0  # the host tier's size in GB (0: hicache_ratio sizes it)
    # Whether retracted requests are backed up at all: SGLang backs them up on a decode server
    # (``disaggregation_mode == "decode"``) only; kvjax also when the backup was set explicitly.
    decode_retraction_active: bool = False


@dataclass(frozen=True)
class DraftModel:
    """What the draft model caches, per rank.

    ``attention``: the draft pool's layout (the target's pool kind); ``layer_ids``: the draft's
    layer ids (see the module docstring); ``on_this_stage``: this pipeline rank holds the draft
    (the last one); ``layout_kind``: the cache kind of that layout; ``kv_head_replicas``: ranks
    holding each of the draft's KV heads and ``host_head_shards`` the distinct shards they make (its
    host pool holds each head once).
    """

    algorithm: str
    spec_name: str
    attention: MHALayout | MLALayout
    layer_ids: tuple[int, ...]
    on_this_stage: bool
    layout_kind: str = FULL  # the cache kind of the layout (``PlannerKind.layout_pool`` plans the pool)
    host_head_shards: int = 1  # distinct KV-head shards over the ranks (its ``attn_tp_size // kv_head_replicas``)
    kv_head_replicas: int = 1  # ranks holding each of the draft's KV heads (its own ``Target.kv_head_replicas``)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over every draft layer, on the stage that holds the draft (the last:
        every stage's sizing needs it, since the token count is the minimum over stages)."""
        return self.num_layers * self.attention.bytes_per_token_per_layer
