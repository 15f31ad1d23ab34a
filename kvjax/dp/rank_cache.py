"""`RankKVCache`: one DP rank's ``KVCache``, over the rank's host objects and every rank's pools.

Lockstep DP serving (``kvjax.dp.lockstep``) gives each rank a kvjax ``Scheduler``; that scheduler
needs a ``KVCache``. A rank's view holds the rank's plan, request table, allocator and tree (a
``DPRank``), its host pools (with the host tier), its own queue of pending device updates (its
extensions' state copies, its tree's host loads and retraction restores), and, as its device
state, the ``DPKVCache``'s stacked pools of all ranks.

Invariant: every rank's view and the ``DPKVCache`` hold one ``DeviceState`` (``kvjax.device_state``),
so they hold the same pools. Handing pools to one view (``set_pools``, also what ``apply_pending``
does after applying the rank's updates) stores them in that state, which every view and every
rank's pending queue reads, so a rank that applies its updates never leaves another rank holding
donated arrays. A rank's pending
updates write only its own slice (``kvjax.dp.rank_state``, ``kvjax.dp.rank_transfer``), so the
ranks' queues commute.
"""

from __future__ import annotations

from kvjax.build import KVCache
from kvjax.dp.cache import DPKVCache, DPRank

__all__ = ["RankKVCache", "rank_caches"]


class RankKVCache(KVCache):
    """One rank's view (module docstring). Build the group with :func:`rank_caches`.

    Attributes:
        dp_cache: the DP cache whose pools the group shares.
        rank: the rank's index along ``"data"``.
    """

    def __init__(self, dp_cache: DPKVCache, rank: DPRank) -> None:
        super().__init__(
            plan=rank.plan,
            pools=dp_cache.pools,
            req_to_token_pool=rank.req_to_token_pool,  # type: ignore[arg-type]
            token_to_kv_pool_allocator=rank.allocator,
            tree_cache=rank.tree_cache,
            host_pool=rank.host_pool,
            draft_host_pool=rank.draft_host_pool,
            host_pools=rank.host_pools,
            pending=rank.pending,  # the rank's queue, which its tree's host transfers record into
            state=dp_cache.state,  # one device state for the DP cache and every view
        )
        self.dp_cache = dp_cache
        self.rank = rank.rank


def rank_caches(dp_cache: DPKVCache) -> list[RankKVCache]:
    """A view per rank of ``dp_cache``, in rank order, sharing its device state (module docstring)."""
    return [RankKVCache(dp_cache, rank) for rank in dp_cache.ranks]
