"""`HiRadixCache`: the full-KV radix cache with a host tier (SGLang's ``HiRadixCache`` /
``UnifiedRadixCache`` + ``init_hicache``), the preset over :class:`HostTierComponent`.

Standalone for simulation: ``HiRadixCache(page_size=4, host_pool_tokens=132)`` (slot ids are
synthesized, copies simulated by :class:`~kvjax.tiers.SimulatedCopyEngine`); in serving, give it
the device allocator and request table as to :class:`RadixCache`, a host allocator (the host
pool's) and a copy engine (``kvjax.tiers.transfer.PageTransferEngine``).

The scheduler's polling step is :meth:`check_transfers` (``writing_check`` + ``loading_check``);
after a match, :meth:`init_load_back` brings a host hit back to the device. The rules are in
``host_component.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.radix.host_component import LOAD_BACK_THRESHOLD, HostTierComponent
from kvjax.radix.lock import LockError
from kvjax.radix.match import MatchResult
from kvjax.radix.node import TreeNode
from kvjax.radix.radix_cache import RadixCache
from kvjax.tiers.copy_engine import CopyEngine
from kvjax.tiers.host_allocator import HostSlotAllocator

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol


class HiRadixCache(RadixCache):
    """Radix cache over device KV with a host tier (see module docstring).

    Args (beyond :class:`RadixCache`'s):
        host_allocator: the host pool's slot allocator; or ``host_pool_tokens`` to make one.
        copy_engine: the transfers (default: simulated, no device arrays).
        write_policy: ``write_through`` (default), ``write_through_selective`` or ``write_back``.
        load_back_threshold: SGLang's 10.
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
        **kwargs: Any,
    ) -> None:
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
            eviction_policy,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            components=(self.host, *kwargs.pop("components", ())),
            **kwargs,
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
        return self.host.writing_check(wait) + self.host.loading_check(wait)

    def evict_host(self, num_tokens: int) -> int:
        """Free host copies of host-only leaves (LRU); returns host slots freed."""
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
        if self.protected_size():
            raise LockError(f"reset: {self.protected_size()} device tokens are locked by requests; release them first")
        self.host.on_reset()
        super().reset()
