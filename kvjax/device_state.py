"""`DeviceState`: the device state of one group of devices, the one type every holder keeps it in.

A group is one device or one mesh (``KVCache``), the DP ranks' stacked pools (``DPKVCache``, whose
rank views share it), or one pipeline stage (``PipelineCache``). ``DeviceState`` holds the group's
current ``CachePools`` and the structure every later state must have; the serving loop that owns
the step is the only writer (:meth:`store`, after each donated step). The queues of pending device
updates that read it (``PendingDeviceUpdates``: host-tier backups, retraction copies) are attached
to it and see every stored state at once, so a group shared by several views (the DP ranks) has
one state and nothing writes another holder's fields.

Invariant: ``pools`` always has the structure the state was made with (names, pool types, array
shapes and dtypes, static metadata); :meth:`store` refuses anything else, the state unchanged.
"""

from __future__ import annotations

from typing import Any

import jax

from kvjax.device_updates import PendingDeviceUpdates
from kvjax.pools.cache_pools import CachePools

__all__ = ["DeviceState"]

# Structures remembered per state (one per compiled step shape; more only clears the memo).
_MAX_CHECKED_ORIGINS = 64


class DeviceState:
    """The current ``CachePools`` of one group of devices (module docstring).

    Args:
        pools: the group's device state as built.
    """

    __slots__ = ("_checked_origins", "_pools", "_readers", "_structure")

    def __init__(self, pools: CachePools) -> None:
        if not isinstance(pools, CachePools):
            raise TypeError(f"DeviceState: expected CachePools, got {type(pools).__name__}")
        self._pools = pools
        # Fixed for the state's life (store only accepts the same structure): computed once, so the
        # check on every serving step flattens only the new pools.
        self._structure: Any = jax.tree_util.tree_structure(pools)
        # Origins (``CachePools.origin``) of pools that passed the structure check, by identity;
        # the values keep the tuples alive so that an id is never reused while it is a key.
        self._checked_origins: dict[int, tuple[str, ...]] = {}
        self._readers: list[PendingDeviceUpdates] = []

    @property
    def pools(self) -> CachePools:
        """The pools last stored (a donated step's result, or the pools as built)."""
        return self._pools

    def attach(self, pending: PendingDeviceUpdates) -> None:
        """Let ``pending`` read this state: it is handed the current pools now and every pools
        stored from now on."""
        pending.hand_in(self._pools)
        if all(reader is not pending for reader in self._readers):
            self._readers.append(pending)

    def store(self, pools: CachePools, what: str = "set_pools") -> None:
        """Make ``pools`` (a donated step's result) the current state; every attached queue of
        pending updates reads it from now on. Raises ``TypeError`` naming ``what`` (nothing
        changed) unless ``pools`` has this state's structure."""
        self.check_structure(pools, what)
        self._pools = pools
        for reader in self._readers:
            reader.hand_in(pools)

    def check_structure(self, pools: Any, what: str) -> None:
        """Raise ``TypeError`` naming ``what`` unless ``pools`` has this state's tree structure.

        Run once per structure, not once per step: pools JAX rebuilt from a treedef (a compiled
        step's outputs) carry that treedef's names tuple as their ``origin``, and every object
        rebuilt from it has its structure. An origin whose pools passed the full check once is
        accepted by identity afterwards (an attribute read and a dict lookup); anything else
        (pools built by hand, the first output of each compiled step) is flattened and compared.
        """
        if not isinstance(pools, CachePools):
            raise TypeError(f"{what}: expected CachePools, got {type(pools).__name__}")
        origin = pools.origin
        if origin is not None and self._checked_origins.get(id(origin)) is origin:
            return
        # PyTreeDefs are equal iff same structure and static metadata (names, page size, dtype, ...).
        if jax.tree_util.tree_structure(pools) != self._structure:
            raise TypeError(
                f"{what}: the new pools {pools.names} do not have the structure of the cache's {self._pools.names} "
                "(pass what the step returned for cache.pools)"
            )
        if origin is not None:
            if len(self._checked_origins) >= _MAX_CHECKED_ORIGINS:
                self._checked_origins.clear()  # bounded: one entry per compiled step shape
            self._checked_origins[id(origin)] = origin

    def nbytes(self) -> int:
        """Bytes of the state's arrays (over all the group's devices)."""
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self._pools))

    def __repr__(self) -> str:
        return f"DeviceState({self._pools!r})"
