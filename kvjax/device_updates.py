"""`PendingDeviceUpdates`: device-state changes recorded by the cache's host side, applied by the owner of the step.

The rule (``docs/architecture.md``, "Device state: who changes it"): device state (a
``CachePools``) changes only in calls whose caller receives the new pools. The owner of the step
(the serving scheduler, or a user's own loop) holds the current pools and donates them into its
jitted step. Nothing else swaps them: host-tier loads, retraction restores and recurrent-state
forks happen inside kvjax calls that do not hold the pools (``match_prefix``, ``init_load_back``,
an extension's admission hook), so they *record* a :class:`DeviceUpdate` here instead, and the owner
applies them, in the order they were recorded, before it launches its next step::

    pools = cache.apply_pending(pools)   # loads, restores, forks land here, in order
    pools, out = step(pools, ...)         # donated
    cache.set_pools(pools)                # hand the new state in: reads (backups) see it

Ordering is exact: every update sees the pools as the owner handed them in plus every update
recorded before it; the owner applies them all before the step that reads the pages they write
(the loaded prefix, the restored tokens, the forked state slot).

Reads (host-tier backups, a retraction's copy aside) need the current pools, not a stored
reference to someone's holder: they read the pools the owner last handed in (:meth:`hand_in`,
called by ``KVCache.set_pools`` and ``KVCache.apply_pending``), through :meth:`read`, which
refuses (nothing started) pools whose arrays were donated since (``StaleDeviceStateError``: the
owner ran a step without handing its result in) and pages a recorded update has yet to write
(``PendingWriteError``: apply the updates first). A backup thus reads exactly the state after the
step that wrote its pages.

Units: ``pages`` are page ids of the pool named by ``target`` (``"kv"``, ``"kv_draft"``, or
``"swa.full"`` / ``"swa.swa"`` for one half of a sliding-window pool); state slots for
``"recurrent"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from kvjax.pools.cache_pools import CachePools

__all__ = ["DeviceUpdate", "PendingDeviceUpdates", "PendingWriteError", "StaleDeviceStateError"]


class StaleDeviceStateError(RuntimeError):
    """A read of device state found the owner's last handed-in pools donated (deleted)."""


class PendingWriteError(RuntimeError):
    """A read of device state asked for pages that a recorded update has not written yet."""


@dataclass(frozen=True)
class DeviceUpdate:
    """One recorded change of device state.

    Attributes:
        what: what it is, for messages (``"host load"``, ``"retraction restore"``, ``"state fork"``).
        target: the pool it writes (see the module docstring for names).
        pages: the page ids (or state slots) it writes; ``None``: unknown (any read of ``target``
            conflicts with it until it is applied).
        apply: ``apply(pools) -> new pools``; may donate the arrays it replaces (in place).
    """

    what: str
    target: str
    pages: np.ndarray | None
    apply: Callable[[CachePools], CachePools] = field(repr=False)


class PendingDeviceUpdates:
    """The ordered queue of :class:`DeviceUpdate` and the pools the owner last handed in.

    Args:
        pools: the current device state (static facts such as shapes, dtypes and shardings are
            read from it by the transfer engines; reads of data go through :meth:`read`).
    """

    def __init__(self, pools: CachePools) -> None:
        if not isinstance(pools, CachePools):
            raise TypeError(f"PendingDeviceUpdates: expected CachePools, got {type(pools).__name__}")
        self._owner_pools = pools
        self._queue: list[DeviceUpdate] = []
        self.applied = 0  # updates applied so far (a counter for tests and stats)

    @property
    def owner_pools(self) -> CachePools:
        """The pools the owner last handed in (they may have been donated since: use :meth:`read`
        for data; shapes, dtypes and shardings are fixed for the cache's life)."""
        return self._owner_pools

    @property
    def count(self) -> int:
        """Updates recorded and not applied yet."""
        return len(self._queue)

    def updates(self) -> tuple[DeviceUpdate, ...]:
        """The updates not applied yet, in the order they will be applied."""
        return tuple(self._queue)

    def record(self, update: DeviceUpdate) -> None:
        """Queue ``update`` behind every update recorded before it."""
        if not isinstance(update, DeviceUpdate):
            raise TypeError(f"record: expected a DeviceUpdate, got {type(update).__name__}")
        self._queue.append(update)

    def hand_in(self, pools: CachePools) -> None:
        """The owner's current device state (what reads see from now on)."""
        if not isinstance(pools, CachePools):
            raise TypeError(f"hand_in: expected CachePools, got {type(pools).__name__}")
        self._owner_pools = pools

    def read(self, target: str, pages: np.ndarray | None = None) -> CachePools:
        """The current pools, for a read of ``pages`` of ``target`` (``None``: all of them).

        Raises ``PendingWriteError`` when a recorded update writes some of those pages (apply the
        updates first), ``StaleDeviceStateError`` when the handed-in pool was donated since (the
        owner must hand its step's result in with ``KVCache.set_pools`` before calling the tree
        or the extensions). Neither changes anything.
        """
        for update in self._queue:
            if update.target != target:
                continue
            if update.pages is None or pages is None or np.intersect1d(update.pages, pages).size:
                raise PendingWriteError(
                    f"a read of {target!r} pages waits for a recorded {update.what} that writes them: apply the "
                    "pending device updates first (pools = cache.apply_pending(pools))"
                )
        pools = self._owner_pools
        name = target.split(".", 1)[0]
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(pools[name])):
            raise StaleDeviceStateError(
                f"the device pool {name!r} the owner last handed in was donated into a step: hand the step's result "
                "in (cache.set_pools(new_pools)) before calling the tree, the transfers or the extensions"
            )
        return pools

    def apply(self, pools: CachePools) -> CachePools:
        """Apply every recorded update to ``pools`` in order and return the new pools (the
        arrays replaced may be donated: use only what this returns). The result is handed in.

        An update that raises leaves itself and those after it queued (the ones before it are
        applied into pools the caller no longer holds: treat the error as fatal for the step).
        """
        if not isinstance(pools, CachePools):
            raise TypeError(f"apply: expected CachePools, got {type(pools).__name__}")
        queue, self._queue = self._queue, []
        for i, update in enumerate(queue):
            try:
                pools = update.apply(pools)
            except BaseException:
                self._queue = queue[i:] + self._queue
                raise
            self.applied += 1
        self._owner_pools = pools
        return pools

    def __repr__(self) -> str:
        return f"PendingDeviceUpdates({[u.what for u in self._queue]})"
