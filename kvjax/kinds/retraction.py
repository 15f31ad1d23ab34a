"""The ``cpu_tensor`` decode retraction backup: a retracted request's KV pages copied to host
memory and written back at re-admission (``kvjax.serve.retraction_extension``). Used when the
plan resolves ``decode_retraction_backup == "cpu_tensor"`` and the backup is active; it attaches
only where every kind of the cache allows page copies (``CacheKind.page_backup``). The
``host_pool`` backup comes with the host tier's extension."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.cache_kind import CacheKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.plan import CachePlan
    from kvjax.serve.extension import ServingExtension


def uses(plan: CachePlan) -> bool:
    return plan.decode_retraction_backup == "cpu_tensor" and bool(plan.decode_retraction_active)


def serving_extension(cache: KVCache) -> ServingExtension | None:
    from kvjax.serve.retraction_extension import retraction_extensions

    found = retraction_extensions(cache)
    return found[0] if found else None


KIND = CacheKind(name="retraction", uses=uses, serving_extension=serving_extension)
