"""`StorageCheckpoints`: recurrent-state checkpoints in the storage tier, beside the KV pages.

The recurrent-state tree with a host tier (``HiMambaRadixCache``) keeps a node's checkpoint (the
state after its last token) in a host state slot of its own (``kvjax.tiers.host_state_pool``); a
prefix is served only from a node with a state. SGLang 0.5.23 stores the state as a pool of its own
beside the KV pool (``PoolName.MAMBA``, hit policy ``TRAILING_PAGES`` with one key: the node's last
page hash; ``unified_cache/components/mamba.py``, ``hybrid_cache_controller.py``); kvjax does the
same:

* **store.** When a checkpoint's host copy lands (``HiMambaComponent.on_state_landed``), the state
  is written under the chained hash of its node's last page, as one entry: every layer's rows of
  every state array, as bytes (``page_shape = (layers, 1, bytes per layer)``, ``uint8``), under
  the state's own :class:`~kvjax.tiers.storage_key.StorageKey` (the recurrent layers, the arrays'
  dtypes). The node's KV pages are the page store's, written when its KV host copy lands.
* **hit.** Of the stored run of KV pages ``[0, n)`` beyond the match, the prefix of ``p`` pages is
  restorable when a state is stored under page ``p - 1``'s hash; the hit is the longest such ``p``
  (0: none, no prefetch), as SGLang's ``batch_exists_v2`` folds a one-key ``TRAILING_PAGES`` pool
  into the hit.
* **prefetch.** The state of the hit's last page is read with its KV pages. When every KV page
  and the state arrived, the new host-only node gets a host state slot (the tree's
  ``adopt_stored_checkpoint``, evicting host copies of states no longer on the device when the
  pool is full) holding the state: a checkpoint on the host only, which the host hit ends at and
  the load-back brings to the device with the KV. Otherwise (fewer KV pages, the state missing or
  late, no host state slot) the node is inserted without a state, as SGLang drops the state then;
  the host hit never ends at such a node.

Where kvjax differs: the state entry's bytes are the host pool's rows as the device stores them
(every TP rank's share of one process, as the host state pool holds them), so it is read only by
the same layout (its key names the arrays' dtypes and the TP size).

Units: pages, host state slots (one state each), bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvjax.tiers.storage import Prefetch, StorageTier, StorageWrite

if TYPE_CHECKING:
    from kvjax.radix.node import TreeNode
    from kvjax.tiers.host_state_pool import HostStatePool

__all__ = ["CheckpointStore", "CheckpointedTree", "StorageCheckpoints", "state_page_shape"]


class CheckpointedTree(Protocol):
    """What a tree whose prefixes end at checkpoints offers the storage link."""

    def landed_checkpoint(self, node: TreeNode) -> int | None:
        """The host state slot of ``node``'s landed checkpoint copy (None: none)."""
        ...

    def adopt_stored_checkpoint(self, leaf: TreeNode) -> int | None:
        """A host state slot that is now the host-only ``leaf``'s checkpoint copy (the caller
        writes the state into it at once); None when none can be freed (the leaf keeps none)."""
        ...


def state_page_shape(pool: HostStatePool) -> tuple[int, int, int]:
    """The stored page of one state of ``pool``: ``(layers, 1, bytes of one layer's rows of every
    array)``."""
    per_layer = sum(math.prod(shape) * a.dtype.itemsize for (shape, _), a in zip(pool.rows, pool.arrays, strict=True))
    return (pool.num_layers, 1, per_layer)


@dataclass(frozen=True)
class CheckpointStore:
    """The checkpoints' store and host state pool (``StorageOptions.checkpoints``).

    Args:
        store: the states' entries (page shape :func:`state_page_shape` of ``host_pool``, ``uint8``).
        host_pool: the host state pool.
    """

    store: StorageTier
    host_pool: HostStatePool


@dataclass
class CheckpointRead:
    """A prefetch's state read: the state after the run's last page."""

    prefetch: Prefetch


