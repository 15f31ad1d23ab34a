"""The component interface: what a kind of cached state adds to the one radix tree.

The tree core owns the structure (keys, splits, the full-KV slot ids in ``node.value``, locks
and eviction order). A *component* attaches state to nodes and reacts to the core's events, so
later kinds — the sliding-window (SWA) slots, recurrent-state checkpoints, a host-memory tier —
plug in without changing the core:

* ``limit_match`` can shorten a match (e.g. SWA accepts only a live window; Mamba only nodes
  that carry a checkpoint), returning an ancestor-or-self of the matched node;
* ``lock`` / ``unlock`` add what the component locks to a lock receipt and release exactly that;
* ``on_new_leaf`` / ``on_split`` keep per-node state consistent when the core adds or splits;
* ``on_evict`` releases the resources of evicted nodes (batched per ``evict`` call);
* ``on_reset`` releases everything at ``reset``.

Only the full-KV component exists now (:class:`FullKVComponent`). The core calls the hooks of
the *extra* components only when there are some, so the full-KV-only tree pays nothing for the
interface on its hot paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvjax.radix.node import TreeNode


class TreeComponent:
    """Base class; every hook is a no-op. ``name`` keys the component's data in ``node.comp``."""

    name: str = "component"

    def attach(self, tree: Any) -> None:
        """Called once by the tree that owns this component."""
        self.tree = tree

    def limit_match(self, node: TreeNode, length: int) -> tuple[TreeNode, int]:
        """Given the deepest full-KV match ``(node, length)``, return the deepest acceptable
        ``(ancestor_or_self, its depth)``. Default: accept everything."""
        return node, length

    def on_new_leaf(self, node: TreeNode) -> None:
        """A node was created by an insert (its ``value`` is set)."""

    def on_split(self, parent: TreeNode, child: TreeNode, split_len: int) -> None:
        """``child`` was cut at ``split_len``: ``parent`` now holds its first ``split_len``
        key elements and ``child`` the rest."""

    def lock(self, node: TreeNode) -> Any:
        """Lock what this component needs for a request ending at ``node``; the return value
        is stored in the receipt and handed back to :meth:`unlock`."""
        return None

    def unlock(self, node: TreeNode, part: Any) -> None:
        """Release what :meth:`lock` returned ``part`` for."""

    def on_evict(self, nodes: Sequence[TreeNode], values: Sequence[np.ndarray]) -> None:
        """``nodes`` were evicted (detached); ``values`` are their full-KV slot ids."""

    def on_reset(self, values: Sequence[np.ndarray]) -> None:
        """The tree was cleared; ``values`` are the full-KV slot ids it held."""

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0


class FullKVComponent(TreeComponent):
    """Full-attention KV: the slot ids in ``node.value``, freed into the allocator.

    Args:
        allocator: a token/paged allocator with ``free(np.ndarray)``, or None for a standalone
            (simulation) tree that frees nothing.
    """

    name = "full"

    def __init__(self, allocator: Any | None = None) -> None:
        self.allocator = allocator

    def _free(self, values: Sequence[np.ndarray]) -> None:
        if self.allocator is None or not values:
            return
        arr = values[0] if len(values) == 1 else np.concatenate(values)
        if arr.size:
            # One free per evict call: the allocator's per-call checks dominate small frees.
            self.allocator.free(arr)

    def on_evict(self, nodes: Sequence[TreeNode], values: Sequence[np.ndarray]) -> None:
        self._free(values)

    def on_reset(self, values: Sequence[np.ndarray]) -> None:
        self._free(values)

    def evictable_size(self) -> int:
        return self.tree._evictable

    def protected_size(self) -> int:
        return self.tree._protected
