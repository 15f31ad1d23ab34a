"""`CacheConfig`: every setting the KV-cache builder reads, passed explicitly.

Field names are SGLang's server-argument names with underscores (``--page-size`` ->
``page_size``), so SGLang users recognise them. Nothing here reads the environment: settings
SGLang takes from environment variables (``SGLANG_VLM_CACHE_SIZE_MB``) are plain fields.

Deliberate differences from SGLang's defaults, for TPU serving:
  * ``page_size`` defaults to 16 (SGLang: 1); TPU paged-attention kernels want pages.
  * ``chunked_prefill_size`` defaults to 8192 (SGLang picks by GPU memory). ``None`` or ``-1``
    disables chunked prefill, as ``-1`` does in SGLang.
  * ``memory_budget_bytes`` is the KV budget itself; with ``mem_fraction_static`` instead, the
    budget is that fraction of the device memory given to the planner, minus ``reserved_memory_bytes``
    (weights, activations), since kvjax does not load weights to measure what is left.

The config is validated on construction: a bad value raises ``kvjax.ConfigError`` naming the
field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvjax.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first")
# SGLang's other host layouts, which kvjax's host tier does not build (refused by name).
HICACHE_MEM_LAYOUTS_NOT_BUILT = ("page_first_direct", "page_head")
HICACHE_STORAGE_BACKENDS = (None, "file", "memory")
HICACHE_STORAGE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
RETRACTION_BACKUPS = ("host_pool", "cpu_tensor")
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
MODEL_IMPLS = ("auto", "sglang", "transformers")
PLATFORMS = ("tpu", "cpu", "gpu")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Settings of the KV cache. Units: tokens, bytes, megabytes (``*_mb``) or gigabytes (``hicache_size``)."""

    # --- pool geometry and budget ---------------------------------------------------------------
    page_size: int = 16
    kv_cache_dtype: str = "auto"
    max_total_tokens: int | None = None
    memory_budget_bytes: int | None = None
    mem_fraction_static: float | None = None
    reserved_memory_bytes: int = 0
    max_running_requests: int | None = None
    context_length: int | None = None
    platform: str | None = None  # storage layout target; None: TPU when planning, the device when building

    # --- prefix cache -----------------------------------------------------------------------------
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = 8192
    radix_eviction_policy: str = "lru"
    enable_session_radix_cache: bool = False
    enable_kv_cache_events: bool = False
    enable_metrics: bool = False

    # --- hierarchical cache (host tier) -----------------------------------------------------------
    enable_hierarchical_cache: bool = False
    hicache_ratio: float | None = None
    hicache_size: float = 0  # GB; > 0 overrides hicache_ratio
    hicache_write_policy: str = "write_through"
    hicache_mem_layout: str = "layer_first"
    # Storage tier (L3): None (off), "file" (hicache_storage_dir) or "memory"; SGLang's knob names,
    # except the directory, the timeout and the threshold (SGLang: env var / backend extra config).
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_prefetch_timeout_s: float | None = None  # None: 1 s + 0.25 s per 1024 tokens
    hicache_storage_prefetch_threshold: int = 256
    # What the stored pages are keyed by beyond the layout (kvjax.tiers.storage_key): the weights'
    # fingerprint (LoadedModel.fingerprint; required with a storage backend) and a user namespace.
    hicache_storage_model_fingerprint: str | None = None
    hicache_storage_namespace: str = ""

    # --- PD disaggregation ------------------------------------------------------------------------
    disaggregation_mode: str = "null"
    disaggregation_decode_enable_radix_cache: bool = False
    disaggregation_decode_retraction_backup: str | None = None
    disaggregation_decode_enable_offload_kvcache: bool = False

    # --- scheduling -------------------------------------------------------------------------------
    enable_priority_scheduling: bool = False
    disable_priority_preemption: bool = False

    # --- speculative decoding ---------------------------------------------------------------------
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None

    # --- model implementation ---------------------------------------------------------------------
    model_impl: str = "auto"

    # --- hybrid models ----------------------------------------------------------------------------
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    mamba_full_memory_ratio: float = 0.9
    enable_mamba_extra_buffer: bool = False
    max_mamba_cache_size: int | None = None
    mamba_ssm_dtype: str | None = None
    mamba_max_states_per_path: int = -1

    # --- parallelism ------------------------------------------------------------------------------
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    enable_dp_attention: bool = False
    dcp_size: int = 1

    # --- multimodal -------------------------------------------------------------------------------
    vlm_cache_size_mb: int = 100  # SGLang's SGLANG_VLM_CACHE_SIZE_MB

    def __post_init__(self) -> None:
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == -1:
            object.__setattr__(self, "chunked_prefill_size", None)
        self._validate()

    # --- validation -------------------------------------------------------------------------------

    def _validate(self) -> None:
        _positive_int(self, "page_size")
        _one_of(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        _positive_int(self, "max_total_tokens", optional=True)
        _positive_int(self, "memory_budget_bytes", optional=True)
        _positive_int(self, "max_running_requests", optional=True)
        _positive_int(self, "context_length", optional=True)
        _positive_int(self, "chunked_prefill_size", optional=True)
        _positive_int(self, "tp_size")
        _positive_int(self, "pp_size")
        _positive_int(self, "dp_size")
        _positive_int(self, "dcp_size")
        _one_of(self, "radix_eviction_policy", EVICTION_POLICIES)
        _one_of(self, "hicache_write_policy", HICACHE_WRITE_POLICIES)
        if self.hicache_mem_layout in HICACHE_MEM_LAYOUTS_NOT_BUILT:
            raise ConfigError(
                "hicache_mem_layout",
                self.hicache_mem_layout,
                f"an SGLang host layout that kvjax does not build; use one of {list(HICACHE_MEM_LAYOUTS)}",
            )
        _one_of(self, "hicache_mem_layout", HICACHE_MEM_LAYOUTS)
        _one_of(self, "hicache_storage_prefetch_policy", HICACHE_STORAGE_PREFETCH_POLICIES)
        if self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            raise ConfigError(
                "hicache_storage_backend", self.hicache_storage_backend, f"use one of {list(HICACHE_STORAGE_BACKENDS)}"
            )
        if self.hicache_storage_backend == "file" and not self.hicache_storage_dir:
            raise ConfigError("hicache_storage_dir", self.hicache_storage_dir, "give a directory for the file backend")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ConfigError(
                "hicache_storage_backend",
                self.hicache_storage_backend,
                "the storage tier needs enable_hierarchical_cache",
            )
        if self.hicache_storage_backend is not None and not self.hicache_storage_model_fingerprint:
            raise ConfigError(
                "hicache_storage_model_fingerprint",
                self.hicache_storage_model_fingerprint,
                "the storage tier keys pages by the model's weights: pass LoadedModel.fingerprint "
                "(load_checkpoint computes it) or kvjax.serve.model_fingerprint.random_weights_fingerprint",
            )
        timeout = self.hicache_storage_prefetch_timeout_s
        if (timeout is not None and not timeout >= 0) or self.hicache_storage_prefetch_threshold < 0:
            raise ConfigError(
                "hicache_storage_prefetch_timeout_s/threshold",
                (self.hicache_storage_prefetch_timeout_s, self.hicache_storage_prefetch_threshold),
                "use a timeout >= 0 seconds and a threshold >= 0 tokens",
            )
        _one_of(self, "disaggregation_mode", DISAGGREGATION_MODES)
        _one_of(self, "model_impl", MODEL_IMPLS)
        if self.platform is not None:
            _one_of(self, "platform", PLATFORMS)
        if self.disaggregation_decode_retraction_backup is not None:
            _one_of(self, "disaggregation_decode_retraction_backup", RETRACTION_BACKUPS)
        if self.speculative_algorithm is not None:
            _one_of(self, "speculative_algorithm", SPECULATIVE_ALGORITHMS)
        _positive_int(self, "speculative_num_draft_tokens", optional=True)
        _positive_int(self, "speculative_num_steps", optional=True)
        _positive_int(self, "speculative_eagle_topk", optional=True)
        if self.speculative_num_draft_tokens is not None and self.speculative_algorithm is None:
            raise ConfigError(
                "speculative_num_draft_tokens",
                self.speculative_num_draft_tokens,
                "set speculative_algorithm too, or leave the draft token count unset",
            )
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ConfigError("mem_fraction_static", self.mem_fraction_static, "use a fraction in (0, 1]")
        if not isinstance(self.reserved_memory_bytes, int) or self.reserved_memory_bytes < 0:
            raise ConfigError("reserved_memory_bytes", self.reserved_memory_bytes, "use a byte count >= 0")
        if self.hicache_ratio is not None and not self.hicache_ratio > 0:
            raise ConfigError("hicache_ratio", self.hicache_ratio, "use a ratio > 0 (host tokens per device token)")
        if self.hicache_size < 0:
            raise ConfigError("hicache_size", self.hicache_size, "use a size in GB >= 0 (0 sizes by hicache_ratio)")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ConfigError("swa_full_tokens_ratio", self.swa_full_tokens_ratio, "use a ratio in (0, 1]")
        if not self.mamba_full_memory_ratio > 0:
            raise ConfigError("mamba_full_memory_ratio", self.mamba_full_memory_ratio, "use a ratio > 0")
        _positive_int(self, "max_mamba_cache_size", optional=True)
        cap = self.mamba_max_states_per_path
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < -1 or cap == 0:
            raise ConfigError("mamba_max_states_per_path", cap, "use -1 (no cap) or a positive integer")
        if self.mamba_ssm_dtype is not None:
            _one_of(self, "mamba_ssm_dtype", ("float32", "bfloat16", "float16"))
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError("pp_rank", self.pp_rank, f"use a rank in [0, pp_size={self.pp_size})")
        if self.vlm_cache_size_mb < 0:
            raise ConfigError("vlm_cache_size_mb", self.vlm_cache_size_mb, "use a size in MB >= 0")
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ConfigError(
                "dp_size", self.dp_size, f"with enable_dp_attention, dp_size must divide tp_size={self.tp_size}"
            )
        if self.tp_size % self.dcp_size:
            raise ConfigError(
                "dcp_size",
                self.dcp_size,
                f"decode context parallelism divides the TP group, and {self.dcp_size} does not divide "
                f"{{tp_size}} {self.tp_size}; use a {{dcp_size}} that divides {{tp_size}}, or a {{tp_size}} that "
                f"{self.dcp_size} divides",
            )
        group = self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size
        if self.enable_dp_attention and not self.tp_size % self.dp_size and group % self.dcp_size:
            raise ConfigError(
                "dcp_size",
                self.dcp_size,
                f"under DP attention decode context parallelism divides each DP rank's attention TP group of "
                f"{{tp_size}} {self.tp_size} / {{dp_size}} {self.dp_size} = {group} chips, and {self.dcp_size} "
                f"does not divide {group}; use a {{dcp_size}} that divides {group}",
            )
        if self.disaggregation_decode_enable_radix_cache and self.disaggregation_mode != "decode":
            raise ConfigError(
                "disaggregation_decode_enable_radix_cache",
                True,
                "it applies to a decode server only: set disaggregation_mode='decode' or leave it off",
            )

    # --- derived facts ----------------------------------------------------------------------------

    @property
    def dcp_enabled(self) -> bool:
        """Decode context parallelism: KV pages are striped over ``dcp_size`` ranks."""
        return self.dcp_size > 1

    @property
    def alloc_page_size(self) -> int:
        """The allocator's page size: ``page_size * dcp_size`` under DCP (SGLang's ``get_alloc_page_size``)."""
        return self.page_size * self.dcp_size

    @property
    def attn_tp_size(self) -> int:
        """The ranks KV heads are split over (the mesh's ``"tp"`` axis): ``tp_size / dp_size`` under DP
        attention, ``tp_size / dcp_size`` under decode context parallelism (SGLang's DCP divides the TP
        group: KV heads over ``tp / dcp`` ranks, tokens striped over ``dcp``), ``tp_size / dp_size /
        dcp_size`` under both (DCP divides each DP rank's group), else ``tp_size``."""
        if self.enable_dp_attention:
            return self.tp_size // self.dp_size // self.dcp_size
        return self.tp_size // self.dcp_size

    @property
    def priority_preemption(self) -> bool:
        return self.enable_priority_scheduling and not self.disable_priority_preemption

    @property
    def need_sort(self) -> bool:
        """Allocators keep sorted free lists under PD disaggregation (contiguous transfers)."""
        return self.disaggregation_mode in ("prefill", "decode")

    def replace(self, **changes: Any) -> CacheConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive_int(cfg: CacheConfig, name: str, *, optional: bool = False) -> None:
    value = getattr(cfg, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        hint = "a positive integer" + (" or None" if optional else "")
        raise ConfigError(name, value, f"use {hint}")


def _one_of(cfg: CacheConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(name, value, f"use one of {list(allowed)}")
