"""The component interface: what a kind of cached state adds to the one radix tree.

The tree core (``tree.py``) owns the structure: keys, splits, node residency, and the FULL
component's per-node data (``node.value`` slot ids, ``node.lock_ref`` path locks, the eviction
policy's heap over evictable device leaves), because FULL alone decides whether a node exists.
Every other kind of state — sliding-window (SWA) slots, recurrent-state checkpoints, a host
tier — is a :class:`TreeComponent` that keeps its data in ``node.comp[name]`` (absent = its
tombstone on that node), its own recency order over its own evictable nodes, its own sizes, and
reacts to the core's hooks. The core never reads another component's data.

Hooks, in the order the core calls them (every default does nothing / accepts everything):

=====================================  =====================================================
hook                                   when
=====================================  =====================================================
``attach(tree)``                        once, by the tree that owns the component
``on_insert_overlap(node, payload,``    an insert walked over an existing node (after any
``revived)``                            split); ``revived``: the core just made a host-only
                                        node device-resident from the incoming slots
``on_new_node(node, payload)``          an insert created ``node`` (a new leaf)
``commit_insert(node, payload)``        the insert ended at ``node``; the return value is the
                                        component's insert result (e.g. a donated slot that
                                        the caller must free because ``node`` already had one)
``on_split(parent, child, k)``          ``child`` was cut after ``k`` key elements
``finalize_match(result)``              a match walked; may shorten it
                                        (``result.shorten_to``), add results
                                        (``result.extras[name]``), refresh its recency
``lock(node)`` / ``unlock(node, part)`` a lock on ``node``: lock what this component needs
                                        (its own scope), return a receipt part; the release
                                        replays exactly that part
``evict(amount)``                       ``tree.evict({name: amount})``: free ``amount`` units
                                        (what earlier cascades left of the asked amount) in
                                        this component's own recency order; may delete
                                        leaves through ``tree.delete_leaf`` (cascade)
``keeps_node(node)``                    residency: the core is about to drop ``node``'s
                                        device copy (every component is asked, before the
                                        copy is freed), or ``node`` is a childless host-only
                                        node; True keeps it in the tree host-only
``on_demote(node)``                     ``node``'s device copy was freed; it stays host-only
                                        (free device data, return units freed)
``on_delete(node)``                     ``node`` leaves the tree; free this component's data
                                        on it, return the units freed (counted as cascade)
``on_reset()``                          the tree was cleared: free everything
``sizes()``                             ``ComponentSizes(evictable, protected)``
``check_invariants()``                  raise ``TreeInvariantError`` on inconsistency
=====================================  =====================================================

Cascade rules (written down once, here; ``docs/architecture.md`` maps SGLang 0.5.23's):

* Only FULL decides whether a node survives. FULL eviction takes an unlocked device leaf (no
  device-resident child); if some component ``keeps_node`` it, or it has host-only children,
  its device slots are freed and it stays host-only (``on_demote``); otherwise it is deleted
  and every component's ``on_delete`` frees that component's data on it.
* A component's own eviction decides per node: free only its own data (a tombstone; e.g. an
  internal node, or a leaf whose FULL part is locked), or delete the leaf outright through
  ``tree.delete_leaf`` (FULL KV included; e.g. an unlocked leaf under SWA or Mamba eviction).
  A component clears its own data on the node *before* calling ``delete_leaf`` and counts it
  itself; ``delete_leaf`` counts what the other components and FULL freed.
* After a deletion, a parent that is host-only, childless and kept by no component is deleted
  too (iteratively); a device parent that became an unlocked device leaf joins FULL's
  candidates.
* Locks: FULL locks the node and every ancestor; each component's ``lock`` decides its own
  scope (SWA: the trailing window segment; Mamba: the node itself) and never locks anything
  FULL does not lock, so a FULL-unlocked node holds no component lock.

The full-KV-only tree pays nothing for the interface on its hot paths: the core calls the
extra components' hooks only when there are some (``tree.has_components``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, overload

import numpy as np

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol
    from kvjax.radix.events import BlockStored, KVEvent
    from kvjax.radix.lock import LockReceipt
    from kvjax.radix.match import ComponentMatchResult
    from kvjax.radix.node import TreeNode


@dataclass(frozen=True)
class ComponentSizes:
    """One component's cached units (tokens for KV components, states for state slots).

    Invariant: ``evictable + protected`` is everything the component holds in the tree, and for
    the resource behind it ``available + evictable + protected + held by requests == capacity``.
    """

    evictable: int
    protected: int

    @property
    def total(self) -> int:
        return self.evictable + self.protected


class ComponentTree(Protocol):
    """What a component reaches of the tree it is attached to (``kvjax.radix.tree.RadixTree``
    is one): the structure, FULL's locks, sizes and eviction, and the node surgery a component's
    own eviction needs. Sizes are in cached units (tokens for KV, states for state slots)."""

    root: TreeNode
    page_size: int
    is_eagle: bool
    hash_seed: int | bytes | str
    enable_kv_cache_events: bool

    @property
    def evictable_leaves(self) -> Set[TreeNode]: ...

    @property
    def retention_now(self) -> float: ...

    def emit_event(self, event: KVEvent) -> None: ...
    def stored_event(self, node: TreeNode, medium: str) -> BlockStored: ...

    def nodes(self) -> Iterator[TreeNode]: ...
    def split_node(self, node: TreeNode, k: int) -> TreeNode: ...
    def delete_leaf(self, node: TreeNode) -> None: ...
    def revive_node(self, node: TreeNode, values: np.ndarray) -> None: ...
    def add_host_only_leaf(self, parent: TreeNode, tokens: Sequence[int], extra_key: Hashable = None) -> TreeNode: ...
    def inc_lock_ref(self, node: Any) -> LockReceipt: ...
    def dec_lock_ref(self, node_or_receipt: Any) -> int: ...
    def synthesize_slots(self, n: int) -> np.ndarray: ...
    def evictable_size(self, component: str = "full") -> int: ...
    def protected_size(self, component: str = "full") -> int: ...
    def evict_full(self, num_tokens: int) -> int: ...
    @overload
    def evict(self, num_tokens: int) -> int: ...
    @overload
    def evict(self, num_tokens: Mapping[str, int]) -> dict[str, int]: ...
    def check_full_invariants(self) -> None: ...
    def pretty_print(self) -> str: ...


class TreeComponent:
    """Base class; every hook is a no-op (see the module docstring for when each is called).

    ``name`` keys the component's data in ``node.comp``, its amount in ``tree.evict({...})``,
    its payload in ``insert(..., payloads={...})`` and its results in ``MatchResult.extras``.
    """

    name: str = "component"

    def attach(self, tree: ComponentTree) -> None:
        """Called once by the tree that owns this component."""
        self.tree = tree

    # -- per-node data helpers (the component's own slot in ``node.comp``) ----------------------

    def data(self, node: TreeNode) -> Any:
        """This component's data on ``node``; None is its tombstone."""
        comp = node.comp
        return None if comp is None else comp.get(self.name)

    def set_data(self, node: TreeNode, value: Any) -> None:
        """Set (value not None) or clear (None: tombstone) this component's data on ``node``."""
        if value is None:
            if node.comp is not None:
                node.comp.pop(self.name, None)
                if not node.comp:
                    node.comp = None
            return
        if node.comp is None:
            node.comp = {self.name: value}
        else:
            node.comp[self.name] = value

    # -- insert ---------------------------------------------------------------------------------

    def on_insert_overlap(self, node: TreeNode, payload: Any, revived: bool) -> None:
        """An insert walked over the existing ``node`` (it covers key elements
        ``[node.depth - node.klen, node.depth)``); ``payload`` is this component's insert payload
        (None if the caller gave none). It may split ``node`` (``tree.split_node``): the insert
        continues below the cut and collects the upper parts' slots too."""

    def on_new_node(self, node: TreeNode, payload: Any) -> None:
        """An insert created ``node`` (a leaf with ``value`` set)."""

    def commit_insert(self, node: TreeNode, payload: Any) -> Any:
        """The insert ended at ``node`` (the root for an empty key). Returns this component's
        insert result (``InsertOutcome.results[name]``)."""
        return None

    def on_split(self, parent: TreeNode, child: TreeNode, k: int) -> None:
        """``child`` was cut at ``k``: ``parent`` (new) now holds its first ``k`` key elements
        and ``child`` (the same object as before) the rest, with the same end depth."""

    # -- match ----------------------------------------------------------------------------------

    def finalize_match(self, result: ComponentMatchResult) -> None:
        """A match walked: ``result.last_node`` / ``prefix_len`` are the device match so far
        (``result.walk_node`` the deepest node walked, host-only nodes included). Shorten it with
        ``result.shorten_to(ancestor)``, add ``result.extras[self.name]``, refresh recency."""

    # -- locks ----------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> Any:
        """Lock what this component needs for a request ending at ``node``; the return value is
        stored in the receipt and handed back to :meth:`unlock`."""
        return None

    def unlock(self, node: TreeNode, part: Any) -> None:
        """Release what :meth:`lock` returned ``part`` for."""

    # -- eviction and residency -----------------------------------------------------------------

    def evict(self, amount: int) -> int:
        """Free at least ``amount`` units (or all that are evictable) in this component's own
        recency order; returns the units this component freed itself."""
        return 0

    def keeps_node(self, node: TreeNode) -> bool:
        """Whether ``node`` should stay in the tree without its device copy (host tier)."""
        return False

    def on_demote(self, node: TreeNode) -> int:
        """``node``'s device slots were freed; it stays in the tree host-only. Free this
        component's device data on it; returns units freed (counted as cascade)."""
        return 0

    def on_delete(self, node: TreeNode) -> int:
        """``node`` is leaving the tree: free this component's data on it; returns units freed."""
        return 0

    def on_reset(self) -> None:
        """The tree was cleared: free everything this component holds."""

    # -- sizes and checks -----------------------------------------------------------------------

    def sizes(self) -> ComponentSizes:
        return ComponentSizes(0, 0)

    def check_invariants(self) -> None:
        """Raise ``TreeInvariantError`` when this component's data, recency or sizes disagree."""


