"""The tree with its memory tiers: an optional host tier (SGLang's HiCache L2) and, behind it, an
optional storage tier (L3), both given at construction.

``TieredTree`` is the layer of the tree that owns them: ``host`` (a :class:`HostTierComponent`,
attached after the other components) and ``storage`` (the :class:`StorageLink` it builds from
:class:`StorageOptions` once the host component is attached). It offers SGLang's HiCache names
(``check_transfers``, ``init_load_back``, ``start_prefetch``, ...) to every preset: without a host
tier the polling calls do nothing and return their neutral value, and the calls that need one
(``load_back``, ``evict_host``) raise ``ValueError``. :func:`make_host_tier` builds the host
component (and a host pool for a storage tier that brings none) from the presets' arguments.

Rules of the tiers are in ``host_component.py`` and ``storage_link.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvjax.radix.host_component import LOAD_BACK_THRESHOLD, HostTierComponent
from kvjax.radix.lock import LockError
from kvjax.radix.match import MatchResult
from kvjax.radix.storage_link import StorageLink, StorageOptions
from kvjax.radix.tree import RadixTree
from kvjax.tiers.host_allocator import HostSlotAllocator
from kvjax.tiers.host_pool import HostKVPool

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol
    from kvjax.radix.component import TreeComponent
    from kvjax.radix.node import TreeNode
    from kvjax.tiers.copy_engine import CopyEngine


def make_host_tier(
    page_size: int,
    *,
    host_allocator: HostSlotAllocator | None = None,
    host_pool_tokens: int | None = None,
    copy_engine: CopyEngine | None = None,
    write_policy: str = "write_through",
    load_back_threshold: int = LOAD_BACK_THRESHOLD,
    device_allocator: AllocatorProtocol | None = None,
    storage: StorageOptions | None = None,
) -> tuple[HostTierComponent, StorageOptions | None]:
    """The host tier component for a tree of ``page_size``, and ``storage`` completed with the host
    pool it uses.

    ``host_allocator``: the host pool's slot allocator, or ``host_pool_tokens`` to make one. With a
    storage tier but no ``storage.host_pages``, a host pool of the store's page shape is made
    (``page_first``; sized by the host allocator or ``host_pool_tokens``) and, without a
    ``host_allocator``, its allocator is the host allocator.

    Raises ValueError for no host allocator and no size, or a store whose page shape is not
    ``(layers, page_size, C, D)`` when no host pool is given.
    """
    if storage is not None and storage.host_pages is None:
        layers, ps, *row = storage.store.page_shape
        size = host_allocator.size if host_allocator is not None else host_pool_tokens
        if size is None or ps != page_size or len(row) != 2:
            raise ValueError(
                f"storage page shape {storage.store.page_shape}: give host_pages, or a (layers, {page_size}, C, D) "
                "page shape and host_pool_tokens"
            )
        pool = HostKVPool(size, layers, (ps, *row), storage.store.dtype.itemsize, "page_first")
        storage = replace(storage, host_pages=pool)
        host_allocator = host_allocator if host_allocator is not None else pool.allocator
    if host_allocator is None:
        if host_pool_tokens is None:
            raise ValueError("the host tier needs a host_allocator or host_pool_tokens")
        host_allocator = HostSlotAllocator(host_pool_tokens, page_size)
    host = HostTierComponent(
        host_allocator,
        copy_engine,
        write_policy=write_policy,
        load_back_threshold=load_back_threshold,
        device_allocator=device_allocator,
    )
    return host, storage


class TieredTree(RadixTree):
    """The tree layer that owns the host and storage tiers (module docstring).

    Args (beyond :class:`RadixTree`'s):
        host: the host tier component (None: no host tier); attached after ``components``.
        storage: the storage tier to link behind the host tier (needs ``host`` and its
            ``host_pages``; see :func:`make_host_tier`).
    """

    __slots__ = ("host", "storage")

    def __init__(
        self,
        *args: Any,
        host: HostTierComponent | None = None,
        storage: StorageOptions | None = None,
        components: Sequence[TreeComponent] = (),
        **kwargs: Any,
    ) -> None:
        if storage is not None and (host is None or storage.host_pages is None):
            raise ValueError("a storage tier needs the host tier and its host pages (see make_host_tier)")
        super().__init__(*args, components=(*components, host) if host is not None else tuple(components), **kwargs)
        self.host: HostTierComponent | None = host
        self.storage: StorageLink | None = None
        if storage is not None:
            assert host is not None and storage.host_pages is not None
            self.storage = StorageLink(
                host,
                storage.store,
                storage.host_pages,
                prefetch_policy=storage.prefetch_policy,
                prefetch_timeout_s=storage.prefetch_timeout_s,
                prefetch_threshold=storage.prefetch_threshold,
                window=storage.window,
                checkpoints=storage.checkpoints,
            )

    def _require_host(self, what: str) -> HostTierComponent:
        if self.host is None:
            raise ValueError(f"{what}: this {type(self).__name__} has no host tier; build it with one (HiRadixCache)")
        return self.host

    @property
    def host_allocator(self) -> HostSlotAllocator:
        """The host pool's slot allocator. Raises ValueError without a host tier."""
        return self._require_host("host_allocator").host_allocator

    # SGLang's names on the cache

    def writing_check(self, wait: bool = False) -> int:
        """Complete landed backups (all of them with ``wait``); returns how many (0: no host tier)."""
        return 0 if self.host is None else self.host.writing_check(wait)

    def loading_check(self, wait: bool = False) -> int:
        """Complete landed loads (all of them with ``wait``); returns how many (0: no host tier)."""
        return 0 if self.host is None else self.host.loading_check(wait)

    def check_transfers(self, wait: bool = False) -> int:
        """The polling step: complete landed backups and loads (all of them with ``wait``), and the
        storage writes they started."""
        if self.host is None:
            return 0
        done = self.host.writing_check(wait) + self.host.loading_check(wait)
        if self.storage is not None:
            self.storage.check_writes(wait)
        return done

    def start_prefetch(self, rid: Any, match: MatchResult, key: Any, extra_key: Any = None) -> int:
        """After ``match_prefix(key, extra_key)``: prefetch the stored pages beyond the match for
        request ``rid``; returns their tokens (0: none started, or no storage tier)."""
        if self.storage is None:
            return 0
        return self.storage.start_prefetch(rid, match, key, extra_key)

    def check_prefetch_progress(self, rid: Any) -> bool:
        """Whether ``rid`` may be admitted (per the prefetch policy); when True, the pages that
        arrived are in the tree as a host-only node. True without a prefetch."""
        return True if self.storage is None else self.storage.check_prefetch_progress(rid)

    def evict_host(self, num_tokens: int) -> int:
        """Free host copies (under write_back, those of device nodes first; then host-only
        leaves, LRU); returns host slots freed. Raises ValueError without a host tier."""
        return self._require_host("evict_host").evict_host(num_tokens)

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> int:
        """Load the host-only chain ending at ``node``; key elements loaded (0: nothing). Raises
        ValueError without a host tier."""
        return self._require_host("load_back").load_back(node, mem_quota)

    def init_load_back(self, match: MatchResult, mem_quota: int | None = None) -> MatchResult:
        """After ``match_prefix``: load its host hit back when it is worth it, and return the
        match to use (the longer device match when loaded; ``match`` itself otherwise)."""
        host = self.host
        if host is None or getattr(match, "host_hit_length", 0) < max(host.load_back_threshold, 1):
            return match
        if not host.load_back(match.last_host_node, mem_quota):
            return match
        node = match.last_host_node
        parts = []
        n = node
        while n is not self.root:
            parts.append(n.value)
            n = n.parent
        parts.reverse()
        return MatchResult.from_parts(parts, node, node.depth)

    def reset(self) -> None:
        """Drop every cached prefix (device, and with a host tier host and storage links too).

        With a host tier, every transfer is waited for first. Raises :class:`LockError` (nothing
        dropped) while a request holds a lock. Host copies of device nodes count as the host
        tier's protected size, not as locks, so they are dropped first and the core's reset then
        sees no host lock.
        """
        if self.host is None:
            super().reset()
            return
        self.check_transfers(wait=True)
        if self.storage is not None:
            self.storage.cancel_all()
            self.storage.forget_reported()  # the reset's AllBlocksCleared covers storage too
        if self.protected_size():
            raise LockError(f"reset: {self.protected_size()} device tokens are locked by requests; release them first")
        self.host.on_reset()
        super().reset()
