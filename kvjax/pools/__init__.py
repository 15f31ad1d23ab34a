"""Device state: the pools of a KV cache, as immutable pytrees (see ``docs/architecture.md``)."""

from kvjax.pools.cache_pools import CachePools
from kvjax.pools.mha import MHAKVPool

__all__ = ["CachePools", "MHAKVPool"]
