"""What the host tier's page transfer engine of a cache is made from (`TransferContext`) and the
engine of a cache none of whose kinds offers one (``default_transfer_engine``); a kind's own
(``PoolBuilders.transfer_engine``: the sliding-window pair moves both sides) is asked first, by
the build (``kvjax.build``).

The engine is made before the tree (which takes it at construction): it holds no cache, only the
pending device updates its loads are recorded in (``kvjax.device_updates``) and the host pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvjax.plan.kinds.host_tier import HOST_KV
from kvjax.transfers.transfer import PageTransferEngine

if TYPE_CHECKING:
    from kvjax.device_updates import PendingDeviceUpdates
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.protocols import AllocatorProtocol

__all__ = ["TransferContext", "default_transfer_engine"]


@dataclasses.dataclass(frozen=True)
class TransferContext:
    """What a host-tier transfer engine is made from, before the tree and the cache exist.

    ``pending``: the device updates its loads are recorded in (the cache's ``pending``);
    ``host_pools``: the built host pools by plan name (``"host_kv"``, a kind's own such as
    ``"host_kv_swa"``); ``allocator``: the device token allocator.
    """

    plan: CachePlan
    pending: PendingDeviceUpdates
    host_pools: Mapping[str, Any]
    allocator: AllocatorProtocol

    @property
    def host_pool(self) -> Any:
        """The host pool of the device KV (``"host_kv"``)."""
        return self.host_pools[HOST_KV]


def default_transfer_engine(context: TransferContext) -> PageTransferEngine:
    """``PageTransferEngine`` between the first device pool and the host pool ``host_kv``: the
    engine of a cache none of whose kinds offers its own."""
    device_pool = next(p.name for p in context.plan.pools if p.memory == "device")
    return PageTransferEngine(context.pending, context.host_pool, pool_name=device_pool)
