"""Small caches of preset models that tests in several folders build alike."""

from __future__ import annotations

from typing import Any

from kvjax import CacheConfig, ModelSpec, build_kv_cache


def host_tier_cache(name: str = "tiny", *, mesh: Any = None, **config: Any) -> Any:
    """A cache of the preset ``name`` with the host tier on (64 pool tokens, context 64), over
    ``mesh`` if given; ``config``: the other ``CacheConfig`` fields (the mesh's sizes, the page
    size, the host tier's)."""
    config = CacheConfig(max_total_tokens=64, context_length=64, enable_hierarchical_cache=True, **config)
    return build_kv_cache(ModelSpec.preset(name), config, mesh=mesh)
