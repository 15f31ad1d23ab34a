"""What the host tier's page transfer engine of a cache is made from (`TransferContext`) and the
engine of a cache none of whose kinds offers one (``default_transfer_engine``); a kind's own
(``PoolBuilders.transfer_engine``: the sliding-window pair moves both sides, the recurrent kind
adds its checkpoints' state engine) is asked first, by the build (``kvjax.build``).

The engine is made before the tree (which takes it at construction): it holds no cache, only the
pending device updates its loads are recorded in (``kvjax.device_updates``) and the host pools.

Every engine a kind composes copies one pool (or one part of a pool) through the context's
factories: ``page_engine`` for pages (``PageTransferEngine``: the cache's own pools) and
``state_engine`` for recurrent-state slots (``StateTransferEngine``). A DP rank's context
(``kvjax.dp.cache``) gives the rank's factories instead (``kvjax.dp.rank_transfer``,
``kvjax.dp.rank_state_transfer``): the same compositions then read and write only the rank's slice
of the stacked pools, so no kind writes a second engine for DP attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from kvjax.plan.kinds.host_tier import HOST_KV
from kvjax.transfers.transfer import PageTransferEngine

if TYPE_CHECKING:
    from kvjax.device_updates import PendingDeviceUpdates
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.protocols import AllocatorProtocol

__all__ = ["PageEngineFactory", "StateEngineFactory", "TransferContext", "default_transfer_engine"]


class PageEngineFactory(Protocol):
    """Makes the page engine of one device pool (or ``part`` of an ``SWAKVPool``) and its host
    pool, recording its loads in ``pending``: ``PageTransferEngine``'s arguments."""

    def __call__(
        self,
        pending: PendingDeviceUpdates,
        host_pool: Any,
        pool_name: str = "kv",
        staging: str = "auto",
        *,
        part: str | None = None,
    ) -> Any: ...


#: Makes the state engine of the recurrent pool and its host state pool: ``(pending, host_pool)``.
StateEngineFactory = Callable[["PendingDeviceUpdates", Any], Any]


@dataclasses.dataclass(frozen=True)
class TransferContext:
    """What a host-tier transfer engine is made from, before the tree and the cache exist.

    ``pending``: the device updates its loads are recorded in (the cache's ``pending``);
    ``host_pools``: the built host pools by plan name (``"host_kv"``, a kind's own such as
    ``"host_kv_swa"``); ``allocator``: the device token allocator; ``page_engine`` and
    ``state_engine``: the factories of the engines over one pool (module docstring; ``None``:
    the engines over the cache's own pools, ``PageTransferEngine`` and ``StateTransferEngine``).
    """

    plan: CachePlan
    pending: PendingDeviceUpdates
    host_pools: Mapping[str, Any]
    allocator: AllocatorProtocol
    page_engine: PageEngineFactory | None = None
    state_engine: StateEngineFactory | None = None

    def make_page_engine(
        self, host_pool: Any, pool_name: str = "kv", staging: str = "auto", *, part: str | None = None
    ) -> Any:
        """The page engine of ``pool_name`` (its ``part``) and ``host_pool``, recording into ``pending``."""
        make: PageEngineFactory = self.page_engine if self.page_engine is not None else PageTransferEngine
        return make(self.pending, host_pool, pool_name, staging, part=part)

    @property
    def host_pool(self) -> Any:
        """The host pool of the device KV (``"host_kv"``)."""
        return self.host_pools[HOST_KV]


def default_transfer_engine(context: TransferContext) -> Any:
    """The page engine (``context.make_page_engine``: ``PageTransferEngine`` over a cache's own
    pools) between the first device pool and the host pool ``host_kv``: the engine of a cache none
    of whose kinds offers its own."""
    device_pool = next(p.name for p in context.plan.pools if p.memory == "device")
    return context.make_page_engine(context.host_pool, device_pool)