class StorageCheckpoints:
    """The checkpoint half of a :class:`~kvjax.radix.storage_link.StorageLink` (module docstring).

    Args:
        tree: the tree (a :class:`CheckpointedTree`; TypeError otherwise).
        checkpoints: the states' store and host state pool (ValueError for a store of another
            page shape or dtype).

    Counters: ``states_backed_up`` (states handed to the store), ``states_taken`` (prefetches
    whose state arrived and was adopted), ``states_dropped`` (prefetches whose node was inserted
    without its state).
    """

    def __init__(self, tree: Any, checkpoints: CheckpointStore) -> None:
        if not all(callable(getattr(tree, m, None)) for m in ("landed_checkpoint", "adopt_stored_checkpoint")):
            raise TypeError(
                f"{type(tree).__name__} keeps no checkpoints; give StorageOptions.checkpoints only to a tree that does"
            )
        pool, store = checkpoints.host_pool, checkpoints.store
        if tuple(store.page_shape) != state_page_shape(pool) or store.dtype != np.uint8:
            raise ValueError(
                f"the checkpoint store's pages {store.dtype}{list(store.page_shape)} are not the host state pool's "
                f"uint8{list(state_page_shape(pool))}"
            )
        self.tree: CheckpointedTree = tree
        self.store = store
        self.pool = pool
        self.states_backed_up = 0
        self.states_taken = 0
        self.states_dropped = 0

    # -- bytes ------------------------------------------------------------------------------------

    def _page(self, host_slot: int) -> np.ndarray:
        """The state in ``host_slot`` as one stored page ``[layers, 1, bytes]``."""
        rows = self.pool.read([host_slot])  # per array [layers, 1, *row]
        layers = self.pool.num_layers
        parts = [np.ascontiguousarray(r).reshape(layers, -1).view(np.uint8) for r in rows]
        return np.concatenate(parts, axis=1).reshape(layers, 1, -1)

    def _write(self, host_slot: int, page: np.ndarray) -> None:
        """Write a stored page (``[layers, 1, bytes]``) into ``host_slot``."""
        layers = self.pool.num_layers
        flat = np.ascontiguousarray(page).reshape(layers, -1)
        data = []
        offset = 0
        for (shape, _), host in zip(self.pool.rows, self.pool.arrays, strict=True):
            width = math.prod(shape) * host.dtype.itemsize
            part = np.ascontiguousarray(flat[:, offset : offset + width]).view(host.dtype)
            data.append(part.reshape(layers, 1, *shape))
            offset += width
        self.pool.write([host_slot], tuple(data))

    # -- the link's calls -------------------------------------------------------------------------

    def backup(self, node: TreeNode, slots: np.ndarray, hashes: list[int]) -> StorageWrite | None:
        """A KV host copy landed: the states are stored when their own copies land
        (:meth:`backup_state`), so nothing here."""
        return None

    def backup_state(self, node: TreeNode, last_hash: int) -> StorageWrite | None:
        """Write ``node``'s landed checkpoint copy under its last page's hash; None without one."""
        host_slot = self.tree.landed_checkpoint(node)
        if host_slot is None:
            return None
        write = self.store.backup([last_hash], self._page(host_slot)[None])
        self.states_backed_up += len(write.futures)
        return write

    def restorable(self, hashes: list[int]) -> int:
        """The longest prefix of the stored run ``hashes`` (KV pages, every one stored) whose last
        page has a stored state; 0: none."""
        present = self.store.present(hashes)
        return max((p for p, stored in enumerate(present, 1) if stored), default=0)

    def start(self, hashes: list[int]) -> CheckpointRead:
        """Start reading the state after the run ``hashes``."""
        return CheckpointRead(self.store.prefetch(hashes[-1:]))

    def take(self, read: CheckpointRead, policy: str, timeout_s: float) -> np.ndarray | None:
        """The state's page ``[1, *page_shape]`` when it arrived (per ``policy``), else None."""
        pages = read.prefetch.take(policy, timeout_s)
        return pages if pages.shape[0] == 1 else None

    def cancel(self, read: CheckpointRead) -> None:
        """Abandon the read (a cancelled or cut prefetch)."""
        if read.prefetch.taken is None:
            read.prefetch.take("best_effort")

    def adopt(self, leaf: TreeNode, slots: np.ndarray, read: CheckpointRead, pages: np.ndarray) -> None:
        """Give the host-only ``leaf`` a host state slot holding the state ``pages[0]`` (the tree's
        ``adopt_stored_checkpoint``); without a free slot the leaf keeps no state (counted)."""
        host_slot = self.tree.adopt_stored_checkpoint(leaf)
        if host_slot is None:
            self.states_dropped += 1
            return
        self._write(host_slot, pages[0])
        self.states_taken += 1

    def dropped(self) -> None:
        """A prefetch's node was inserted without its state."""
        self.states_dropped += 1
