"""Step 1 of the planner: what kind of model this is (pure)."""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.plan.records import ModelKind
from kvjax.spec import ModelSpec


def decide_model_kind(spec: ModelSpec, config: CacheConfig) -> ModelKind:
    """``is_hybrid_swa`` (sliding layers and hybrid SWA memory on), ``is_hybrid_ssm`` (recurrent
    state), ``is_dsa``, ``is_mla``, and the KV pool kind those imply."""
    is_hybrid_swa = spec.has_sliding_layers and not config.disable_hybrid_swa_memory
    is_hybrid_ssm = spec.uses_ssm_state
    if is_hybrid_ssm:
        pool_kind = "hybrid_linear"
    elif is_hybrid_swa:
        pool_kind = "swa"
    else:
        pool_kind = "mla" if spec.is_mla else "mha"
    return ModelKind(
        is_hybrid_swa=is_hybrid_swa,
        is_hybrid_ssm=is_hybrid_ssm,
        is_dsa=spec.is_dsa,
        is_mla=spec.is_mla,
        kv_pool_kind=pool_kind,
        sliding_window_size=spec.sliding_window if is_hybrid_swa else None,
    )
