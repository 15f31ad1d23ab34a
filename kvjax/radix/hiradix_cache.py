"""`HiRadixCache`: the full-KV radix cache with a host tier (SGLang's ``HiRadixCache`` /
``UnifiedRadixCache`` + ``init_hicache``), the preset over :class:`HostTierComponent`.

Standalone for simulation: ``HiRadixCache(page_size=4, host_pool_tokens=132)`` (slot ids are
synthesized, copies simulated by :class:`~kvjax.tiers.SimulatedCopyEngine`); in serving, give it
the device allocator and request table as to :class:`RadixCache`, a host allocator (the host
pool's) and a copy engine (``kvjax.transfers.transfer.PageTransferEngine``).

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

from abc import ABCMeta
from typing import TYPE_CHECKING, Any

from kvjax.radix.host_component import LOAD_BACK_THRESHOLD, HostTierComponent
from kvjax.radix.host_pages import HostPages
from kvjax.radix.radix_cache import RadixCache
from kvjax.radix.storage_link import PREFETCH_THRESHOLD, StorageOptions
from kvjax.radix.tiered_tree import make_host_tier
from kvjax.tiers.copy_engine import CopyEngine
from kvjax.tiers.host_allocator import HostSlotAllocator
from kvjax.tiers.storage import StorageTier

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol


class HiRadixCache(RadixCache, metaclass=ABCMeta):
    """Radix cache over device KV with a host tier (see module docstring): a preset of
    :class:`RadixCache` with the host component (and the storage tier) given at construction.
    The host-tier methods are the tree's (``tiered_tree.py``).

    ``isinstance(tree, HiRadixCache)`` holds for every preset with a host tier: the hybrid one
    (``HiSWARadixCache``, a preset of ``SWARadixCache``) is registered as a virtual subclass.

    Args (beyond :class:`RadixCache`'s):
        host_allocator: the host pool's slot allocator; or ``host_pool_tokens`` to make one.
        copy_engine: the transfers (default: simulated, no device arrays).
        write_policy: ``write_through`` (default), ``write_through_selective`` or ``write_back``.
        load_back_threshold: SGLang's 10.
        storage: the storage tier (None: no L3), a :class:`StorageTier` or the full
            :class:`StorageOptions`; ``host_pages``: the host pool holding the pages' bytes
            (``read_pages``/``write_pages``; default: one made for ``storage``).
        prefetch_policy, prefetch_timeout_s, prefetch_threshold: see ``StorageLink`` (with a
            bare :class:`StorageTier`).
    """

    host: HostTierComponent  # never None in this preset

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
        storage: StorageTier | StorageOptions | None = None,
        host_pages: HostPages | None = None,
        prefetch_policy: str = "best_effort",
        prefetch_timeout_s: float | None = None,
        prefetch_threshold: int = PREFETCH_THRESHOLD,
        **kwargs: Any,
    ) -> None:
        if isinstance(storage, StorageTier):
            storage = StorageOptions(storage, host_pages, prefetch_policy, prefetch_timeout_s, prefetch_threshold)
        host, storage = make_host_tier(
            page_size,
            host_allocator=host_allocator,
            host_pool_tokens=host_pool_tokens,
            copy_engine=copy_engine,
            write_policy=write_policy,
            load_back_threshold=load_back_threshold,
            device_allocator=token_to_kv_pool_allocator,
            storage=storage,
        )
        super().__init__(
            page_size,
            eviction_policy=eviction_policy,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            host=host,
            storage=storage,
            **kwargs,
        )
