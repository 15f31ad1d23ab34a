"""`plan_kv_cache`: every decision and every size of the KV cache, before a byte is allocated.

The planner is a pure function of ``(ModelSpec, CacheConfig, device_memory_bytes)``: no globals,
no environment reads, no devices touched. Equal inputs give equal plans. It ports the decisions of
SGLang's ``kv_cache_builder.build_kv_cache`` and of the sizing it relies on
(``model_runner_kv_cache_mixin``): hybrid detection, token budgets, the SWA split, the SSM state
set-aside, radix on/off, which tree, the decode retraction backup, the host ratio, draft host pools
and the multimodal embedding cache.

Decisions, in the seed's order (each has a test named after it in ``tests/test_plan.py``):

1. model kind: ``is_hybrid_swa`` (some sliding layers, hybrid SWA memory not disabled),
   ``is_hybrid_ssm`` (recurrent layers), ``is_dsa`` (DeepSeek sparse attention indexer);
2. sizes: bytes per token from the storage layout, tokens from the budget (after the SSM state
   set-aside), capped by ``max_total_tokens``, page aligned, minimum across pipeline stages; the
   SWA split; request rows and the request-table width;
3. retraction backup and the ``hicache_ratio`` default;
4. radix cache disabled (asked, or multimodal on the Transformers backend, with a warning), and the
   effective chunked prefill size;
5. decode-side radix cache rejected for SWA and SSM models;
6. the tree cache kind (table below) and its page size;
7. draft host pools, host tier size, multimodal embedding cache.

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

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.pools.dtypes import storage_dtype
from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec, dtype_bytes

logger = logging.getLogger(__name__)

# SGLang's defaults around the planner.
DEFAULT_MEM_FRACTION_STATIC = 0.9
REQ_TABLE_EXTRA_TOKENS = 4
DEFAULT_MAMBA_CACHE_SIZE = 512
MAMBA_STATES_PER_REQ_WITH_RADIX = 3
MAMBA_EXTRA_BUFFER_STATES = {False: 2, True: 1}  # keyed by "speculative decoding on"
HICACHE_RATIO_WITH_HOST_POOL = 1.0
HICACHE_RATIO_DEFAULT = 2.0
DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


@dataclass(frozen=True)
class PoolPlan:
    """One buffer the build will allocate: where it lives, its shape, dtype and total bytes.

    ``count`` arrays of ``shape`` (one per layer for KV pools); ``nbytes`` covers all of them.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    nbytes: int
    memory: str = "device"  # "device" or "host"
    built: bool = True  # False: the capability that would build it is not implemented yet

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class CachePlan:
    """The decided KV cache. Token counts are per layer; bytes are per device (per TP/PP rank)."""

    model: str
    platform: str
    kv_cache_dtype: str
    storage_dtype: str
    # model kind
    is_hybrid_swa: bool
    is_hybrid_ssm: bool
    is_dsa: bool
    is_mla: bool
    kv_pool_kind: str  # "mha", "mla", "swa" (full + sliding pools) or "hybrid_linear" (KV + recurrent state)
    sliding_window_size: int | None
    # sizes
    page_size: int
    alloc_page_size: int
    head_dim_padded: int
    num_kv_heads_per_rank: int
    num_kv_layers: int
    num_full_layers: int
    num_swa_layers: int
    num_recurrent_layers: int
    start_layer: int
    end_layer: int
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
    # prefix cache
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
    # host tier, retraction, drafts, multimodal
    decode_retraction_backup: str
    hicache_ratio: float
    attach_host_tier: bool
    host_pool_tokens: int
    draft_host_pools: bool
    mm_embedding_cache_bytes: int
    pools: tuple[PoolPlan, ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def device_bytes(self) -> int:
        """Bytes of all device buffers in the plan."""
        return sum(p.nbytes for p in self.pools if p.memory == "device")

    @property
    def host_bytes(self) -> int:
        """Bytes of all host buffers in the plan (request table, host KV tier)."""
        return sum(p.nbytes for p in self.pools if p.memory == "host")

    def pool(self, name: str) -> PoolPlan:
        """The planned buffer called ``name`` (``KeyError`` naming the choices otherwise)."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no pool {name!r} in this plan; pools: {[p.name for p in self.pools]}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (pools as dicts, tuples as lists)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["pools"] = [p.to_dict() for p in self.pools]
        d["tree_components"] = list(self.tree_components)
        d["warnings"] = list(self.warnings)
        d["device_bytes"] = self.device_bytes
        d["host_bytes"] = self.host_bytes
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"KV cache plan for {self.model} ({self.platform}, {self.kv_cache_dtype} stored as {self.storage_dtype})",
            f"  tokens: {self.max_total_tokens:,} ({self.num_pages:,} pages of {self.alloc_page_size}), "
            f"{self.bytes_per_token:,} bytes/token, budget {_fmt_bytes(self.kv_budget_bytes)}",
            f"  kind: pool={self.kv_pool_kind} hybrid_swa={self.is_hybrid_swa} hybrid_ssm={self.is_hybrid_ssm} "
            f"dsa={self.is_dsa} window={self.sliding_window_size}",
        ]
        if self.is_hybrid_swa:
            lines.append(
                f"  per layer: full={self.full_tokens_per_layer:,} tokens, swa={self.swa_tokens_per_layer:,} tokens"
            )
        lines += [
            f"  requests: {self.max_running_requests:,} rows x {self.req_to_token_width:,} tokens (context {self.context_length:,})",
            f"  tree: {self.tree_cache_kind} {list(self.tree_components)} page={self.tree_page_size} "
            f"policy={self.radix_eviction_policy} radix_disabled={self.disable_radix_cache} "
            f"chunked_prefill={self.chunked_prefill_size}",
            f"  retraction backup: {self.decode_retraction_backup}, hicache_ratio={self.hicache_ratio}, "
            f"host tier={self.attach_host_tier}, draft host pools={self.draft_host_pools}",
            "",
            f"  {'pool':<16} {'kind':<16} {'where':<7} {'count':>5}  {'shape':<34} {'dtype':<9} {'bytes':>11}",
        ]
        for p in self.pools:
            shape = "[" + ", ".join(f"{d:,}" for d in p.shape) + "]"
            mark = "" if p.built else "  (not built yet)"
            lines.append(
                f"  {p.name:<16} {p.kind:<16} {p.memory:<7} {p.count:>5}  {shape:<34} {p.dtype:<9} "
                f"{_fmt_bytes(p.nbytes):>11}{mark}"
            )
        lines.append(
            f"  {'total device':<16} {'':<16} {'':<7} {'':>5}  {'':<34} {'':<9} {_fmt_bytes(self.device_bytes):>11}"
        )
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)


def plan_kv_cache(spec: ModelSpec, config: CacheConfig, *, device_memory_bytes: int | None = None) -> CachePlan:
    """Decide and size the KV cache of ``spec`` under ``config``. Pure and deterministic.

    ``device_memory_bytes`` is the memory of one device; it is needed only when the budget is
    given as ``mem_fraction_static``. Raises ``ConfigError`` for a combination that cannot be built.
    """
    warnings: list[str] = []
    platform = config.platform or "tpu"
    kv_dtype = spec.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    store = storage_dtype(kv_dtype, platform)
    itemsize = store.itemsize
    align = 128 if platform == "tpu" else 1
    ps = config.alloc_page_size
    context_length = config.context_length or spec.context_length

    # 1. Model kind -------------------------------------------------------------------------------
    is_hybrid_swa = spec.has_sliding_layers and not config.disable_hybrid_swa_memory
    is_hybrid_ssm = spec.uses_ssm_state
    sliding_window_size = spec.sliding_window if is_hybrid_swa else None
    kv_heads = 1 if spec.is_mla else max(1, spec.num_kv_heads // config.attn_tp_size)
    if spec.is_mla:
        head_dim_padded = _round_up(spec.kv_lora_rank + spec.qk_rope_head_dim, align)
    else:
        head_dim_padded = _round_up(max(spec.head_dim, spec.v_head_dim), align)
    per_layer_bytes = (1 if spec.is_mla else 2) * kv_heads * head_dim_padded * itemsize
    if spec.is_dsa and spec.index_head_dim:
        per_layer_bytes += spec.index_head_dim + spec.index_head_dim // 128 * 4  # uint8 keys + f32 scales

    # 2. Sizes: every pipeline stage sized, the minimum taken (SGLang all-reduces MIN) ------------
    budget = _kv_budget(config, device_memory_bytes)
    stage_sizes = [_stage_tokens(spec, config, stage, per_layer_bytes, budget) for stage in range(config.pp_size)]
    stage = stage_sizes[config.pp_rank]
    max_total_tokens = min(s.tokens for s in stage_sizes)
    if config.max_total_tokens is not None:
        if budget is not None and config.max_total_tokens > max_total_tokens:
            warnings.append(
                f"max_total_tokens={config.max_total_tokens} exceeds what the budget holds "
                f"({max_total_tokens}); using {max_total_tokens}"
            )
        max_total_tokens = (
            min(max_total_tokens, config.max_total_tokens) if budget is not None else config.max_total_tokens
        )
    max_total_tokens = max_total_tokens // ps * ps
    if max_total_tokens <= 0:
        need = stage.bytes_per_token * ps + stage.mamba_bytes
        raise ConfigError(
            "memory_budget_bytes",
            budget,
            f"the budget holds no page of {ps} tokens ({stage.bytes_per_token} bytes/token, "
            f"{stage.mamba_bytes} bytes of recurrent state); give at least {need} bytes",
        )

    full_tokens: int | None = None
    swa_tokens: int | None = None
    if is_hybrid_swa:
        full_tokens, swa_tokens = _split_hybrid_swa(max_total_tokens, stage, config.swa_full_tokens_ratio, ps)
        max_total_tokens = full_tokens if stage.full_layers else swa_tokens

    max_running_requests = _max_running_requests(config, max_total_tokens, context_length, stage, is_hybrid_ssm)
    req_to_token_width = _req_to_token_width(config, context_length)

    # 3. Retraction backup and hicache_ratio -----------------------------------------------------
    supports_host_pool = not is_hybrid_ssm and not spec.is_mla and (not is_hybrid_swa or bool(full_tokens))
    backup = config.disaggregation_decode_retraction_backup
    if backup is None:
        backup = (
            "host_pool"
            if config.disaggregation_mode == "decode"
            and not config.dcp_enabled
            and not config.disaggregation_decode_enable_radix_cache
            and not config.disaggregation_decode_enable_offload_kvcache
            and not config.priority_preemption
            and supports_host_pool
            else "cpu_tensor"
        )
    hicache_ratio = config.hicache_ratio
    if hicache_ratio is None:
        hicache_ratio = HICACHE_RATIO_WITH_HOST_POOL if backup == "host_pool" else HICACHE_RATIO_DEFAULT

    # 4. Radix cache on or off --------------------------------------------------------------------
    uses_transformers_backend = config.model_impl == "transformers"
    mm_on_transformers = spec.is_multimodal and uses_transformers_backend
    disable_radix_cache = config.disable_radix_cache or mm_on_transformers
    if disable_radix_cache and not config.disable_radix_cache:
        msg = (
            "Radix cache is disabled for multimodal models with the Transformers backend "
            "to avoid multimodal prefix-cache mismatches."
        )
        logger.warning(msg)
        warnings.append(msg)
    chunked_prefill_size = None if mm_on_transformers else config.chunked_prefill_size

    # 5. Decode-side radix cache --------------------------------------------------------------------
    if config.disaggregation_decode_enable_radix_cache and config.disaggregation_mode == "decode":
        if is_hybrid_swa:
            raise ConfigError(
                "disaggregation_decode_enable_radix_cache",
                True,
                "--disaggregation-decode-enable-radix-cache is incompatible with sliding window "
                "attention (SWA) models; turn it off for this model",
            )
        if is_hybrid_ssm:
            raise ConfigError(
                "disaggregation_decode_enable_radix_cache",
                True,
                "--disaggregation-decode-enable-radix-cache is incompatible with Mamba/SSM models; "
                "turn it off for this model",
            )

    # 6. Tree cache ---------------------------------------------------------------------------------
    pure_swa = is_hybrid_swa and not full_tokens
    tree_cache_kind = _tree_cache_kind(disable_radix_cache, backup, chunked_prefill_size, is_hybrid_swa, pure_swa)
    components = ("full",) + (("swa",) if is_hybrid_swa else ()) + (("mamba",) if is_hybrid_ssm else ())
    if tree_cache_kind in ("chunk", "swa_chunk", "pure_swa_chunk", "pure_swa_radix"):
        components = ("swa",) if pure_swa else ("full",) + (("swa",) if is_hybrid_swa else ())
    if backup == "host_pool":
        if tree_cache_kind != "unified":
            raise ConfigError(
                "disaggregation_decode_retraction_backup",
                backup,
                "--disaggregation-decode-retraction-backup=host_pool requires UnifiedRadixCache with HiCache "
                f"attached, and this configuration selects a {tree_cache_kind!r} tree; use 'cpu_tensor'",
            )
        if is_hybrid_ssm:
            raise ConfigError(
                "disaggregation_decode_retraction_backup",
                backup,
                "host_pool retraction does not support Mamba/SSM models; use 'cpu_tensor'",
            )
    if config.enable_session_radix_cache and tree_cache_kind != "unified":
        raise ConfigError(
            "enable_session_radix_cache",
            True,
            f"session radix cache needs the unified radix tree, and this configuration selects {tree_cache_kind!r}; "
            "turn it off or enable the radix cache",
        )
    attach_host_tier = tree_cache_kind == "unified" and (config.enable_hierarchical_cache or backup == "host_pool")
    if config.enable_hierarchical_cache and not attach_host_tier:
        warnings.append(f"enable_hierarchical_cache is ignored: a {tree_cache_kind!r} tree has no host tier")
    tree_page_size = ps if config.dcp_enabled else config.page_size

    # 7. Drafts, host tier, multimodal ---------------------------------------------------------------
    has_draft_model = config.speculative_algorithm in DRAFT_MODEL_ALGORITHMS
    draft_host_pools = has_draft_model and (config.enable_hierarchical_cache or backup == "host_pool")
    host_pool_tokens = 0
    if attach_host_tier:
        device_tokens = full_tokens if is_hybrid_swa else max_total_tokens
        if config.hicache_size > 0:
            host_pool_tokens = int(config.hicache_size * 1e9) // stage.bytes_per_token
        else:
            host_pool_tokens = int(device_tokens * hicache_ratio)
        host_pool_tokens = (-(-host_pool_tokens // ps) + 1) * ps  # whole pages plus one (trash page)
    mm_embedding_cache_bytes = config.vlm_cache_size_mb * 1024 * 1024

    kv_pool_kind = "hybrid_linear" if is_hybrid_ssm else "swa" if is_hybrid_swa else "mla" if spec.is_mla else "mha"
    pools = _pool_plans(
        kv_pool_kind=kv_pool_kind,
        spec=spec,
        recurrent=_recurrent_spec(spec, config),
        stage=stage,
        store=str(store),
        ps=ps,
        kv_heads=kv_heads,
        head_dim_padded=head_dim_padded,
        per_layer_bytes=per_layer_bytes,
        max_total_tokens=max_total_tokens,
        full_tokens=full_tokens,
        swa_tokens=swa_tokens,
        is_hybrid_swa=is_hybrid_swa,
        rows=max_running_requests,
        width=req_to_token_width,
        host_pool_tokens=host_pool_tokens,
    )

    return CachePlan(
        model=spec.name,
        platform=platform,
        kv_cache_dtype=kv_dtype,
        storage_dtype=str(store),
        is_hybrid_swa=is_hybrid_swa,
        is_hybrid_ssm=is_hybrid_ssm,
        is_dsa=spec.is_dsa,
        is_mla=spec.is_mla,
        kv_pool_kind=kv_pool_kind,
        sliding_window_size=sliding_window_size,
        page_size=config.page_size,
        alloc_page_size=ps,
        head_dim_padded=head_dim_padded,
        num_kv_heads_per_rank=kv_heads,
        num_kv_layers=stage.kv_layers,
        num_full_layers=stage.full_layers,
        num_swa_layers=stage.swa_layers,
        num_recurrent_layers=stage.recurrent_layers,
        start_layer=stage.start,
        end_layer=stage.end,
        bytes_per_token=stage.bytes_per_token,
        kv_budget_bytes=budget,
        max_total_tokens=max_total_tokens,
        num_pages=max_total_tokens // ps,
        full_tokens_per_layer=full_tokens,
        swa_tokens_per_layer=swa_tokens,
        max_mamba_cache_size=stage.mamba_slots if is_hybrid_ssm else None,
        mamba_state_bytes_per_req=stage.mamba_bytes_per_req,
        max_running_requests=max_running_requests,
        context_length=context_length,
        req_to_token_width=req_to_token_width,
        need_sort=config.need_sort,
        disable_radix_cache=disable_radix_cache,
        chunked_prefill_size=chunked_prefill_size,
        tree_cache_kind=tree_cache_kind,
        tree_components=components,
        tree_page_size=tree_page_size,
        radix_eviction_policy=config.radix_eviction_policy,
        is_eagle=config.speculative_algorithm in EAGLE_ALGORITHMS,
        enable_kv_cache_events=config.enable_kv_cache_events,
        enable_metrics=config.enable_metrics,
        enable_session_radix_cache=config.enable_session_radix_cache,
        decode_retraction_backup=backup,
        hicache_ratio=hicache_ratio,
        attach_host_tier=attach_host_tier,
        host_pool_tokens=host_pool_tokens,
        draft_host_pools=draft_host_pools,
        mm_embedding_cache_bytes=mm_embedding_cache_bytes,
        pools=pools,
        warnings=tuple(warnings),
    )


# --- sizing helpers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StageSize:
    """The layers of one pipeline stage and the tokens its budget holds."""

    start: int
    end: int
    full_layers: int  # full-attention and MLA layers
    swa_layers: int
    recurrent_layers: int
    bytes_per_token: int
    mamba_bytes_per_req: int
    mamba_slots: int
    mamba_bytes: int
    tokens: int

    @property
    def kv_layers(self) -> int:
        return self.full_layers + self.swa_layers


def _kv_budget(config: CacheConfig, device_memory_bytes: int | None) -> int | None:
    """Bytes for KV and recurrent state on one device, or None when only ``max_total_tokens`` sizes the pool."""
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    if device_memory_bytes is not None:
        if device_memory_bytes <= 0:
            raise ConfigError("device_memory_bytes", device_memory_bytes, "pass the device's memory in bytes (> 0)")
        fraction = config.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
        budget = int(device_memory_bytes * fraction) - config.reserved_memory_bytes
        if budget <= 0:
            raise ConfigError(
                "reserved_memory_bytes",
                config.reserved_memory_bytes,
                f"it leaves nothing of {fraction} x {device_memory_bytes} bytes for the KV cache; lower it",
            )
        return budget
    if config.mem_fraction_static is not None:
        raise ConfigError(
            "mem_fraction_static",
            config.mem_fraction_static,
            "a fraction needs the device memory: pass device_memory_bytes to the planner, or set memory_budget_bytes",
        )
    if config.max_total_tokens is None:
        raise ConfigError(
            "memory_budget_bytes",
            None,
            "size the cache: set memory_budget_bytes, mem_fraction_static (with device memory) or max_total_tokens",
        )
    return None


def _stage_layers(num_layers: int, pp_size: int, rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of pipeline stage ``rank``: an even split, earlier stages one larger."""
    base, extra = divmod(num_layers, pp_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _stage_tokens(
    spec: ModelSpec, config: CacheConfig, rank: int, per_layer_bytes: int, budget: int | None
) -> _StageSize:
    start, end = _stage_layers(spec.num_hidden_layers, config.pp_size, rank)
    kinds = spec.layer_kinds[start:end]
    sliding_as_swa = not config.disable_hybrid_swa_memory
    swa_layers = sum(1 for k in kinds if k == LayerKind.SLIDING) if sliding_as_swa else 0
    recurrent_layers = sum(1 for k in kinds if k == LayerKind.RECURRENT)
    full_layers = len(kinds) - swa_layers - recurrent_layers
    bytes_per_token = max(1, (full_layers + swa_layers) * per_layer_bytes)

    mamba_bytes_per_req = 0
    mamba_slots = 0
    mamba_bytes = 0
    rest = budget
    recurrent = _recurrent_spec(spec, config)
    if recurrent is not None:
        # Recurrent heads are sharded over tensor parallelism like attention heads.
        per_layer = recurrent.bytes_per_slot()
        mamba_bytes_per_req = -(-per_layer * recurrent_layers // config.tp_size)
        mamba_slots, mamba_bytes = _mamba_set_aside(config, mamba_bytes_per_req, budget)
        rest = None if budget is None else budget - mamba_bytes
    if rest is None:
        tokens = config.max_total_tokens or 0
    else:
        tokens = max(0, rest) // bytes_per_token
    return _StageSize(
        start,
        end,
        full_layers,
        swa_layers,
        recurrent_layers,
        bytes_per_token,
        mamba_bytes_per_req,
        mamba_slots,
        mamba_bytes,
        tokens,
    )


def _recurrent_spec(spec: ModelSpec, config: CacheConfig) -> RecurrentStateSpec | None:
    """The model's recurrent state with ``mamba_ssm_dtype`` applied when the config sets it."""
    if spec.recurrent is None or config.mamba_ssm_dtype is None:
        return spec.recurrent
    return dataclasses.replace(spec.recurrent, ssm_dtype=config.mamba_ssm_dtype)


def _mamba_set_aside(config: CacheConfig, per_req: int, budget: int | None) -> tuple[int, int]:
    """SGLang's ``handle_max_mamba_cache``: (state slots, bytes set aside for recurrent state)."""
    speculative = config.speculative_algorithm is not None
    spec_bytes = 0
    if speculative and config.speculative_num_draft_tokens and config.max_running_requests:
        spec_bytes = per_req * config.max_running_requests * config.speculative_num_draft_tokens
    if config.disable_radix_cache or config.max_mamba_cache_size is not None or budget is None:
        slots = config.max_mamba_cache_size or config.max_running_requests or DEFAULT_MAMBA_CACHE_SIZE
        if config.enable_dp_attention:
            slots = max(1, slots // config.dp_size)
        return slots, slots * per_req + spec_bytes
    rest = budget - spec_bytes
    r = config.mamba_full_memory_ratio
    mamba_mem = int(rest * r / (1 + r))
    slots = mamba_mem // per_req if per_req else 0
    return slots, mamba_mem + spec_bytes


def _split_hybrid_swa(max_total: int, stage: _StageSize, ratio: float, ps: int) -> tuple[int, int]:
    """SGLang's ``set_num_tokens_hybrid_swa``: (full tokens per layer, SWA tokens per layer).

    The budget counted every KV layer at ``max_total`` tokens; it is re-split so that each SWA
    layer holds ``ratio`` times the tokens of a full layer.
    """
    if stage.full_layers == 0:
        return 0, max_total // ps * ps
    total = max_total * stage.kv_layers
    full = int(total / (ratio * stage.swa_layers + stage.full_layers))
    swa = int(full * ratio)
    return full // ps * ps, swa // ps * ps


def _max_running_requests(
    config: CacheConfig, max_total_tokens: int, context_length: int, stage: _StageSize, is_hybrid_ssm: bool
) -> int:
    """Request rows: given, else SGLang's ``clamp(tokens / context * 512, 2048, 4096)``; SSM caps it by state slots."""
    rows = config.max_running_requests
    if rows is None:
        rows = min(max(int(max_total_tokens / context_length * 512), 2048), 4096)
    if is_hybrid_ssm:
        if config.disable_radix_cache:
            per_req = 1
        else:
            per_req = MAMBA_STATES_PER_REQ_WITH_RADIX
            if config.enable_mamba_extra_buffer:
                per_req += MAMBA_EXTRA_BUFFER_STATES[config.speculative_algorithm is not None]
        cap = stage.mamba_slots // per_req
        if cap <= 0:
            raise ConfigError(
                "mamba_full_memory_ratio",
                config.mamba_full_memory_ratio,
                f"the budget holds {stage.mamba_slots} recurrent-state slots, fewer than the {per_req} one request "
                "needs; raise the memory budget or mamba_full_memory_ratio",
            )
        rows = min(rows, cap)
    return rows


def _req_to_token_width(config: CacheConfig, context_length: int) -> int:
    """Request-table width: ``context + 4 + draft tokens``; with speculation on pages, room for a decode reservation."""
    extra = REQ_TABLE_EXTRA_TOKENS + (config.speculative_num_draft_tokens or 0)
    if config.speculative_algorithm is not None and config.page_size > 1:
        steps = config.speculative_num_steps or 1
        topk = config.speculative_eagle_topk or 1
        per_decode = max(steps * topk, config.speculative_num_draft_tokens or 0)
        extra = max(extra, 2 * per_decode + config.page_size - 1)
    return context_length + extra


def _tree_cache_kind(
    disable_radix_cache: bool, backup: str, chunked_prefill_size: int | None, is_hybrid_swa: bool, pure_swa: bool
) -> str:
    """The decision table of the module docstring."""
    if disable_radix_cache and backup == "host_pool":
        return "unified"
    if chunked_prefill_size is not None and disable_radix_cache:
        if not is_hybrid_swa:
            return "chunk"
        return "pure_swa_chunk" if pure_swa else "swa_chunk"
    if pure_swa:
        return "pure_swa_radix"
    return "unified"


def _pool_plans(
    *,
    kv_pool_kind: str,
    spec: ModelSpec,
    recurrent: RecurrentStateSpec | None,
    stage: _StageSize,
    store: str,
    ps: int,
    kv_heads: int,
    head_dim_padded: int,
    per_layer_bytes: int,
    max_total_tokens: int,
    full_tokens: int | None,
    swa_tokens: int | None,
    is_hybrid_swa: bool,
    rows: int,
    width: int,
    host_pool_tokens: int,
) -> tuple[PoolPlan, ...]:
    """The buffers the build allocates. Page 0 (the trash page) is included in each KV shape."""
    heads_axis = 1 if spec.is_mla else 2 * kv_heads

    def kv_pool(name: str, kind: str, tokens: int, layers: int, built: bool) -> PoolPlan:
        shape = (tokens // ps + 1, ps, heads_axis, head_dim_padded)
        return PoolPlan(
            name, kind, shape, store, layers, layers * (tokens // ps + 1) * ps * per_layer_bytes, built=built
        )

    pools: list[PoolPlan] = []
    if is_hybrid_swa:
        if stage.full_layers:
            pools.append(kv_pool("kv_full", "mla" if spec.is_mla else "mha", full_tokens, stage.full_layers, False))
        pools.append(kv_pool("kv_swa", "swa", swa_tokens, stage.swa_layers, False))
    elif stage.kv_layers:
        kind = "mla" if spec.is_mla else "mha"
        pools.append(kv_pool("kv", kind, max_total_tokens, stage.kv_layers, kind == "mha" and kv_pool_kind == "mha"))
    if recurrent is not None and stage.recurrent_layers:
        rec = recurrent
        slots = stage.mamba_slots + 1  # slot 0 is the padding slot
        for i, shape in enumerate(rec.conv_state_shapes):
            n = stage.recurrent_layers * slots * math.prod(shape)
            pools.append(
                PoolPlan(
                    f"conv_state_{i}",
                    "recurrent",
                    (stage.recurrent_layers, slots, *shape),
                    rec.conv_dtype,
                    1,
                    n * dtype_bytes(rec.conv_dtype),
                    built=False,
                )
            )
        n = stage.recurrent_layers * slots * math.prod(rec.ssm_state_shape)
        pools.append(
            PoolPlan(
                "ssm_state",
                "recurrent",
                (stage.recurrent_layers, slots, *rec.ssm_state_shape),
                rec.ssm_dtype,
                1,
                n * dtype_bytes(rec.ssm_dtype),
                built=False,
            )
        )
    pools.append(PoolPlan("req_to_token", "request_table", (rows, width), "int32", 1, rows * width * 4, memory="host"))
    if host_pool_tokens:
        pools.append(
            PoolPlan(
                "host_kv",
                "host_tier",
                (host_pool_tokens // ps, ps, heads_axis, head_dim_padded),
                store,
                stage.kv_layers,
                host_pool_tokens * stage.bytes_per_token,
                memory="host",
                built=False,
            )
        )
    return tuple(pools)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
