"""What pipeline parallelism serves, checked before anything is planned or allocated (jax-free).

``check_pipeline_config(spec, config)`` refuses, each with a ``ConfigError`` naming the option, the
value and the change: more stages than layers (``pp_size``); a ``pp_rank`` other than 0 (one
process serves every stage); DCP, DP attention, speculative decoding, the storage tier, a host
tier sized by ``hicache_size`` and the retraction backup together with stages; and models with
recurrent layers. The retraction backup and recurrent state
change device state through updates recorded on one cache (``KVCache.pending``), which would reach
the first stage's layers only; DCP, DP attention and speculative decoding are other layouts of
the step that are not combined with stages. The host tier is served: each stage copies its own
layers (``kvjax.serve.pipeline_cache``), with one host slot id per token on every stage, so every
stage's host pool has the same slots (``hicache_ratio``: a size in bytes would give each stage its
own); the storage tier would store stage 0's layers only.
"""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan.target import check_pipeline_stages
from kvjax.spec import ModelSpec

__all__ = ["check_pipeline_config"]


def check_pipeline_config(spec: ModelSpec, config: CacheConfig) -> None:
    """Refuse what pipeline parallelism does not serve (module docstring), naming the option and
    the change. Changes nothing."""
    check_pipeline_stages(spec, config.pp_size)
    refusals: tuple[tuple[bool, str, object, str], ...] = (
        (config.pp_rank != 0, "pp_rank", config.pp_rank, "one process serves every stage; leave {pp_rank} 0"),
        (
            config.dcp_size > 1,
            "dcp_size",
            config.dcp_size,
            "decode context parallelism with pipeline stages is not served; use {dcp_size} 1 or {pp_size} 1",
        ),
        (
            config.enable_dp_attention,
            "enable_dp_attention",
            True,
            "DP attention with pipeline stages is not served; leave it off or use {pp_size} 1",
        ),
        (
            config.speculative_algorithm is not None,
            "speculative_algorithm",
            config.speculative_algorithm,
            "speculative decoding with pipeline stages is not served; leave it unset or use {pp_size} 1",
        ),
        (
            config.enable_hierarchical_cache and config.hicache_storage_backend is not None,
            "hicache_storage_backend",
            config.hicache_storage_backend,
            "the storage tier with pipeline stages is not served (it would store the first stage's layers only); "
            "leave it unset or use {pp_size} 1",
        ),
        (
            config.enable_hierarchical_cache and config.hicache_size > 0,
            "hicache_size",
            config.hicache_size,
            "a host tier sized in bytes with pipeline stages is not served (every stage's host pool must have "
            "the same slots); size it with hicache_ratio or use {pp_size} 1",
        ),
        (
            config.disaggregation_decode_retraction_backup is not None,
            "disaggregation_decode_retraction_backup",
            config.disaggregation_decode_retraction_backup,
            "the retraction backup with pipeline stages is not served; leave it unset or use {pp_size} 1",
        ),
        (
            bool(spec.recurrent_layer_ids()),
            "pp_size",
            config.pp_size,
            f"{spec.name} has recurrent layers, whose state forks and checkpoints are not served over pipeline "
            "stages; use {pp_size} 1",
        ),
    )
    for refused, option, value, fix in refusals:
        if refused:
            raise ConfigError(option, value, fix)
