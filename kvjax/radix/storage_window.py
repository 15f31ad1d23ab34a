"""`StorageWindow`: a windowed pool's pages in the storage tier, beside the pages of the full layers.

A hybrid sliding-window tree (``HiSWARadixCache``) keeps two host pools with the same host slot ids:
the full layers' (every token of a host copy) and the sliding layers' (valid only for the host
copies that carry them: the node was SWA-live when its backup started). A prefix served from
storage is usable only with the sliding layers' KV of its last window. SGLang 0.5.23 stores the
sliding pool as a pool of its own beside the KV pool (``PoolName.SWA``, hit policy
``TRAILING_PAGES``: ``unified_cache/components/swa.py``, ``hybrid_cache_controller.py``,
``hicache_storage.py``); kvjax does the same:

* **store.** When a node's host copy lands, the storage link writes its full layers' pages to the
  page store and, when the tree says the host copy carries the window pool
  (``host_copy_carries_window``), that pool's pages of the node to the window store, one entry per
  page under the same chained page hash and the window pool's own
  :class:`~kvjax.tiers.storage_key.StorageKey` (its own layers). A page whose host copy holds no
  window KV (an SWA tombstone's) has no window entry.
* **hit.** Of the stored run of full pages ``[0, n)`` beyond the match, the prefix of ``p`` pages
  is restorable when the window entries of its last ``window_pages = ceil(W / page_size)`` pages
  (``[max(0, p - window_pages), p)``: clipped at the run's start, where the tree decides from
  the nodes above) are stored; the hit is the longest restorable ``p`` (0: none, no prefetch),
  as SGLang's ``batch_exists_v2`` folds a ``TRAILING_PAGES`` pool into the hit.
* **prefetch.** The window entries of the hit's last pages are read with the full pages. When
  every full page of the hit and every window page arrived, the window pages are written into
  the window host pool at the host slots of the hit's last pages, and the tree splits the new
  host-only node there (``adopt_stored_window``): the lower node's host copy carries the window,
  the upper one is an SWA tombstone, as SGLang's ``_commit_prefetch`` fills the window's nodes
  and leaves the rest tombstones. Otherwise (fewer full pages, a window page missing or late)
  the node is inserted without the window, all tombstone, as SGLang drops the window then; the
  tree's host hit never counts such a node by itself.

Where kvjax differs: SGLang can prefetch the window alone over FULL KV already on the device
(``trim_prefetch_full_head``); kvjax prefetches only below the deepest node the match walked (the
tree holds everything above it). A window that reaches above the prefetched run is checked by the
tree's host hit (``HiSWARadixCache.match_prefix``) on the nodes above, where SGLang drops a
prefetched window shorter than ``W`` below the root.

Units: pages, host slots, key elements (tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvjax.tiers.storage import Prefetch, StorageTier, StorageWrite

if TYPE_CHECKING:
    from kvjax.radix.host_pages import HostPages
    from kvjax.radix.node import TreeNode

__all__ = ["StorageWindow", "WindowStore", "WindowedTree"]


class WindowedTree(Protocol):
    """What a tree whose prefixes need a window pool's pages offers the storage link."""

    sliding_window_size: int
    page_size: int

    def host_copy_carries_window(self, node: TreeNode) -> bool:
        """Whether ``node``'s host copy holds the window pool's KV of every one of its tokens."""
        ...

    def adopt_stored_window(self, leaf: TreeNode, tokens: int) -> None:
        """The host-only ``leaf`` (its host slots adopted) got the window pool's KV of its last
        ``tokens`` key elements (whole pages, ``0 < tokens <= leaf.klen``) from storage."""
        ...


@dataclass(frozen=True)
class WindowStore:
    """The window pool's store and host pool (``StorageOptions.window``).

    Args:
        store: the window pool's entries (its own key: the window pool's layers).
        host_pages: the window pool's host pool (the same host slot ids as the page source's).
    """

    store: StorageTier
    host_pages: HostPages


@dataclass
class WindowRead:
    """A prefetch's window reads: the run's pages ``[first, first + len(prefetch))``."""

    first: int
    prefetch: Prefetch


