"""The host tier's page transfer engine for a cache: the one a kind of the plan offers
(``PoolBuilders.transfer_engine``: the sliding-window pair moves both sides), else
``PageTransferEngine`` over the first device pool.

The engine is made before the tree (which takes it at construction): it holds no cache, only the
pending device updates its loads are recorded in (``kvjax.device_updates``) and the host pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvjax.plan.kinds import planner_kinds_of
from kvjax.plan.kinds.host_tier import HOST_KV
from kvjax.pools.registry import POOL_BUILDERS
from kvjax.transfers.transfer import PageTransferEngine

if TYPE_CHECKING:
    from kvjax.device_updates import PendingDeviceUpdates
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.protocols import AllocatorProtocol

__all__ = ["TransferContext", "make_transfer_engine"]


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


def make_transfer_engine(context: TransferContext) -> Any:
    """The page transfer engine between the device pools and the host pool ``host_kv``: the first
    a kind of the plan offers, else ``PageTransferEngine`` over the first device pool."""
    for kind in planner_kinds_of(context.plan):
        offer = POOL_BUILDERS[kind.name].transfer_engine
        engine = offer(context) if offer is not None else None
        if engine is not None:
            return engine
    device_pool = next(p.name for p in context.plan.pools if p.memory == "device")
    return PageTransferEngine(context.pending, context.host_pool, pool_name=device_pool)