class FullKVComponent(TreeComponent):
    """Full-attention KV: the device slot ids in ``node.value``, freed into the allocator.

    Its per-node data (``value``), lock scope (the node and every ancestor, ``lock_ref``) and
    recency (the eviction policy's heap over unlocked device leaves) are the tree core's own
    fields and inlined hot loops: FULL alone decides whether a node exists. This object is
    FULL under the component interface: ``tree.evict({"full": n})`` dispatches to it, it
    frees slot ids into the allocator (one ``free_segment`` per evicted node, in eviction order:
    a node's value is a page-aligned piece of a request's row, so its pages go back in row
    order, as SGLang 0.5.23's ``FreeComponentDeviceSlot``), and it
    reports FULL's sizes and checks FULL's invariants.

    Args:
        allocator: a token/paged allocator, or None for a standalone (simulation) tree that
            frees nothing.
    """

    name = "full"

    def __init__(self, allocator: AllocatorProtocol | None = None) -> None:
        self.allocator = allocator
        # An allocator that tracks the tree's slots (``hold_for_tree`` / ``free_from_tree``, the
        # paged and token allocators) refuses a request owner's ``free`` of them; a hybrid one
        # does not track them, and FULL frees through its ``free_segment``.
        self.tracks = allocator is not None and hasattr(allocator, "hold_for_tree")

    def hold(self, value: np.ndarray) -> None:
        """A node's device slots became the tree's (an insert's new leaf, a revived node). Only
        where :attr:`tracks` (the callers test it first: the insert's hot path pays no call
        otherwise)."""
        cast(Any, self.allocator).hold_for_tree(value)

    def free(self, value: np.ndarray | None) -> None:
        """Free one node's device slots as one row segment (no-op without an allocator or for
        None/empty). Raises what the allocator raises, freeing nothing (call it before changing
        the node, so a refused free leaves the tree as it was)."""
        if self.allocator is not None and value is not None and value.size:
            if self.tracks:
                cast(Any, self.allocator).free_from_tree(value)
            else:
                self.allocator.free_segment(value, start_pos=0)

    def evict(self, amount: int) -> int:
        return self.tree.evict_full(amount)

    def on_reset(self) -> None:
        """Nothing: the core frees FULL's slots itself at reset (it holds the node values)."""

    def free_all(self, values: Sequence[np.ndarray]) -> None:
        """Free every node's slots at reset, in one call."""
        if self.allocator is None or not values:
            return
        arr = values[0] if len(values) == 1 else np.concatenate(values)
        if arr.size:
            if self.tracks:
                cast(Any, self.allocator).free_from_tree(arr, segment=False)
            else:
                self.allocator.free(arr)

    def sizes(self) -> ComponentSizes:
        return ComponentSizes(self.tree.evictable_size("full"), self.tree.protected_size("full"))

    def check_invariants(self) -> None:
        self.tree.check_full_invariants()
