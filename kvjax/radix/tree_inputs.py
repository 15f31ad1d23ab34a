"""`TreeInputs`: what a tree is built with besides its `TreeOptions` (jax-free).

``create_tree_cache`` gathers them once and hands them, with the options, to the builder the
plan's tree maps to (a cache kind's ``tree_builders``); ``common`` and ``host_tier`` are the
keyword arguments every preset tree and every host-tier tree take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvjax.plan.tree_options import TreeOptions

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.radix.events import EventSink
    from kvjax.radix.storage_link import StorageOptions
    from kvjax.tiers import CopyEngine, HostSlotAllocator

__all__ = ["TreeInputs"]


@dataclass(frozen=True)
class TreeInputs:
    """The request table, token allocator, event sink and host tier parts a tree holds (each may
    be None: a standalone tree makes its own or goes without)."""

    options: TreeOptions
    req_to_token_pool: ReqToTokenPoolProtocol | None = None
    token_to_kv_pool_allocator: AllocatorProtocol | None = None
    event_sink: EventSink | None = None
    host_allocator: HostSlotAllocator | None = None
    host_engine: CopyEngine | None = None
    storage: StorageOptions | None = None

    @property
    def page_size(self) -> int:
        """The tree's page size in tokens (>= 1)."""
        return int(self.options.tree_page_size or 1)

    @property
    def common(self) -> dict[str, Any]:
        """The keyword arguments the radix trees share."""
        o = self.options
        return dict(
            eviction_policy=o.radix_eviction_policy or "lru",
            req_to_token_pool=self.req_to_token_pool,
            is_eagle=bool(o.is_eagle),
            enable_kv_cache_events=bool(o.enable_kv_cache_events),
            event_sink=self.event_sink,
            enable_metrics=bool(o.enable_metrics),
        )

    @property
    def host_tier(self) -> dict[str, Any]:
        """The keyword arguments of a tree with the host tier."""
        return dict(
            host_allocator=self.host_allocator,
            host_pool_tokens=int(self.options.host_pool_tokens) or None,
            copy_engine=self.host_engine,
            write_policy=self.options.hicache_write_policy,
        )

    @property
    def chunk(self) -> dict[str, Any]:
        """The keyword arguments of a chunk cache."""
        return dict(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            page_size=self.page_size,
        )
