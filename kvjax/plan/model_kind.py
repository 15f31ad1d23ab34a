"""Step 1 of the planner: what kind of model this is, asked of the cache kinds (pure).

Each registered kind says whether the model needs it (``PlannerKind.applies``) and which of
SGLang's flags that sets (``model_flags``); the kind of the highest ``kv_pool_priority`` among
them names the KV pool kind. No kind is named here.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import CacheConfig
from kvjax.plan.kinds.planning import by_priority, kinds_for_model
from kvjax.plan.records import ModelKind
from kvjax.spec import ModelSpec

_FLAG_FIELDS = {f.name for f in dataclasses.fields(ModelKind)} - {"kv_pool_kind", "cache_kinds"}


def decide_model_kind(spec: ModelSpec, config: CacheConfig) -> ModelKind:
    """The kinds the model needs, the flags they set (``is_hybrid_swa``, ``is_hybrid_ssm``,
    ``is_mla``, the window), ``is_dsa`` (the spec's), and the KV pool kind they imply.

    Raises ``ValueError`` naming the kind when a kind sets a field ``ModelKind`` does not have.
    """
    kinds = kinds_for_model(spec, config)
    flags: dict[str, object] = {"is_dsa": spec.is_dsa}
    for kind in kinds:
        if kind.model_flags is None:
            continue
        fields = dict(kind.model_flags(spec))
        unknown = sorted(set(fields) - _FLAG_FIELDS)
        if unknown:
            raise ValueError(
                f"cache kind {kind.name!r} sets {unknown}, not fields of ModelKind; use {sorted(_FLAG_FIELDS)}"
            )
        flags.update(fields)
    named = [k for k in by_priority(kinds) if k.kv_pool_kind is not None]
    if not named:
        raise ValueError(f"no registered cache kind with a kv_pool_kind applies to {spec.name}; register one")
    return ModelKind(
        kv_pool_kind=str(named[0].kv_pool_kind),
        cache_kinds=tuple(k.name for k in kinds),
        **flags,  # type: ignore[arg-type]  # checked against the fields above
    )
