"""`HiRadixCache`: the full-KV radix cache with a host tier (SGLang's ``HiRadixCache`` /
``UnifiedRadixCache`` + ``init_hicache``), the preset over :class:`HostTierComponent`.

Standalone for simulation: ``HiRadixCache(page_size=4, host_pool_tokens=132)`` (slot ids are
synthesized, copies simulated by :class:`~kvjax.tiers.SimulatedCopyEngine`); in serving, give it
the device allocator and request table as to :class:`RadixCache`, a host allocator (the host
pool's) and a copy engine (``kvjax.tiers.transfer.PageTransferEngine``).

The scheduler's polling step is :meth:`check_transfers` (``writing_check`` + ``loading_check``);
after a match, :meth:`init_load_back` brings a host hit back to the device. The rules are in
``host_component.py``.

With ``storage`` (a :class:`~kvjax.tiers.storage.StorageTier`, SGLang's L3), landed host copies
are backed up to it and a match miss can prefetch stored pages into the host tier
(:meth:`start_prefetch`, :meth:`check_prefetch_progress`; rules in ``storage_link.py``). The
pages' bytes come from ``host_pages`` (the host pool); standalone, a host pool of the storage's
page shape is made (``page_first``) and its allocator is the host allocator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.radix.host_component import LOAD_BACK_THRESHOLD, HostTierComponent
from kvjax.radix.lock import LockError
from kvjax.radix.match import MatchResult
from kvjax.radix.node import TreeNode
from kvjax.radix.radix_cache import RadixCache
from kvjax.radix.storage_link import PREFETCH_THRESHOLD, HostPages, StorageLink
from kvjax.tiers.copy_engine import CopyEngine
from kvjax.tiers.host_allocator import HostSlotAllocator
from kvjax.tiers.host_pool import HostKVPool
from kvjax.tiers.storage import StorageTier

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol


class HiRadixCache(RadixCache):
    """Radix cache over device KV with a host tier (see module docstring).

    Args (beyond :class:`RadixCache`'s):
        host_allocator: the host pool's slot allocator; or ``host_pool_tokens`` to make one.
        copy_engine: the transfers (default: simulated, no device arrays).
        write_policy: ``write_through`` (default), ``write_through_selective`` or ``write_back``.
        load_back_threshold: SGLang's 10.
        storage: the storage tier (None: no L3); ``host_pages``: the host pool holding the pages'
            bytes (``read_pages``/``write_pages``; default: one made for ``storage``).
        prefetch_policy, prefetch_timeout_s, prefetch_threshold: see ``StorageLink``.
    """

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str = "lru",
        *,
        host_allocator: HostSlotAllocator | None = None,
        host_pool_tokens: int | None = None,
        copy_engine: CopyEngine | None = None,
        write_policy: str = "write_through",
        load_back_threshold: int = LOAD_BACK_THRESHOLD,
        req_to_token_pool: ReqToTokenPoolProtocol | None = None,
        token_to_kv_pool_allocator: AllocatorProtocol | None = None,
        storage: StorageTier | None = None,
        host_pages: HostPages | None = None,
        prefetch_policy: str = "best_effort",
        prefetch_timeout_s: float | None = None,
        prefetch_threshold: int = PREFETCH_THRESHOLD,
        **kwargs: Any,
    ) -> None:
        if storage is not None and host_pages is None:
            layers, ps, *row = storage.page_shape
            size = host_allocator.size if host_allocator is not None else host_pool_tokens
            if size is None or ps != page_size or len(row) != 2:
                raise ValueError(
                    f"storage page shape {storage.page_shape}: give host_pages, or a (layers, {page_size}, C, D) "
                    "page shape and host_pool_tokens"
                )
            pool = HostKVPool(size, layers, (ps, *row), storage.dtype.itemsize, "page_first")
            host_pages = pool
            host_allocator = host_allocator if host_allocator is not None else pool.allocator
        if host_allocator is None:
            if host_pool_tokens is None:
                raise ValueError("HiRadixCache needs a host_allocator or host_pool_tokens")
            host_allocator = HostSlotAllocator(host_pool_tokens, page_size)
        self.host = HostTierComponent(
            host_allocator,
            copy_engine,
            write_policy=write_policy,
            load_back_threshold=load_back_threshold,
            device_allocator=token_to_kv_pool_allocator,
        )
        super().__init__(
            page_size,
            eviction_policy=eviction_policy,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            components=(self.host, *kwargs.pop("components", ())),
            **kwargs,
        )
        self.storage: StorageLink | None = None
        if storage is not None:
            assert host_pages is not None
            self.storage = StorageLink(
                self.host,
                storage,
                host_pages,
                prefetch_policy=prefetch_policy,
                prefetch_timeout_s=prefetch_timeout_s,
                prefetch_threshold=prefetch_threshold,
            )

    @property
    def host_allocator(self) -> HostSlotAllocator:
        return self.host.host_allocator

    # SGLang's names on the cache

    def writing_check(self, wait: bool = False) -> int:
        return self.host.writing_check(wait)

    def loading_check(self, wait: bool = False) -> int:
        return self.host.loading_check(wait)

    def check_transfers(self, wait: bool = False) -> int:
        """The polling step: complete landed backups and loads (all of them with ``wait``)."""
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
        leaves, LRU); returns host slots freed."""
        return self.host.evict_host(num_tokens)

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> int:
        """Load the host-only chain ending at ``node``; key elements loaded (0: nothing)."""
        return self.host.load_back(node, mem_quota)

    def init_load_back(self, match: MatchResult, mem_quota: int | None = None) -> MatchResult:
        """After ``match_prefix``: load its host hit back when it is worth it, and return the
        match to use (the longer device match when loaded; ``match`` itself otherwise)."""
        if getattr(match, "host_hit_length", 0) < max(self.host.load_back_threshold, 1):
            return match
        if not self.load_back(match.last_host_node, mem_quota):
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
        """Wait for every transfer, then drop everything (device and host).

        Raises :class:`LockError` (nothing dropped) while a request holds a lock. Host copies of
        device nodes count as the host tier's protected size, not as locks, so they are dropped
        first and the core's reset then sees no host lock.
        """
        self.check_transfers(wait=True)
        if self.storage is not None:
            self.storage.cancel_all()
        if self.protected_size():
            raise LockError(f"reset: {self.protected_size()} device tokens are locked by requests; release them first")
        self.host.on_reset()
        super().reset()