class StorageWindow:
    """The window half of a :class:`~kvjax.radix.storage_link.StorageLink` (module docstring).

    Args:
        tree: the tree (a :class:`WindowedTree`; TypeError otherwise).
        window: the window pool's store and host pool; its store's page size must be the tree's.

    Counters: ``pages_backed_up`` (window pages handed to the store), ``windows_taken``
    (prefetches whose window arrived and was adopted), ``windows_dropped`` (prefetches whose
    node was inserted without its window).
    """

    def __init__(self, tree: Any, window: WindowStore) -> None:
        if not all(callable(getattr(tree, m, None)) for m in ("host_copy_carries_window", "adopt_stored_window")):
            raise TypeError(
                f"{type(tree).__name__} keeps no window pool; give StorageOptions.window only to a tree that does"
            )
        if window.store.storage_key.page_size != tree.page_size:
            raise ValueError(
                f"the window store's page size {window.store.storage_key.page_size} is not the tree's {tree.page_size}"
            )
        self.tree: WindowedTree = tree
        self.store = window.store
        self.pages = window.host_pages
        self.pages_backed_up = 0
        self.windows_taken = 0
        self.windows_dropped = 0

    @property
    def window_pages(self) -> int:
        """Pages of the window ending at a page boundary: ``ceil(W / page_size)`` (read from the
        tree, which sets its window after its tiers are linked)."""
        return -(-int(self.tree.sliding_window_size) // int(self.tree.page_size))

    def backup(self, node: TreeNode, slots: np.ndarray, hashes: list[int]) -> StorageWrite | None:
        """Write ``node``'s window pages (host ``slots``, page ``hashes``) when its host copy
        carries them; None otherwise."""
        if not self.tree.host_copy_carries_window(node):
            return None
        buf = self.pages.read_pages(slots, self.store.dtype)
        write = self.store.backup(hashes, np.swapaxes(buf, 0, 1))
        self.pages_backed_up += len(write.futures)
        return write

    def restorable(self, hashes: list[int]) -> int:
        """The longest prefix of the stored run ``hashes`` (full pages, every one stored) whose
        last ``window_pages`` pages (clipped at the run's start) have window entries; 0: none."""
        present = self.store.present(hashes)
        run = 0  # stored window pages ending at page p (exclusive), counted backwards below
        best = 0
        for p, stored in enumerate(present, 1):
            run = run + 1 if stored else 0
            if run >= min(self.window_pages, p):
                best = p
        return best

    def start(self, hashes: list[int]) -> WindowRead:
        """Start reading the window pages of the run ``hashes`` (the prefetch's pages)."""
        first = max(0, len(hashes) - self.window_pages)
        return WindowRead(first, self.store.prefetch(hashes[first:]))

    def take(self, read: WindowRead, policy: str, timeout_s: float) -> np.ndarray | None:
        """The window pages ``[n, *page_shape]`` when every one arrived (per ``policy``), else None."""
        pages = read.prefetch.take(policy, timeout_s)
        return pages if pages.shape[0] == len(read.prefetch) else None

    def cancel(self, read: WindowRead) -> None:
        """Abandon the reads (a cancelled or cut prefetch)."""
        if read.prefetch.taken is None:
            read.prefetch.take("best_effort")

    def dropped(self) -> None:
        """A prefetch's node was inserted without its window."""
        self.windows_dropped += 1

    def adopt(self, leaf: TreeNode, slots: np.ndarray, read: WindowRead, pages: np.ndarray) -> None:
        """Write the window ``pages`` into the window host pool at the host ``slots`` of the
        run's pages ``[read.first, ...)`` (``slots``: the run's, one per token) and tell the tree
        its ``leaf`` carries them."""
        ps = int(self.tree.page_size)
        tokens = pages.shape[0] * ps
        self.pages.write_pages(slots[read.first * ps : read.first * ps + tokens], np.swapaxes(pages, 0, 1))
        self.tree.adopt_stored_window(leaf, tokens)
        self.windows_taken += 1
